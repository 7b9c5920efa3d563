"""Fused linear GRPO loss: the LM head projection, log-softmax and TRL's GRPO loss without the (tokens x vocab)
logits of the whole batch.

Design
------
Only the scored tokens (mask != 0) are projected: they are gathered once into (n, H), in the dtype TRL's head
would use (the autocast dtype under autocast, else the common dtype of hidden and weight). They are then processed
in chunks of `rows` tokens whose logits, fp32 (rows, V), fit a budget (_chunk_budget: on CUDA a share of the free
memory, bounded; elsewhere a constant). For each chunk:

1. GEMM: logits = h_chunk @ W^T (+ b), fp32 output (cuBLAS with fp32 accumulation and output for bf16/fp16).
2. Row pass (Triton kernel, or torch on CPU): online log-sum-exp over the vocabulary -> log p(target),
   entropy and the log-partition of every row, from the logits held in the chunk buffer.
3. g = d(loss)/d(log p) for the chunk's tokens, by autograd through gfpo_kernels.grpo_loss_math, the same
   code as the reference: no gradient is derived by hand. With token-level importance sampling the loss is
   token-local (d(loss)/d(logp[t]) depends on no other token's log-probability), so g of a chunk is exact
   before the other chunks are computed.
4. Row pass, in place: logits -> d(loss)/d(logits) = g * (onehot(target) - p) / temperature.
5. Two GEMMs: grad_h[chunk] = dlogits @ W, grad_W += dlogits^T @ h_chunk (fp32 accumulators; grad_b too),
   from dlogits rounded once to the operand dtype for both.

The gradients are finished inside the forward and only scaled by the incoming gradient in backward (folded into
their conversion to the parameters' dtypes; skipped for fp32 parameters when the incoming gradient is known to
be 1 without a device sync): three
GEMMs per chunk (6*N*H*V FLOPs) instead of the four (8*N*H*V) of a forward + recomputing backward such as
TRL's chunked log-prob kernel or Liger's, and nothing is recomputed. With sequence-level importance sampling
the loss is not token-local: a first sweep (steps 1-2) computes all log-probabilities, g is taken once over the
whole batch, and a second sweep does steps 1, 4, 5 (four GEMMs). Without grad mode (eval, no_grad,
inference_mode) only steps 1-2 run, whatever the parameters' requires_grad.

Host syncs: one per call, reading the number of scored tokens with the target-id range (_validation); the
row gather then uses nonzero_static. Besides it, only the fp32-parameter backward on CPU reads grad_output.

Extra memory: one fp32 logits chunk (_CHUNK_BYTES), the fp32 gradient accumulators (n x H, V x H), and O(B*T)
per-token vectors; never a (B*T, V) tensor. Precision: logits and softmax statistics in fp32; the GEMMs
accumulate in fp32; for bf16/fp16 operands on CUDA the logits gradient is rounded to that dtype once per chunk
before the two gradient GEMMs (as TRL and Liger do), elsewhere it stays fp32. On CPU (no out_dtype GEMM) the
operands are rounded to their dtype and then held in fp32. Unlike cut-cross-entropy we do not skip
vocabulary tiles of negligible softmax mass: the GEMMs are cuBLAS calls over whole chunks (what such a mode would
gain and cost: docs/cce-gradient-filtering-study.md).
"""

from __future__ import annotations

import torch

from ._dispatch import select_backend
from ._validation import linear_grpo_call_options
from .grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps

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


def _chunk_budget(device: torch.device) -> int:
    """Bytes the per-chunk buffers (fp32 logits, and their half-precision copy) may take on `device`."""
    if device.type in _CHUNK_BYTES:
        return _CHUNK_BYTES[device.type]
    if device.type != "cuda":
        return _DEFAULT_CHUNK_BYTES
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(min(max(free * _CUDA_CHUNK_SHARE, _CUDA_CHUNK_BYTES_MIN), _CUDA_CHUNK_BYTES_MAX))


