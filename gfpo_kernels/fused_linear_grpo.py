"""Fused linear GRPO loss: the LM head projection, log-softmax and TRL's GRPO loss without the (tokens x vocab)
logits of the whole batch.

Design
------
Only the scored tokens (mask != 0) are projected: they are gathered once into (n, H), in the dtype TRL's head
would use (the autocast dtype under autocast, else the common dtype of hidden and weight). They are then processed
in chunks of `chunk_rows` tokens, each projected `stage_rows` tokens at a time (_chunk_plan; the buffers fit a
budget, _chunk_budget: on CUDA a share of the free memory, bounded, and at most about the LM head weight's size).
For each stage of a chunk:

1. GEMM: logits = h_stage @ W^T (+ b) into the fp32 staging buffer (stage_rows, V) (cuBLAS with fp32
   accumulation and output for bf16/fp16).
2. Row pass (Triton kernel, or torch on CPU): online log-sum-exp over the vocabulary -> log p(target),
   entropy and the log-partition of every row (of the soft-capped logits, cap * tanh(z / cap), when the model caps
   them: logit_softcap; the staged logits stay raw and each pass applies the cap).
3. g = d(loss)/d(log p) for the stage's tokens, by autograd through gfpo_kernels.grpo_loss_math, the same
   code as the reference: no gradient is derived by hand. With token-level importance sampling the loss is
   token-local (d(loss)/d(logp[t]) depends on no other token's log-probability), so g of a stage is exact
   before the other stages are computed.
4. Row pass: logits -> d(loss)/d(logits) = g * (onehot(target) - p) / temperature (times 1 - tanh^2(z / cap)
   with a soft cap), written rounded once to the operand dtype into the chunk's gradient buffer (chunk_rows, V).

Then, once per chunk:

5. Two GEMMs from that buffer: grad_h[chunk] = dlogits @ W, grad_W += dlogits^T @ h_chunk (fp32; the first
   chunk writes grad_W instead of adding, so it is never zero-filled; grad_b sums the fp32 values).

Why two levels: each chunk reads and writes the fp32 (V, H) grad_W once (2.5 GB each way at Qwen's vocabulary and
H=4096), so chunks want thousands of tokens; holding their gradient in bf16 (2 bytes per logit) rather than their
fp32 logits (4, plus the bf16 copy) fits 3x the tokens in the same memory, and the fp32 logits only ever exist
for one stage.

The gradients are finished inside the forward and only scaled by the incoming gradient in backward (folded into
their conversion to the parameters' dtypes; skipped for fp32 parameters when the incoming gradient is known to
be 1 without a device sync): three
GEMMs per chunk (6*N*H*V FLOPs) instead of the four (8*N*H*V) of a forward + recomputing backward such as
TRL's chunked log-prob kernel or Liger's, and nothing is recomputed. With sequence-level importance sampling
the loss is not token-local: a first sweep (steps 1-2) computes all log-probabilities, g is taken once over the
whole batch, and a second sweep does steps 1, 4, 5 (four GEMMs). Without grad mode (eval, no_grad,
inference_mode) only steps 1-2 run, whatever the parameters' requires_grad. vespo given old log-probabilities takes
the two sweeps too: its per-sequence weight phi is a function of every log-probability of the sequence.

Host syncs: one per call, reading the number of scored tokens with the target-id range (_validation); the
row gather then uses nonzero_static; a host num_items_in_batch goes to the device once per call. Besides it, only
the fp32-parameter backward on CPU reads grad_output. The Triton launches make the tensors' device current.

Extra memory: the staging and chunk buffers (_chunk_budget; on CUDA at most the LM head weight's size in the
operand dtype, not under 1 GiB), the fp32 gradient accumulators (n x H, V x H), and O(B*T) per-token vectors;
never a (B*T, V) tensor. TRL's fused head holds the same fp32 accumulators plus the weight gradient it returns,
so for heads of 1 GiB or more (Qwen's vocabulary at H >= 3.5k) our peak is no higher than its.

Precision: logits and softmax statistics in fp32; the GEMMs accumulate in fp32; for bf16/fp16 operands that cuBLAS
multiplies as such the logits gradient is rounded to that dtype once before the two gradient GEMMs (as TRL and
Liger do), elsewhere it stays fp32. Where cuBLAS cannot write fp32 from half precision operands (CPU; bf16 before sm_80;
_half_gemm_on_device) the operands are rounded to their dtype and then held in fp32. Unlike
cut-cross-entropy we do not skip vocabulary tiles of negligible softmax mass: the GEMMs are cuBLAS calls over whole
stages and chunks (what such a mode would gain and cost: docs/cce-gradient-filtering-study.md).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._dispatch import select_backend
from ._validation import linear_grpo_call_options
from .grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps, soft_capped

__all__ = ["FusedLinearGRPOLoss", "fused_linear_grpo_loss"]

# Fixed chunk budgets (bytes of the per-chunk buffers) per device type, overriding the derived one below: tests
# shrink them to force many chunks, bench/tune.py sweeps them.
_CHUNK_BYTES: dict[str, int] = {}
_DEFAULT_CHUNK_BYTES = 64 << 20  # CPU and any device without a free-memory query
# CUDA: this share of the memory free for new tensors (the device's free memory plus what PyTorch's caching
# allocator holds unused), bounded: at least a few hundred rows at any vocabulary, and past 4 GiB the fp32 grad_W
# traffic saved by fewer chunks is negligible next to the GEMMs.
_CUDA_CHUNK_SHARE = 0.25
_CUDA_CHUNK_BYTES_MIN = 256 << 20
_CUDA_CHUNK_BYTES_MAX = 4 << 30
# ... and no more than the LM head weight in the operand dtype, the extra memory TRL's fused head holds at the end of
# its backward (its fp32 weight-gradient accumulator plus the copy returned), so that our peak (the same fp32
# accumulator plus these buffers) is no higher than its. Not under 1 GiB: a chunk of r tokens reads and writes the
# fp32 (V, H) accumulator once, which costs about 276 / r of the GEMM time on an H100 whatever H is, so small heads
# keep chunks of a few thousand tokens.
_CUDA_WEIGHT_CAP_MIN = 1 << 30
# The fp32 staging buffer of the projections takes this share of the budget, the chunk's logits gradient the rest,
_STAGE_SHARE = 8
# ... but a stage projects at least this many FLOPs (up to half the budget): each stage costs the host about 0.6 ms
# (launches and the autograd call for g; measured on CPU with tiny shapes), and its projection, ~0.3 ms at
# 600 TFLOP/s, plus its share of the chunk's two gradient GEMMs (twice that) keeps the GPU ahead of the host. At
# H=4096 the share decides (256 tokens); small heads get longer stages (H=896: 735 tokens instead of 220).
_STAGE_MIN_FLOPS = 2e11


def _chunk_budget(device: torch.device, weight_bytes: int | None = None) -> int:
    """Bytes the per-chunk buffers may take on `device` (weight_bytes: the LM head weight in the operand dtype)."""
    if device.type in _CHUNK_BYTES:
        return _CHUNK_BYTES[device.type]
    if device.type != "cuda":
        return _DEFAULT_CHUNK_BYTES
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    budget = min(max(free * _CUDA_CHUNK_SHARE, _CUDA_CHUNK_BYTES_MIN), _CUDA_CHUNK_BYTES_MAX)
    if weight_bytes is not None:
        budget = min(budget, max(weight_bytes, _CUDA_WEIGHT_CAP_MIN))
    return int(budget)


def _chunk_plan(n: int, V: int, H: int, device: torch.device, operand_dtype: torch.dtype,
                positions: int | None = None) -> tuple[int, int]:
    """(stage_rows, chunk_rows) for n scored tokens. The logits are projected stage_rows tokens at a time into an
    fp32 staging buffer (rows, V) (1/_STAGE_SHARE of the budget, or _STAGE_MIN_FLOPS of projection); with
    gradients, each stage's logits gradient is written, rounded once to the operand dtype, into a buffer of
    chunk_rows tokens (the rest of the budget), from which the two gradient GEMMs run once per chunk. Long chunks
    keep the fp32 grad_W traffic small (one read and write per chunk); a bf16 gradient buffer holds 3x the rows of
    fp32 logits plus their bf16 copy. When every one of the B*T `positions` is scored, both hold at most half of
    them (rounded up), so that no buffer is the (B*T, V) logits. Without gradients only the staging buffer exists;
    the stages are the same, so the log-probabilities are the same bits with and without grad mode. The plan
    follows the free memory only where a quarter of it is less than the head-size cap (for Qwen's vocabulary at
    H=4096, under 4.6 GiB free): there the stages and chunks shrink, and the GEMMs' row counts with them, which may
    change the last bits of the log-probabilities and the weight gradient's fp32 sum."""
    itemsize = operand_dtype.itemsize
    budget = _chunk_budget(device, V * H * itemsize)
    # A batch with every position scored (no padding) that fits one chunk would hold the whole (B*T, V) logits
    # (or their gradient): two chunks instead, at the cost of one more read and write of the fp32 weight-gradient
    # accumulator. GRPO batches carry padding, so their single chunk (fewer rows than B*T) is kept.
    most = -(-n // 2) if positions is not None and n >= positions > 1 else n
    by_share, by_flops = budget // _STAGE_SHARE // (4 * V), math.ceil(_STAGE_MIN_FLOPS / (2 * V * H))
    stage_rows = max(1, min(most, max(by_share, by_flops), budget // 2 // (4 * V)))
    return stage_rows, max(stage_rows, min(most, (budget - 4 * V * stage_rows) // (itemsize * V)))


def _normaliser_on(value, device: torch.device) -> torch.Tensor | None:
    """The dapo/cispo normaliser (a number or a tensor) as an fp32 tensor on `device`, made once per call: each
    stage's loss reads it, and a host value copied to a GPU there would wait for the stream every stage."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):  # one element (validated), as a 0-d tensor: the loss stays a scalar
        return value.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return torch.full((), value, dtype=torch.float32, device=device)


def _operand_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype TRL's path would run the LM head GEMM in: the autocast dtype under autocast (an fp32 head under
    bf16 autocast runs bf16 GEMMs, as F.linear would), otherwise the common dtype of hidden and weight."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _half_gemm_on_device(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuBLAS can multiply `dtype` operands into an fp32 output on `device` (torch.mm's out_dtype, CUDA
    only, torch >= 2.8, the declared floor): bf16 needs compute capability 8.0 or higher, and fp16 is refused
    while torch.backends.cuda.matmul.allow_fp16_accumulation is set (checks of PyTorch 2.8-2.11's Blas.cpp)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(device)[0] >= 8
    return not getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False)


def _gemm_operands(
    hidden_rows: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands in `dtype` (None: _operand_dtype), prepared once per call. Where cuBLAS writes fp32 from
    half precision operands (_half_gemm_on_device) they stay bf16/fp16, so the weight is never copied to fp32.
    Elsewhere (the CPU has no out_dtype GEMM; bf16 before sm_80) the operands, rounded to `dtype` first, are
    converted to fp32 here once, not per chunk: the same numerics (the products of the rounded values accumulated
    in fp32), at the cost of an fp32 copy of the weight."""
    dtype = _operand_dtype(hidden_rows, weight) if dtype is None else dtype
    h, w = hidden_rows.to(dtype), weight.to(dtype)
    if _half_gemm_on_device(hidden_rows.device, dtype):
        return h, w
    return h.float(), w.float()


def _project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = h @ weight^T (+ bias, fp32) in fp32, from operands prepared by _gemm_operands."""
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    if bias is not None:
        out.add_(bias)
    return out


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = True) -> None:
    """acc += a @ b (accumulate=False: acc = a @ b, no zero fill nor read of acc) with fp32 accumulation (a: the
    logits gradient, already in b's dtype; b: an operand from _gemm_operands)."""
    if b.dtype == torch.float32:
        acc.addmm_(a, b) if accumulate else torch.mm(a, b, out=acc)
    elif accumulate:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=acc)


def _scaled(acc: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype, scale_into) -> torch.Tensor:
    """acc * grad_output in `dtype`, from an fp32 gradient accumulator that is not used afterwards. For a half
    precision parameter the scale rides on the conversion the accumulator needs anyway (one pass either way:
    `scale_into`, the backend's kernel from _backend_ops). For an fp32 parameter the multiply is skipped when
    grad_output is known on the host to be 1 (a CPU tensor: no device sync); on CUDA it is one in-place pass, as
    reading the value would stall the host."""
    if acc.dtype != dtype:
        into = scale_into if dtype in (torch.bfloat16, torch.float16) else _scale_into_torch
        return into(acc, grad_output, dtype)
    if grad_output.device.type == "cpu" and grad_output.item() == 1.0:
        return acc
    return acc.mul_(grad_output)


def _logprob_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None = None):
    """Torch twin of linear_grpo_triton.logprob_entropy_triton: (log p(target), entropy, log-partition)."""
    z = soft_capped(logits, softcap) * inv_t
    lse = torch.logsumexp(z, dim=-1)
    log_p = z - lse.unsqueeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy, lse


def _grad_logits_torch(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_t: float,
                       out: torch.Tensor | None = None, softcap: float | None = None):
    """Torch twin of linear_grpo_triton.grad_logits_triton: logits -> d(loss)/d(logits), in place or rounded once
    into `out`."""
    g = g.float()
    slope = None
    if softcap is not None:  # z -> cap * tanh(z / cap), whose derivative is 1 - tanh^2
        logits.div_(softcap).tanh_()
        slope = 1 - logits.square()
        logits.mul_(softcap)
    logits.mul_(inv_t).sub_(lse.unsqueeze(-1)).exp_().mul_(-(g * inv_t).unsqueeze(-1))
    logits[torch.arange(logits.shape[0], device=logits.device), targets] += g * inv_t
    if slope is not None:
        logits.mul_(slope)
    return logits if out is None else out.copy_(logits)


def _scale_into_torch(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch twin of linear_grpo_triton.scale_into_triton: acc * scale as a new `dtype` tensor, in one pass (PyTorch's
    casting elementwise kernel, not vectorized on CUDA)."""
    return torch.mul(acc, scale, out=torch.empty_like(acc, dtype=dtype))


def _backend_ops(backend: str):
    """(logprob_entropy, grad_logits, scale_into) of `backend`: the Triton kernels or their torch twins."""
    if backend == "triton":
        from .linear_grpo_triton import grad_logits_triton, logprob_entropy_triton, scale_into_triton

        return logprob_entropy_triton, grad_logits_triton, scale_into_triton
    return _logprob_entropy_torch, _grad_logits_torch, _scale_into_torch


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a call works through its n scored tokens: chunks of `chunk_rows` tokens, whose two gradient GEMMs run
    together, each projected `stage_rows` tokens at a time (_chunk_plan decides both)."""

    n: int
    stage_rows: int
    chunk_rows: int

    def chunks(self) -> list[tuple[int, int]]:
        return [(start, min(start + self.chunk_rows, self.n)) for start in range(0, self.n, self.chunk_rows)]

    def stages(self, start: int, end: int) -> list[tuple[int, int]]:
        return [(lo, min(lo + self.stage_rows, end)) for lo in range(start, end, self.stage_rows)]


class _ScoredRows:
    """The scored tokens of one call, gathered once (in the GEMM operand dtype), and their per-token statistics:
    log p(target) and entropy (written into flat (B*T,) vectors, 0 where nothing is scored) and the log-partition
    (n,), which the logits-gradient pass reads."""

    def __init__(self, hidden, weight, bias, target_ids, mask, num_scored, operand_dtype, options, backend):
        B, T, H = hidden.shape
        device = hidden.device
        # the count is known on the host (validation read it with the target range in one transfer), so
        # nonzero_static needs no second sync
        self.rows = torch.nonzero_static(mask.reshape(-1) != 0, size=num_scored).squeeze(1)
        self.h, self.w = _gemm_operands(hidden.reshape(-1, H).index_select(0, self.rows), weight, operand_dtype)
        self.b = None if bias is None else bias.to(operand_dtype).float()
        self.targets = target_ids.reshape(-1).index_select(0, self.rows).long()
        self.logps = torch.zeros(B * T, dtype=torch.float32, device=device)
        self.entropy = torch.zeros(B * T, dtype=torch.float32, device=device)
        self.lse = torch.empty(num_scored, dtype=torch.float32, device=device)
        self.inv_t = 1.0 / options.temperature
        self.softcap = options.logit_softcap
        self.logprob_entropy, self.grad_logits, _ = _backend_ops(backend)

    def project(self, lo: int, hi: int, stage: torch.Tensor) -> torch.Tensor:
        """Rows [lo, hi)'s fp32 logits, in the staging buffer."""
        return _project(self.h[lo:hi], self.w, self.b, stage[: hi - lo])

    def record_statistics(self, lo: int, hi: int, logits: torch.Tensor) -> torch.Tensor:
        """Rows [lo, hi)'s log p(target), entropy and log-partition from their logits; returns the log-probs."""
        logp, entropy, self.lse[lo:hi] = self.logprob_entropy(logits, self.targets[lo:hi], self.inv_t, self.softcap)
        self.logps[self.rows[lo:hi]] = logp
        self.entropy[self.rows[lo:hi]] = entropy
        return logp


class _LossGradient:
    """g = d(loss)/d(log p) by autograd through grpo_loss_math (the reference's code), at some of the scored
    positions, the others holding the log-probabilities recorded so far."""

    def __init__(self, scored: _ScoredRows, mask, loss_inputs, options):
        self.scored, self.mask, self.loss_inputs, self.options = scored, mask, loss_inputs, options

    def loss(self, logps_2d: torch.Tensor) -> torch.Tensor:
        return grpo_loss_from_logps(logps_2d, self.mask, options=self.options, with_stats=False,
                                    **self.loss_inputs)[0]

    def at(self, logp_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = logp_rows.detach().requires_grad_()
            logps = self.scored.logps.index_put((positions,), x).view(self.mask.shape)
            return torch.autograd.grad(self.loss(logps), x)[0]


class _Gradients:
    """The fp32 gradient sums of one call (grad_h of the scored rows, grad_W, grad_b where asked) and the chunk's
    logits-gradient buffer, in the GEMM operand dtype. grad_h: each chunk's GEMM writes its rows; grad_W: the
    first chunk's GEMM writes it, the others add to it: neither is zero-filled (unless nothing is scored)."""

    def __init__(self, scored: _ScoredRows, plan: _Plan, V: int, needs_grad: tuple[bool, bool, bool]):
        need_h, need_w, need_b = needs_grad
        n, H = scored.h.shape
        device = scored.h.device
        alloc = torch.empty if n else torch.zeros
        self.scored = scored
        self.grad_h = alloc(n, H, dtype=torch.float32, device=device) if need_h else None
        self.grad_w = alloc(V, H, dtype=torch.float32, device=device) if need_w else None
        self.grad_b = torch.zeros(V, dtype=torch.float32, device=device) if need_b else None
        self.dlogits = torch.empty(min(plan.chunk_rows, n), V, dtype=scored.w.dtype, device=device)

    def add_stage(self, lo: int, hi: int, chunk_start: int, logits: torch.Tensor, g: torch.Tensor) -> None:
        """Rows [lo, hi)'s d(loss)/d(logits) into the chunk's buffer, rounded once to the operand dtype by the row
        kernel itself. A bias gradient sums the fp32 values first, then they are rounded."""
        s = self.scored
        out = self.dlogits[lo - chunk_start: hi - chunk_start]
        exact = self.grad_b is None or out.dtype == torch.float32
        d = s.grad_logits(logits, s.targets[lo:hi], s.lse[lo:hi], g, s.inv_t, out if exact else None,
                          softcap=s.softcap)
        if self.grad_b is not None:
            self.grad_b.add_(d.sum(0))
            if not exact:
                out.copy_(d)

    def add_chunk(self, start: int, end: int) -> None:
        """The chunk's two gradient GEMMs from its logits-gradient buffer."""
        d = self.dlogits[: end - start]
        if self.grad_h is not None:
            _addmm_fp32(self.grad_h[start:end], d, self.scored.w, accumulate=False)
        if self.grad_w is not None:
            _addmm_fp32(self.grad_w, d.t(), self.scored.h[start:end], accumulate=start > 0)


def _sweep(scored: _ScoredRows, plan: _Plan, stage: torch.Tensor, *, statistics: bool,
           gradients: _Gradients | None = None, loss_gradient=None) -> None:
    """One pass over the scored tokens, stage by stage: each stage is projected into `stage`; with `statistics`,
    its log-probs, entropy and log-partition are recorded; with `gradients`, its logits gradient from
    loss_gradient(lo, hi, logp) goes into the chunk's buffer, and each chunk ends with its gradient GEMMs."""
    logp = None
    for start, end in plan.chunks():
        for lo, hi in plan.stages(start, end):
            logits = scored.project(lo, hi, stage)
            if statistics:
                logp = scored.record_statistics(lo, hi, logits)
            if gradients is not None:
                gradients.add_stage(lo, hi, start, logits, loss_gradient(lo, hi, logp))
        if gradients is not None:
            gradients.add_chunk(start, end)


def _fused_forward(hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, num_scored, operand_dtype,
                   needs_grad):
    """The loss, the per-token log-probs and entropy, and the fp32 gradient sums (rows, grad_h, grad_w, grad_b;
    None where `needs_grad` does not ask for them; no gradient work at all without any: forward-only)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    scored = _ScoredRows(hidden, weight, bias, target_ids, mask, num_scored, operand_dtype, options, backend)
    loss_gradient = _LossGradient(scored, mask, loss_inputs, options)
    n = num_scored
    plan = _Plan(n, *_chunk_plan(n, V, H, hidden.device, scored.w.dtype, positions=B * T))
    gradients = _Gradients(scored, plan, V, needs_grad) if any(needs_grad) else None
    stage = torch.empty(min(plan.stage_rows, n), V, dtype=torch.float32, device=hidden.device)

    if gradients is None:
        _sweep(scored, plan, stage, statistics=True)
    elif options.is_token_local(with_old_logps=loss_inputs["old_logps"] is not None):
        # token-level importance sampling: a stage's g depends on its own log-probs only, so one sweep does all
        _sweep(scored, plan, stage, statistics=True, gradients=gradients,
               loss_gradient=lambda lo, hi, logp: loss_gradient.at(logp, scored.rows[lo:hi]))
    else:
        # sequence level (and vespo given old log-probs): g needs every log-probability first, then a second sweep
        # projects again
        _sweep(scored, plan, stage, statistics=True)
        g_all = loss_gradient.at(scored.logps[scored.rows], scored.rows)
        _sweep(scored, plan, stage, statistics=False, gradients=gradients,
               loss_gradient=lambda lo, hi, _logp: g_all[lo:hi])
    del stage

    logps, entropy = scored.logps.view(B, T), scored.entropy.view(B, T)
    sums = (None, None, None) if gradients is None else (gradients.grad_h, gradients.grad_w, gradients.grad_b)
    return loss_gradient.loss(logps), logps, entropy, (scored.rows, *sums)


class _FusedLinearGRPOFunction(torch.autograd.Function):
    """The gradients are finished in the forward as fp32 sums; backward only scales them by the incoming gradient
    (folded into their conversion to the parameters' dtypes) and can run once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, num_scored, operand_dtype):
        needs_grad = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, logps, entropy, ctx.accumulators = _fused_forward(
            hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, num_scored, operand_dtype,
            needs_grad,
        )
        ctx.hidden_shape, ctx.dtypes = hidden.shape, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.scale_into = _backend_ops(backend)[2]
        ctx.mark_non_differentiable(logps, entropy)
        return loss, logps, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logps, _grad_entropy):
        if ctx.accumulators is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: backward ran twice through the same call (retain_graph=True); its "
                "gradients are computed in the forward and handed over once. Call the loss again instead."
            )
        (rows, grad_h, grad_w, grad_b), ctx.accumulators = ctx.accumulators, None  # freed as soon as handed over
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad_loss = grad_loss.float()
        full_grad_h = None
        if grad_h is not None:
            B, T, H = ctx.hidden_shape
            full_grad_h = torch.zeros(B * T, H, dtype=hidden_dtype, device=grad_h.device)
            full_grad_h.index_copy_(0, rows, _scaled(grad_h, grad_loss, hidden_dtype, ctx.scale_into))
            full_grad_h = full_grad_h.view(B, T, H)
        grads = (
            full_grad_h,
            None if grad_w is None else _scaled(grad_w, grad_loss, weight_dtype, ctx.scale_into),
            None if grad_b is None else _scaled(grad_b, grad_loss, bias_dtype, ctx.scale_into),
        )
        return (*grads, None, None, None, None, None, None, None)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    temperature: float = 1.0,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    num_items_in_batch=None,
    max_completion_length: int | None = None,
    vllm_is_ratio: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    logit_softcap: float | None = None,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's GRPO loss (GRPOTrainer._compute_loss of TRL 1.16, one process, no gradient accumulation) of the
    LM head `hidden @ weight.T (+ bias)`, without materialising the (B*T, V) logits.

    Args:
        hidden: (B, T, H) last hidden states at the completion positions (the states that predict target_ids).
        weight: (V, H) LM head weight. bias: optional (V,).
        target_ids: (B, T) completion token ids; only positions where `mask` is set are read.
        mask: (B, T) completion mask (1 = scored token).
        advantages: (B,) (or (B, T)) advantages.
        old_logps, ref_logps: (B, T) log-probabilities of the old policy (None: this policy, detached) and of the
            reference model (needed when beta != 0).
        beta, epsilon_low, epsilon_high (None: epsilon_low), delta, temperature, loss_type ("grpo", "bnpo",
            "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"), importance_sampling_level ("token",
            "sequence"), max_completion_length (dr_grpo; None: T), use_bias_correction_kl,
            sapo_temperature_pos/neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: as in TRL's
            GRPOConfig.
        num_items_in_batch: the dapo/cispo/vespo normaliser: a number or a one-element tensor (None: mask.sum());
            clamped to at least 1, as TRL does.
        vllm_is_ratio: (B, T), or one ratio a sequence, (B, 1) or (B,): importance-sampling correction of vLLM
            generation (it multiplies the per-token loss; vespo takes it into its weight phi instead, as TRL does).
        logit_softcap: the model's final logit soft cap (Gemma 2's final_logit_softcapping): the logits become
            cap * tanh(logits / cap) before the temperature, as the model's forward and TRL's fused head do.
            None: no cap.

    Returns:
        (loss, stats): the scalar fp32 loss, with gradients for hidden, weight and bias; stats holds detached
        per-token "logps" and "entropy" (B, T) (0 where mask is 0), and as scalar means over the scored tokens
        "kl" when beta != 0 and the loss type's clip ratios ("clip_ratio/low_mean", "clip_ratio/high_mean",
        "clip_ratio/region_mean"; "cispo_clip_ratio"), each also per token as "per_token/<name>" ((B, T), or
        (B, 1) at sequence level) for averaging over processes; vespo: the mean of its per-sequence weight,
        "vespo/phi_seq_mean" (per sequence, (B, 1), as "per_token/vespo/phi_seq_mean"). NaN advantages or
        log-probabilities at scored positions propagate into the loss, as in TRL; masked positions (mask 0: padding,
        tool output) take no part in any ratio, exp, clip or KL, whatever old_logps, ref_logps or vllm_is_ratio
        hold there (-1e4, inf, NaN), so the loss is finite and equals TRL's.

    Raises:
        TypeError: hidden, weight, target_ids, mask or advantages not a torch.Tensor.
        ValueError: unknown loss_type or importance_sampling_level, beta != 0 without ref_logps, mismatched
            shapes (H of hidden vs weight among them), a tensor not on hidden's device, target ids outside [0, V)
            where mask is set, a num_items_in_batch that is not a number, bad options.
    """
    options, num_scored = linear_grpo_call_options(locals())
    backend = select_backend("linear_grpo", hidden.device)
    if backend == "reference":
        from . import reference

        return reference.fused_linear_grpo_loss(
            hidden, weight, target_ids, mask, advantages, bias=bias, old_logps=old_logps, ref_logps=ref_logps,
            num_items_in_batch=num_items_in_batch, vllm_is_ratio=vllm_is_ratio, **options.as_kwargs(),
        )
    loss_inputs = {
        "advantages": advantages.float(),
        "old_logps": None if old_logps is None else old_logps.float(),
        "ref_logps": None if ref_logps is None else ref_logps.float(),
        "vllm_is_ratio": None if vllm_is_ratio is None else vllm_is_ratio.float(),
        "num_items_in_batch": _normaliser_on(num_items_in_batch, hidden.device),
    }
    operand_dtype = _operand_dtype(hidden, weight)
    args = (hidden, weight, bias, target_ids, mask.float(), loss_inputs, options, backend, num_scored, operand_dtype)
    # autocast decided the operand dtype above; inside, every op runs in the dtype chosen for it (fp32 logits)
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
            loss, logps, entropy = _FusedLinearGRPOFunction.apply(*args)
        else:
            # no_grad / inference_mode (TRL's eval prediction_step): forward-only work, no gradient GEMM nor buffer
            loss, logps, entropy, _ = _fused_forward(*args, needs_grad=(False, False, False))
    with torch.no_grad():
        _, stats = grpo_loss_from_logps(logps, mask.float(), options=options, **loss_inputs)
    stats["logps"] = logps
    stats["entropy"] = entropy
    return loss, stats


class FusedLinearGRPOLoss(torch.nn.Module):
    """:func:`fused_linear_grpo_loss` as a module: the loss options are fixed at construction.

    Example::

        loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="grpo")
        loss, stats = loss_fn(hidden, lm_head.weight, completion_ids, completion_mask, advantages,
                              ref_logps=ref_logps)
    """

    def __init__(self, **options):
        super().__init__()
        if "num_items_in_batch" in options:  # forward takes it: it changes with every batch
            raise ValueError(
                f"num_items_in_batch is a per-batch value: pass it to forward(), not to FusedLinearGRPOLoss(...) "
                f"(got num_items_in_batch={options['num_items_in_batch']!r})"
            )
        GRPOLossOptions(**options)  # validate early
        self.options = options

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target_ids: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        bias: torch.Tensor | None = None,
        old_logps: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        vllm_is_ratio: torch.Tensor | None = None,
        num_items_in_batch=None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return fused_linear_grpo_loss(
            hidden, weight, target_ids, mask, advantages, bias=bias, old_logps=old_logps, ref_logps=ref_logps,
            vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch, **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
