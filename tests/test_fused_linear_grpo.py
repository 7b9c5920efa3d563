"""fused_linear_grpo_loss (every backend: Triton, chunked torch) against gfpo_kernels.reference, which takes
the full logits in float64; and against Liger-Kernel's LigerFusedLinearGRPOLoss where both implement a loss."""

import contextlib
import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gfpo_kernels
from gfpo_kernels import chunk_plan
from gfpo_kernels import fused_linear_grpo as flg
from gfpo_kernels import linear_grpo_executor as executor
from gfpo_kernels import linear_grpo_gemm as gemms
from gfpo_kernels import reference as ref
from gfpo_kernels.chunk_plan import DEFAULT_LIMITS, Budget, CallShape, Plan, fixed_planner, plan_chunks, planning
from gfpo_kernels.grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps, token_grad_inputs
from gfpo_kernels.loss_types import LOSS_SPECS

from gfpo_test_utils import DEVICE, LOSS_BACKENDS, peak_memory, record_on_device, record_plans

B, T, H, V = 3, 6, 16, 40
LOSS_TYPES = list(LOSS_SPECS)


def force_plan(stage_rows, chunk_rows):
    """Within the block: chunks of `chunk_rows` tokens (their gradient GEMMs together), projected `stage_rows` at a
    time."""
    return planning(fixed_planner(stage_rows, chunk_rows))


def _sweep_counts(n, stage_rows, chunk_rows):
    """(stages, chunks) of a sweep over n tokens."""
    chunks = [min(chunk_rows, n - start) for start in range(0, n, chunk_rows)]
    return sum(-(-c // stage_rows) for c in chunks), len(chunks)


@pytest.fixture(params=LOSS_BACKENDS)
def backend(request):
    """Each test once per backend, with stages of 2 tokens in chunks of 5, so that every test runs several chunks,
    each with several stages, the last of them short."""
    with force_plan(2, 5), gfpo_kernels.use_backend(request.param):
        yield request.param


def _problem(seed, *, vocab=V, bias=True, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, T, H, generator=g) * scale).to(dtype)
    weight = (torch.randn(vocab, H, generator=g) / H**0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype) if bias else None
    target = torch.randint(0, vocab, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.75).float()
    mask[0, :2] = 1.0
    mask[2] = 0.0  # a row with nothing to score
    adv = torch.randn(B, generator=g)
    # old and reference log-probs near the policy's own, so ratios fall on both sides of the clip range
    with torch.no_grad():
        _, st = ref.fused_linear_grpo_loss(hidden, weight, target, mask, adv, bias=b)
    old = st["logps"] + 0.3 * torch.randn(B, T, generator=g)
    ref_lp = st["logps"] + 0.2 * torch.randn(B, T, generator=g)
    is_ratio = 0.5 + torch.rand(B, T, generator=g)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dict(hidden=to(hidden), weight=to(weight), bias=to(b), target=to(target), mask=to(mask), adv=to(adv),
                old=to(old), ref=to(ref_lp), is_ratio=to(is_ratio))


def _run(fn, p, grads=True, **options):
    leaves = [p["hidden"], p["weight"]] + ([p["bias"]] if p["bias"] is not None else [])
    leaves = [x.detach().clone().requires_grad_(grads) for x in leaves]
    hidden, weight = leaves[0], leaves[1]
    bias = leaves[2] if len(leaves) > 2 else None
    loss, stats = fn(hidden, weight, p["target"], p["mask"], p["adv"], bias=bias, **options)
    gs = torch.autograd.grad(loss, leaves) if grads else ()
    return loss, stats, gs


def _compare(p, rtol=1e-5, atol=1e-5, grad_rtol=1e-4, grad_atol=1e-5, **options):
    loss, stats, grads = _run(gfpo_kernels.fused_linear_grpo_loss, p, **options)
    want_loss, want_stats, want_grads = _run(ref.fused_linear_grpo_loss, p, **options)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=atol)
    assert set(stats) == set(want_stats)
    for name in stats:
        got, want = stats[name], want_stats[name]
        if name.startswith("per_token/") and got.shape[1] != 1:  # only scored tokens carry a value
            got, want = got * p["mask"], want * p["mask"]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=name)
    for got, want in zip(grads, want_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.isfinite(got).all()
        scale = want.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got / scale, want / scale, rtol=grad_rtol, atol=grad_atol)
    return loss, stats, grads


CONFIGS = [dict(loss_type=lt, importance_sampling_level=lvl) for lt in LOSS_TYPES for lvl in ("token", "sequence")]
CONFIGS += [
    dict(loss_type="grpo", beta=0.04, uses_ref=True),
    dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, uses_ref=True, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", delta=1.1, epsilon_low=0.1, epsilon_high=0.28),
    dict(loss_type="dr_grpo", max_completion_length=10, temperature=0.7),
    dict(loss_type="cispo", epsilon_high=1.2, uses_vllm=True),
    dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.3, beta=0.02, uses_ref=True),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.05, uses_ref=True, uses_vllm=True),
    dict(loss_type="dapo", num_items_in_batch=25, temperature=1.3, uses_vllm=True),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0, vespo_lambda_neg=1.5,
         num_items_in_batch=25, uses_vllm=True),
    dict(loss_type="vespo", beta=0.04, use_bias_correction_kl=True, uses_ref=True, temperature=0.8),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CONFIGS])
@pytest.mark.parametrize("with_old", [True, False])
def test_matches_reference(backend, config, with_old):
    config = dict(config)
    p = _problem(len(str(config)))
    options = {k: v for k, v in config.items() if not k.startswith("uses_")}
    if config.get("uses_ref"):
        options["ref_logps"] = p["ref"]
    if config.get("uses_vllm"):
        options["vllm_is_ratio"] = p["is_ratio"]
    if with_old:
        options["old_logps"] = p["old"]
    loss, stats, _ = _compare(p, **options)
    assert torch.isfinite(loss)
    assert torch.all(stats["logps"][p["mask"] == 0] == 0) and torch.all(stats["entropy"][p["mask"] == 0] == 0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_positions_take_no_part(backend, loss_type, level):
    """old_logps, ref_logps and the vLLM ratio may hold anything at masked positions (-1e4, where exp(0 - (-1e4)) =
    inf times mask 0 would be NaN; +-inf, NaN): the loss, statistics and gradients are finite and
    those of the reference on ordinary values there (tests/test_grpo_loss_math.py: TRL's on the same)."""
    p = _problem(83)
    masked = p["mask"] == 0
    bad = torch.tensor([-1e4, float("inf"), float("-inf"), float("nan")], device=DEVICE).repeat(B * T)[: B * T]
    bad = bad.view(B, T)
    clean = dict(old_logps=p["old"], ref_logps=p["ref"], vllm_is_ratio=torch.where(masked, 1.0, p["is_ratio"]))
    dirty = {name: torch.where(masked, bad, value) for name, value in clean.items()}
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, use_bias_correction_kl=True)
    loss, stats, grads = _run(gfpo_kernels.fused_linear_grpo_loss, p, **options, **dirty)
    want_loss, want_stats, want_grads = _run(ref.fused_linear_grpo_loss, p, **options, **clean)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for name in want_stats:  # masked positions included: neutral in both
        torch.testing.assert_close(stats[name], want_stats[name], rtol=1e-5, atol=1e-5, msg=name)
    for got, want in zip(grads, want_grads):
        scale = want.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got / scale, want / scale, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "vespo"])
def test_vllm_ratio_per_sequence_as_b_or_b1(backend, loss_type):
    """A per-sequence vLLM ratio given as (B,) is the same as (B, 1), in both implementations (Liger takes (B,);
    it was a ValueError)."""
    p = _problem(89)
    ratio = p["is_ratio"][:, 0]
    options = dict(loss_type=loss_type, old_logps=p["old"])
    loss, _, grads = _run(gfpo_kernels.fused_linear_grpo_loss, p, vllm_is_ratio=ratio, **options)
    want, _, want_grads = _run(ref.fused_linear_grpo_loss, p, vllm_is_ratio=ratio.unsqueeze(1), **options)
    ref_b, _, _ = _run(ref.fused_linear_grpo_loss, p, vllm_is_ratio=ratio, **options)
    without, _, _ = _run(ref.fused_linear_grpo_loss, p, **options)
    assert ref_b.item() == want.item() and abs(want.item() - without.item()) > 1e-3
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("vocab", [1, 37, 1100])
def test_vocab_sizes_and_no_bias(backend, vocab):
    """A vocabulary below, at and past one row-kernel block (1024), not a multiple of it."""
    p = _problem(11, vocab=vocab, bias=False)
    _compare(p, loss_type="grpo", old_logps=p["old"])
    _compare(p, loss_type="dapo", importance_sampling_level="sequence", old_logps=p["old"])


def test_nothing_to_score(backend):
    p = _problem(5)
    p["mask"] = torch.zeros_like(p["mask"])
    for loss_type in LOSS_TYPES:
        loss, stats, grads = _compare(p, loss_type=loss_type)
        assert loss.item() == 0.0
        assert all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("scale", [30.0, 300.0])
