"""Checks that only mean something on a CUDA machine (skipped elsewhere; the rest of the suite also runs on CUDA
tensors there, through gfpo_test_utils.DEVICE).

GFPO_TEST_DEVICE=cpu rehearses the size-parametrized checks below on CPU (Triton under the interpreter, small
sizes), so their logic is checked before GPU time is spent: `GFPO_TEST_DEVICE=cpu pytest tests/test_gpu.py`."""

import os

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import _dispatch
from gfpo_kernels import reference as ref

from gfpo_test_utils import peak_memory, record_plans

TEST_DEVICE = os.environ.get("GFPO_TEST_DEVICE", "cuda")
ON_CUDA = TEST_DEVICE == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"
)


@needs_cuda
def test_cuda_kernels_are_built_and_chosen():
    assert _dispatch.HAS_TRITON
    if os.environ.get("GFPO_NO_EXTENSION") != "1" and torch.version.cuda is not None:
        assert _dispatch.HAS_CPP_CUDA, "the extension was built without its CUDA kernel"
    # the CUDA op up to its largest group (faster from Python, bench/results/2026-11-23-h100-*), Triton past it
    expected = "cpp" if _dispatch.HAS_CPP_CUDA else "triton"
    assert _dispatch.select_backend("group", torch.device("cuda"), 16) == expected
    assert _dispatch.select_backend("group", torch.device("cuda"), 2048) == "triton"


@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_filter_advantages_4096x16_on_cuda(backend):
    if backend not in gfpo_kernels.available_backends("group", "cuda"):
        pytest.skip(f"{backend} cannot run CUDA tensors here")
    g = torch.Generator(device="cuda").manual_seed(0)
    rewards = torch.rand(4096 * 16, generator=g, device="cuda")
    lengths = torch.randint(16, 4096, (4096 * 16,), generator=g, device="cuda").float()
    with gfpo_kernels.use_backend(backend):
        keep, adv = gfpo_kernels.gfpo_filter_advantages(
            rewards, lengths, 16, 8, largest=False, scale="batch"
        )
    want_keep, want_adv = ref.gfpo_filter_advantages(
        rewards, lengths, 16, 8, largest=False, scale="batch"
    )
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5)


@needs_cuda
def test_fused_loss_bf16_uses_fp32_gemm_output():
    from gfpo_kernels import linear_grpo_gemm as gemms

    hidden = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(
        1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    h, w = gemms.gemm_operands(hidden.reshape(-1, 64), weight)
    assert (
        h.dtype == w.dtype == torch.bfloat16
    )  # no fp32 copy: cuBLAS writes fp32 itself
    target = torch.randint(0, 1000, (2, 8), device="cuda")
    mask, adv = torch.ones(2, 8, device="cuda"), torch.randn(2, device="cuda")
    loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, adv)
    want, _ = ref.fused_linear_grpo_loss(hidden, weight, target, mask, adv)
    torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)


# Realistic sizes on CUDA; under GFPO_TEST_DEVICE=cpu the same checks at sizes the interpreter runs in seconds.
GROUP_SIZES = [(4096, 16), (8192, 64)] if ON_CUDA else [(8, 16), (4, 64)]


def _group_inputs(num_groups, G, seed, nan_fraction=0.0):
    g = torch.Generator(device=TEST_DEVICE).manual_seed(seed)
    rewards = torch.rand(num_groups * G, generator=g, device=TEST_DEVICE)
    if nan_fraction:
        rewards[
            torch.rand(num_groups * G, generator=g, device=TEST_DEVICE) < nan_fraction
        ] = float("nan")
    # Lengths with ties (integers in a narrow range), as real completion lengths have.
    lengths = torch.randint(
        1, 64, (num_groups * G,), generator=g, device=TEST_DEVICE
    ).float()
    return rewards, lengths


@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize(
    "num_groups, G", GROUP_SIZES, ids=[f"{n}x{g}" for n, g in GROUP_SIZES]
)
@pytest.mark.parametrize("k_kind", ["fixed", "adaptive"])
@pytest.mark.parametrize("nan_fraction", [0.0, 0.05], ids=["finite", "nan-rewards"])
def test_group_ops_at_realistic_sizes(backend, num_groups, G, k_kind, nan_fraction):
    if backend not in gfpo_kernels.available_backends("group", TEST_DEVICE):
        pytest.skip(f"{backend} cannot run {TEST_DEVICE} tensors here")
    rewards, lengths = _group_inputs(
        num_groups, G, seed=num_groups + G, nan_fraction=nan_fraction
    )
    if k_kind == "fixed":
        k = G // 2
    else:  # adaptive k: one k per group, 1..G
        k = torch.randint(
            1, G + 1, (num_groups,), generator=torch.Generator().manual_seed(1)
        ).to(TEST_DEVICE)
    with gfpo_kernels.use_backend(backend):
        keep, adv = gfpo_kernels.gfpo_filter_advantages(
            rewards, lengths, G, k, largest=False, scale="group"
        )
        mask = gfpo_kernels.group_topk_mask(lengths, G, k, largest=False)
    want_keep, want_adv = ref.gfpo_filter_advantages(
        rewards, lengths, G, k, largest=False, scale="group"
    )
    assert torch.equal(keep, want_keep)
    assert torch.equal(mask, ref.group_topk_mask(lengths, G, k, largest=False))
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5, equal_nan=True)


LOSS_SIZE = (
    (2, 128, 1024, 151936) if ON_CUDA else (2, 4, 32, 300)
)  # B, T, H, V: N = B*T = 256 rows on CUDA


