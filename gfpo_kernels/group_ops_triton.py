"""Triton kernel of the group ops: segmented top-k and masked mean/std advantages in one launch.

Tiling: a program owns ROWS whole groups as a (ROWS, BLOCK_G) tile, BLOCK_G = next power of two >= G, so
every reduction stays inside the program and no atomics or second pass are needed (scale="batch" is the
exception: its one batch-wide std is applied afterwards by the wrapper). Ranks are counted, not sorted:
row i's rank is the number of rows j that rank before it (better score, NaN last, ties -> lower index),
accumulated over a loop on j. That is G^2 comparisons per group, exact for every dtype (no key packing),
and trivial next to the memory traffic for the group sizes GFPO uses (G <= 256; up to MAX_GROUP_SIZE).
Rewards are read in their own dtype and the statistics accumulate in fp64, as in the C++ and CUDA kernels: rewards
up to FLT_MAX square without overflow and float64 rewards keep their digits (the kernel is bound by memory and
launch latency, not by fp64 arithmetic, on every GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import on_device

MAX_GROUP_SIZE = 4096
# Elements per program tile: enough rows per program for small G, one group per program from G=1024 on.
_TILE_ELEMENTS = 1024


@triton.jit
def _group_filter_advantages_kernel(
    scores_ptr,
    k_ptr,
    keep_in_ptr,
    rewards_ptr,
    keep_out_ptr,
    adv_ptr,
    num_groups,
    G,
    k_scalar,
    EPS: tl.constexpr,  # a constexpr so that it stays an fp64 constant (a float argument arrives as fp32)
    LARGEST: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    K_IS_TENSOR: tl.constexpr,
    HAS_KEEP_IN: tl.constexpr,
    HAS_REWARDS: tl.constexpr,
    DIVIDE_BY_STD: tl.constexpr,
    UPCAST_SCORES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    groups = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_G)
    group_ok = groups < num_groups
    tile_ok = group_ok[:, None] & (cols[None, :] < G)
    row_start = groups.to(tl.int64) * G
    offs = row_start[:, None] + cols[None, :]

    if HAS_SCORES:
        s_i = tl.load(scores_ptr + offs, mask=tile_ok, other=0)
        if UPCAST_SCORES:  # fp16/bf16 -> fp32 is exact
            s_i = s_i.to(tl.float32)
        nan_i = s_i != s_i
        rank = tl.zeros([ROWS, BLOCK_G], dtype=tl.int32)
        for j in range(0, G):
            s_j = tl.load(scores_ptr + row_start + j, mask=group_ok, other=0)
            if UPCAST_SCORES:
                s_j = s_j.to(tl.float32)
            s_j = s_j[:, None]
            if LARGEST:
                better = s_j > s_i
            else:
                better = s_j < s_i
            tie = (s_j == s_i) | (nan_i & (s_j != s_j))
            before = (nan_i & (s_j == s_j)) | better | (tie & (cols[None, :] > j))
            rank += before.to(tl.int32)
        if K_IS_TENSOR:
            k = tl.load(k_ptr + groups, mask=group_ok, other=0)[:, None]
        else:
            k = k_scalar
        keep = tile_ok & (rank < k)
        tl.store(keep_out_ptr + offs, keep, mask=tile_ok)
    elif HAS_KEEP_IN:
        keep = tile_ok & (tl.load(keep_in_ptr + offs, mask=tile_ok, other=0) != 0)
    else:
        keep = tile_ok

    if HAS_REWARDS:
        r = tl.load(rewards_ptr + offs, mask=tile_ok, other=0).to(tl.float64)
        valid = keep & (tl.abs(r) < float("inf"))  # non-finite rewards (NaN, +-inf) take no part and get 0
        n = tl.sum(valid.to(tl.float64), axis=1)
        # Mean of shifted data: a group of equal rewards gets a mean equal to them, so exactly 0 advantages.
        shift = tl.max(tl.where(valid, r, -float("inf")), axis=1)
        shift = tl.where(n > 0, shift, 0.0)
        mean = shift + tl.sum(tl.where(valid, r - shift[:, None], 0.0), axis=1) / tl.maximum(n, 1.0)
        centred = tl.where(valid, r - mean[:, None], 0.0)
        if DIVIDE_BY_STD:
            m2 = tl.sum(centred * centred, axis=1)
            std = tl.where(n >= 2.0, tl.sqrt(m2 / tl.maximum(n - 1.0, 1.0)), 0.0)
            centred = centred / (std + EPS)[:, None]
        tl.store(adv_ptr + offs, centred.to(adv_ptr.dtype.element_ty), mask=tile_ok)


def _batch_std(rewards: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Unbiased std of all kept, finite rewards of the batch (0 when fewer than 2), in fp64."""
    r = rewards.double()
    valid = torch.isfinite(r) if keep is None else keep & torch.isfinite(r)
    n = valid.sum()
    mean = torch.where(valid, r, 0.0).sum() / n.clamp_min(1)
    var = torch.where(valid, r - mean, 0.0).square().sum() / (n - 1).clamp_min(1)
    return torch.where(n >= 2, var.sqrt(), 0.0)


