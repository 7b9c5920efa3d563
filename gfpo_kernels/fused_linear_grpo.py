"""Fused linear GRPO loss: the LM head projection, log-softmax and TRL's GRPO loss without the (tokens x vocab)
logits of the whole batch.

Design
------
Only the scored tokens (mask != 0) are projected: they are gathered once into (n, H). They are then processed
in chunks of `rows` tokens whose logits, fp32 (rows, V), fit a fixed budget (_CHUNK_BYTES). For each chunk:

1. GEMM: logits = h_chunk @ W^T (+ b), fp32 output (cuBLAS with fp32 accumulation and output for bf16/fp16).
2. Row pass (Triton kernel, or torch on CPU): online log-sum-exp over the vocabulary -> log p(target),
   entropy and the log-partition of every row, from the logits held in the chunk buffer.
3. g = d(loss)/d(log p) for the chunk's tokens, by autograd through gfpo_kernels.grpo_loss_math, the same
   code as the reference: no gradient is derived by hand. With token-level importance sampling the loss is
   token-local (d(loss)/d(logp[t]) depends on no other token's log-probability), so g of a chunk is exact
   before the other chunks are computed.
4. Row pass, in place: logits -> d(loss)/d(logits) = g * (onehot(target) - p) / temperature.
5. Two GEMMs: grad_h[chunk] = dlogits @ W, grad_W += dlogits^T @ h_chunk (fp32 accumulators; grad_b too).

The gradients are finished inside the forward and only scaled by the incoming gradient in backward: three
GEMMs per chunk (6*N*H*V FLOPs) instead of the four (8*N*H*V) of a forward + recomputing backward such as
TRL's chunked log-prob kernel or Liger's, and nothing is recomputed. With sequence-level importance sampling
the loss is not token-local: a first sweep (steps 1-2) computes all log-probabilities, g is taken once over the
whole batch, and a second sweep does steps 1, 4, 5 (four GEMMs). Without gradients (eval, no_grad) only
steps 1-2 run.

Extra memory: one fp32 logits chunk (_CHUNK_BYTES), the fp32 gradient accumulators (n x H, V x H), and O(B*T)
per-token vectors; never a (B*T, V) tensor. Precision: logits and softmax statistics in fp32; the GEMMs
accumulate in fp32; for bf16/fp16 weights on CUDA the logits gradient is rounded to the weight dtype before the
two gradient GEMMs (as TRL and Liger do), elsewhere it stays fp32. Unlike cut-cross-entropy we do not skip
vocabulary tiles of negligible softmax mass: the GEMMs are cuBLAS calls over whole chunks.
"""

from __future__ import annotations

import torch

from ._dispatch import select_backend
from ._validation import linear_grpo_call_options
from .grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps

__all__ = ["FusedLinearGRPOLoss", "fused_linear_grpo_loss"]

# Budget of the fp32 logits chunk, per device type; tests shrink it to force many chunks.
_CHUNK_BYTES = {"cuda": 1 << 30}
_DEFAULT_CHUNK_BYTES = 64 << 20


