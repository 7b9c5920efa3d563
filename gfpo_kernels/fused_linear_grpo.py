"""Fused linear GRPO loss: the LM head projection, log-softmax and TRL's GRPO loss without the (tokens x vocab)
logits of the whole batch (docs/fused-loss.md).

Only the scored tokens (mask != 0) are projected: gathered once into (n, H), in the dtype TRL's head would use (the
autocast dtype under autocast, else the common dtype of hidden and weight). A plan cuts them into stages, projected
one at a time into an fp32 staging buffer, grouped into chunks whose gradient GEMMs run together (chunk_plan: a pure
function of the shapes, dtypes and a budget that counts everything the call holds). An executor owns the call's
buffers and runs the passes in order (linear_grpo_executor): projection, statistics (log p(target), entropy,
log-partition and, for a token-local loss, g = d(loss)/d(logp) in closed form), grad-logits (rounded once into the
chunk's buffer in the GEMMs' dtype), and per chunk the two gradient GEMMs (linear_grpo_gemm).

Why the gradients are finished inside the forward: three GEMMs (6*N*H*V FLOPs) instead of the four (8*N*H*V) of a
forward plus a recomputing backward, and nothing is recomputed; backward only scales them by the incoming gradient
(_finished: folded into the cast of an fp32 sum, or in place, and skipped on the device when it is 1). A loss that
is not token-local (sequence-level importance sampling; vespo given old log-probabilities, whose weight phi is a
function of every log-probability of the sequence) takes g by autograd once over the whole batch and projects twice
(8*N*H*V). Without grad mode (eval, no_grad, inference_mode) only the projection and statistics run, over the same
stages (the same bits).

Scored tokens whose loss gradient is exactly 0 whatever their log-probability (zero advantage, no KL term, their
other inputs finite: grpo_loss_math.zero_gradient_tokens) are counted in validation's host transfer and gathered
last, in stages of their own: projection and statistics only, no row in the gradient work.

Host syncs: one per call, reading the number of scored tokens (and of those without gradient) with the target-id
range (_validation.count_scored); the row gathers then use nonzero_static; a host num_items_in_batch goes to the
device once per call. Besides it, only the torch backward on CPU reads grad_output. The Triton launches make the
tensors' device current.

Extra memory: the staging and chunk buffers, the gathered rows and their input gradient (n x H), a converted copy of
the weight where the operand dtype is not the weight's, the fp32 (V, H) accumulator with several chunks, the
gradients returned and O(B*T) per-token vectors, all counted by the plan's budget (chunk_plan.CallShape); never a
(B*T, V) tensor.
"""

from __future__ import annotations

import torch

from . import linear_grpo_gemm as gemms
from ._dispatch import select_backend
from ._validation import check_linear_grpo_inputs, check_num_items_in_batch, count_scored
from .grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps, zero_gradient_tokens
from .linear_grpo_executor import Count, Executor, Gradients, LossInputs, RowPasses
from .linear_grpo_torch import scale_into_torch

__all__ = ["FusedLinearGRPOLoss", "fused_linear_grpo_loss"]


