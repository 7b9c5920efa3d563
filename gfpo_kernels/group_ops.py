"""GFPO's per-group selection and advantages: the public ops.

Each op validates its input once (the same checks as the reference), picks a backend in `_dispatch`, and
runs it on the (num_groups, G) view; outputs keep the input's shape.
"""

from __future__ import annotations

import torch

from . import reference
from ._dispatch import HAS_CPP, select_backend
from ._validation import (
    as_groups, check_group_size, check_k, check_keep, check_largest, check_same_shape, check_scale_eps
)

__all__ = ["group_topk_mask", "group_advantages", "gfpo_filter_advantages"]


def _k_args(k: int | torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """(k, k_fixed) of the C++ ops: an adaptive k as its tensor, a single k as an int (no tensor to fill on the
    device, so the CUDA op is one launch)."""
    return (k, 0) if isinstance(k, torch.Tensor) else (None, k)


def group_topk_mask(scores: torch.Tensor, group_size: int, k, *, largest: bool = True) -> torch.Tensor:
    """Marks the top-k rows of every group.

    Args:
        scores: (N,) with each group's G rows contiguous (TRL's layout), or (num_groups, G). Any real dtype.
        group_size: G, the number of completions per prompt.
        k: rows kept per group: an int with 1 <= k <= G, or an integer tensor (num_groups,) with
            0 <= k_g <= G (adaptive k; copied to the scores' device if it is elsewhere).
        largest: keep the highest scores (True) or the lowest (False, e.g. the shortest completions).

    Returns:
        A bool tensor of the shape of `scores` with exactly min(k_g, G) True rows per group. Ties go to the
        lower index; NaN scores rank last whatever `largest`.

    Raises:
        ValueError: N not a multiple of G, k out of range, k tensor of the wrong length, input not 1-D/2-D.
    """
    group_size = check_group_size(group_size)
    s = as_groups(scores, group_size, "scores", ranked=True)
    kk = check_k(k, s.shape[0], group_size, s.device)
    largest = check_largest(largest)
    backend = select_backend("group", s.device, group_size)
    if backend == "reference":
        return reference.group_topk_mask(scores, group_size, kk, largest=largest)
    if backend == "cpp":
        keep = torch.ops.gfpo.group_topk_mask(s, *_k_args(kk), bool(largest))
    else:
        from . import group_ops_triton

        keep, _ = group_ops_triton.group_filter_advantages(
            scores=s, k=kk, keep=None, rewards=None, largest=largest, scale="none", eps=0.0
        )
    return keep.reshape(scores.shape)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, keep: torch.Tensor | None = None, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO advantages over the kept rows of every group.

    mean_g and std_g are taken over the kept rows of group g; std is unbiased (n-1) and 0 with fewer than
    2 kept rows, so zero-variance groups give 0, never NaN. Rows not kept get exactly 0. Non-finite
    rewards (NaN: TRL's unscorable completions, which TRL also gives 0; +-inf) take no part in the statistics and
    get 0, so one bad reward never turns its group (or with scale="batch" the batch) into NaN.

    Args:
        rewards: (N,) in TRL's group layout, or (num_groups, G). Any real dtype.
        group_size: G.
        keep: optional bool mask of the shape of `rewards`; None keeps every row (= TRL's GRPO).
        scale: "group": (r - mean_g) / (std_g + eps); "batch": divide by the unbiased std of all kept
            rewards of the batch + eps; "none": r - mean_g.
        eps: added to the std, 1e-4 as in TRL; must be > 0 (it keeps a zero-variance group at 0, not 0 / 0).

    Returns:
        float32 advantages of the shape of `rewards`.

    Raises:
        ValueError: N not a multiple of G, keep not a bool tensor of the shape of `rewards` (it is copied to the
            rewards' device if it is elsewhere), bad scale or eps.
    """
    group_size = check_group_size(group_size)
    check_scale_eps(scale, eps)
    r = as_groups(rewards, group_size, "rewards")
    kept = None
    if keep is not None:
        check_keep(keep, rewards)
        kept = keep.reshape(r.shape).to(device=r.device, dtype=torch.bool)
    backend = select_backend("group", r.device, group_size)
    if backend == "reference":
        kept = None if kept is None else kept.reshape(rewards.shape)
        return reference.group_advantages(rewards, group_size, keep=kept, scale=scale, eps=eps)
    if backend == "cpp":
        adv = torch.ops.gfpo.group_advantages(r, kept, scale, float(eps))
    else:
        from . import group_ops_triton

        _, adv = group_ops_triton.group_filter_advantages(
            scores=None, k=None, keep=kept, rewards=r, largest=True, scale=scale, eps=eps
        )
    return adv.reshape(rewards.shape)


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
    """GFPO's filter and advantages in one pass (one kernel launch on GPU): the top-k mask of `scores`
    (see :func:`group_topk_mask`), then the advantages of `rewards` over the kept rows (see
    :func:`group_advantages`).

    Args:
        rewards: (N,) in TRL's group layout, or (num_groups, G). Any real dtype; non-finite rewards get 0.
        scores: the filter's metric, of the shape of `rewards` and on its device. Any real dtype.
        group_size: G.
        k: rows kept per group: an int with 1 <= k <= G, or an integer tensor (num_groups,) with 0 <= k_g <= G
            (copied to the scores' device if it is elsewhere).
        largest: keep the highest scores (True) or the lowest (False).
        scale, eps: as in :func:`group_advantages`.

    Returns:
        (keep, advantages): a bool mask and float32 advantages, both of the shape of `rewards`.

    Raises:
        ValueError: N not a multiple of G, rewards and scores of different shapes or devices, k out of range or a
            k tensor of the wrong length, bad scale or eps.
    """
    group_size = check_group_size(group_size)
    check_scale_eps(scale, eps)
    check_same_shape(rewards, "rewards", scores, "scores")
    r = as_groups(rewards, group_size, "rewards")
    s = as_groups(scores, group_size, "scores", ranked=True)
    kk = check_k(k, s.shape[0], group_size, s.device)
    largest = check_largest(largest)
    if r.device != s.device:
        raise ValueError(f"rewards and scores must be on one device, got {r.device} and {s.device}")
    backend = select_backend("group", s.device, group_size)
    if backend == "reference":
        return reference.gfpo_filter_advantages(
            rewards, scores, group_size, kk, largest=largest, scale=scale, eps=eps
        )
    if backend == "cpp":
        keep, adv = torch.ops.gfpo.gfpo_filter_advantages(r, s, *_k_args(kk), bool(largest), scale, float(eps))
    else:
        from . import group_ops_triton

        keep, adv = group_ops_triton.group_filter_advantages(
            scores=s, k=kk, keep=None, rewards=r, largest=largest, scale=scale, eps=eps
        )
    return keep.reshape(rewards.shape), adv.reshape(rewards.shape)


if HAS_CPP:
    # Shapes for tracing (torch.compile, meta tensors): the ops keep the (num_groups, G) shape.
    @torch.library.register_fake("gfpo::group_topk_mask")
    def _(scores, k, k_fixed, largest):
        return torch.empty_like(scores, dtype=torch.bool)

    @torch.library.register_fake("gfpo::group_advantages")
    def _(rewards, keep, scale, eps):
        return torch.empty_like(rewards, dtype=torch.float32)

    @torch.library.register_fake("gfpo::gfpo_filter_advantages")
    def _(rewards, scores, k, k_fixed, largest, scale, eps):
        return torch.empty_like(scores, dtype=torch.bool), torch.empty_like(rewards, dtype=torch.float32)