def _chunk_rows(n: int, V: int, device: torch.device, operand_dtype: torch.dtype = torch.float32) -> int:
    """Tokens per chunk: the fp32 logits (rows, V), plus their rounded copy for half-precision GEMM operands."""
    bytes_per_row = V * (4 + (0 if operand_dtype == torch.float32 else operand_dtype.itemsize))
    return max(1, min(n, _chunk_budget(device) // bytes_per_row))


def _operand_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype TRL's path would run the LM head GEMM in: the autocast dtype under autocast (an fp32 head under
    bf16 autocast runs bf16 GEMMs, as F.linear would), otherwise the common dtype of hidden and weight."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _gemm_operands(
    hidden_rows: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands in `dtype` (None: _operand_dtype), prepared once per call. On CUDA bf16/fp16 operands stay
    half precision: cuBLAS accumulates and writes fp32 itself (torch.mm's out_dtype, torch >= 2.8, the declared
    floor), so the weight is never copied to fp32. The CPU has no out_dtype GEMM: the operands, rounded to `dtype`
    first, are converted to fp32 here once, not per chunk (same numerics: the products of the rounded values
    accumulated in fp32)."""
    dtype = _operand_dtype(hidden_rows, weight) if dtype is None else dtype
    h, w = hidden_rows.to(dtype), weight.to(dtype)
    if hidden_rows.is_cuda and dtype in (torch.float16, torch.bfloat16):
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


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with fp32 accumulation (a: the logits gradient, already in b's dtype; b: an operand from
    _gemm_operands)."""
    if b.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _scaled(acc: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc * grad_output in `dtype`, from an fp32 gradient accumulator that is not used afterwards. For a half
    precision parameter the scale rides on the conversion the accumulator needs anyway (one pass either way). For
    an fp32 parameter the multiply is skipped when grad_output is known on the host to be 1 (a CPU tensor: no device
    sync); on CUDA it is one in-place pass, as reading the value would stall the host."""
    if acc.dtype != dtype:
        return torch.mul(acc, grad_output, out=torch.empty_like(acc, dtype=dtype))
    if grad_output.device.type == "cpu" and grad_output.item() == 1.0:
        return acc
    return acc.mul_(grad_output)


def _logprob_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float):
    """Torch twin of linear_grpo_triton.logprob_entropy_triton: (log p(target), entropy, log-partition)."""
    z = logits * inv_t
    lse = torch.logsumexp(z, dim=-1)
    log_p = z - lse.unsqueeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy, lse


def _grad_logits_torch(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_t: float,
                       out: torch.Tensor | None = None):
    """Torch twin of linear_grpo_triton.grad_logits_triton: logits -> d(loss)/d(logits), in place or rounded once
    into `out`."""
    g = g.float()
    logits.mul_(inv_t).sub_(lse.unsqueeze(-1)).exp_().mul_(-(g * inv_t).unsqueeze(-1))
    logits[torch.arange(logits.shape[0], device=logits.device), targets] += g * inv_t
    return logits if out is None else out.copy_(logits)


def _row_ops(backend: str):
    if backend == "triton":
        from .linear_grpo_triton import grad_logits_triton, logprob_entropy_triton

        return logprob_entropy_triton, grad_logits_triton
    return _logprob_entropy_torch, _grad_logits_torch


def _fused_forward(hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, num_scored, operand_dtype,
                   needs_grad):
    """The chunked sweep: (loss, logps, entropy, accumulators) with accumulators the fp32 gradient sums
    (grad_h of the scored rows, grad_w, grad_b) where `needs_grad` asks for them (None where not; all None without
    gradients: forward-only work, no gradient GEMM nor buffer)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / options.temperature
    logprob_entropy, grad_logits = _row_ops(backend)

    # Only the scored tokens are projected; their count is known on the host (validation read it with the target
    # range in one transfer), so nonzero_static needs no second sync.
    n = num_scored
    rows = torch.nonzero_static(mask.reshape(-1) != 0, size=n).squeeze(1)
    h, w = _gemm_operands(hidden.reshape(-1, H).index_select(0, rows), weight, operand_dtype)
    b = None if bias is None else bias.to(operand_dtype).float()
    targets = target_ids.reshape(-1).index_select(0, rows).long()
    flat_logps = torch.zeros(B * T, dtype=torch.float32, device=device)
    flat_entropy = torch.zeros(B * T, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)

    def loss_of(logps_2d):
        return grpo_loss_from_logps(logps_2d, mask, options=options, with_stats=False, **loss_inputs)[0]

    def dloss_dlogp(logp_rows: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """d(loss)/d(logp) at flat positions `at`, the other positions holding flat_logps' values."""
        with torch.enable_grad():
            x = logp_rows.detach().requires_grad_()
            logps = flat_logps.index_put((at,), x).view(B, T)
            return torch.autograd.grad(loss_of(logps), x)[0]

    need_h, need_w, need_b = needs_grad
    want_grad = need_h or need_w or (bias is not None and need_b)
    grad_h = torch.zeros(n, H, dtype=torch.float32, device=device) if need_h else None
    grad_w = torch.zeros(V, H, dtype=torch.float32, device=device) if need_w else None
    grad_b = torch.zeros(V, dtype=torch.float32, device=device) if bias is not None and need_b else None

    def accumulate(start, end, logits, g):
        # Half-precision GEMM operands: the row kernel writes the logits gradient rounded once into half_buffer,
        # shared by both gradient GEMMs. A bias gradient sums the fp32 values first, then they are rounded.
        out = None if half_buffer is None or grad_b is not None else half_buffer[: end - start]
        dlogits = grad_logits(logits, targets[start:end], lse[start:end], g, inv_t, out)
        if grad_b is not None:
            grad_b.add_(dlogits.sum(0))
            if half_buffer is not None:
                dlogits = half_buffer[: end - start].copy_(dlogits)
        if grad_h is not None:
            _addmm_fp32(grad_h[start:end], dlogits, w)
        if grad_w is not None:
            _addmm_fp32(grad_w, dlogits.t(), h[start:end])

    step = _chunk_rows(n, V, device, w.dtype)
    buffer = torch.empty(min(step, n), V, dtype=torch.float32, device=device)
    half_buffer = (torch.empty(min(step, n), V, dtype=w.dtype, device=device)
                   if want_grad and w.dtype != torch.float32 else None)
    single_sweep = want_grad and options.token_local
    for start in range(0, n, step):
        end = min(start + step, n)
        logits = _project(h[start:end], w, b, buffer[: end - start])
        logp, entropy, lse[start:end] = logprob_entropy(logits, targets[start:end], inv_t)
        flat_logps[rows[start:end]] = logp
        flat_entropy[rows[start:end]] = entropy
        if single_sweep:
            accumulate(start, end, logits, dloss_dlogp(logp, rows[start:end]))
    if want_grad and not single_sweep:
        g_all = dloss_dlogp(flat_logps[rows], rows)
        for start in range(0, n, step):
            end = min(start + step, n)
            logits = _project(h[start:end], w, b, buffer[: end - start])
            accumulate(start, end, logits, g_all[start:end])
    del buffer, half_buffer

    logps, entropy = flat_logps.view(B, T), flat_entropy.view(B, T)
    return loss_of(logps), logps, entropy, (rows, grad_h, grad_w, grad_b)


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
            full_grad_h.index_copy_(0, rows, _scaled(grad_h, grad_loss, hidden_dtype))
            full_grad_h = full_grad_h.view(B, T, H)
        grads = (
            full_grad_h,
            None if grad_w is None else _scaled(grad_w, grad_loss, weight_dtype),
            None if grad_b is None else _scaled(grad_b, grad_loss, bias_dtype),
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
            "dr_grpo", "dapo", "cispo", "sapo", "luspo"), importance_sampling_level ("token", "sequence"),
            max_completion_length (dr_grpo; None: T), use_bias_correction_kl, sapo_temperature_pos/neg: as in
            TRL's GRPOConfig.
        num_items_in_batch: the dapo/cispo normaliser (None: mask.sum()).
        vllm_is_ratio: (B, T) or (B, 1) importance-sampling correction of vLLM generation.

    Returns:
        (loss, stats): the scalar fp32 loss, with gradients for hidden, weight and bias; stats holds detached
        per-token "logps" and "entropy" (B, T) (0 where mask is 0), "kl" when beta != 0, and the loss type's
        clip ratios ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"; "cispo_clip_ratio").

    Raises:
        ValueError: unknown loss_type or importance_sampling_level, beta != 0 without ref_logps, mismatched
            shapes (H of hidden vs weight among them), target ids outside [0, V) where mask is set, bad options.
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
        "num_items_in_batch": num_items_in_batch,
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
        GRPOLossOptions(**{k: v for k, v in options.items() if k != "num_items_in_batch"})  # validate early
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