def test_extreme_logits_stay_finite(backend, scale):
    """Logits in the thousands, large positive and very negative: no inf or NaN, still exact."""
    p = _problem(7, scale=scale)
    # A logit's rounding error grows with its magnitude, and so does the gradient's through softmax(logits): on CUDA
    # the chunked GEMMs sum in another order than the reference's single GEMM (seen: 4.8e-5 of the largest
    # gradient at scale 300 on an H100).
    loss, stats, grads = _compare(p, loss_type="grpo", old_logps=p["old"], grad_atol=1e-5 * max(1.0, scale / 30))
    assert torch.isfinite(stats["logps"]).all() and torch.isfinite(stats["entropy"]).all()
    assert stats["logps"].min() < -scale  # the targets include very unlikely tokens


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logit_softcap(backend, level):
    """Gemma 2's final_logit_softcapping: the loss, statistics and gradients of cap * tanh(logits / cap) (then the
    temperature) equal the reference's, with logits large enough for the cap to bend them (|logit| up to ~30 against
    a cap of 5); the uncapped loss is far from it."""
    p = _problem(13, scale=10.0)
    options = dict(loss_type="grpo", old_logps=p["old"], ref_logps=p["ref"], beta=0.04, temperature=0.8,
                   importance_sampling_level=level)
    loss, stats, _ = _compare(p, logit_softcap=5.0, **options)
    _, uncapped, _ = _run(ref.fused_linear_grpo_loss, p, **options)
    live = p["mask"] != 0
    assert (stats["logps"][live] - uncapped["logps"][live]).abs().max() > 1.0
    assert stats["logps"][live].min() > -2 * 5.0 / 0.8 - math.log(V)  # capped logits: log p >= -2 cap / T - log V


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(backend, dtype):
    """bf16/fp16 hidden, weight and bias; fp32 accumulation; gradients come back in the input dtype."""
    p = _problem(9, dtype=dtype)
    # on CUDA the logits gradient is rounded to the input dtype before the gradient GEMMs
    tol = 2e-2 if DEVICE == "cuda" else 1e-2
    _compare(p, rtol=1e-4, atol=1e-4, grad_rtol=tol, grad_atol=tol, loss_type="dapo", old_logps=p["old"])


def test_no_grad_and_eval(backend):
    p = _problem(13)
    with torch.no_grad():
        loss, stats = gfpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"])
        want, want_stats = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"])
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(stats["logps"], want_stats["logps"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_gradient_work_without_grad_mode(backend, context, monkeypatch):
    """Parameters that require grad, called under no_grad (TRL's eval prediction_step) or inference_mode: the
    forward values only, with no gradient GEMM and no (V, H) fp32 accumulator."""
    p = _problem(14)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    gemm_calls = []
    monkeypatch.setattr(gemms, "gemm", lambda *args, **kwargs: gemm_calls.append(args))

    class _Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.data_ptr() != weight.data_ptr():  # new memory, not a view
                self.shapes.append(tuple(out.shape))
            return out

    with context(), _Allocations() as seen:
        loss, stats = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"],
                                                          old_logps=p["old"])
    want, want_stats = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"],
                                                  old_logps=p["old"])
    assert gemm_calls == []
    assert tuple(weight.shape) not in seen.shapes
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["logps"], want_stats["logps"], rtol=1e-5, atol=1e-5)


class _OpLog(TorchDispatchMode):
    """Records (op name, output shape, output dtype) of every op, and "index_bool" for a boolean-mask index."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        name = func.overloadpacket.__name__
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            name = "index_bool"
        if isinstance(first, torch.Tensor):
            self.ops.append((name, tuple(first.shape), first.dtype))
        else:
            self.ops.append((name, None, None))
        return out

    def count(self, *names):
        return sum(op in names for op, _, _ in self.ops)


GEMMS = ("mm", "addmm", "addmm_")


@pytest.mark.parametrize(
    "mode, level, gemms_per_chunk, loss_type, with_old",
    [("grad", "token", 3, "dapo", True), ("grad", "sequence", 4, "dapo", True), ("no_grad", "token", 1, "dapo", True),
     ("no_grad", "sequence", 1, "dapo", True), ("inference_mode", "token", 1, "dapo", True),
     ("grad", "token", 4, "vespo", True), ("grad", "token", 3, "vespo", False)],
)
def test_gemm_count_per_chunk(backend, monkeypatch, mode, level, gemms_per_chunk, loss_type, with_old):
    """Token-level IS: each token projected once and two gradient GEMMs per chunk (6*N*H*V FLOPs); sequence level,
    and vespo given old log-probabilities (its weight phi sums the sequence's log-ratios): a second sweep that
    projects again (8*N*H*V); without grad mode (parameters requiring grad): the projection only. The gradient
    accumulators are never zero-filled (the first chunk's GEMMs write them)."""
    p = _problem(31)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    context = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with force_plan(2, 3), context(), _OpLog() as log:
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"],
                                                      old_logps=p["old"] if with_old else None, loss_type=loss_type,
                                                      importance_sampling_level=level)
        if mode == "grad":
            loss.backward()
    n = int(p["mask"].sum())
    stages, chunks = _sweep_counts(n, 2, 3)
    assert chunks >= 3 and stages > chunks
    projections = stages * (2 if gemms_per_chunk == 4 else 1)
    assert log.count(*GEMMS) == projections + (2 * chunks if mode == "grad" else 0)
    assert not [op for op, shape, _ in log.ops if op in ("zero_", "zeros", "fill_") and shape in ((V, H), (n, H))]


def _interpreter_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as Triton's interpreter converts: the low 16 bits dropped (truncation, whatever rounding mode
    the kernel names)."""
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_grad_logits_rounded_once_into_a_half_buffer(backend, out_dtype):
    """With half-precision GEMM operands the row kernel writes the logits gradient straight into the operand buffer:
    exactly its fp32 in-place result rounded once to nearest even, every element written, the logits only read."""
    rows, vocab, inv_t = 6, 1100, 1 / 0.7
    g = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    upstream = torch.randn(rows, generator=g).to(DEVICE)
    lse = torch.logsumexp(logits * inv_t, dim=-1)
    grad_logits = executor.row_passes(backend).grad_logits
    want = grad_logits(logits.clone(), targets, lse, upstream, inv_t)
    out = torch.full((rows, vocab), float("nan"), dtype=out_dtype, device=DEVICE)
    source = logits.clone()
    got = grad_logits(source, targets, lse, upstream, inv_t, out)
    assert got is out
    if backend == "triton" and DEVICE == "cpu" and out_dtype == torch.bfloat16:
        # Triton's interpreter casts fp32 to bf16 by dropping the low 16 bits (it ignores the rounding mode); the
        # compiled kernel rounds to nearest even: tests/test_triton_aot.py reads that from its PTX, and on CUDA the
        # branch below checks the values.
        expected = _interpreter_bf16(want)
    else:
        expected = want.to(out_dtype)
    assert torch.equal(got, expected)
    if backend == "triton":  # the torch twin computes in place first; the kernel leaves the logits as they were
        assert torch.equal(source, logits)


def test_inference_mode_equals_grad_mode(backend):
    p = _problem(33)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    loss, stats = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"],
                                                      old_logps=p["old"], beta=0.04, ref_logps=p["ref"])
    with torch.inference_mode():
        inf_loss, inf_stats = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"],
                                                                  old_logps=p["old"], beta=0.04, ref_logps=p["ref"])
    assert inf_loss.item() == loss.item()
    assert set(inf_stats) == set(stats)
    for name in stats:
        assert torch.equal(inf_stats[name], stats[name]), name


@pytest.mark.parametrize("dtype, passes", [(torch.float32, 0 if DEVICE == "cpu" else 1), (torch.bfloat16, 1)])
def test_weight_gradient_finished_in_at_most_one_pass(backend, dtype, passes, monkeypatch):
    """Past the GEMMs that accumulate it, the (V, H) gradient takes no elementwise pass for an fp32 weight when the
    incoming gradient is 1 and on the host (CPU: no rescale by 1, and autograd takes the tensor without a copy), one
    in-place multiply on CUDA (reading the incoming gradient there would stall the host: fused_linear_grpo._finished),
    and exactly one for a bf16 weight (the scale rides on the fp32 -> bf16 conversion, no separate
    multiply): a torch op on the torch backend, the scale_into kernel on Triton (no torch op)."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter copies argument storages through torch ops")
    p = _problem(37, dtype=dtype, bias=False)
    weight = p["weight"].clone().requires_grad_()
    kernel_passes = []  # the scale-into kernel is no torch op: counted at its wrapper
    if backend == "triton":
        from gfpo_kernels import linear_grpo_triton as lgt

        real = lgt.scale_into_triton
        monkeypatch.setattr(lgt, "scale_into_triton",
                            lambda acc, *args: kernel_passes.append(tuple(acc.shape)) or real(acc, *args))
    with _OpLog() as log:
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(p["hidden"], weight, p["target"], p["mask"], p["adv"],
                                                      old_logps=p["old"])
        loss.backward()
    elementwise = ("mul", "_to_copy", "copy_", "clone", "add", "add_", "div", "mul_")
    passes_seen = [op for op, shape, dt in log.ops if shape == tuple(weight.shape) and dt == dtype and op in elementwise]
    passes_seen += ["scale_into_triton" for shape in kernel_passes if shape == tuple(weight.shape)]
    assert len(passes_seen) == passes, passes_seen
    w2 = p["weight"].clone().requires_grad_()
    want, _ = ref.fused_linear_grpo_loss(p["hidden"], w2, p["target"], p["mask"], p["adv"], old_logps=p["old"])
    want.backward()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(weight.grad.float(), w2.grad.float(), rtol=tol, atol=tol * w2.grad.abs().max().item())