@pytest.mark.parametrize("several_chunks", [False, True])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_fused_loss_bf16_at_qwen_vocab_matches_float64(loss_type, several_chunks):
    """The fused loss at V=151936 in bf16 against the float64 reference on the same (bf16-rounded) inputs:
    loss within bf16 GEMM error, gradients by relative norm error. The derived plan (one chunk here: the gradients
    written in bf16 by their GEMMs), or, several_chunks, stages of 32 rows in chunks of 64 (an fp32 weight-gradient
    accumulator; forced: a short budget no longer picks several chunks where one chunk peaks lower, as here)."""
    from gfpo_kernels.chunk_plan import fixed_planner, planning

    plans = record_plans(fixed_planner(32, 64) if several_chunks else None)
    B, T, H, V = LOSS_SIZE
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    g = torch.Generator(device=TEST_DEVICE).manual_seed(7)
    hidden = (torch.randn(B, T, H, generator=g, device=TEST_DEVICE) / H**0.5).to(dtype)
    weight = torch.randn(V, H, generator=g, device=TEST_DEVICE).to(dtype)
    target = torch.randint(0, V, (B, T), generator=g, device=TEST_DEVICE)
    mask = (torch.rand(B, T, generator=g, device=TEST_DEVICE) < 0.8).float()
    adv = torch.randn(B, generator=g, device=TEST_DEVICE)
    old = torch.randn(B, T, generator=g, device=TEST_DEVICE) * 0.1 - 12.0

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with planning(plans):
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(
            h, w, target, mask, adv, old_logps=old, loss_type=loss_type
        )
    loss.backward()
    if ON_CUDA:
        (plan,) = plans
        n = int(mask.sum())
        if not several_chunks:
            assert len(plan.chunks) == 1
        else:
            assert plan.stage_rows < plan.chunk_rows < n, (plan, n)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want, _ = ref.fused_linear_grpo_loss(
        h64,
        w64,
        target,
        mask.double(),
        adv.double(),
        old_logps=old.double(),
        loss_type=loss_type,
    )
    want.backward()

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.isfinite(loss) and abs(
        loss.double().item() - want.item()
    ) <= tol * max(1.0, abs(want.item()))
    for got, ref_grad, name in (
        (h.grad, h64.grad, "hidden"),
        (w.grad, w64.grad, "weight"),
    ):
        assert got is not None and torch.isfinite(got).all(), name
        err = (got.double() - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30)
        assert err < tol, f"{name} gradient relative error {err:.3e}"


PEAK_SIZE = (512, 4096, 151936, torch.bfloat16) if ON_CUDA else (64, 32, 16384, torch.float32)  # T, H, V, dtype


@pytest.mark.parametrize("B", [8, 32])
def test_fused_loss_peak_memory_is_the_plans(B):
    """Forward+backward at Qwen's vocabulary, H=4096, bf16: the extra memory peaks where the plan the call made
    says (plan.peak_bytes, what its budget counted: chunk_plan.CallShape, which the cost model uses too),
    within 3% (+64 MiB of small tensors). The plan is the one the call used, recorded as it was made: one made again
    after the call would see other free memory. B=8: 4096 tokens, every one scored: two chunks, an fp32
    weight-gradient accumulator; B=32 with a GRPO-like mask (a quarter scored): one chunk, the weight gradient
    written in bf16 by its GEMM. GFPO_TEST_DEVICE=cpu: the same on the CPU at small sizes (within 3% + 1 MiB; the
    profiler's allocation events)."""
    from gfpo_kernels.chunk_plan import planning

    plans = record_plans()
    T, H, V, dtype = PEAK_SIZE
    g = torch.Generator(device=TEST_DEVICE).manual_seed(11)
    hidden = (torch.randn(B, T, H, generator=g, device=TEST_DEVICE) / H**0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, device=TEST_DEVICE) / H**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, V, (B, T), generator=g, device=TEST_DEVICE)
    mask = torch.ones(B, T, device=TEST_DEVICE)
    if B == 32:
        mask[:, T // 4:] = 0
    adv = torch.randn(B, generator=g, device=TEST_DEVICE)

    def call():
        with planning(plans):
            loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, adv)
        loss.backward()

    peak = peak_memory(call, TEST_DEVICE)
    (plan,) = plans
    if ON_CUDA:
        assert len(plan.chunks) == (2 if B == 8 else 1)
    slack = (64 << 20) if ON_CUDA else (1 << 20)
    assert abs(peak - plan.peak_bytes) <= 0.03 * plan.peak_bytes + slack, (peak / 2**30, plan.peak_bytes / 2**30)
    assert torch.isfinite(weight.grad.float()).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_triton_kernels_on_a_device_that_is_not_current():
    """Tensors on cuda:1 while cuda:0 is current: the Triton launches run on the tensors' device and stream
    (Triton launches on the current device whatever the pointers are), with the values of a run where cuda:1 is
    current."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 64, 256, generator=g), torch.randn(4096, 256, generator=g) / 16
    target, adv = torch.randint(0, 4096, (2, 64), generator=g), torch.randn(2, generator=g)
    mask = torch.ones(2, 64)
    rewards, scores = torch.randn(64 * 16, generator=g), torch.randn(64 * 16, generator=g)

    def run():
        d = "cuda:1"
        h, w = hidden.to(d).requires_grad_(), weight.to(d).requires_grad_()
        with gfpo_kernels.use_backend("triton"):
            loss, stats = gfpo_kernels.fused_linear_grpo_loss(h, w, target.to(d), mask.to(d), adv.to(d))
            loss.backward()
            keep, a = gfpo_kernels.gfpo_filter_advantages(rewards.to(d), scores.to(d), 16, 4)
        return [x.cpu() for x in (loss.detach(), stats["logps"], h.grad, w.grad, keep, a)]

    with torch.cuda.device(1):
        want = run()
    with torch.cuda.device(0):
        got = run()
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
