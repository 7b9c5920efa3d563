"""Pure-PyTorch reference of the gfpo ops: the oracle that every kernel is tested and benchmarked against.

Written from the semantics in docs/design.md, for clarity rather than speed: ranks come from counting, for every
row, the rows of its group that rank before it; statistics are computed in float64; the GRPO loss takes the
full (B, T, V) logits in float64.
"""

from __future__ import annotations

import torch

from ._validation import (
    as_groups,
    check_group_size,
    check_k,
    check_keep,
    check_largest,
    check_same_shape,
    check_linear_grpo_inputs,
    check_num_items_in_batch,
    check_scale_eps,
    count_scored,
)
from .grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps, soft_capped

__all__ = ["group_topk_mask", "group_advantages", "gfpo_filter_advantages", "fused_linear_grpo_loss"]

# Pairwise comparisons are (groups, G, G): bound the number held at once.
_PAIRS_PER_CHUNK = 1 << 22


def _ranks(s: torch.Tensor, largest: bool) -> torch.Tensor:
    """rank[g, i] = number of rows j of group g that rank before row i: a better score, or NaN at i but not
    at j, or an equal score (both NaN counts as equal) at a lower index."""
    num_groups, G = s.shape
    v = s.double() if s.is_floating_point() else s
    lower = torch.arange(G, device=s.device)
    j_before_i = lower[None, :] < lower[:, None]  # [i, j]
    out = torch.empty(num_groups, G, dtype=torch.int64, device=s.device)
    step = max(1, _PAIRS_PER_CHUNK // (G * G))
    for start in range(0, num_groups, step):
        vc = v[start : start + step]
        vi, vj = vc[:, :, None], vc[:, None, :]
        nan_i, nan_j = torch.isnan(vi), torch.isnan(vj)
        better = vj > vi if largest else vj < vi  # False whenever either side is NaN
        tie = (vj == vi) | (nan_i & nan_j)
        before = (nan_i & ~nan_j) | better | (tie & j_before_i)
        out[start : start + step] = before.sum(dim=-1)
    return out


def group_topk_mask(scores: torch.Tensor, group_size: int, k, *, largest: bool = True) -> torch.Tensor:
    """Reference of :func:`gfpo_kernels.group_topk_mask`: True for the top-k rows of every group."""
    group_size = check_group_size(group_size)
    s = as_groups(scores, group_size, "scores", ranked=True)
    kk = check_k(k, s.shape[0], group_size, s.device)
    largest = check_largest(largest)
    k_col = kk[:, None] if isinstance(kk, torch.Tensor) else kk
    return (_ranks(s, largest) < k_col).reshape(scores.shape)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, keep: torch.Tensor | None = None, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Reference of :func:`gfpo_kernels.group_advantages`: GRPO advantages over the kept rows of each group.

    Non-finite rewards (NaN: TRL's unscorable completions; +-inf) take no part in the statistics and get
    advantage 0."""
    group_size = check_group_size(group_size)
    check_scale_eps(scale, eps)
    r = as_groups(rewards, group_size, "rewards").double()
    if keep is None:
        kept = torch.ones_like(r, dtype=torch.bool)
    else:
        check_keep(keep, rewards)
        kept = keep.reshape(r.shape).bool()
    valid = kept & torch.isfinite(r)
    n = valid.sum(dim=1, keepdim=True)
    # Mean of data shifted by the group's largest reward: equal rewards give a mean equal to them, so
    # zero-variance groups get exactly 0 (the plain float mean can be off by an ulp).
    shift = torch.where(valid, r, -torch.inf).amax(dim=1, keepdim=True)
    shift = torch.where(n > 0, shift, 0.0)
    mean = shift + torch.where(valid, r - shift, 0.0).sum(dim=1, keepdim=True) / n.clamp_min(1)
    centred = torch.where(valid, r - mean, 0.0)
    if scale == "group":
        var = centred.square().sum(dim=1, keepdim=True) / (n - 1).clamp_min(1)
        std = torch.where(n >= 2, var.sqrt(), 0.0)
        centred = centred / (std + eps)
    elif scale == "batch":
        all_kept = r[valid]
        std = all_kept.std() if all_kept.numel() >= 2 else torch.zeros((), dtype=r.dtype, device=r.device)
        centred = centred / (std + eps)
    return centred.float().reshape(rewards.shape)


def gfpo_filter_advantages(
    rewards: torch.Tensor,
    scores: torch.Tensor,
    group_size: int,
    k,
    *,
    largest: bool = True,
    scale: str = "group",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`gfpo_kernels.gfpo_filter_advantages`: the top-k mask of `scores`, then the
    advantages of `rewards` over the kept rows."""
    check_same_shape(rewards, "rewards", scores, "scores")
    keep = group_topk_mask(scores, group_size, k, largest=largest)
    return keep, group_advantages(rewards, group_size, keep=keep, scale=scale, eps=eps)


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
    """Reference of :func:`gfpo_kernels.fused_linear_grpo_loss`: the full (B, T, V) logits in float64, then
    TRL's loss (gfpo_kernels.grpo_loss_math). Gradients flow to hidden, weight and bias by autograd."""
    options = GRPOLossOptions(
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, temperature=temperature,
        loss_type=loss_type, importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length, use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, logit_softcap=logit_softcap,
    )
    return _fused_linear_grpo_loss(hidden, weight, target_ids, mask, advantages, options, bias=bias,
                                   old_logps=old_logps, ref_logps=ref_logps, vllm_is_ratio=vllm_is_ratio,
                                   num_items_in_batch=num_items_in_batch)


def _fused_linear_grpo_loss(hidden, weight, target_ids, mask, advantages, options: GRPOLossOptions, *, bias=None,
                            old_logps=None, ref_logps=None, vllm_is_ratio=None, num_items_in_batch=None):
    """fused_linear_grpo_loss of options already made (the kernel entry hands its call over here when the reference
    backend runs it): checks the call, then computes it."""
    check_num_items_in_batch(num_items_in_batch)
    check_linear_grpo_inputs(hidden, weight, target_ids, mask, advantages, bias=bias, old_logps=old_logps,
                             ref_logps=ref_logps, vllm_is_ratio=vllm_is_ratio, beta=options.beta)
    count_scored(mask != 0, target_ids, weight.shape[0])  # the target-id range
    logit_softcap, temperature = options.logit_softcap, options.temperature
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    log_probs = torch.log_softmax(soft_capped(logits, logit_softcap) / temperature, dim=-1)
    live = mask != 0
    safe_ids = torch.where(live, target_ids, 0).long()
    logps = log_probs.gather(-1, safe_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    loss, stats = grpo_loss_from_logps(
        logps, mask.double(), advantages.double(), options,
        old_logps=None if old_logps is None else old_logps.double(),
        ref_logps=None if ref_logps is None else ref_logps.double(),
        vllm_is_ratio=None if vllm_is_ratio is None else vllm_is_ratio.double(),
        num_items_in_batch=num_items_in_batch,
    )
    stats = {name: value.float() for name, value in stats.items()}
    stats["logps"] = torch.where(live, logps, 0.0).detach().float()
    stats["entropy"] = torch.where(live, entropy, 0.0).detach().float()
    return loss.float(), stats