def test_logprob_entropy_split_over_the_vocabulary(monkeypatch):
    """The Triton log-prob pass cuts each row's vocabulary into spans when a stage has few rows (a 256-row stage of
    Qwen's vocabulary: 8 spans, 2048 programs) and folds them exactly: equal to a float64 log-softmax, with a span
    that ends inside a block, a row dominated by one logit and a temperature."""
    if "triton" not in LOSS_BACKENDS:
        pytest.skip("Triton is not available here")
    from gfpo_kernels import linear_grpo_triton as lgt

    assert lgt._split_span(256, 151936, 1024) == (8, 19456)
    assert lgt._split_span(4096, 151936, 1024) == (1, 152576)  # enough rows: one program a row
    monkeypatch.setattr(lgt, "BLOCK_V", 64)
    rows, vocab, inv_t = 5, 1100, 1 / 0.7
    assert lgt._split_span(rows, vocab, 64) == (3, 384)
    g = torch.Generator().manual_seed(67)
    logits = 5 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    logits[0] = -3e4
    logits[0, 700] = 50.0
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logp, entropy, lse = lgt.logprob_entropy_triton(logits.float().to(DEVICE), targets.to(DEVICE), inv_t)
    log_p = torch.log_softmax(logits.float().double() * inv_t, -1)
    torch.testing.assert_close(logp.cpu().double(), log_p.gather(1, targets[:, None])[:, 0], rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), -(log_p.exp() * log_p).sum(-1), rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(logits.float().double() * inv_t, -1), rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_into_rounds_once(dtype):
    """The Triton backward kernel: an fp32 accumulator times the incoming gradient, rounded once into the parameter's
    half dtype, equal to torch.mul(acc, scale, out=half) (to nearest even; the interpreter truncates to bf16), at a
    size that is not a multiple of its block."""
    if "triton" not in LOSS_BACKENDS:
        pytest.skip("Triton is not available here")
    from gfpo_kernels.linear_grpo_triton import SCALE_BLOCK, scale_into_triton

    g = torch.Generator().manual_seed(61)
    acc = (torch.randn(3, SCALE_BLOCK // 3 + 7, generator=g) * 100).to(DEVICE)
    scale = torch.tensor(-0.37, device=DEVICE)
    want = acc * scale
    got = scale_into_triton(acc, scale, dtype)
    assert got.dtype == dtype and got.shape == acc.shape
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        expected = _interpreter_bf16(want)
    else:
        expected = torch.mul(acc, scale, out=torch.empty_like(acc, dtype=dtype))
    assert torch.equal(got, expected)
    assert scale_into_triton(acc[:0], scale, dtype).shape == (0, acc.shape[1])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_no_uninitialised_memory_is_read(backend, level):
    """The staging and chunk buffers and the gradient accumulators are allocated without a zero fill (the first
    chunk's GEMMs write grad_h and grad_W): with every uninitialised tensor filled with NaN (PyTorch's
    deterministic mode), the gradients over several chunks of several stages still equal the reference."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        assert torch.isnan(torch.empty(4)).all()
        p = _problem(71)
        loss, _, grads = _run(gfpo_kernels.fused_linear_grpo_loss, p, old_logps=p["old"],
                              importance_sampling_level=level)
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)
    want_loss, _, want = _run(ref.fused_linear_grpo_loss, p, old_logps=p["old"], importance_sampling_level=level)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 3.7, -2.0, 0.0])
def test_any_incoming_gradient(backend, scale):
    p = _problem(39)
    _, _, grads = _run(lambda *a, **k: _scaled_loss(gfpo_kernels.fused_linear_grpo_loss, scale, *a, **k), p,
                          loss_type="grpo", old_logps=p["old"])
    _, _, want = _run(lambda *a, **k: _scaled_loss(ref.fused_linear_grpo_loss, scale, *a, **k), p,
                      loss_type="grpo", old_logps=p["old"])
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def _scaled_loss(fn, scale, *args, **kwargs):
    loss, stats = fn(*args, **kwargs)
    return loss * scale, stats


def test_second_backward_through_one_call_is_refused(backend):
    p = _problem(43)
    weight = p["weight"].clone().requires_grad_()
    loss, _ = gfpo_kernels.fused_linear_grpo_loss(p["hidden"], weight, p["target"], p["mask"], p["adv"])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through the same call"):
        loss.backward()


def test_autocast_runs_the_gemms_in_the_autocast_dtype(backend):
    """fp32 hidden and head under bf16 autocast: the GEMM operands are bf16, as F.linear (TRL's path) would make
    them: the log-probs equal the reference's on bf16-rounded inputs, not its fp32 ones; gradients stay fp32."""
    p = _problem(41)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert gemms.operand_dtype(p["hidden"], p["weight"]) == torch.bfloat16
        loss, stats, grads = _run(gfpo_kernels.fused_linear_grpo_loss, p, loss_type="dapo", old_logps=p["old"])
    rounded = dict(p, hidden=p["hidden"].bfloat16().float(), weight=p["weight"].bfloat16().float(),
                   bias=p["bias"].bfloat16().float())
    want_loss, want_stats, want_grads = _run(ref.fused_linear_grpo_loss, rounded, loss_type="dapo", old_logps=p["old"])
    _, fp32_stats, _ = _run(ref.fused_linear_grpo_loss, p, grads=False, loss_type="dapo", old_logps=p["old"])
    torch.testing.assert_close(stats["logps"], want_stats["logps"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert (stats["logps"] - fp32_stats["logps"]).abs().max() > 1e-3  # the bf16 rounding shows
    for got, expected in zip(grads, want_grads):
        assert got.dtype == torch.float32
        if DEVICE == "cpu":  # the gradient GEMMs take the fp32 logits gradient: as exact as the reference
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        else:  # CUDA rounds the logits gradient to bf16 once before the gradient GEMMs (as TRL's bf16 path does)
            scale = expected.abs().max()
            torch.testing.assert_close(got / scale, expected / scale, rtol=2**-7, atol=2**-8)


def _qwen_shape(n, positions=16384, H=4096, **changes):
    """A bf16 call at Qwen's vocabulary as the planner sees it (gradients for hidden and weight)."""
    sizes = dict(n=n, positions=positions, V=151936, H=H, operand_elem_bytes=2, hidden_elem_bytes=2,
                 grad_h_elem_bytes=2, weight_elem_bytes=2, weight_direct=True, weight_copy=False, need_h=True,
                 need_w=True)
    return CallShape(**{**sizes, **changes})


def _cuda_plan(shape, budget_bytes):
    """plan_chunks within a CUDA budget (one that follows free memory) of `budget_bytes`."""
    return plan_chunks(shape, Budget(budget_bytes, follows_free_memory=True))


def test_budget_follows_free_cuda_memory(monkeypatch):
    """CUDA: half the memory free for new tensors (device free + what the allocator caches unused); other devices a
    constant; planning(budget_bytes=...) overrides."""
    memory = {"free": 8 << 30, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (memory["free"], 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    cuda = torch.device("cuda")
    assert chunk_plan.device_budget(cuda) == Budget(4 << 30, follows_free_memory=True)
    memory.update(reserved=6 << 30, allocated=2 << 30)  # 4 GiB cached but unused count as free
    assert chunk_plan.device_budget(cuda) == Budget(6 << 30, follows_free_memory=True)
    assert chunk_plan.device_budget(torch.device("cpu")) == Budget(64 << 20, follows_free_memory=False)
    budgets = []
    with planning(lambda shape, budget, limits: budgets.append(budget), budget_bytes=1 << 20):
        chunk_plan.plan_call(_qwen_shape(10), cuda)
    assert budgets == [Budget(1 << 20, follows_free_memory=True)]


def test_chunk_plan_from_the_one_budget():
    """Stages of at most 512 rows cut evenly, whatever the memory; one chunk where its peak is no higher than
    several chunks' (a GRPO batch of short completions); else chunks whose buffers take the LM head weight's size,
    fewer rows when the budget is short, never under 256 MiB."""
    V, H = 151936, 4096
    budget = 40 << 30
    # 26.5% of 16384 scored: 9 stages of 481-482 rows, one chunk (its logits gradient in bf16, 1.23 GiB, plus the
    # bf16 weight gradient it writes: no fp32 accumulator, 2.4 GiB at the peak, against 3.7 for several chunks)
    plan = _cuda_plan(_qwen_shape(4335), budget)
    assert plan.chunks == ((0, 4335),) and len(plan.stages) == 9 and plan.stage_rows == 482
    # 87% scored: 28 stages of 511-512 rows; the buffers take the weight's 2VH bytes: the staging buffer 4*512*V,
    # the chunk's gradient (2VH - 4*512*V) / 2V = H - 1024 = 3072 rows, 6 stages: 5 chunks of 5-6 stages
    roomy = _cuda_plan(_qwen_shape(14309), budget)
    assert len(roomy.stages) == 28 and roomy.stage_rows == 512
    assert len(roomy.chunks) == 5 and roomy.chunk_rows <= H - 1024
    assert [len(roomy.stages_of(*c)) for c in roomy.chunks] == [5, 6, 5, 6, 6]
    # a short budget (2.5 GiB: less than the fp32 accumulator and the rest already take): the chunks shrink to
    # 256 MiB (one stage each); the stages stay, so the log-probabilities keep their bits
    budget = int(2.5 * 2**30)
    short = _cuda_plan(_qwen_shape(14309), budget)
    assert short.stages == roomy.stages and len(short.chunks) == 28
    # a budget (2 GiB) that one chunk exceeds (4335 rows: 2.45 GiB; 8000: 3.55) keeps it all the same: several
    # chunks would peak higher still (3.64 / 3.66 GiB: the fp32 accumulator beside the weight gradient cast from it)
    # and run 9 / 16 accumulator passes; where one chunk peaks higher than several (10000 rows: 4.14 against
    # 3.68 GiB), several
    budget = 2 << 30
    for n, one_chunk in ((4335, True), (8000, True), (10000, False)):
        shape = _qwen_shape(n)
        chosen = _cuda_plan(shape, budget)
        assert (len(chosen.chunks) == 1) is one_chunk, n
        peak = shape.peak_bytes(chosen.stage_rows, chosen.chunk_rows, len(chosen.chunks))
        other = (shape.peak_bytes(chosen.stage_rows, 3 * chosen.stage_rows, 2) if one_chunk
                 else shape.peak_bytes(chosen.stage_rows, n, 1))
        assert peak <= other, (n, peak / 2**30, other / 2**30)
    # an fp32 head under bf16 autocast: its bf16 copy (VH * 2 bytes) and the fp32 input gradient count, so a budget
    # that holds the bf16 head's 5 chunks exactly leaves its chunks only the 256 MiB floor
    bf16 = _qwen_shape(14309)
    exact = bf16.phase_bytes(512, 0, chunks=2)[0] + 2 * V * H - 4 * 512 * V
    assert len(_cuda_plan(bf16, exact).chunks) == 5
    fp32_head = _qwen_shape(14309, hidden_elem_bytes=4, grad_h_elem_bytes=4, weight_elem_bytes=4, weight_copy=True)
    assert len(_cuda_plan(fp32_head, exact).chunks) == 28
    # every position scored: no stage or chunk holds more than half of them
    budget = 40 << 30
    plan = _cuda_plan(_qwen_shape(1000, positions=1000), budget)
    assert plan.chunks == ((0, 500), (500, 1000)) and plan.stage_rows == 500
    # a small head (H=896, weight 0.25 GiB): buffers of 1 GiB, (2**30 - 4*512*V) / 2V = 2509 rows: 4 stages a chunk
    plan = _cuda_plan(_qwen_shape(14309, H=896), budget)
    assert plan.chunk_rows <= 2509 and len(plan.chunks) == 7
    # never more rows than tokens, never fewer than one; nothing scored: nothing to do
    assert _cuda_plan(_qwen_shape(3, V=1000, H=8), budget).chunks == ((0, 3),)
    assert _cuda_plan(_qwen_shape(0), budget) == Plan(chunks=(), stages=())
    no_grad = _qwen_shape(14309, need_h=False, need_w=False)
    assert _cuda_plan(no_grad, budget).stages == roomy.stages


@pytest.mark.parametrize("shape", [_qwen_shape(14309), _qwen_shape(4335), _qwen_shape(8000, H=896),
                                   _qwen_shape(14309, n_zero=6000, need_w=False),
                                   _qwen_shape(14309, hidden_elem_bytes=4, grad_h_elem_bytes=4, weight_elem_bytes=4,
                                               weight_copy=True)],
                         ids=["ragged", "grpo-lengths", "small-head", "frozen-head-zero-rows", "fp32-head"])
def test_plan_depends_on_free_memory_only_below_the_roomy_budget(shape):
    """Where the budget follows free memory (CUDA), the stages never depend on it, and the chunks depend on it only
    below chunk_plan.roomy_budget_bytes: from there up every budget makes the same plan, so the same inputs give the
    same bits on any device with twice that free (docs/fused-loss.md, "Same inputs, same bits"). Below it, chunks
    may shrink (the stages stay)."""
    roomy = chunk_plan.roomy_budget_bytes(shape)
    plan = _cuda_plan(shape, roomy)
    assert roomy < 8 << 30  # at Qwen's vocabulary and H=4096: 16 GiB free on the GPU suffice
    for budget in (roomy + 1, 2 * roomy, 40 << 30, 1 << 40):
        assert _cuda_plan(shape, budget) == plan and _cuda_plan(shape, budget).peak_bytes == plan.peak_bytes
    short = _cuda_plan(shape, roomy // 3)
    assert short.stages == plan.stages
    if len(plan.chunks) > 1:
        assert len(short.chunks) > len(plan.chunks)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gradient_bits_across_chunk_counts(backend, monkeypatch, weight_dtype):
    """What a busier GPU changes (a short budget: more chunks, plan_chunks): the loss, log-probabilities and entropy
    keep every bit (the stages stay); the gradients are fp32 sums taken in another order, each rounded once, so they
    may differ in their last bits: a bf16 weight gradient by at most one unit in the last place (one chunk: one
    GEMM's fp32 sum written in bf16 on CUDA; several: an fp32 accumulator, cast once), an fp32 one within fp32
    summation error; the input gradient (each chunk's GEMM sums a row over the whole vocabulary; the GEMM's shape
    changes with the chunk) likewise. bf16: CUDA's path emulated on the CPU."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter copies argument storages through torch ops")
    if weight_dtype == torch.bfloat16:
        _bf16_operands_on_cpu(monkeypatch)
    p = _problem(101, dtype=weight_dtype, bias=False)
    runs = []
    for stage_rows, chunk_rows in ((2, 1 << 20), (2, 4)):  # one chunk, several
        with force_plan(stage_rows, chunk_rows):
            runs.append(_run(gfpo_kernels.fused_linear_grpo_loss, p, old_logps=p["old"]))
    (loss_1, stats_1, grads_1), (loss_n, stats_n, grads_n) = runs
    assert torch.equal(loss_1, loss_n)
    assert all(torch.equal(stats_1[name], stats_n[name]) for name in stats_1)
    for one, several in zip(grads_1, grads_n):
        assert one.dtype == several.dtype == weight_dtype
        if weight_dtype == torch.bfloat16:  # one unit in the last place at most (eps * |x| >= ulp(x))
            ulp = torch.finfo(weight_dtype).eps * one.float().abs()
            assert torch.all((one.float() - several.float()).abs() <= ulp)
        else:
            torch.testing.assert_close(one, several, rtol=1e-5, atol=1e-6 * one.abs().max().item())


@pytest.mark.parametrize("call", ["no_grad", "forward+backward", "frozen head, most advantages 0"])
def test_cpu_call_holds_its_plans_count_within_the_constant_budget(call):
    """Off CUDA the budget is a constant (64 MiB): a stage and the torch twins' temporaries take at most half of it
    (whatever the call, so the stages stay a function of the shapes), the chunk buffer what the rest leaves. A CPU
    call (V=32768, H=32, 600 scored tokens) then holds at its peak what its plan counted (plan.peak_bytes, the
    twins' temporaries among it), measured by the profiler's allocation events, and that stays within the budget."""
    plans = record_plans()
    g = torch.Generator().manual_seed(37)
    b, t, h, v = 8, 100, 32, 32768
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    target = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.75).float()
    adv = torch.randn(b, generator=g)
    if call.startswith("frozen"):
        adv[1:] = 0.0  # 7 of 8 sequences: their rows project for log-probs only, in stages of their own
    grad = call != "no_grad"
    leaves = (hidden.requires_grad_(grad), weight.requires_grad_(grad and not call.startswith("frozen")))

    logps = []

    def run():
        with gfpo_kernels.use_backend("torch"), planning(plans):
            loss, stats = gfpo_kernels.fused_linear_grpo_loss(*leaves, target, mask, adv)
            logps.append(stats["logps"])
            if loss.requires_grad:
                loss.backward()

    peak = peak_memory(run, "cpu")
    (plan,) = plans
    assert peak == pytest.approx(plan.peak_bytes, rel=0.05), (peak / 2**20, plan.peak_bytes / 2**20)
    assert peak <= DEFAULT_LIMITS.constant_budget_bytes, peak / 2**20
    assert len(plan.stages) > 4 and (len(plan.chunks) > 1) is (call == "forward+backward")
    if grad:  # the same stages without gradients: the same bits
        with torch.no_grad():
            run()
        assert plans[1].stages == plan.stages and torch.equal(logps[1], logps[0])


def test_one_host_read_per_forward(backend, monkeypatch):
    """The forward reads the device once (the count of scored tokens and the target-id range, in one transfer):
    no any(), boolean index, int(), item() or data-dependent nonzero besides."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter reads tensors on the host")
    p = _problem(47)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: transfers.append("tolist") or tolist(self))
    with _OpLog() as log:
        gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"], old_logps=p["old"],
                                            num_items_in_batch=20)
    host_reads = transfers + [op for op, _, _ in log.ops if op in ("_local_scalar_dense", "nonzero", "index_bool")]
    assert host_reads == ["tolist"]


class _RoundGradToBF16(torch.autograd.Function):
    """Identity whose backward rounds the incoming gradient to bf16 once."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16).to(grad.dtype)


def test_logits_gradient_rounded_once(backend, monkeypatch):
    """bf16 operands (CUDA's path; emulated on CPU, whose torch.mm has no out_dtype): the fp32 logits gradient of
    each stage is converted to bf16 once, into the chunk's buffer (by the row kernel itself on Triton), and both
    gradient GEMMs use it; the gradients equal a float64 reference whose logits gradient
    is rounded to bf16 once."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter copies argument storages through torch ops")
    if DEVICE == "cpu":
        monkeypatch.setattr(gemms, "gemm_operands", lambda h, w, dtype=None: (h.bfloat16(), w.bfloat16()))

        def project(h, w, b, out):
            torch.mm(h.float(), w.float().t(), out=out)
            return out if b is None else out.add_(b)

        monkeypatch.setattr(gemms, "project", project)
        # a.to(b.dtype): what main's _addmm_fp32 did per GEMM; a no-op once the chunk's gradient is already bf16
        def gemm(out, a, b, accumulate=False):
            product = a.to(b.dtype).float() @ b.float()
            out.add_(product) if accumulate else out.copy_(product)

        monkeypatch.setattr(gemms, "gemm", gemm)
    p = _problem(53, dtype=torch.bfloat16, bias=False)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    with force_plan(2, 4), _OpLog() as log:
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"],
                                                      old_logps=p["old"])
    stages, chunks = _sweep_counts(int(p["mask"].sum()), 2, 4)
    roundings = [op for op, shape, dt in log.ops if op in ("_to_copy", "copy_") and dt == torch.bfloat16
                 and shape is not None and V in shape]  # (rows, V), (V, rows)
    # the torch twin rounds with one copy per stage; the Triton kernel writes the bf16 values itself (no torch op)
    assert chunks >= 3 and len(roundings) == (stages if backend == "torch" else 0)
    got = torch.autograd.grad(loss, (hidden, weight))

    h64, w64 = p["hidden"].double().requires_grad_(), p["weight"].double().requires_grad_()
    logits = _RoundGradToBF16.apply(h64 @ w64.t())
    logps = torch.log_softmax(logits, -1).gather(-1, p["target"].unsqueeze(-1)).squeeze(-1)
    want_loss, _ = grpo_loss_from_logps(logps, p["mask"].double(), p["adv"].double(), GRPOLossOptions(),
                                        old_logps=p["old"].double())
    want = torch.autograd.grad(want_loss, (h64, w64))
    for g, w in zip(got, want):
        scale = w.abs().max()
        torch.testing.assert_close(g.double() / scale, w / scale, rtol=0, atol=1e-2)


G_CONFIGS = [dict(loss_type=lt) for lt in LOSS_TYPES] + [
    dict(loss_type="grpo", beta=0.04, delta=1.1),
    dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, epsilon_high=0.28),
    dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.3, beta=0.02),
    dict(loss_type="cispo", epsilon_high=1.2),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5),
]


@pytest.mark.parametrize("config", G_CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in G_CONFIGS])
@pytest.mark.parametrize("with_old", [True, False])
def test_log_prob_pass_computes_the_loss_gradient(backend, config, with_old):
    """The log-prob pass of a stage (Triton kernel or torch twin) writes the rows' log-probs and entropy at their
    flat positions and their log-partition, and, for a token-local loss, g = d(loss)/d(logp) in closed form: equal
    to autograd through grpo_loss_math over the whole batch (the oracle), with the vLLM ratio (B, T) or one a
    sequence, and a temperature and soft cap (which change the log-probs, not g's formula)."""
    options = GRPOLossOptions(**config, temperature=0.8, logit_softcap=6.0)
    if not options.is_token_local(with_old_logps=with_old):
        pytest.skip("vespo given old log-probs: g by autograd (two sweeps)")
    p = _problem(sum(map(ord, str(config))) + with_old)
    mask = p["mask"]
    positions = torch.nonzero(mask.reshape(-1) != 0).squeeze(1)
    n = positions.numel()
    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(n, V, generator=g)).to(DEVICE)
    targets = p["target"].reshape(-1)[positions]
    ratio = p["is_ratio"] if with_old else p["is_ratio"][:, :1]
    loss_inputs = dict(advantages=p["adv"], old_logps=p["old"] if with_old else None,
                       ref_logps=p["ref"] if options.beta else None, vllm_is_ratio=ratio, num_items_in_batch=None)
    lo, hi = 2, n - 1  # one stage: rows [lo, hi)
    inputs = token_grad_inputs(mask, positions, options=options, **loss_inputs)
    logps, entropy = torch.zeros(B * T, device=DEVICE), torch.zeros(B * T, device=DEVICE)
    lse, g_rows = torch.empty(hi - lo, device=DEVICE), torch.empty(hi - lo, device=DEVICE)
    stage_statistics = executor.row_passes(backend).stage_statistics
    stage_statistics(logits[lo:hi].clone(), targets[lo:hi], 1 / 0.8, 6.0, logps=logps, entropy=entropy, lse=lse,
                     positions=positions[lo:hi], g=g_rows, g_inputs=inputs.rows(lo, hi), options=options)

    z = (6.0 * torch.tanh(logits.double() / 6.0)) / 0.8
    log_p = torch.log_softmax(z, -1)
    want_logp = log_p.gather(1, targets[:, None])[:, 0]
    at = positions[lo:hi]
    torch.testing.assert_close(logps[at].double(), want_logp[lo:hi], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[at].double(), -(log_p.exp() * log_p).sum(-1)[lo:hi], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1)[lo:hi], rtol=1e-6, atol=1e-5)
    assert logps.count_nonzero() == hi - lo  # nothing written elsewhere
    # the oracle at the pass's own log-probs, in fp32 as the fused loss computes
    x = torch.zeros(B * T, device=DEVICE).index_put((positions,), want_logp.float()).index_put((at,), logps[at])
    x.requires_grad_()
    loss, _ = grpo_loss_from_logps(x.view(B, T), mask, options=options, with_stats=False, **loss_inputs)
    (want,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g_rows, want[at], rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("config", [dict(loss_type="grpo", delta=1.1), dict(loss_type="cispo"),
                                    dict(loss_type="sapo"), dict(loss_type="bnpo", epsilon_high=0.18)],
                         ids=["grpo,delta", "cispo", "sapo", "bnpo"])
# the Triton interpreter computes exp(inf) and 0 * inf in NumPy, which warns; those values are the test's input
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning",
                            "ignore:invalid value encountered in multiply:RuntimeWarning")
