"""Fused linear GRPO loss: the LM head projection, log-softmax and TRL's GRPO loss without the (tokens x vocab)
logits of the whole batch.

Design
------
Only the scored tokens (mask != 0) are projected: they are gathered once into (n, H), in the dtype TRL's head
would use (the autocast dtype under autocast, else the common dtype of hidden and weight). One budget decides the
plan (_chunk_plan, _budget: on CUDA half the free memory, elsewhere a constant; counting everything the call
holds): stages of at most 512 tokens (off CUDA within half the budget), grouped into chunks. For each stage:

1. GEMM: logits = h_stage @ W^T (+ b) into the fp32 staging buffer (stage_rows, V) (cuBLAS with fp32
   accumulation and output for bf16/fp16).
2. Row pass (Triton kernels, or torch on CPU): online log-sum-exp over the vocabulary -> log p(target),
   entropy and the log-partition of every row (of the soft-capped logits, cap * tanh(z / cap), when the model caps
   them: logit_softcap; the staged logits stay raw and each pass applies the cap), written where the call keeps
   them, and, with gradients, 3.
3. g = d(loss)/d(log p) of each row, in closed form (grpo_loss_math.token_loss_gradient; the same formula in the
   Triton kernel), from per-token inputs gathered once per call (token_grad_inputs: advantage, normaliser, old
   and reference log-probs, vLLM ratio, vespo's phi). This needs the loss to be token-local (d(loss)/d(logp[t])
   depends on no other token's log-probability: token-level importance sampling), so g of a stage is exact before
   the other stages are computed. Autograd through grpo_loss_math, the reference's code, is its oracle in the
   tests. A stage thus launches its projection GEMM and three Triton kernels, nothing else; with an LM head bias
   (_project, _Gradients.add_stage) 1 aten op more without gradients (the bias added to the staged logits) and 3
   with them (its column sum added into grad_b), 4 with half-precision operands (the fp32 logits gradient, taken in
   place for that sum, then copied into the chunk's buffer; 20 bytes a logit more than the kernels' 10).
4. Row pass: logits -> d(loss)/d(logits) = g * (onehot(target) - p) / temperature (times 1 - tanh^2(z / cap)
   with a soft cap), written rounded once to the operand dtype into the chunk's gradient buffer (chunk_rows, V).

Then, once per chunk, two GEMMs from that buffer:

5. grad_h[chunk] = dlogits @ W, summed over the whole vocabulary by one GEMM in fp32 and written once in hidden's
   dtype. grad_W = dlogits^T @ h: with one chunk (few scored tokens: GRPO batches of short completions), one
   GEMM sums over every scored token and writes it once in the weight's dtype; with several chunks an fp32 (V, H)
   accumulator that the first chunk's GEMM writes and the others add to (never zero-filled), cast to the weight's
   dtype in backward. grad_b sums the fp32 logits gradient.

Why two levels: each chunk of several reads and writes the fp32 (V, H) accumulator once (2.5 GB each way at Qwen's
vocabulary and H=4096), so chunks want thousands of tokens, while stages want to be small, since their fp32 logits
take 4 bytes a logit against the chunk buffer's 2, and large enough to keep the projection compute-bound. The
staging buffer is freed before the last chunk's GEMMs.

The gradients are finished inside the forward and only scaled by the incoming gradient in backward: folded into
the cast of an fp32 accumulator, or in place, and skipped on the device when the incoming gradient is 1
(_finished). Three GEMMs (6*N*H*V FLOPs) instead of the four (8*N*H*V) of a forward + recomputing backward such
as TRL's chunked log-prob kernel or Liger's, and nothing is recomputed. With sequence-level importance sampling
the loss is not token-local: a first sweep (steps 1-2) computes all log-probabilities, g is taken once over the
whole batch by autograd through grpo_loss_math, and a second sweep does steps 1, 4, 5 (four GEMMs). Without grad
mode (eval, no_grad, inference_mode) only steps 1-2 run, whatever the parameters' requires_grad, over the same
stages (the same bits).
vespo given old log-probabilities takes the two sweeps too: its per-sequence weight phi is a function of every
log-probability of the sequence.

Scored tokens whose loss gradient is exactly 0 whatever their log-probability (zero advantage, no KL term, their
other inputs finite: grpo_loss_math.zero_gradient_tokens; zero-variance groups, rows a trainer could not leave out)
are counted in validation's host transfer and gathered last, in stages of their own: steps 1-2 only (their log-probs
and entropy are computed), no logits-gradient pass and no row in either gradient GEMM. Only for token-local losses;
the stages depend on these counts too, with and without gradients alike.

Host syncs: one per call, reading the number of scored tokens (and of those without gradient) with the target-id
range (_validation); the row gathers then use nonzero_static; a host num_items_in_batch goes to the device once per
call. Besides it, only
the torch backward on CPU reads grad_output. The Triton launches make the tensors' device current.

Extra memory (what the budget counts, _Footprint): the staging and chunk buffers (with several chunks at most the
LM head weight's size in the operand dtype, not under 1 GiB on CUDA) and the torch twins' (rows, V) temporaries
(_TORCH_STAGE_TEMPORARIES), the gathered rows and their input gradient (n x H),
a converted copy of the weight where the operand dtype is not the weight's (an fp32 head under bf16 autocast:
V x H x 2), the fp32 (V, H) accumulator with several chunks, the gradients returned, and O(B*T) per-token vectors;
never a (B*T, V) tensor. What that comes to against TRL's fused head at the benchmark's shape is a prediction of
gfpo_kernels.fused_loss_cost (python -m gfpo_kernels.fused_loss_cost), checked by each GPU run
(bench/predicted_vs_measured.py), not a guarantee: an fp32 head under autocast holds its bf16 copy beside the fp32
accumulator, which TRL's head (casting slices) does not.

Precision: logits and softmax statistics in fp32; the GEMMs accumulate in fp32 (split-K partial sums included:
_fp32_reductions); for bf16/fp16 operands that cuBLAS multiplies as such the logits gradient is rounded to that
dtype once before the two gradient GEMMs (as TRL and Liger do), elsewhere it stays fp32. A gradient a GEMM writes
in a half-precision parameter's dtype is rounded once, as the cast of an fp32 sum would be; an incoming gradient
other than 1 then rounds it a second time (within one unit in the last place). Where cuBLAS cannot write fp32 from
half precision operands (CPU; bf16 before sm_80; _half_gemm_on_device) the operands are rounded to their dtype and
then held in fp32, and the gradients kept in fp32 until backward. Unlike cut-cross-entropy we do not skip
vocabulary tiles of negligible softmax mass: the GEMMs are cuBLAS calls over whole stages and chunks (what such a
mode would gain and cost: docs/cce-gradient-filtering-study.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch

from ._dispatch import select_backend
from ._validation import linear_grpo_call_options
from .grpo_loss_math import (GRPOLossOptions, grpo_loss_from_logps, token_grad_inputs, token_loss_gradient,
                             zero_gradient_tokens)

__all__ = ["FusedLinearGRPOLoss", "fused_linear_grpo_loss"]

# The one budget: the bytes a call may hold at its peak, everything counted (the staging and chunk buffers, the
# gathered rows and a converted copy of the weight, the fp32 weight-gradient accumulator, the gradients it returns).
# Overrides per device type: tests shrink it to force many chunks, bench/tune.py sweeps it.
_BUDGET_BYTES: dict[str, int] = {}
_DEFAULT_BUDGET_BYTES = 64 << 20  # CPU and any device without a free-memory query
# CUDA: this share of the memory free for new tensors (the device's free memory plus what PyTorch's caching
# allocator holds unused). It counts the accumulators and the returned gradients too, which need their memory
# whatever the plan; the buffers get what they leave.
_CUDA_BUDGET_SHARE = 0.5
# Rows per projection stage: twice the rows at which an H100's projection turns compute-bound. A stage of r rows
# does 2rHV FLOPs while streaming the 2HV bytes of the bf16 weight, r FLOP per byte, and the ridge of an H100 is
# 693 TFLOP/s over 2.92 TB/s = 237 FLOP per byte (fused_loss_cost.H100): 512 rows leave the weight's stream at most
# half the projection's time, whatever H. Each stage also costs the host its launches, so fewer is better.
_STAGE_ROWS = 512
# ... and the fp32 staging buffer (rows, V) stays within this, so that vocabularies past 256k take shorter stages.
_STAGE_BYTES_MAX = 512 << 20
# With several chunks, the staging and chunk buffers together take at most this share of the LM head weight in the
# operand dtype: for a half-precision head, 1 is the weight gradient's converted copy, which backward holds beside
# the fp32 accumulator anyway, so the buffers add no peak memory (bench/tune.py sweeps it: more buys fewer chunks).
_BUFFER_SHARE_OF_WEIGHT = 1.0
# ... not under 1 GiB: each chunk reads and writes the fp32 (V, H) accumulator once, exposed in full below about
# 1800 rows (fused_loss_cost.H100), so small heads keep chunks of thousands of rows.
_BUFFER_BYTES_MIN = 1 << 30
# When the budget is short, the chunk's logits-gradient buffer still takes this much (on CUDA, where the budget
# follows free memory; elsewhere the budget is a constant, the buffers stay within it).
_MIN_CHUNK_BYTES = 256 << 20
# Where the budget is a constant (off CUDA), the staging buffer and the row passes' temporaries take at most this
# share of it, with or without gradients (so the stages, and the log-probabilities' bits, stay a function of the
# shapes): the rest is for a call with gradients, its chunk buffer among it.
_STAGE_SHARE_OF_CONSTANT_BUDGET = 0.5


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a call works through its n scored tokens: chunks (start, end), whose two gradient GEMMs run together,
    each made of stages (lo, hi) projected one at a time. With one chunk the weight gradient is written by one GEMM,
    in the weight's dtype; with several it is summed over the chunks in an fp32 accumulator."""

    chunks: tuple[tuple[int, int], ...]
    stages: tuple[tuple[int, int], ...]  # in order; those of the gradient rows each inside one chunk
    statistics_only: tuple[tuple[int, int], ...] = ()  # stages of rows whose loss gradient is exactly 0
    # the peak the budget counted for this plan (_Footprint.peak of its own buffer sizes; None: a plan not made by
    # _chunk_plan, which tests force)
    peak_bytes: int | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def balanced(cls, n: int, n_stages: int, n_chunks: int, zero: tuple[int, int] = (0, 0)) -> _Plan:
        """n rows in n_stages stages of as equal sizes as can be, grouped into n_chunks chunks of whole stages; then
        zero = (rows, stages): rows n..n+rows whose loss gradient is 0, in their own stages."""
        bounds = [i * n // n_stages for i in range(n_stages + 1)] if n_stages else [0]
        groups = [j * n_stages // n_chunks for j in range(n_chunks + 1)] if n_chunks else [0]
        chunks = tuple((bounds[groups[j]], bounds[groups[j + 1]]) for j in range(n_chunks))
        rows, stages = zero
        after = tuple((n + i * rows // stages, n + (i + 1) * rows // stages) for i in range(stages))
        return cls(chunks=chunks, stages=tuple((bounds[i], bounds[i + 1]) for i in range(n_stages)) + after,
                   statistics_only=after)

    @classmethod
    def fixed(cls, n: int, stage_rows: int, chunk_rows: int, zero_rows: int = 0) -> _Plan:
        """Chunks of chunk_rows rows (the last one shorter), each cut into stages of stage_rows, then zero_rows rows
        without gradients in stages of stage_rows (tests force it)."""
        chunks = tuple((a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows))
        stages = tuple((lo, min(lo + stage_rows, b)) for a, b in chunks for lo in range(a, b, stage_rows))
        after = tuple((lo, min(lo + stage_rows, n + zero_rows)) for lo in range(n, n + zero_rows, stage_rows))
        return cls(chunks=chunks, stages=stages + after, statistics_only=after)

    def stages_of(self, start: int, end: int) -> list[tuple[int, int]]:
        return [(lo, hi) for lo, hi in self.stages if start <= lo < end and (lo, hi) not in self.statistics_only]

    @property
    def stage_rows(self) -> int:
        return max((hi - lo for lo, hi in self.stages), default=0)

    @property
    def chunk_rows(self) -> int:
        return max((end - start for start, end in self.chunks), default=0)


@dataclasses.dataclass(frozen=True)
class _Footprint:
    """What one call holds besides its staging and chunk buffers, in bytes, for the budget: the gathered rows (n, H)
    in the operand dtype, the per-token vectors, the input gradient of the scored rows, a converted copy of the
    weight (the operand dtype differs from the weight's: an fp32 head under bf16 autocast, or fp32 operands where
    cuBLAS cannot write fp32 from half), the fp32 weight-gradient accumulator and the weight gradient returned; in
    backward, hidden's gradient (B*T, H)."""

    n: int
    positions: int
    V: int
    H: int
    operand_size: int  # itemsize of the GEMM operands and of the chunk's logits-gradient buffer
    hidden_size: int
    grad_h_size: int  # itemsize of the scored rows' input gradient as the forward keeps it
    weight_size: int
    weight_direct: bool  # one chunk's GEMM can write the weight gradient in the weight's dtype
    weight_copy: bool
    need_h: bool
    need_w: bool
    n_zero: int = 0  # scored rows whose loss gradient is exactly 0: projected, no gradient work
    stage_temporaries: int = 0  # (rows, V) fp32 temporaries the backend's row passes hold beside the staging buffer

    def staging(self, stage_rows: int) -> int:
        """Bytes of a stage of `stage_rows`: the fp32 staging buffer and the row passes' temporaries."""
        return 4 * stage_rows * self.V * (1 + self.stage_temporaries)

    def phases(self, stage_rows: int, chunk_rows: int, chunks: int) -> tuple[int, int, int]:
        """Bytes held during the stage loop, during the last chunk's GEMMs (the staging buffer freed, a weight
        gradient written directly allocated) and during backward."""
        n, V, H = self.n, self.V, self.H
        n_grad = n - self.n_zero
        rows = n * H * self.operand_size + 20 * n + 8 * self.positions + n_grad * H * self.grad_h_size * self.need_h
        copy = V * H * self.operand_size if self.weight_copy else 0
        staging = self.staging(stage_rows)
        if not (self.need_h or self.need_w):
            return rows + copy + staging, 0, 0
        buffer = self.operand_size * chunk_rows * V
        sums = self.need_w and (chunks > 1 or not self.weight_direct)
        acc = 4 * V * H if sums else 0
        # the weight gradient returned: written directly (one chunk), cast from the accumulator in backward, or the
        # accumulator itself (an fp32 weight)
        out = V * H * self.weight_size if self.need_w and not (sums and self.weight_size == 4) else 0
        stage_loop = rows + copy + staging + buffer + acc
        last_gemms = rows + copy + buffer + acc + (0 if sums else out)
        cast_h = n_grad * H * self.hidden_size if self.grad_h_size != self.hidden_size else 0
        hidden_grad = (n_grad * self.grad_h_size + self.positions * self.hidden_size) * H + cast_h
        backward = acc + out + hidden_grad * self.need_h
        return stage_loop, last_gemms, backward

    def peak(self, stage_rows: int, chunk_rows: int, chunks: int) -> int:
        return max(self.phases(stage_rows, chunk_rows, chunks))

    def counted(self, plan: _Plan) -> _Plan:
        """`plan` with the peak it holds (peak_bytes), from the buffers the call allocates for it: the staging buffer
        of its largest stage (those of the rows without gradients included) and the chunk buffer of its largest
        chunk."""
        return dataclasses.replace(plan, peak_bytes=self.peak(plan.stage_rows, plan.chunk_rows, len(plan.chunks)))


def _budget(device: torch.device) -> int:
    """The bytes a call may hold at its peak on `device` (_BUDGET_BYTES overrides)."""
    if device.type in _BUDGET_BYTES:
        return _BUDGET_BYTES[device.type]
    if device.type != "cuda":
        return _DEFAULT_BUDGET_BYTES
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free * _CUDA_BUDGET_SHARE)


def _chunk_plan(footprint: _Footprint, device: torch.device) -> _Plan:
    """The plan for a call, from the one budget (_budget, everything counted).

    Stages: _STAGE_ROWS rows (fewer past _STAGE_BYTES_MAX of fp32 logits; off CUDA, where the budget is a
    constant, fewer past _STAGE_SHARE_OF_CONSTANT_BUDGET of it, the backend's temporaries counted), cut evenly: they
    depend on the shapes only, so the log-probabilities are the same bits with and without gradients and whatever
    memory is free.
    Without gradients that is all. With them:
    - several chunks of whole stages, cut evenly, as few as fit in buffers of the LM head weight's size
      (_BUFFER_SHARE_OF_WEIGHT; _BUFFER_BYTES_MIN at least), or in what the budget leaves beside everything else
      when that is less (on CUDA not under _MIN_CHUNK_BYTES for the chunk, elsewhere not under one stage): their
      weight gradient is summed in an fp32 accumulator;
    - or one chunk, when its peak is no higher than that (budget or not): every stage's logits gradient in one
      buffer, and the weight gradient written once by one GEMM in the weight's dtype, no fp32 accumulator. (Few
      scored rows: GRPO batches of short completions.)
    When every one of the B*T positions is scored, no stage or chunk holds more than half of them, so that no
    buffer is the (B*T, V) logits (then always two chunks or more)."""
    f = footprint
    V = f.V
    n = f.n - f.n_zero  # the rows with gradients come first; those without get stages of their own
    most = -(-f.n // 2) if f.n >= f.positions > 1 else f.n
    stage_max = max(1, min(_STAGE_ROWS, _STAGE_BYTES_MAX // (4 * V), most))
    constant = device.type != "cuda"  # a constant budget (_budget): the stages within their share of it
    if constant:
        stage_max = max(1, min(stage_max, int(_budget(device) * _STAGE_SHARE_OF_CONSTANT_BUDGET) // f.staging(1)))
    zero = (f.n_zero, -(-f.n_zero // stage_max))
    n_stages = -(-n // stage_max)
    one = f.counted(_Plan.balanced(n, n_stages, min(n_stages, 1), zero))
    if not (f.need_h or f.need_w) or n_stages <= 1 and most >= n:
        return one
    # every count below from the buffers as allocated: the staging buffer holds the largest stage, which may be one
    # of the rows without gradients, the chunk buffer only rows with gradients
    budget = _budget(device)
    staging, grad_stage_rows = f.staging(one.stage_rows), -(-n // n_stages)
    stage_loop = f.phases(one.stage_rows, 0, chunks=2)[0]  # several chunks, without the chunk buffer
    cap = max(int(_BUFFER_SHARE_OF_WEIGHT * V * f.H * f.operand_size), _BUFFER_BYTES_MIN)
    buffers = min(cap, budget - stage_loop + staging)
    chunk_bytes = max(buffers - staging, 0 if constant else _MIN_CHUNK_BYTES)
    stages_per_chunk = max(1, min(chunk_bytes // (f.operand_size * V * grad_stage_rows), most // grad_stage_rows))
    several = f.counted(_Plan.balanced(n, n_stages, max(2, -(-n_stages // stages_per_chunk)), zero))
    # one chunk when it peaks no higher than several would, whatever the budget: a budget one chunk exceeds is
    # exceeded further by several chunks then (the fp32 accumulator beside the weight gradient cast from it)
    if most >= n and one.peak_bytes <= several.peak_bytes:
        return one
    return several


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


def _written_dtype(param_dtype: torch.dtype, operand_dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient GEMM writes for a parameter of `param_dtype`: the parameter's own where cuBLAS writes it
    from these operands (the same dtype, or fp32), else fp32 (cast in backward)."""
    return param_dtype if param_dtype in (operand_dtype, torch.float32) else torch.float32


@contextlib.contextmanager
def _fp32_reductions(dtype: torch.dtype, device: torch.device):
    """cuBLAS may add split-K partial products in a half-precision output's dtype, which PyTorch allows by default
    (torch.backends.cuda.matmul.allow_bf16/fp16_reduced_precision_reduction): disallowed around the GEMMs that write
    a gradient in bf16/fp16, so that every sum is fp32 until its one rounding."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    matmul = torch.backends.cuda.matmul
    name = f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
    previous = getattr(matmul, name)
    # torch >= 2.10 keeps a second flag, split-K allowed, which setting a bool turns on: kept as the user set it
    split_k = getattr(matmul, name + "_split_k", None)
    setattr(matmul, name, False if split_k is None else (False, split_k))
    try:
        yield
    finally:
        setattr(matmul, name, previous if split_k is None else (previous, split_k))


def _gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b (accumulate: out += a @ b, fp32 out only) with fp32 accumulation, rounded once to out's dtype (a:
    the logits gradient, in b's dtype; b: an operand from _gemm_operands; out: fp32, or b's half dtype)."""
    assert not accumulate or out.dtype == torch.float32, "only an fp32 accumulator adds"
    if out.dtype == b.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            with _fp32_reductions(out.dtype, out.device):
                torch.mm(a, b, out=out)
    elif out.dtype == torch.float32:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        raise AssertionError(f"no GEMM writes {out.dtype} from {b.dtype} operands")


def _finished(grad: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype, scale_into, scale_in_place):
    """A gradient the forward computed (not used afterwards) times grad_output, in the parameter's `dtype`. An fp32
    sum for a half-precision parameter is scaled on its way to that dtype (one pass: `scale_into`, the backend's
    kernel). A gradient already in `dtype` is scaled in place only when grad_output is not 1 (`scale_in_place`
    tests it on the device: no pass, and no host sync, in the common case). Then a half-precision gradient that
    a GEMM wrote is rounded a second time: round(round(x) * s), within one unit in the last place of round(x * s)."""
    if grad.dtype != dtype:
        into = scale_into if dtype in (torch.bfloat16, torch.float16) else _scale_into_torch
        return into(grad, grad_output, dtype)
    return scale_in_place(grad, grad_output)


# (rows, V) fp32 temporaries the torch twins of the row passes hold beside the staging buffer, at most: the shifted
# logits z - max and exp(z - max) (_logprob_entropy_torch; the logits-gradient pass works in place, one with a soft
# cap). The Triton kernels hold none.
_TORCH_STAGE_TEMPORARIES = 2


def _logprob_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None = None):
    """Torch twin of linear_grpo_triton.logprob_entropy_triton: (log p(target), entropy, log-partition), by the
    kernel's formulas (the sums of exp(z - m) and of exp(z - m) * (z - m) over the row, m its maximum), in place
    where it can (_TORCH_STAGE_TEMPORARIES)."""
    z = logits * inv_t if softcap is None else (logits / softcap).tanh_().mul_(softcap).mul_(inv_t)
    m = z.amax(-1, keepdim=True)
    z.sub_(m)
    e = z.exp()
    total = e.sum(-1, keepdim=True)
    log_total = total.log()
    entropy = log_total - e.mul_(z).sum(-1, keepdim=True) / total
    logp = z.gather(-1, targets.unsqueeze(-1)) - log_total
    return logp.squeeze(-1), entropy.squeeze(-1), (m + log_total).squeeze(-1)


def _stage_statistics_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None, *,
                            logps: torch.Tensor, entropy: torch.Tensor, lse: torch.Tensor,
                            positions: torch.Tensor | None = None, g: torch.Tensor | None = None, g_inputs=None,
                            options=None) -> None:
    """Torch twin of linear_grpo_triton.stage_statistics_triton (the closed-form g of
    grpo_loss_math.token_loss_gradient)."""
    logp, ent, lse[:] = _logprob_entropy_torch(logits, targets, inv_t, softcap)
    at = slice(None, logp.shape[0]) if positions is None else positions
    logps[at] = logp
    entropy[at] = ent
    if g is not None:
        g[:] = token_loss_gradient(logp, g_inputs, options)


def _grad_logits_torch(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_t: float,
                       out: torch.Tensor | None = None, softcap: float | None = None):
    """Torch twin of linear_grpo_triton.grad_logits_triton: logits -> d(loss)/d(logits), in place or rounded once
    into `out`."""
    g = g.float()
    slope = None
    if softcap is not None:  # z -> cap * tanh(z / cap), whose derivative is 1 - tanh^2
        logits.div_(softcap).tanh_()
        slope = logits.square().neg_().add_(1)
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


def _scale_in_place_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch twin of linear_grpo_triton.scale_in_place_triton: x *= scale unless scale is 1. On the CPU the test is
    free; elsewhere it would stall the host, so x is multiplied whatever the scale."""
    if scale.device.type != "cpu" or scale.item() != 1.0:
        x.mul_(scale)
    return x


def _backend_ops(backend: str):
    """(stage_statistics, grad_logits, scale_into, scale_in_place) of `backend`: the Triton kernels or their torch
    twins."""
    if backend == "triton":
        from .linear_grpo_triton import (grad_logits_triton, scale_in_place_triton, scale_into_triton,
                                         stage_statistics_triton)

        return stage_statistics_triton, grad_logits_triton, scale_into_triton, scale_in_place_triton
    return _stage_statistics_torch, _grad_logits_torch, _scale_into_torch, _scale_in_place_torch


class _Count(NamedTuple):
    """What validation counted in its one host transfer: the scored tokens, and those among them whose loss gradient
    is exactly 0 (grpo_loss_math.zero_gradient_tokens; None where the loss has none)."""

    scored: int
    zero_gradient_tokens: torch.Tensor | None = None
    zero_gradient: int = 0


class _ScoredRows:
    """The scored tokens of one call, gathered once (in the GEMM operand dtype), the fp32 staging buffer their
    logits are projected into, and what the passes record for them: log p(target) and entropy (written into flat
    (B*T,) vectors, 0 where nothing is scored), the log-partition (n,), which the logits-gradient pass reads, and
    g = d(loss)/d(log p) (n,) where gradients are asked: computed by the log-prob pass itself, in closed form, for
    a token-local loss (`token_grad`: grpo_loss_math.TokenGradInputs), else set once by autograd."""

    def __init__(self, hidden, weight, bias, target_ids, mask, count: _Count, operand_dtype, options, backend):
        B, T, H = hidden.shape
        device = hidden.device
        num_scored = count.scored
        # the counts are known on the host (validation read them with the target range in one transfer), so
        # nonzero_static needs no second sync. Rows whose loss gradient is exactly 0 go last.
        live = mask.reshape(-1) != 0
        self.n_grad = num_scored - count.zero_gradient
        if count.zero_gradient:
            zero = count.zero_gradient_tokens.reshape(-1)
            self.rows = torch.cat([torch.nonzero_static(live & ~zero, size=self.n_grad),
                                   torch.nonzero_static(zero, size=count.zero_gradient)]).squeeze(1)
        else:
            self.rows = torch.nonzero_static(live, size=num_scored).squeeze(1)
        self.h, self.w = _gemm_operands(hidden.reshape(-1, H).index_select(0, self.rows), weight, operand_dtype)
        self.b = None if bias is None else bias.to(operand_dtype).float()
        self.targets = target_ids.reshape(-1).index_select(0, self.rows).long()
        self.logps = torch.zeros(B * T, dtype=torch.float32, device=device)
        self.entropy = torch.zeros(B * T, dtype=torch.float32, device=device)
        self.lse = torch.empty(num_scored, dtype=torch.float32, device=device)
        self.g = None
        self.token_grad = None
        self.stage = None
        self.options = options
        self.inv_t = 1.0 / options.temperature
        self.softcap = options.logit_softcap
        self.backend = backend
        self.stage_statistics, self.grad_logits = _backend_ops(backend)[:2]

    def compute_token_gradients(self, mask, loss_inputs) -> None:
        """Have the log-prob pass compute g of each stage of the rows with gradients (a token-local loss): its
        inputs gathered once."""
        rows = self.rows[: self.n_grad]
        self.token_grad = token_grad_inputs(mask, rows, options=self.options, **loss_inputs)
        self.g = torch.empty(self.n_grad, dtype=torch.float32, device=rows.device)

    def project(self, lo: int, hi: int, plan: _Plan) -> torch.Tensor:
        """Rows [lo, hi)'s fp32 logits, in the staging buffer (allocated by the first stage)."""
        if self.stage is None:
            self.stage = torch.empty(plan.stage_rows, self.w.shape[0], dtype=torch.float32, device=self.w.device)
        return _project(self.h[lo:hi], self.w, self.b, self.stage[: hi - lo])

    def record_statistics(self, lo: int, hi: int, logits: torch.Tensor) -> None:
        """Rows [lo, hi)'s log p(target), entropy, log-partition and (token_grad, rows with gradients) g, from
        their logits."""
        grad = self.token_grad is not None and hi <= self.n_grad
        g, g_inputs = (self.g[lo:hi], self.token_grad.rows(lo, hi)) if grad else (None, None)
        self.stage_statistics(logits, self.targets[lo:hi], self.inv_t, self.softcap, logps=self.logps,
                              entropy=self.entropy, lse=self.lse[lo:hi], positions=self.rows[lo:hi], g=g,
                              g_inputs=g_inputs, options=self.options)


class _LossGradient:
    """The loss of the recorded log-probabilities, and g = d(loss)/d(log p) of every scored token by autograd
    through grpo_loss_math (the reference's code): for the losses that are not token-local."""

    def __init__(self, scored: _ScoredRows, mask, loss_inputs, options):
        self.scored, self.mask, self.loss_inputs, self.options = scored, mask, loss_inputs, options

    def loss(self, logps_2d: torch.Tensor) -> torch.Tensor:
        return grpo_loss_from_logps(logps_2d, self.mask, options=self.options, with_stats=False,
                                    **self.loss_inputs)[0]

    def of_every_token(self) -> torch.Tensor:
        rows = self.scored.rows
        with torch.enable_grad():
            x = self.scored.logps[rows].requires_grad_()
            logps = self.scored.logps.index_put((rows,), x).view(self.mask.shape)
            return torch.autograd.grad(self.loss(logps), x)[0]


class _Gradients:
    """The gradients of one call: grad_h of the scored rows, grad_W, grad_b (where asked), and the chunk's
    logits-gradient buffer in the GEMM operand dtype.

    grad_h: each chunk's GEMM sums over the whole vocabulary and writes its rows once, in hidden's dtype where the
    GEMM can write it (_written_dtype), so it is rounded once. grad_W: with one chunk, one GEMM sums over every
    scored row and writes it once, in the weight's dtype likewise (allocated after the staging buffer is freed);
    with several, an fp32 accumulator that the first chunk's GEMM writes and the others add to. Nothing is
    zero-filled (unless nothing is scored). grad_b: fp32, from the fp32 logits gradient."""

    def __init__(self, scored: _ScoredRows, plan: _Plan, V: int, needs_grad: tuple[bool, bool, bool],
                 hidden_dtype: torch.dtype, weight_dtype: torch.dtype):
        need_h, need_w, need_b = needs_grad
        n, H = scored.n_grad, scored.h.shape[1]
        device = scored.h.device
        alloc = torch.empty if n else torch.zeros
        self.scored = scored
        self.grad_h = alloc(n, H, dtype=_written_dtype(hidden_dtype, scored.w.dtype), device=device) if need_h else None
        one_chunk = len(plan.chunks) <= 1
        self.need_w = need_w
        self.grad_w = None  # one chunk: its GEMM writes the weight gradient
        if need_w and (not one_chunk or n == 0):
            self.grad_w = alloc(V, H, dtype=_written_dtype(weight_dtype, scored.w.dtype) if one_chunk else
                                torch.float32, device=device)
        self.weight_dtype = weight_dtype
        self.grad_b = torch.zeros(V, dtype=torch.float32, device=device) if need_b else None
        # the two GEMMs' operand; a bias trained alone sums each stage's logits gradient and needs none (its plan
        # is the forward's: one chunk of every row)
        self.dlogits = None
        if need_h or need_w:
            self.dlogits = torch.empty(plan.chunk_rows, V, dtype=scored.w.dtype, device=device)

    def add_stage(self, lo: int, hi: int, chunk_start: int, logits: torch.Tensor) -> None:
        """Rows [lo, hi)'s d(loss)/d(logits) from their g into the chunk's buffer, rounded once to the operand dtype
        by the row kernel itself. A bias gradient sums the fp32 values first, then they are rounded."""
        s = self.scored
        out = None if self.dlogits is None else self.dlogits[lo - chunk_start: hi - chunk_start]
        exact = self.grad_b is None or out is None or out.dtype == torch.float32
        d = s.grad_logits(logits, s.targets[lo:hi], s.lse[lo:hi], s.g[lo:hi], s.inv_t, out if exact else None,
                          softcap=s.softcap)
        if self.grad_b is not None:
            self.grad_b.add_(d.sum(0))
            if not exact:
                out.copy_(d)

    def add_chunk(self, start: int, end: int) -> None:
        """The chunk's two gradient GEMMs from its logits-gradient buffer."""
        s = self.scored
        if self.dlogits is None:  # a bias alone: summed per stage
            return
        d = self.dlogits[: end - start]
        if self.grad_h is not None:
            _gemm(self.grad_h[start:end], d, s.w)
        if self.need_w:
            if self.grad_w is None:  # one chunk: its GEMM writes the weight gradient
                dtype = _written_dtype(self.weight_dtype, s.w.dtype)
                self.grad_w = torch.empty(s.w.shape, dtype=dtype, device=d.device)
            _gemm(self.grad_w, d.t(), s.h[start:end], accumulate=start > 0)


def _sweep(scored: _ScoredRows, plan: _Plan, *, statistics: bool, gradients: _Gradients | None = None,
           last: bool = True) -> None:
    """One pass over the scored tokens, stage by stage: each stage is projected into the staging buffer; with
    `statistics`, its log-probs, entropy and log-partition are recorded (and g, where the log-prob pass computes
    it); with `gradients`, its logits gradient from g goes into the chunk's buffer, and each chunk ends with its
    gradient GEMMs. In the `last` pass the staging buffer is freed once the last stage is projected, before the last
    GEMMs. Rows whose loss gradient is exactly 0 have their own stages, statistics only, first."""
    if statistics:
        for lo, hi in plan.statistics_only:
            scored.record_statistics(lo, hi, scored.project(lo, hi, plan))
    if last and not plan.chunks:
        scored.stage = None
    for start, end in plan.chunks:
        for lo, hi in plan.stages_of(start, end):
            logits = scored.project(lo, hi, plan)
            if statistics:
                scored.record_statistics(lo, hi, logits)
            if gradients is not None:
                gradients.add_stage(lo, hi, start, logits)
            del logits
        if last and end == plan.chunks[-1][1]:
            scored.stage = None
        if gradients is not None:
            gradients.add_chunk(start, end)


def _footprint(scored: _ScoredRows, hidden, weight, needs_grad) -> _Footprint:
    """The budget's view of a call (_Footprint) from its operands and parameters."""
    n, H = scored.h.shape
    V = scored.w.shape[0]
    operand = scored.w.dtype
    return _Footprint(
        n=n, positions=hidden.shape[0] * hidden.shape[1], V=V, H=H, operand_size=operand.itemsize,
        hidden_size=hidden.dtype.itemsize, grad_h_size=_written_dtype(hidden.dtype, operand).itemsize,
        weight_size=weight.dtype.itemsize, weight_direct=_written_dtype(weight.dtype, operand) == weight.dtype,
        weight_copy=scored.w.data_ptr() != weight.data_ptr(), need_h=needs_grad[0], need_w=needs_grad[1],
        n_zero=n - scored.n_grad, stage_temporaries=_TORCH_STAGE_TEMPORARIES if scored.backend == "torch" else 0,
    )


def _fused_forward(hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, count, operand_dtype,
                   needs_grad):
    """The loss, the per-token log-probs and entropy, and the gradients (rows, grad_h, grad_w, grad_b; None where
    `needs_grad` does not ask for them; no gradient work at all without any: forward-only)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    scored = _ScoredRows(hidden, weight, bias, target_ids, mask, count, operand_dtype, options, backend)
    loss_gradient = _LossGradient(scored, mask, loss_inputs, options)
    plan = _chunk_plan(_footprint(scored, hidden, weight, needs_grad), hidden.device)
    gradients = None
    if any(needs_grad):
        gradients = _Gradients(scored, plan, V, needs_grad, hidden.dtype, weight.dtype)

    if gradients is None:
        _sweep(scored, plan, statistics=True)
    elif options.is_token_local(with_old_logps=loss_inputs["old_logps"] is not None):
        # token-level importance sampling: a stage's g depends on its own log-probs only, so the log-prob pass
        # computes it in closed form and one sweep does all
        scored.compute_token_gradients(mask, loss_inputs)
        _sweep(scored, plan, statistics=True, gradients=gradients)
    else:
        # sequence level (and vespo given old log-probs): g needs every log-probability first, by autograd over
        # the whole batch, then a second sweep projects again
        _sweep(scored, plan, statistics=True, last=False)
        scored.g = loss_gradient.of_every_token()
        _sweep(scored, plan, statistics=False, gradients=gradients)
    scored.stage = None

    logps, entropy = scored.logps.view(B, T), scored.entropy.view(B, T)
    grads = (None, None, None) if gradients is None else (gradients.grad_h, gradients.grad_w, gradients.grad_b)
    return loss_gradient.loss(logps), logps, entropy, (scored.rows[: scored.n_grad], *grads)


class _FusedLinearGRPOFunction(torch.autograd.Function):
    """The gradients are finished in the forward; backward only scales them by the incoming gradient (folded into
    the conversion of an fp32 sum to a half-precision parameter's dtype) and can run once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, count, operand_dtype):
        needs_grad = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, logps, entropy, ctx.gradients = _fused_forward(
            hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, count, operand_dtype,
            needs_grad,
        )
        ctx.hidden_shape, ctx.dtypes = hidden.shape, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.scale_ops = _backend_ops(backend)[2:]
        ctx.mark_non_differentiable(logps, entropy)
        return loss, logps, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logps, _grad_entropy):
        if ctx.gradients is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: backward ran twice through the same call (retain_graph=True); its "
                "gradients are computed in the forward and handed over once. Call the loss again instead."
            )
        (rows, grad_h, grad_w, grad_b), ctx.gradients = ctx.gradients, None  # freed as soon as handed over
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad_loss = grad_loss.float()
        full_grad_h = None
        if grad_h is not None:
            B, T, H = ctx.hidden_shape
            full_grad_h = torch.zeros(B * T, H, dtype=hidden_dtype, device=grad_h.device)
            full_grad_h.index_copy_(0, rows, _finished(grad_h, grad_loss, hidden_dtype, *ctx.scale_ops))
            full_grad_h = full_grad_h.view(B, T, H)
        grads = (
            full_grad_h,
            None if grad_w is None else _finished(grad_w, grad_loss, weight_dtype, *ctx.scale_ops),
            None if grad_b is None else _finished(grad_b, grad_loss, bias_dtype, *ctx.scale_ops),
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
        log-probabilities at scored positions propagate into the loss, as in TRL (but a NaN log-probability of a
        token whose loss gradient is exactly 0, advantage 0 without KL, adds no NaN to the gradients, where TRL's
        would be NaN: that token takes no gradient work); masked positions (mask 0: padding, tool output) take no
        part in any ratio, exp, clip or KL, whatever old_logps, ref_logps or vllm_is_ratio hold there (-1e4, inf,
        NaN), so the loss is finite and equals TRL's.

    Raises:
        TypeError: hidden, weight, target_ids, mask or advantages not a torch.Tensor.
        ValueError: unknown loss_type or importance_sampling_level, beta != 0 without ref_logps, mismatched
            shapes (H of hidden vs weight among them), a tensor not on hidden's device, target ids outside [0, V)
            where mask is set, a num_items_in_batch that is not a number, bad options.
    """
    arguments = dict(locals())  # the call's arguments (a copy: nothing else is bound yet)
    backend = select_backend("linear_grpo", hidden.device) if isinstance(hidden, torch.Tensor) else None
    if backend == "reference":  # it checks the call itself, and needs no count
        from . import reference

        return reference.fused_linear_grpo_loss(**arguments)
    # rows whose gradient is exactly 0 (zero advantage, no KL) are projected for their log-probs and entropy but take
    # no gradient work; counted in validation's one host transfer
    options, *count = linear_grpo_call_options(arguments, subset=lambda live, o: zero_gradient_tokens(
        live, advantages, o, old_logps=old_logps, vllm_is_ratio=vllm_is_ratio))
    loss_inputs = {
        "advantages": advantages.float(),
        "old_logps": None if old_logps is None else old_logps.float(),
        "ref_logps": None if ref_logps is None else ref_logps.float(),
        "vllm_is_ratio": None if vllm_is_ratio is None else vllm_is_ratio.float(),
        "num_items_in_batch": _normaliser_on(num_items_in_batch, hidden.device),
    }
    operand_dtype = _operand_dtype(hidden, weight)
    args = (hidden, weight, bias, target_ids, mask.float(), loss_inputs, options, backend, _Count(*count),
            operand_dtype)
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