def _chunk_rows(n: int, V: int, device: torch.device) -> int:
    budget = _CHUNK_BYTES.get(device.type, _DEFAULT_CHUNK_BYTES)
    return max(1, min(n, budget // (4 * V)))


# torch.mm/addmm(..., out_dtype=torch.float32) from bf16/fp16 operands: CUDA only, torch >= 2.8
_HAS_MM_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"


def _gemm_operands(hidden_rows: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands, prepared once per call: bf16/fp16 stay as they are on CUDA, where cuBLAS accumulates
    and writes fp32 (no fp32 copy of the weight); anywhere else they are converted to fp32 here, not per chunk."""
    if _HAS_MM_OUT_DTYPE and hidden_rows.is_cuda and hidden_rows.dtype in (torch.float16, torch.bfloat16):
        return hidden_rows, weight
    return hidden_rows.float(), weight.float()


def _project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = h @ weight^T (+ bias) in fp32, from operands prepared by _gemm_operands."""
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    if bias is not None:
        out.add_(bias.float())
    return out


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with fp32 accumulation (a: the fp32 logits gradient; b: an operand from _gemm_operands)."""
    if b.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a.to(b.dtype), b, out_dtype=torch.float32, out=acc)


def _logprob_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float):
    """Torch twin of linear_grpo_triton.logprob_entropy_triton: (log p(target), entropy, log-partition)."""
    z = logits * inv_t
    lse = torch.logsumexp(z, dim=-1)
    log_p = z - lse.unsqueeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy, lse


def _grad_logits_torch(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_t: float):
    """Torch twin of linear_grpo_triton.grad_logits_triton: in place, logits -> d(loss)/d(logits)."""
    g = g.float()
    logits.mul_(inv_t).sub_(lse.unsqueeze(-1)).exp_().mul_(-(g * inv_t).unsqueeze(-1))
    logits[torch.arange(logits.shape[0], device=logits.device), targets] += g * inv_t
    return logits


def _row_ops(backend: str):
    if backend == "triton":
        from .linear_grpo_triton import grad_logits_triton, logprob_entropy_triton

        return logprob_entropy_triton, grad_logits_triton
    return _logprob_entropy_torch, _grad_logits_torch


def _fused_forward(hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, needs_grad):
    """The chunked sweep: (loss, logps, entropy, grads) with grads the finished gradients of hidden, weight and
    bias where `needs_grad` asks for them (None where not; all None without gradients: forward-only work)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / options.temperature
    logprob_entropy, grad_logits = _row_ops(backend)

    # Only the scored tokens are projected.
    rows = (mask.reshape(-1) != 0).nonzero().squeeze(1)
    n = rows.numel()
    h, w = _gemm_operands(hidden.reshape(-1, H).index_select(0, rows), weight)
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
        dlogits = grad_logits(logits, targets[start:end], lse[start:end], g, inv_t)
        if grad_b is not None:
            grad_b.add_(dlogits.sum(0))
        if w.dtype != torch.float32:
            dlogits = dlogits.to(w.dtype)  # one rounding per chunk, shared by both gradient GEMMs
        if grad_h is not None:
            _addmm_fp32(grad_h[start:end], dlogits, w)
        if grad_w is not None:
            _addmm_fp32(grad_w, dlogits.t(), h[start:end])

    step = _chunk_rows(n, V, device)
    buffer = torch.empty(min(step, n), V, dtype=torch.float32, device=device)
    single_sweep = want_grad and options.token_local
    for start in range(0, n, step):
        end = min(start + step, n)
        logits = _project(h[start:end], w, bias, buffer[: end - start])
        logp, entropy, lse[start:end] = logprob_entropy(logits, targets[start:end], inv_t)
        flat_logps[rows[start:end]] = logp
        flat_entropy[rows[start:end]] = entropy
        if single_sweep:
            accumulate(start, end, logits, dloss_dlogp(logp, rows[start:end]))
    if want_grad and not single_sweep:
        g_all = dloss_dlogp(flat_logps[rows], rows)
        for start in range(0, n, step):
            end = min(start + step, n)
            logits = _project(h[start:end], w, bias, buffer[: end - start])
            accumulate(start, end, logits, g_all[start:end])
    del buffer

    logps, entropy = flat_logps.view(B, T), flat_entropy.view(B, T)
    loss = loss_of(logps)
    grads = (None, None, None)
    if want_grad:
        full_grad_h = None
        if grad_h is not None:
            full_grad_h = torch.zeros(B * T, H, dtype=hidden.dtype, device=device)
            full_grad_h.index_copy_(0, rows, grad_h.to(hidden.dtype))
            full_grad_h = full_grad_h.view(B, T, H)
        grads = (
            full_grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        )
    return loss, logps, entropy, grads


class _FusedLinearGRPOFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, mask, loss_inputs, options, backend):
        needs_grad = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, logps, entropy, ctx.grads = _fused_forward(
            hidden, weight, bias, target_ids, mask, loss_inputs, options, backend, needs_grad
        )
        ctx.mark_non_differentiable(logps, entropy)
        return loss, logps, entropy


    @staticmethod
    def backward(ctx, grad_loss, _grad_logps, _grad_entropy):
        grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads)
        return (*grads, None, None, None, None, None)


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
    options = linear_grpo_call_options(locals())
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
    args = (hidden, weight, bias, target_ids, mask.float(), loss_inputs, options, backend)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        loss, logps, entropy = _FusedLinearGRPOFunction.apply(*args)
    else:
        # no_grad / inference_mode (TRL's eval prediction_step): forward-only work, no gradient GEMMs or buffers
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