def test_log_prob_pass_loss_gradient_at_non_finite_ratios(backend, config):
    """Old log-probs that overflow the fp32 ratio (-100, -inf) or are NaN at scored tokens: the log-prob pass's g
    (Triton kernel or torch twin) is non-finite exactly where autograd through grpo_loss_math is (0 * inf = NaN in
    exp's backward, as in TRL; torch.clamp passes NaN through) and equal to it elsewhere: neither delta's clamp nor a
    NaN-dropping minimum may turn it finite."""
    options = GRPOLossOptions(**config)
    p = _problem(61)
    mask = torch.ones(B, T, device=DEVICE)
    positions = torch.arange(B * T, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    logits = (2 * torch.randn(B * T, V, generator=g)).to(DEVICE)
    targets = p["target"].reshape(-1)
    adv = torch.tensor([1.0, -1.0, 0.5], device=DEVICE)
    old = p["old"].clone()
    old[:2, :3] = torch.tensor([-100.0, float("-inf"), float("nan")], device=DEVICE)
    inputs = token_grad_inputs(mask, positions, adv, options, old_logps=old)
    logps, entropy = torch.zeros(B * T, device=DEVICE), torch.zeros(B * T, device=DEVICE)
    lse, g_rows = torch.empty(B * T, device=DEVICE), torch.empty(B * T, device=DEVICE)
    executor.row_passes(backend).stage_statistics(logits, targets, 1.0, None, logps=logps, entropy=entropy,
                                                  lse=lse, positions=positions, g=g_rows, g_inputs=inputs,
                                                  options=options)
    x = logps.clone().view(B, T).requires_grad_()
    loss, _ = grpo_loss_from_logps(x, mask, adv, options, old_logps=old, with_stats=False)
    (want,) = torch.autograd.grad(loss, x)
    want = want.reshape(-1)
    finite = torch.isfinite(want)
    assert not finite.all()
    assert torch.equal(torch.isfinite(g_rows), finite)
    torch.testing.assert_close(g_rows[finite], want[finite], rtol=1e-5, atol=1e-7)


def test_an_unknown_loss_type_at_the_log_prob_pass_is_an_error(backend):
    """A loss type without a row in loss_types.LOSS_SPECS that reaches the log-prob pass's loss gradient (options made
    around GRPOLossOptions' own check) is a ValueError naming it, in the Triton dispatch and in the torch closed
    form alike, never another type's branch."""
    options = GRPOLossOptions(loss_type="dapo")
    object.__setattr__(options, "loss_type", "made_up")
    p = _problem(97)
    positions = torch.nonzero(p["mask"].reshape(-1) != 0).squeeze(1)
    n = positions.numel()
    inputs = token_grad_inputs(p["mask"], positions, p["adv"], GRPOLossOptions(loss_type="dapo"), old_logps=p["old"])
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logps, entropy = torch.zeros(B * T, device=DEVICE), torch.zeros(B * T, device=DEVICE)
    lse, g_rows = torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE)
    with pytest.raises(ValueError, match=r"loss_type must be one of .* got loss_type='made_up'"):
        executor.row_passes(backend).stage_statistics(
            logits, p["target"].reshape(-1)[positions], 1.0, None, logps=logps, entropy=entropy, lse=lse,
            positions=positions, g=g_rows, g_inputs=inputs, options=options)


