"""Torch twins of the fused linear GRPO loss's Triton row passes (linear_grpo_triton): the same formulas in torch
ops, the default off CUDA. Each pass works on one stage of fp32 logits (rows, V), raw (before the model's soft cap
and the temperature), in place where it can.
"""

from __future__ import annotations

import torch

from .grpo_loss_math import token_loss_gradient


# (rows, V) fp32 temporaries the torch twins of the row passes hold beside the staging buffer, at most: the shifted
# logits z - max and exp(z - max) (logprob_entropy_torch; the logits-gradient pass works in place, one with a soft
# cap). The Triton kernels hold none.
STAGE_TEMPORARIES = 2


def logprob_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None = None):
    """Torch twin of linear_grpo_triton.logprob_entropy_triton: (log p(target), entropy, log-partition), by the
    kernel's formulas (the sums of exp(z - m) and of exp(z - m) * (z - m) over the row, m its maximum), in place
    where it can (STAGE_TEMPORARIES)."""
    z = logits * inv_t if softcap is None else (logits / softcap).tanh_().mul_(softcap).mul_(inv_t)
    m = z.amax(-1, keepdim=True)
    z.sub_(m)
    e = z.exp()
    total = e.sum(-1, keepdim=True)
    log_total = total.log()
    entropy = log_total - e.mul_(z).sum(-1, keepdim=True) / total
    logp = z.gather(-1, targets.unsqueeze(-1)) - log_total
    return logp.squeeze(-1), entropy.squeeze(-1), (m + log_total).squeeze(-1)


def stage_statistics_torch(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None, *,
                           logps: torch.Tensor, entropy: torch.Tensor, lse: torch.Tensor,
                           positions: torch.Tensor | None = None, g: torch.Tensor | None = None, g_inputs=None,
                           options=None) -> None:
    """Torch twin of linear_grpo_triton.stage_statistics_triton (the closed-form g of
    grpo_loss_math.token_loss_gradient)."""
    logp, ent, lse[:] = logprob_entropy_torch(logits, targets, inv_t, softcap)
    at = slice(None, logp.shape[0]) if positions is None else positions
    logps[at] = logp
    entropy[at] = ent
    if g is not None:
        g[:] = token_loss_gradient(logp, g_inputs, options)


def grad_logits_torch(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_t: float,
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


def scale_into_torch(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch twin of linear_grpo_triton.scale_into_triton: acc * scale as a new `dtype` tensor, in one pass (PyTorch's
    casting elementwise kernel, not vectorized on CUDA)."""
    return torch.mul(acc, scale, out=torch.empty_like(acc, dtype=dtype))


def scale_in_place_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch twin of linear_grpo_triton.scale_in_place_triton: x *= scale unless scale is 1. On the CPU the test is
    free; elsewhere it would stall the host, so x is multiplied whatever the scale."""
    if scale.device.type != "cpu" or scale.item() != 1.0:
        x.mul_(scale)
    return x