def launch_config(num_groups: int, G: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_G, num_warps) of the group kernel for `num_groups` groups of G. A tile holds _TILE_ELEMENTS (or
    one group when G is larger), and the warps grow with the tile so that each thread keeps at most 8 elements: with
    4 warps a 4096-wide group spills registers on sm_90 (scripts/triton_aot.py)."""
    block_g = triton.next_power_of_2(G)
    rows = max(1, min(triton.next_power_of_2(max(num_groups, 1)), _TILE_ELEMENTS // block_g))
    num_warps = max(4, min(16, rows * block_g // 256))
    return rows, block_g, num_warps


def group_filter_advantages(
    *,
    scores: torch.Tensor | None,
    k: int | torch.Tensor | None,
    keep: torch.Tensor | None,
    rewards: torch.Tensor | None,
    largest: bool,
    scale: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launches the kernel on validated (num_groups, G) tensors. With `scores`, the top-k mask of them decides
    which rows are kept (else `keep`, else all rows); with `rewards`, advantages are computed too.
    Returns (keep, advantages or None)."""
    src = scores if scores is not None else rewards
    num_groups, G = src.shape
    if G > MAX_GROUP_SIZE:
        raise ValueError(f"the Triton group kernel supports group_size <= {MAX_GROUP_SIZE}, got {G}")
    device = src.device
    rows, block_g, num_warps = launch_config(num_groups, G)

    if scores is not None:
        scores = scores.contiguous()
        keep_out = torch.empty(num_groups, G, dtype=torch.bool, device=device)
    else:
        keep_out = keep.contiguous() if keep is not None else torch.ones(num_groups, G, dtype=torch.bool, device=device)
    if rewards is not None:
        rewards = rewards.contiguous()
        # scale="batch": centred rewards in fp64 until the batch std divides them (they may exceed fp32's range
        # where the scaled advantages do not)
        adv = torch.empty(num_groups, G, dtype=torch.float64 if scale == "batch" else torch.float32, device=device)
    else:
        adv = None
    if num_groups == 0:
        return keep_out, None if adv is None else adv.float()

    k_is_tensor = isinstance(k, torch.Tensor)
    with on_device(device):
        _group_filter_advantages_kernel[(triton.cdiv(num_groups, rows),)](
            scores,
            k.contiguous() if k_is_tensor else None,  # read at k_ptr + g
            keep_out if (scores is None and keep is not None) else None,
            rewards,
            keep_out,
            adv,
            num_groups,
            G,
            0 if (k is None or k_is_tensor) else k,
            EPS=float(eps),
            LARGEST=bool(largest),
            HAS_SCORES=scores is not None,
            K_IS_TENSOR=k_is_tensor,
            HAS_KEEP_IN=scores is None and keep is not None,
            HAS_REWARDS=rewards is not None,
            DIVIDE_BY_STD=scale == "group",
            UPCAST_SCORES=scores is not None and scores.dtype in (torch.float16, torch.bfloat16),
            ROWS=rows,
            BLOCK_G=block_g,
            num_warps=num_warps,
        )
    if adv is not None and scale == "batch":
        std = _batch_std(rewards, keep_out if (scores is not None or keep is not None) else None)
        adv = (adv / (std + eps)).float()
    return keep_out, adv