SKIP_CONFIGS = [
    dict(loss_type="dapo", with_old=True, uses_vllm=True),
    dict(loss_type="grpo", with_old=True, delta=1.2),
    dict(loss_type="sapo", with_old=True),
    dict(loss_type="cispo", with_old=True, epsilon_high=1.2),
    dict(loss_type="vespo", uses_vllm=True),
    dict(loss_type="luspo", token_advantages=True),
    dict(loss_type="bnpo", temperature=0.7, logit_softcap=5.0),
]


@pytest.mark.parametrize("config", SKIP_CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in SKIP_CONFIGS])
def test_zero_gradient_rows_skip_the_gradient_work(backend, monkeypatch, config):
    """Scored tokens whose loss gradient is exactly 0 (advantage 0, no KL; grpo_loss_math.zero_gradient_tokens)
    take no logits-gradient pass and no row in either gradient GEMM, yet their log-probs and entropy are computed:
    the loss, statistics and gradients equal the reference's and the fused loss's without skipping, and the rows
    that went through the gradient work are counted (the others' count, the zero-advantage sequences' scored
    tokens, is what is saved)."""
    config = dict(config)
    with_old, uses_vllm, token_adv = (config.pop(k, False) for k in ("with_old", "uses_vllm", "token_advantages"))
    p = _problem(83)
    p["mask"][2, :4] = 1.0  # row 2 scored too
    adv = p["adv"].clone()
    adv[1] = 0.0  # a zero-variance group's row
    if token_adv:  # (B, T) advantages: a zero per token as well
        adv = adv[:, None].expand(B, T).clone()
        adv[0, 1] = 0.0
    p["adv"] = adv
    options = dict(config, old_logps=p["old"] if with_old else None,
                   vllm_is_ratio=p["is_ratio"] if uses_vllm else None)
    zero = (p["mask"] != 0) & ((adv == 0) if adv.dim() == 2 else (adv == 0)[:, None])
    assert 0 < int(zero.sum()) < int(p["mask"].sum())

    rows = []
    real_ops = executor.row_passes

    def counting(backend_name):
        ops = real_ops(backend_name)

        def grad_logits(logits, *args, **kwargs):
            rows.append(logits.shape[0])
            return ops.grad_logits(logits, *args, **kwargs)
        return ops._replace(grad_logits=grad_logits)

    monkeypatch.setattr(executor, "row_passes", counting)
    _compare(p, **options)
    assert sum(rows) == int(p["mask"].sum()) - int(zero.sum())
    rows.clear()
    with _OpLog() as log:
        skipped = _run(gfpo_kernels.fused_linear_grpo_loss, p, **options)
    # the input-gradient GEMMs' outputs (chunk rows, H): the rows the gradient GEMMs took
    gemm_rows = [shape[0] for op, shape, _ in log.ops if op in GEMMS and shape[1] == H and shape[0] != V]
    assert sum(gemm_rows) == sum(rows) == int(p["mask"].sum()) - int(zero.sum())
    monkeypatch.setattr(flg, "zero_gradient_tokens", lambda *args, **kwargs: None)
    rows.clear()
    unskipped = _run(gfpo_kernels.fused_linear_grpo_loss, p, **options)
    assert sum(rows) == int(p["mask"].sum())
    torch.testing.assert_close(skipped[0], unskipped[0], rtol=1e-6, atol=1e-7)
    for got, want in zip(skipped[2], unskipped[2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(skipped[1]["logps"], unskipped[1]["logps"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(skipped[1]["entropy"], unskipped[1]["entropy"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
def test_nan_hidden_state_of_a_zero_gradient_row(backend, loss_type):
    """A NaN hidden state in a row of advantage 0 (docs/fused-loss.md, bad input): its log-probability is NaN, so
    the loss is NaN, as the reference's (TRL's) is; its gradient work is skipped, so the gradients hold no NaN and
    equal the reference's on the same batch with that state finite, where the reference's own gradients are NaN
    (the weight's and bias's everywhere, that hidden state's)."""
    p = _problem(89)
    p["adv"][1] = 0.0
    nan_row = p["hidden"].clone()
    nan_row[1, 1] = float("nan")
    assert p["mask"][1, 1] == 1
    loss, stats, grads = _run(gfpo_kernels.fused_linear_grpo_loss, {**p, "hidden": nan_row}, loss_type=loss_type)
    assert torch.isnan(loss) and torch.isnan(stats["logps"][1, 1])
    _, _, trl_grads = _run(ref.fused_linear_grpo_loss, {**p, "hidden": nan_row}, loss_type=loss_type)
    assert all(torch.isnan(x).any() for x in trl_grads)
    _, _, want = _run(ref.fused_linear_grpo_loss, p, loss_type=loss_type)
    for got, expected in zip(grads, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_no_skip_where_the_gradient_is_not_provably_zero():
    """A zero advantage does not make the gradient 0 with a KL term, at sequence level, for vespo given old
    log-probs, where an old log-prob is not finite or (clipped types, sapo) so low that the ratio could overflow
    (inf x 0 is NaN, in TRL too), or where the vLLM ratio is not finite; where it is flagged, autograd's gradient
    is exactly 0 even at the extremes allowed (an old log-prob of -86.9 under a log-prob of 0)."""
    from gfpo_kernels.grpo_loss_math import zero_gradient_tokens

    live = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([0.0, 1.0])
    old = torch.tensor([[-1.0, -86.9, -90.0], [-1.0, -1.0, -1.0]])
    ratio = torch.tensor([[1.0, float("nan"), 2.0], [1.0, 1.0, 1.0]])
    opts = GRPOLossOptions(loss_type="dapo")
    assert zero_gradient_tokens(live, adv, opts).tolist() == [[True] * 3, [False] * 3]
    assert zero_gradient_tokens(live, adv, opts, old_logps=old).tolist() == [[True, True, False], [False] * 3]
    assert zero_gradient_tokens(live, adv, opts, vllm_is_ratio=ratio).tolist() == [[True, False, True], [False] * 3]
    cispo = GRPOLossOptions(loss_type="cispo")
    assert zero_gradient_tokens(live, adv, cispo, old_logps=old).tolist() == [[True] * 3, [False] * 3]
    nan_old = old.clone()
    nan_old[0, 0] = float("nan")
    assert zero_gradient_tokens(live, adv, cispo, old_logps=nan_old)[0, 0].item() is False
    for opts_off, kw in ((GRPOLossOptions(beta=0.1), {}), (GRPOLossOptions(importance_sampling_level="sequence"), {}),
                         (GRPOLossOptions(loss_type="vespo"), dict(old_logps=old))):
        assert zero_gradient_tokens(live, adv, opts_off, **kw) is None
    # autograd's gradient at the flagged tokens, log-probs at their extremes (0, and far below the old ones)
    for loss_type in ("grpo", "sapo", "cispo", "dapo"):
        opts = GRPOLossOptions(loss_type=loss_type, delta=2.0)
        flagged = zero_gradient_tokens(live, adv, opts, old_logps=old, vllm_is_ratio=ratio)
        for value in (0.0, -200.0):
            x = torch.full((2, 3), value, requires_grad=True)
            loss, _ = grpo_loss_from_logps(x, live.float(), adv, opts, old_logps=old, vllm_is_ratio=ratio)
            (grad,) = torch.autograd.grad(loss, x)
            assert torch.all(grad[flagged] == 0), (loss_type, value)


def _bf16_operands_on_cpu(monkeypatch):
    """CUDA's bf16 path on the CPU, whose torch.mm has no out_dtype: bf16 GEMM operands, fp32 logits. Returns the
    list of (shape, dtype) of what each gradient GEMM writes."""
    written = []
    monkeypatch.setattr(gemms, "gemm_operands", lambda h, w, dtype=None: (h.bfloat16(), w.bfloat16()))

    def project(h, w, b, out):
        torch.mm(h.float(), w.float().t(), out=out)
        return out if b is None else out.add_(b)

    monkeypatch.setattr(gemms, "project", project)

    def gemm(out, a, b, accumulate=False):  # fp32 sums of the bf16 operands, rounded once into out
        written.append((tuple(out.shape), out.dtype))
        product = a.float() @ b.float()
        out.add_(product) if accumulate else out.copy_(product)

    monkeypatch.setattr(gemms, "gemm", gemm)
    return written


@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_one_chunk_writes_the_gradients_in_the_parameter_dtype(backend, monkeypatch, scale):
    """bf16 hidden and head, few scored tokens (one chunk of several stages): the weight gradient is written by one
    GEMM over every scored token, and each chunk's input gradient by one over the vocabulary, straight in bf16: no
    fp32 (V, H) or (n, H) tensor exists. Each is the fp32 sum rounded once to nearest even, so it is within one
    bf16 rounding (relative 2**-8) of a float64 reference whose logits gradient is rounded to bf16 as ours is; an
    incoming gradient other than 1 (3.7) rounds once more, within 2**-7."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter copies argument storages through torch ops")
    written = _bf16_operands_on_cpu(monkeypatch)
    p = _problem(73, dtype=torch.bfloat16, bias=False)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    with force_plan(2, 1 << 20), _OpLog() as log:
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"],
                                                      old_logps=p["old"])
    n = int(p["mask"].sum())
    assert _sweep_counts(n, 2, 1 << 20) == (-(-n // 2), 1)
    assert written == [((n, H), torch.bfloat16), ((V, H), torch.bfloat16)]
    allocations = ("empty", "empty_strided", "zeros", "new_empty", "new_zeros")
    assert not [op for op, shape, dt in log.ops if op in allocations and shape in ((V, H), (n, H))
                and dt == torch.float32]
    got = torch.autograd.grad(loss * scale, (hidden, weight))
    assert all(g.dtype == torch.bfloat16 for g in got)

    h64, w64 = p["hidden"].double().requires_grad_(), p["weight"].double().requires_grad_()
    logits = _RoundGradToBF16.apply(h64 @ w64.t())
    logps = torch.log_softmax(logits, -1).gather(-1, p["target"].unsqueeze(-1)).squeeze(-1)
    want_loss, _ = grpo_loss_from_logps(logps, p["mask"].double(), p["adv"].double(), GRPOLossOptions(),
                                        old_logps=p["old"].double())
    # the forward's gradients are those of the loss itself (its logits gradient rounded as the reference's), scaled
    # in backward: the reference scaled exactly
    want = [w * scale for w in torch.autograd.grad(want_loss, (h64, w64))]
    rtol = 2**-8 if scale == 1.0 else 2**-7
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=1e-6 * w.abs().max().item())


def test_reduced_precision_reductions_off_around_half_outputs():
    """cuBLAS may add split-K partial sums in a bf16/fp16 output's dtype (PyTorch allows it by default): off while
    a gradient GEMM writes half precision on CUDA, restored after; untouched for fp32 outputs and on the CPU."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    cuda = torch.device("cuda")
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        matmul.allow_fp16_reduced_precision_reduction = True
        for dtype, name in ((torch.bfloat16, "allow_bf16_reduced_precision_reduction"),
                            (torch.float16, "allow_fp16_reduced_precision_reduction")):
            with gemms.fp32_reductions(dtype, cuda):
                assert getattr(matmul, name) is False
            assert getattr(matmul, name) is True
            with gemms.fp32_reductions(dtype, torch.device("cpu")):
                assert getattr(matmul, name) is True
        with gemms.fp32_reductions(torch.float32, cuda):
            assert matmul.allow_bf16_reduced_precision_reduction is True
        if hasattr(matmul, "allow_bf16_reduced_precision_reduction_split_k"):  # torch >= 2.10: (reduced, split-K)
            # a user who turned split-K off (deterministic sums) keeps it off inside: only reduced precision goes
            matmul.allow_bf16_reduced_precision_reduction = (False, False)
            with gemms.fp32_reductions(torch.bfloat16, cuda):
                assert matmul.allow_bf16_reduced_precision_reduction_split_k is False
            assert matmul.allow_bf16_reduced_precision_reduction_split_k is False
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


def test_reduced_precision_reductions_across_threads():
    """The reduced-precision flag is process-wide: blocks of two threads that overlap (A enters, B enters, A leaves,
    B leaves) keep it off until the last one leaves, then the user's setting is back; a setting made inside a block
    is kept: A's exit must not turn reduced precision back on under B's GEMMs, nor B's exit leave it off."""
    import threading

    matmul = torch.backends.cuda.matmul
    name = "allow_bf16_reduced_precision_reduction"
    saved = getattr(matmul, name)
    cuda = torch.device("cuda")
    seen = {}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def thread_a():
        with gemms.fp32_reductions(torch.bfloat16, cuda):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def thread_b():
        a_in.wait(5)
        with gemms.fp32_reductions(torch.bfloat16, cuda):
            b_in.set()
            a_out.wait(5)
            seen["inside B after A left"] = getattr(matmul, name)

    try:
        setattr(matmul, name, True)
        threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert seen == {"inside B after A left": False}
        assert getattr(matmul, name) is True
        with gemms.fp32_reductions(torch.bfloat16, cuda):  # the user turns it off inside a block: kept
            setattr(matmul, name, False)
            with gemms.fp32_reductions(torch.bfloat16, cuda):
                pass
            setattr(matmul, name, True)
        assert getattr(matmul, name) is True
    finally:
        setattr(matmul, name, saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_in_place_skips_a_scale_of_one(backend, dtype):
    """The backward's in-place scale of a gradient already in its parameter's dtype: a scale of 1 leaves every bit
    as it was (the kernel returns at once; the CPU twin tests it on the host), any other multiplies, rounded once
    (to nearest even; the Triton interpreter truncates to bf16), at a size that is not a multiple of the block."""
    scale_in_place = executor.row_passes(backend).scale_in_place
    g = torch.Generator().manual_seed(79)
    x = (torch.randn(3, 5000, generator=g) * 50).to(dtype).to(DEVICE)
    before = x.clone()
    with _OpLog() as log:
        assert scale_in_place(x, torch.tensor(1.0, device=DEVICE)) is x
    assert torch.equal(x, before)
    if backend == "torch" and DEVICE == "cpu":  # x * 1 keeps every bit anyway: what shows the skip is no pass
        assert log.count("mul", "mul_") == 0
    if backend == "triton" or DEVICE == "cpu":  # (the torch twin multiplies on a GPU rather than wait for the host)
        # ... except a signalling NaN's, which any multiplication quiets: its bits show that nothing was written
        as_int, pattern = {torch.float32: (torch.int32, 0x7F800001), torch.bfloat16: (torch.int16, 0x7F81)}[dtype]
        snan = torch.full((3, 5000), pattern, dtype=as_int, device=DEVICE).view(dtype)
        scale_in_place(snan, torch.tensor(1.0, device=DEVICE))
        assert torch.all(snan.view(as_int) == pattern)
    scale = torch.tensor(-0.37, device=DEVICE)
    scale_in_place(x, scale)
    want = before.float() * scale
    if backend == "triton" and DEVICE == "cpu" and dtype == torch.bfloat16:
        expected = _interpreter_bf16(want)
    else:
        expected = want.to(dtype)
    assert torch.equal(x, expected)


@pytest.mark.parametrize(
    "device, capability, dtype, fp16_accumulation, half",
    [
        ("cuda", (9, 0), torch.bfloat16, False, True),
        ("cuda", (8, 0), torch.bfloat16, False, True),
        ("cuda", (7, 5), torch.bfloat16, False, False),  # T4: cuBLAS has no bf16 -> fp32 GEMM before sm_80
        ("cuda", (7, 0), torch.float16, False, True),
        ("cuda", (9, 0), torch.float16, True, False),  # torch refuses fp32 output with fp16 accumulation on
        ("cuda", (9, 0), torch.float32, False, False),
        ("cpu", (0, 0), torch.bfloat16, False, False),
    ],
)
def test_half_operands_only_where_cublas_writes_fp32(monkeypatch, device, capability, dtype, fp16_accumulation,
                                                     half):
    """bf16/fp16 operands stay half precision only where torch.mm(out_dtype=float32) runs (PyTorch 2.8-2.11
    refuse bf16 before compute capability 8.0 and fp16 with allow_fp16_accumulation); elsewhere they are rounded
    to the dtype and held in fp32, the same values the GEMM would multiply."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # torch.backends.cuda.matmul.allow_fp16_accumulation reads this getter
    monkeypatch.setattr(torch._C, "_get_cublas_allow_fp16_accumulation", lambda: fp16_accumulation)
    assert gemms.half_gemm_on_device(torch.device(device), dtype) is half
    if device == "cpu":
        h, w = torch.randn(3, 8), torch.randn(5, 8)
        gh, gw = gemms.gemm_operands(h, w, dtype)
        assert gh.dtype == gw.dtype == torch.float32
        assert torch.equal(gw, w.to(dtype).float()) and torch.equal(gh, h.to(dtype).float())


def test_gradient_only_where_asked(backend):
    """A frozen LM head (weight without grad) still gives grads for hidden, and the other way round."""
    p = _problem(17)
    weight = p["weight"].clone()
    hidden = p["hidden"].clone().requires_grad_()
    loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"], old_logps=p["old"])
    (gh,) = torch.autograd.grad(loss, hidden)
    want, _ = ref.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"], old_logps=p["old"])
    (want_gh,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(gh, want_gh, rtol=1e-4, atol=1e-6)


def test_grad_output_scaling_and_accumulation(backend):
    """backward scales by the incoming gradient; .grad accumulates across calls."""
    p = _problem(19)
    weight = p["weight"].clone().requires_grad_()
    for _ in range(2):
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(p["hidden"], weight, p["target"], p["mask"], p["adv"], old_logps=p["old"])
        (0.5 * loss).backward()
    w2 = p["weight"].clone().requires_grad_()
    want, _ = ref.fused_linear_grpo_loss(p["hidden"], w2, p["target"], p["mask"], p["adv"], old_logps=p["old"])
    want.backward()
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-4, atol=1e-6)


def test_module_matches_function(backend):
    p = _problem(23)
    module = gfpo_kernels.FusedLinearGRPOLoss(beta=0.04, loss_type="grpo", temperature=0.9)
    assert "loss_type='grpo'" in repr(module)
    loss, stats = module(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"], bias=p["bias"], ref_logps=p["ref"])
    want, _ = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"], bias=p["bias"],
                                         ref_logps=p["ref"], beta=0.04, loss_type="grpo", temperature=0.9)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert "kl" in stats
    vespo = dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=1.5, vespo_k_neg=2.0, vespo_lambda_neg=0.5)
    module = gfpo_kernels.FusedLinearGRPOLoss(**vespo)
    loss, stats = module(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"], old_logps=p["old"],
                         vllm_is_ratio=p["is_ratio"], num_items_in_batch=30)
    want, want_stats = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"],
                                                  old_logps=p["old"], vllm_is_ratio=p["is_ratio"],
                                                  num_items_in_batch=30, **vespo)
    default, _ = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"],
                                            old_logps=p["old"], vllm_is_ratio=p["is_ratio"], num_items_in_batch=30,
                                            loss_type="vespo")
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert abs(want.item() - default.item()) > 1e-4  # the options reach the loss
    torch.testing.assert_close(stats["vespo/phi_seq_mean"], want_stats["vespo/phi_seq_mean"])


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_never_materialises_all_logits(backend, level):
    """With V*H and the chunk far smaller than B*T*V, no op may produce a tensor anywhere near (B*T, V)."""
    g = torch.Generator().manual_seed(29)
    b, t, h, v = 8, 16, 4, 64
    # the real planner (not the fixture's forced plan) with stages of 2 tokens (1 off CUDA, whose constant budget of
    # 0 bounds them) and chunks as small as the budget allows
    plans = record_plans()
    planned = planning(plans, budget_bytes=0, limits=dataclasses.replace(DEFAULT_LIMITS, stage_rows=2,
                                                                          min_chunk_bytes=0))
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter copies argument storages through torch ops; measured on GPU")
    hidden = torch.randn(b, t, h, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(DEVICE).requires_grad_()
    target = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    mask = torch.ones(b, t, device=DEVICE)
    with planned, _LargestTensor() as probe:
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, torch.randn(b, device=DEVICE),
                                                      importance_sampling_level=level)
        loss.backward()
    (plan,) = plans
    assert plan.stage_rows == plan.chunk_rows == (2 if DEVICE == "cuda" else 1)
    assert probe.largest <= max(4 * v, b * t * h, v * h) < b * t * v // 4


def test_no_buffer_spans_every_token_at_the_default_budget(backend):
    """The contract's "never materialises a (B*T, V) tensor" holds for a batch so small that all its logits would
    fit in one chunk of the default budget, every position scored: the largest tensor any op returns stays under
    B*T*V elements (half the tokens is the most a stage or chunk then holds)."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("the Triton interpreter copies argument storages through torch ops; measured on GPU")
    def real_plan():  # the planner's plans, not the fixture's forced one
        return planning(plan_chunks)

    g = torch.Generator().manual_seed(31)
    b, t, h, v = 4, 8, 8, 64  # 32 tokens: far under the budget; V*H = 512 < B*T*V / 2
    hidden = torch.randn(b, t, h, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(DEVICE).requires_grad_()
    target = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    for loss_type in ("grpo", "dapo"):
        with real_plan(), _LargestTensor() as probe:
            loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, torch.ones(b, t, device=DEVICE),
                                                          torch.randn(b, device=DEVICE), loss_type=loss_type)
            loss.backward()
        assert probe.largest <= b * t * v // 2, (loss_type, probe.largest)
    # a bias trained alone (the head's weight and the hidden states frozen): its gradient sums the logits gradient
    # of each stage; no chunk buffer for the GEMMs it does not run (it was (n, V), every token's)
    bias = torch.zeros(v, device=DEVICE, requires_grad=True)
    with real_plan(), _LargestTensor() as probe:
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden.detach(), weight.detach(), target,
                                                      torch.ones(b, t, device=DEVICE), torch.randn(b, device=DEVICE),
                                                      bias=bias)
        (grad_b,) = torch.autograd.grad(loss, bias)
    assert probe.largest <= b * t * v // 2, ("bias only", probe.largest)
    assert grad_b.abs().sum() > 0


def test_reference_backend_takes_the_call_before_any_work(monkeypatch):
    """Where the reference runs the call (forced, or nothing else can), the kernel entry hands it over first: the
    reference checks the call itself (once: the entry does not check it too) and nothing computes the zero-gradient
    rows, which only the kernels skip."""
    zero_rows, checks = [], []
    monkeypatch.setattr(flg, "zero_gradient_tokens", lambda *args, **kwargs: zero_rows.append(1))
    for module in (flg, ref):
        check = module.check_linear_grpo_inputs
        monkeypatch.setattr(module, "check_linear_grpo_inputs",
                            lambda *args, check=check, **kwargs: checks.append(1) or check(*args, **kwargs))
    p = _problem(3)
    for backend, work in (("reference", 0), ("torch", 1)):
        zero_rows.clear()
        checks.clear()
        with gfpo_kernels.use_backend(backend):
            gfpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"])
        assert (len(zero_rows), len(checks)) == (work, 1), backend


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="ppo"), r"loss_type must be one of .* got loss_type='ppo'"),
        (dict(importance_sampling_level="batch"), r"importance_sampling_level must be one of"),
        (dict(beta=0.1), r"beta=0.1 needs ref_logps"),
        (dict(temperature=0.0), r"temperature must be a float > 0, got temperature=0.0"),
        (dict(delta=-1.0), r"delta must be a float > 0"),
        (dict(epsilon_low=-0.1), r"epsilon_low must be a float >= 0"),
        (dict(max_completion_length=0), r"max_completion_length must be None or an int >= 1"),
        (dict(weight=torch.zeros(V, H + 1)), r"weight must be \(V, H\) with H=16 .* got shape \(40, 17\)"),
        (dict(hidden=torch.zeros(B, H)), r"hidden must be 3-D \(B, T, H\)"),
        (dict(target=torch.full((B, T), V)), r"target_ids where mask is set must lie in \[0, V=40\), got target id 40"),
        (dict(target=torch.full((B, T), -1)), r"got target id -1"),
        (dict(target=torch.zeros(B, T + 1, dtype=torch.long)), r"target_ids must have shape \(B, T\) = \(3, 6\)"),
        (dict(mask=torch.ones(B, T - 1)), r"mask must have shape \(B, T\)"),
        (dict(adv=torch.zeros(B + 1)), r"advantages must have shape \(B,\) = \(3,\) or \(B, T\)"),
        (dict(bias=torch.zeros(V - 1)), r"bias must have shape \(V,\) = \(40,\)"),
        (dict(old_logps=torch.zeros(B, T + 2)), r"old_logps must have shape \(B, T\)"),
        (dict(vllm_is_ratio=torch.ones(B, T + 1)),
         r"vllm_is_ratio must have shape \(B, T\) = \(3, 6\), \(B, 1\) or \(B,\), got \(3, 7\)"),
        (dict(vllm_is_ratio=torch.ones(B + 1)), r"vllm_is_ratio must have shape .* got \(4,\)"),
        (dict(loss_type="vespo", vespo_k_pos=float("nan")), r"vespo_k_pos must be a finite float, got vespo_k_pos=nan"),
        (dict(loss_type="vespo", vespo_lambda_neg="2"), r"vespo_lambda_neg must be a finite float"),
        (dict(logit_softcap=0.0), r"logit_softcap must be a float > 0, got logit_softcap=0.0"),
        (dict(logit_softcap=float("inf")), r"logit_softcap must be a finite float > 0 or None, got logit_softcap=inf"),
    ],
)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_bad_input(kwargs, match, impl):
    p, kwargs = _problem(1), dict(kwargs)
    args = {k: kwargs.pop(k, p[k]) for k in ("hidden", "weight", "target", "mask", "adv", "bias")}
    fn = gfpo_kernels.fused_linear_grpo_loss if impl == "kernel" else ref.fused_linear_grpo_loss
    with pytest.raises(ValueError, match=match):
        fn(args["hidden"].to(DEVICE), args["weight"].to(DEVICE), args["target"].to(DEVICE), args["mask"].to(DEVICE),
           args["adv"].to(DEVICE), bias=None if args["bias"] is None else args["bias"].to(DEVICE), **kwargs)


@pytest.mark.parametrize("key, name", [("weight", "weight"), ("bias", "bias"), ("target", "target_ids"),
                                       ("mask", "mask"), ("adv", "advantages"), ("old", "old_logps"),
                                       ("ref", "ref_logps"), ("is_ratio", "vllm_is_ratio")])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_tensors_on_another_device_are_refused(key, name, impl):
    """Every tensor argument must be on hidden's device: a ValueError naming it and both devices (a Triton launch
    would otherwise read another device's pointer)."""
    p = _problem(1)
    p[key] = p[key].to("meta")
    fn = gfpo_kernels.fused_linear_grpo_loss if impl == "kernel" else ref.fused_linear_grpo_loss
    with pytest.raises(ValueError, match=rf"{name} must be on hidden's device {DEVICE}.*got {name} on meta"):
        fn(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"], bias=p["bias"], old_logps=p["old"],
           ref_logps=p["ref"], vllm_is_ratio=p["is_ratio"], beta=0.1)


@pytest.mark.parametrize("normaliser", [20, 20.0, torch.tensor(20), torch.tensor(20.0, dtype=torch.float64)])
def test_normaliser_made_once_on_the_device(backend, monkeypatch, normaliser):
    """num_items_in_batch given as a number or a host tensor becomes one fp32 tensor on hidden's device per call,
    which everything that reads it reads (a host value copied to a GPU at each read waits for the stream each time);
    the loss is the reference's."""
    seen = []

    def recording(fn):
        def read(*args, **kwargs):
            seen.append(kwargs["num_items_in_batch"])
            return fn(*args, **kwargs)
        return read

    monkeypatch.setattr(flg, "grpo_loss_from_logps", recording(flg.grpo_loss_from_logps))
    monkeypatch.setattr(executor, "grpo_loss_from_logps", recording(executor.grpo_loss_from_logps))
    monkeypatch.setattr(executor, "token_grad_inputs", recording(executor.token_grad_inputs))
    p = _problem(59)
    hidden = p["hidden"].clone().requires_grad_()
    loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, p["weight"], p["target"], p["mask"], p["adv"],
                                                  old_logps=p["old"], num_items_in_batch=normaliser)
    assert len(seen) == 3  # the loss gradient's inputs, the final loss and the statistics
    assert all(x is seen[0] for x in seen)
    assert seen[0].device == hidden.device and seen[0].dtype == torch.float32 and seen[0].item() == 20.0
    want, _ = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"],
                                         old_logps=p["old"], num_items_in_batch=20)
    torch.testing.assert_close(loss.detach().double().cpu(), want.double().cpu(), rtol=1e-5, atol=1e-6)


def test_triton_launches_make_the_tensors_device_current(monkeypatch):
    """Triton launches on the current CUDA device whatever device the pointers are on: each wrapper enters
    _dispatch.on_device(its tensors' device) around its launches (the two-GPU check is in tests/test_gpu.py)."""
    if "triton" not in LOSS_BACKENDS:
        pytest.skip("Triton not available")
    from gfpo_kernels import linear_grpo_triton

    entered = record_on_device(monkeypatch, linear_grpo_triton)
    p = _problem(71, dtype=torch.bfloat16)
    hidden, weight = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    with force_plan(4, 8), gfpo_kernels.use_backend("triton"):
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, p["target"], p["mask"], p["adv"])
        loss.backward()
    # the log-prob pass and the logits-gradient pass of every stage, and the backward's bf16 conversions
    assert len(entered) >= 2 * -(-int(p["mask"].sum()) // 4) + 2
    assert set(entered) == {hidden.device}


def test_module_takes_num_items_in_batch_per_call():
    """The normaliser changes with every batch: FusedLinearGRPOLoss refuses it at construction (it failed at every
    forward with "multiple values for keyword argument") and takes it in forward."""
    with pytest.raises(ValueError, match=r"num_items_in_batch is a per-batch value: pass it to forward\(\).*got "
                                         r"num_items_in_batch=5"):
        gfpo_kernels.FusedLinearGRPOLoss(num_items_in_batch=5)
    p = _problem(61)
    loss_fn = gfpo_kernels.FusedLinearGRPOLoss(loss_type="dapo")
    got, _ = loss_fn(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"], num_items_in_batch=7)
    want, _ = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"],
                                         num_items_in_batch=7)
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normaliser", [torch.tensor([20.0]), torch.tensor([[20]]), "x", torch.ones(2), True])
def test_normaliser_forms(normaliser):
    """A one-element tensor of any shape gives a scalar loss; anything else is refused naming the argument."""
    p = _problem(67)
    call = lambda: gfpo_kernels.fused_linear_grpo_loss(  # noqa: E731
        p["hidden"], p["weight"], p["target"], p["mask"], p["adv"], num_items_in_batch=normaliser)
    if isinstance(normaliser, torch.Tensor) and normaliser.numel() == 1:
        loss, _ = call()
        assert loss.shape == ()
    else:
        with pytest.raises(ValueError, match=r"num_items_in_batch must be None, a number or a one-element tensor"):
            call()


def test_masked_positions_may_hold_any_id(backend):
    """Padding often carries -100 or a pad id past the vocabulary: only scored positions are read."""
    p = _problem(31)
    target = p["target"].masked_fill(p["mask"] == 0, -100)
    loss, _ = gfpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], target, p["mask"], p["adv"])
    want, _ = ref.fused_linear_grpo_loss(p["hidden"], p["weight"], p["target"], p["mask"], p["adv"])
    torch.testing.assert_close(loss, want)