def _normaliser_on(value, device: torch.device) -> torch.Tensor | None:
    """The dapo/cispo normaliser (a number or a tensor) as an fp32 tensor on `device`, made once per call: each
    stage's loss reads it, and a host value copied to a GPU there would wait for the stream every stage."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):  # one element (validated), as a 0-d tensor: the loss stays a scalar
        return value.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return torch.full((), value, dtype=torch.float32, device=device)


def _finished(grad: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype, passes: RowPasses):
    """A gradient the forward computed (not used afterwards) times grad_output, in the parameter's `dtype`. An fp32
    sum for a half-precision parameter is scaled on its way to that dtype (one pass: the backend's scale_into). A
    gradient already in `dtype` is scaled in place only when grad_output is not 1 (scale_in_place tests it on the
    device: no pass, and no host sync, in the common case). Then a half-precision gradient that a GEMM wrote is
    rounded a second time: round(round(x) * s), within one unit in the last place of round(x * s)."""
    if grad.dtype != dtype:
        into = passes.scale_into if dtype in (torch.bfloat16, torch.float16) else scale_into_torch
        return into(grad, grad_output, dtype)
    return passes.scale_in_place(grad, grad_output)


def _fused_forward(hidden, weight, bias, target_ids, mask, inputs, options, backend, count, operand_dtype,
                   needs_grad):
    """(loss, logps, entropy, Gradients or None): the executor's run of one call (linear_grpo_executor)."""
    executor = Executor(hidden, weight, bias, target_ids, mask, inputs, options, backend, count, operand_dtype,
                        needs_grad)
    return (*executor.run(), executor.passes)


class _FusedLinearGRPOFunction(torch.autograd.Function):
    """The gradients are finished in the forward; backward only scales them by the incoming gradient (folded into
    the conversion of an fp32 sum to a half-precision parameter's dtype) and can run once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, mask, inputs, options, backend, count, operand_dtype):
        needs_grad = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, logps, entropy, ctx.gradients, ctx.passes = _fused_forward(
            hidden, weight, bias, target_ids, mask, inputs, options, backend, count, operand_dtype, needs_grad)
        ctx.hidden_shape, ctx.dtypes = hidden.shape, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(logps, entropy)
        return loss, logps, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logps, _grad_entropy):
        if ctx.gradients is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: backward ran twice through the same call (retain_graph=True); its "
                "gradients are computed in the forward and handed over once. Call the loss again instead."
            )
        gradients: Gradients = ctx.gradients
        ctx.gradients = None  # freed as soon as handed over
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad_loss = grad_loss.float()
        full_grad_h = None
        if gradients.grad_h is not None:
            B, T, H = ctx.hidden_shape
            full_grad_h = torch.zeros(B * T, H, dtype=hidden_dtype, device=gradients.grad_h.device)
            full_grad_h.index_copy_(0, gradients.rows, _finished(gradients.grad_h, grad_loss, hidden_dtype,
                                                                 ctx.passes))
            full_grad_h = full_grad_h.view(B, T, H)
        grads = (
            full_grad_h,
            None if gradients.grad_w is None else _finished(gradients.grad_w, grad_loss, weight_dtype, ctx.passes),
            None if gradients.grad_b is None else _finished(gradients.grad_b, grad_loss, bias_dtype, ctx.passes),
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
    """TRL's GRPO loss of the LM head `hidden @ weight.T (+ bias)` without the (B*T, V) logits.

    Projects only the scored tokens, in stages, and finishes the gradients inside the forward: the memory of a
    GRPO step's logits is never held, and no projection is recomputed in backward (docs/fused-loss.md).

    Args:
        hidden: (B, T, H) floating-point last hidden states that predict `target_ids`.
        weight: (V, H) floating-point LM head weight. bias: optional (V,).
        target_ids: (B, T) integer completion token ids, read where `mask` is set.
        mask: (B, T) completion mask, 1 = scored token (any dtype).
        advantages: (B,) or (B, T) float advantages.
        old_logps, ref_logps: optional (B, T) float log-probabilities of the old policy (None: this policy,
            detached) and of the reference model (required when beta != 0).
        vllm_is_ratio: optional (B, T), (B, 1) or (B,) importance-sampling correction of vLLM's sampling.
        num_items_in_batch: the dapo/cispo/vespo normaliser, a number or a one-element tensor (None: mask.sum()).
        logit_softcap: the model's final logit soft cap (logits become cap * tanh(logits / cap)); None: none.
        beta, epsilon_low, epsilon_high, delta, temperature, loss_type, importance_sampling_level,
            max_completion_length, use_bias_correction_kl, sapo_*, vespo_*: as in TRL's GRPOConfig.

    Returns:
        (loss, stats): the fp32 scalar loss, differentiable in hidden, weight and bias, and a dict of detached
        tensors: "logps" and "entropy" (B, T) fp32 (0 where mask is 0), the scalar means "kl" (beta != 0) and
        the loss type's clip ratios or "vespo/phi_seq_mean", each also per token as "per_token/<name>".

    Raises:
        TypeError: one of the five leading arguments is not a tensor.
        ValueError: a bad option, shape, device, target id or num_items_in_batch, naming it.
    """
    options = GRPOLossOptions(
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, temperature=temperature,
        loss_type=loss_type, importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length, use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, logit_softcap=logit_softcap,
    )
    tensors = dict(bias=bias, old_logps=old_logps, ref_logps=ref_logps, vllm_is_ratio=vllm_is_ratio)
    backend = select_backend("linear_grpo", hidden.device) if isinstance(hidden, torch.Tensor) else None
    if backend == "reference":  # it checks the call itself, and needs no count
        from . import reference

        return reference._fused_linear_grpo_loss(hidden, weight, target_ids, mask, advantages, options,
                                                 num_items_in_batch=num_items_in_batch, **tensors)
    check_num_items_in_batch(num_items_in_batch)
    check_linear_grpo_inputs(hidden, weight, target_ids, mask, advantages, beta=options.beta, **tensors)
    # rows whose gradient is exactly 0 (zero advantage, no KL) are projected for their log-probs and entropy but take
    # no gradient work; counted in the one host transfer
    live = mask != 0
    zero = zero_gradient_tokens(live, advantages, options, old_logps=old_logps, vllm_is_ratio=vllm_is_ratio)
    scored, zero_count = count_scored(live, target_ids, weight.shape[0], subset=zero)
    inputs = LossInputs(
        advantages=advantages.float(),
        old_logps=None if old_logps is None else old_logps.float(),
        ref_logps=None if ref_logps is None else ref_logps.float(),
        vllm_is_ratio=None if vllm_is_ratio is None else vllm_is_ratio.float(),
        num_items_in_batch=_normaliser_on(num_items_in_batch, hidden.device),
    )
    args = (hidden, weight, bias, target_ids, mask.float(), inputs, options, backend, Count(scored, zero, zero_count),
            gemms.operand_dtype(hidden, weight))
    # autocast decided the operand dtype above; inside, every op runs in the dtype chosen for it (fp32 logits)
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
            loss, logps, entropy = _FusedLinearGRPOFunction.apply(*args)
        else:
            # no_grad / inference_mode (TRL's eval prediction_step): forward-only work, no gradient GEMM nor buffer
            loss, logps, entropy, *_ = _fused_forward(*args, needs_grad=(False, False, False))
    with torch.no_grad():
        _, stats = grpo_loss_from_logps(logps, mask.float(), options=options, **inputs._asdict())
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
