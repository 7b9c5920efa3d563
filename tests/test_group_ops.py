"""Every kernel backend (Triton, C++/CUDA) against gfpo_kernels.reference.

Masks must be identical; advantages agree to fp32 accuracy (the kernels accumulate in fp64 as the reference does,
and return fp32). On CPU the Triton kernel runs under the interpreter, so shapes stay small."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gfpo_kernels
from gfpo_kernels import reference as ref

from gfpo_test_utils import DEVICE, record_on_device

NAN = float("nan")
INF = float("inf")
ATOL = RTOL = 1e-5


def _check_all(rewards, scores, G, k, largest=True, scale="group", keep=None):
    """The three public ops against the reference on one input."""
    want_keep = ref.group_topk_mask(scores, G, k, largest=largest)
    got_keep = gfpo_kernels.group_topk_mask(scores, G, k, largest=largest)
    assert got_keep.dtype == torch.bool and got_keep.shape == scores.shape
    assert torch.equal(got_keep.cpu(), want_keep.cpu())

    got_keep2, got_adv = gfpo_kernels.gfpo_filter_advantages(rewards, scores, G, k, largest=largest, scale=scale)
    want_keep2, want_adv = ref.gfpo_filter_advantages(rewards, scores, G, k, largest=largest, scale=scale)
    assert torch.equal(got_keep2.cpu(), want_keep2.cpu())
    assert got_adv.dtype == torch.float32 and got_adv.shape == rewards.shape
    torch.testing.assert_close(got_adv.cpu(), want_adv.cpu(), rtol=RTOL, atol=ATOL)
    assert torch.all(got_adv[~got_keep2] == 0)

    for mask in (None, keep if keep is not None else want_keep):
        got = gfpo_kernels.group_advantages(rewards, G, keep=mask, scale=scale)
        want = ref.group_advantages(rewards, G, keep=mask, scale=scale)
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=RTOL, atol=ATOL)


def _k_count(keep, G, k):
    per_group = keep.reshape(-1, G).sum(dim=1).cpu()
    expected = k.cpu() if isinstance(k, torch.Tensor) else torch.full_like(per_group, k)
    assert torch.equal(per_group, expected.clamp(max=G))


@pytest.mark.parametrize("G", [2, 3, 8, 16, 33, 64, 256])
@pytest.mark.parametrize("largest", [True, False])
def test_random_inputs(backend, G, largest):
    g = torch.Generator().manual_seed(G)
    num_groups = 5 if G <= 64 else 2
    rewards = torch.randn(num_groups * G, generator=g).to(DEVICE)
    scores = torch.randn(num_groups * G, generator=g).to(DEVICE)
    for k in sorted({1, max(1, G // 2), G - 1, G} - {0}):
        _check_all(rewards, scores, G, k, largest=largest)
        _k_count(gfpo_kernels.group_topk_mask(scores, G, k, largest=largest), G, k)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scales_2d_and_ties(backend, scale):
    g = torch.Generator().manual_seed(7)
    # small integer scores: many ties; rewards in {0, 0.5, 1}: zero-variance groups too
    scores = torch.randint(0, 3, (12, 8), generator=g).float().to(DEVICE)
    rewards = (torch.randint(0, 3, (12, 8), generator=g).float() / 2).to(DEVICE)
    for k in (1, 3, 7):
        _check_all(rewards, scores, 8, k, largest=True, scale=scale)
        _check_all(rewards, scores, 8, k, largest=False, scale=scale)


def test_nan_scores_and_rewards(backend):
    scores = torch.tensor([[NAN, 1.0, NAN, 0.0, 2.0, NAN], [NAN] * 6, [1.0, NAN, 1.0, NAN, 1.0, -1.0]]).to(DEVICE)
    rewards = torch.tensor([[1.0, NAN, 2.0, 3.0, 0.5, 4.0], [1.0] * 6, [NAN] * 6]).to(DEVICE)
    for k in (1, 2, 4, 5):
        for largest in (True, False):
            _check_all(rewards, scores, 6, k, largest=largest)
    keep = gfpo_kernels.group_topk_mask(scores, 6, 2)
    assert keep[1].tolist() == [True, True, False, False, False, False]  # all NaN: lower index wins
    _, adv = gfpo_kernels.gfpo_filter_advantages(rewards, scores, 6, 4)
    assert not torch.isnan(adv).any()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_infinite_rewards_take_no_part(backend, scale):
    """An infinite reward is unscorable like a NaN one: advantage 0, and the group's (or the batch's) statistics
    are those of the finite rewards, never NaN."""
    rewards = torch.tensor([[1.0, INF, 3.0, 4.0], [2.0, -INF, NAN, 0.0], [INF, INF, -INF, INF]])
    finite = torch.isfinite(rewards)
    want = torch.zeros(3, 4)
    batch_std = rewards[finite].std()
    for g in range(3):
        r = rewards[g][finite[g]]
        if r.numel():
            centred = r - r.mean()
            if scale != "none":
                std = batch_std if scale == "batch" else r.std() if r.numel() > 1 else torch.tensor(0.0)
                centred = centred / (std + 1e-4)
            want[g][finite[g]] = centred
    adv = gfpo_kernels.group_advantages(rewards.to(DEVICE), 4, scale=scale).cpu()
    torch.testing.assert_close(adv, want, rtol=1e-5, atol=1e-6)
    keep, adv = gfpo_kernels.gfpo_filter_advantages(rewards.to(DEVICE), torch.zeros(3, 4, device=DEVICE), 4, 4,
                                                    scale=scale)
    torch.testing.assert_close(adv.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [0.1, 1.0, -3.7, 12345.678])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_give_exact_zero(backend, value, scale):
    rewards = torch.full((4, 16), value).to(DEVICE)
    scores = torch.arange(64.0).reshape(4, 16).to(DEVICE)
    keep, adv = gfpo_kernels.gfpo_filter_advantages(rewards, scores, 16, 5, scale=scale)
    assert torch.equal(adv.cpu(), torch.zeros(4, 16))
    assert torch.equal(gfpo_kernels.group_advantages(rewards, 16, scale=scale).cpu(), torch.zeros(4, 16))
    # one kept row: std is 0, and so is the advantage
    _, adv = gfpo_kernels.gfpo_filter_advantages(torch.randn(64).to(DEVICE), scores.flatten(), 16, 1, scale=scale)
    assert torch.equal(adv.cpu(), torch.zeros(64))


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
     torch.int64, torch.int32, torch.uint8, torch.uint16, torch.uint32, torch.bool],
)
def test_score_dtypes(backend, dtype):
    g = torch.Generator().manual_seed(3)
    if dtype.is_floating_point:
        scores = torch.randn(6, 16, generator=g).to(dtype)  # fp16/bf16/fp8 rounding creates ties
    elif dtype == torch.bool:
        scores = torch.rand(6, 16, generator=g) > 0.5
    else:
        scores = torch.randint(0, 5, (6, 16), generator=g).to(dtype)
    rewards = torch.randn(6, 16, generator=g)
    scores, rewards = scores.to(DEVICE), rewards.to(DEVICE)
    for k in (1, 4, 15):
        _check_all(rewards, scores, 16, k, largest=True)
        _check_all(rewards, scores, 16, k, largest=False)


def test_int64_scores_beyond_float_precision(backend):
    base = 2**62
    scores = torch.tensor([base + 1, base, base + 3, base + 2] * 2, dtype=torch.int64).to(DEVICE)
    keep = gfpo_kernels.group_topk_mask(scores, 4, 2)
    assert keep.cpu().tolist() == [False, False, True, True] * 2


def test_uint64_scores_and_rewards(backend):
    """uint64, which no signed type holds: scores rank by their full 64-bit value (2**64 - 1 highest, values past
    2**63 above every smaller one), rewards are taken as float64 values."""
    top, high = 2**64 - 1, 2**63 + 1
    scores = torch.tensor([5, top, 0, high, high - 2, 7, 2**63, 6], dtype=torch.uint64)
    keep = gfpo_kernels.group_topk_mask(scores.to(DEVICE), 4, 2)
    assert keep.cpu().tolist() == [False, True, False, True, True, False, True, False]
    keep = gfpo_kernels.group_topk_mask(scores.to(DEVICE), 4, 1, largest=False)
    assert keep.cpu().tolist() == [False, False, True, False, False, False, False, True]
    rewards = torch.tensor([1, 2, 3, 4, 10, 10, 10, 30], dtype=torch.uint64)
    values = rewards.double().reshape(2, 4)
    want = (values - values.mean(1, keepdim=True)) / (values.std(1, keepdim=True) + 1e-4)
    got = gfpo_kernels.group_advantages(rewards.to(DEVICE), 4)
    torch.testing.assert_close(got.cpu(), want.float().flatten(), rtol=RTOL, atol=ATOL)
    _, got = gfpo_kernels.gfpo_filter_advantages(rewards.to(DEVICE), scores.to(DEVICE), 4, 4)
    torch.testing.assert_close(got.cpu(), want.float().flatten(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype, offset", [(torch.float64, 1e8), (torch.int64, 2**40), (torch.int32, 2**30)])
def test_rewards_beyond_float32_precision(backend, dtype, offset, scale):
    """float64 and wide integer rewards keep the digits float32 would round away: 1e8 + 0.1 ... 1e8 + 0.4 are one
    float32 value (every advantage 0 when the kernels read float32), the reference's float64 tells them apart."""
    steps = torch.tensor([1, 2, 3, 4, 4, 1, 3, 2], dtype=torch.float64)
    if dtype == torch.float64:
        rewards = offset + 0.1 * steps
    else:
        rewards = (offset + steps).to(dtype)
    want = ref.group_advantages(rewards, 4, scale=scale)
    got = gfpo_kernels.group_advantages(rewards.to(DEVICE), 4, scale=scale)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_rewards_whose_squares_overflow_float32(backend, scale):
    """Finite float32 rewards of 1e20 square beyond float32's range: the statistics accumulate in fp64 (the Triton
    kernel's fp32 variance was inf, every advantage 0)."""
    rewards = torch.tensor([1e20, -1e20, 3e20, 0.0, 2e30, -1e30, 0.0, 5e29], dtype=torch.float32)
    want = ref.group_advantages(rewards, 4, scale=scale)
    got = gfpo_kernels.group_advantages(rewards.to(DEVICE), 4, scale=scale)
    assert (want != 0).all()
    torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("rewards", [
    torch.tensor([3.4e38, -3.4e38, -3.4e38, 0.0], dtype=torch.float32),
    torch.tensor([1e150, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64),  # squares still in double
], ids=["fp32-near-max", "fp64-1e150"])
def test_batch_scale_of_rewards_whose_centred_values_leave_float32(backend, rewards):
    """scale="batch": r - mean_g may lie beyond float32's range where (r - mean_g) / std_batch does not; the centred
    rewards wait for the batch std in double (stored as float32 first they became inf, and inf / inf NaN)."""
    want = ref.group_advantages(rewards, 4, scale="batch")
    got = gfpo_kernels.group_advantages(rewards.to(DEVICE), 4, scale="batch")
    assert torch.isfinite(want).all() and want.abs().max() > 0.5
    torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reward_dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_reward_dtypes(backend, reward_dtype):
    g = torch.Generator().manual_seed(4)
    rewards = (torch.randn(5, 8, generator=g) * 4).to(reward_dtype).to(DEVICE)
    scores = torch.randn(5, 8, generator=g).to(DEVICE)
    _check_all(rewards, scores, 8, 3)


def test_adaptive_k(backend):
    g = torch.Generator().manual_seed(5)
    G = 16
    k = torch.tensor([0, 1, 4, 8, 15, 16, 2]).to(DEVICE)
    scores = torch.randn(7 * G, generator=g).to(DEVICE)
    rewards = torch.randn(7 * G, generator=g).to(DEVICE)
    for largest in (True, False):
        for scale in ("group", "batch", "none"):
            _check_all(rewards, scores, G, k, largest=largest, scale=scale)
        _k_count(gfpo_kernels.group_topk_mask(scores, G, k, largest=largest), G, k)
    # k tensors of other integer dtypes and on the CPU are accepted
    keep = gfpo_kernels.group_topk_mask(scores, G, k.cpu().to(torch.int32))
    assert torch.equal(keep.cpu(), ref.group_topk_mask(scores.cpu(), G, k.cpu()))


def test_adaptive_k_as_a_strided_view(backend):
    """An int64 k that is a view with stride 2 (a column of a (groups, 2) tensor): every backend reads k_g, not the
    element g of the underlying storage (the Triton kernel read [1, 0, 2, 0] for k = [1, 2, 3, 4])."""
    g = torch.Generator().manual_seed(6)
    G = 4
    k = torch.tensor([[1, 0], [2, 0], [3, 0], [4, 0]]).to(DEVICE)[:, 0]
    assert k.stride() == (2,)
    scores = torch.randn(4 * G, generator=g).to(DEVICE)
    rewards = torch.randn(4 * G, generator=g).to(DEVICE)
    _check_all(rewards, scores, G, k)
    _k_count(gfpo_kernels.group_topk_mask(scores, G, k), G, k)


def test_triton_launch_makes_the_tensors_device_current(backend, monkeypatch):
    """The Triton group kernel is launched inside _dispatch.on_device(the scores' device): Triton launches on the
    current CUDA device whatever device the pointers are on."""
    if backend != "triton":
        pytest.skip("Triton only")
    from gfpo_kernels import group_ops_triton

    entered = record_on_device(monkeypatch, group_ops_triton)
    scores = torch.randn(32).to(DEVICE)
    gfpo_kernels.gfpo_filter_advantages(torch.randn(32).to(DEVICE), scores, 8, 2)
    assert entered == [scores.device]


def test_empty_batch(backend):
    empty = torch.empty(0).to(DEVICE)
    assert gfpo_kernels.group_topk_mask(empty, 8, 2).shape == (0,)
    keep, adv = gfpo_kernels.gfpo_filter_advantages(empty, empty, 8, 2)
    assert keep.shape == adv.shape == (0,)


def test_group_size_one(backend):
    scores = torch.tensor([3.0, NAN, 1.0]).to(DEVICE)
    keep, adv = gfpo_kernels.gfpo_filter_advantages(torch.tensor([1.0, 2.0, 3.0]).to(DEVICE), scores, 1, 1)
    assert keep.all() and torch.equal(adv.cpu(), torch.zeros(3))


def test_many_groups_across_programs(backend):
    """More groups than one Triton program or CPU thread chunk holds, with a ragged last program."""
    g = torch.Generator().manual_seed(6)
    num_groups = 333 if DEVICE == "cpu" else 4099
    scores = torch.randn(num_groups, 8, generator=g).to(DEVICE)
    rewards = torch.randn(num_groups, 8, generator=g).to(DEVICE)
    _check_all(rewards, scores, 8, 3, scale="batch")


VALUES = st.sampled_from([-2.0, -0.5, 0.0, 0.25, 1.0, 3.0, NAN, INF, -INF])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_against_reference(backend, data):
    G = data.draw(st.integers(1, 40), label="G")
    num_groups = data.draw(st.integers(0, 6), label="num_groups")
    n = num_groups * G
    scores = torch.tensor(data.draw(st.lists(VALUES, min_size=n, max_size=n)), dtype=torch.float32)
    rewards = torch.tensor(data.draw(st.lists(VALUES, min_size=n, max_size=n)), dtype=torch.float32)
    if data.draw(st.booleans(), label="adaptive"):
        k = torch.tensor(data.draw(st.lists(st.integers(0, G), min_size=num_groups, max_size=num_groups)),
                         dtype=torch.int64)
    else:
        k = data.draw(st.integers(1, G), label="k")
    largest = data.draw(st.booleans(), label="largest")
    scale = data.draw(st.sampled_from(["group", "batch", "none"]), label="scale")
    if data.draw(st.booleans(), label="2-D"):
        scores, rewards = scores.reshape(num_groups, G), rewards.reshape(num_groups, G)
    k = k.to(DEVICE) if isinstance(k, torch.Tensor) else k
    _check_all(rewards.to(DEVICE), scores.to(DEVICE), G, k, largest=largest, scale=scale)