LIGER_CASES = [(lt, "token") for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")] + [
    (lt, "sequence") for lt in ("grpo", "bnpo", "dr_grpo", "dapo")
]


@pytest.mark.parametrize("loss_type, level", LIGER_CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_liger(backend, loss_type, level, beta):
    """Liger-Kernel's LigerFusedLinearGRPOLoss agrees for the loss types both implement as TRL 1.16 does
    (Liger 0.8's luspo normalises as an older TRL did, so it is left out)."""
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    p = _problem(37)
    eps_high = 4.0 if loss_type == "cispo" else 0.28
    module = liger.LigerFusedLinearGRPOLoss(
        beta=beta, compiled=False, use_ref_model=beta != 0.0, loss_type=loss_type, importance_sampling_level=level,
        max_completion_length=T, temperature=0.9, epsilon_high=eps_high,
    )
    ref_lp = p["ref"] if beta != 0.0 else None
    liger_loss, _, liger_grads = _run(
        lambda h, w, t, m, a, bias: module(h, w, t, m, a, bias=bias, ref_per_token_logps=ref_lp, old_per_token_logps=p["old"]),
        p,
    )
    loss, _, grads = _run(
        gfpo_kernels.fused_linear_grpo_loss, p, old_logps=p["old"], ref_logps=ref_lp, beta=beta, loss_type=loss_type,
        importance_sampling_level=level, temperature=0.9, epsilon_high=eps_high,
    )
    torch.testing.assert_close(loss, liger_loss, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, liger_grads):
        scale = want.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got / scale, want / scale, rtol=1e-4, atol=1e-4)
