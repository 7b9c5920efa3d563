"""Selection: which rows of the generation batch GFPO trains on, and their advantages.

Scores every completion of the global batch (a built-in filter on device, or the user's `group_filter_func`),
chooses k (fixed, or per group with Adaptive Difficulty), and computes the kept mask and the advantages over the
kept rows in one call of `gfpo_filter_advantages` (the fused kernel, or the reference with use_gfpo_kernels=False).
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object

import gfpo_kernels
from gfpo_kernels import reference as gfpo_reference

from ._compat import TRLSurfaceError


def select(trainer, rewards_per_func, completions, completion_ids_list) -> dict:
    """Kept mask and advantages of the global batch (every process computes the same)."""
    G = trainer.num_generations
    args = trainer.args
    device = rewards_per_func.device
    # TRL's summed reward; a row whose every reward function returned None is unscorable (NaN): it ranks last
    # under the reward-based filters and gets advantage 0
    rewards = (rewards_per_func * trainer.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    local_lengths = torch.tensor([len(ids) for ids in completion_ids_list], device=device, dtype=torch.float32)
    lengths = trainer.accelerator.gather(local_lengths)
    if lengths.numel() != rewards.numel():
        raise TRLSurfaceError(
            f"GRPOTrainer._calculate_rewards returned {rewards.numel()} rows, the batch holds {lengths.numel()}"
        )
    if args.group_filter == "length":
        scores, largest = lengths, False
    elif args.group_filter == "token_efficiency":
        scores, largest = rewards / lengths.clamp(min=1.0), True
    else:
        scores, largest = _scores_from_func(trainer, completions, completion_ids_list, rewards), True

    quartile = None
    if trainer.adaptive_difficulty is not None:
        group_means = torch.nanmean(rewards.view(-1, G), dim=1)
        quartile, k = trainer.adaptive_difficulty.update_and_assign(group_means)
    else:
        k = args.num_remains_in_group
    ops = gfpo_kernels if args.use_gfpo_kernels else gfpo_reference
    keep, advantages = ops.gfpo_filter_advantages(rewards, scores, G, k, largest=largest, scale=trainer.scale_rewards)
    return {"keep": keep, "advantages": advantages, "lengths": lengths, "k": k, "quartile": quartile}


def _scores_from_func(trainer, completions, completion_ids_list, rewards) -> torch.Tensor:
    G = trainer.num_generations
    all_completions = gather_object(completions)
    all_ids = gather_object(list(completion_ids_list))
    num_groups = len(all_completions) // G
    scores = trainer.group_filter_func(
        group_completions=[all_completions[g * G : (g + 1) * G] for g in range(num_groups)],
        group_rewards=rewards.view(-1, G).tolist(),
        group_completion_ids=[all_ids[g * G : (g + 1) * G] for g in range(num_groups)],
    )
    try:
        scores = torch.as_tensor(scores, dtype=torch.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"group_filter_func must return {num_groups} lists of {G} numbers (one score per completion), "
            f"got something that is not a rectangular list of numbers: {error}"
        ) from None
    if tuple(scores.shape) != (num_groups, G):
        raise ValueError(
            f"group_filter_func must return {num_groups} lists of {G} scores (groups x num_generations), "
            f"got shape {tuple(scores.shape)}"
        )
    bad = ~torch.isfinite(scores)
    if bad.any():
        g, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"group_filter_func returned a non-finite score {scores[g, i].item()} (group {g}, completion {i})")
    return scores.flatten().to(rewards.device)


def log_selection(trainer, selection: dict, keep: torch.Tensor, stopped: torch.Tensor | None) -> None:
    """GFPO's selection metrics: kept fraction, kept vs dropped lengths, the per-quartile k when adaptive."""
    metrics = trainer._metrics["train"]
    lengths = selection["lengths"]
    metrics["gfpo/kept_fraction"].append(keep.float().mean().item())
    metrics["gfpo/kept_completion_length"].append(lengths[keep].mean().item() if keep.any() else float("nan"))
    dropped = ~keep
    dropped_length = lengths[dropped].mean().item() if dropped.any() else float("nan")
    if stopped is None:
        metrics["gfpo/dropped_completion_length"].append(dropped_length)
    else:
        # early-stopped completions were cut short: their lengths (here and in TRL's completions/*) are truncated
        metrics["gfpo/dropped_completion_length_truncated"].append(dropped_length)
        metrics["gfpo/stopped_early_fraction"].append(stopped.float().mean().item())
    if selection["quartile"] is not None:
        quartile, k = selection["quartile"], selection["k"]
        for q, k_q in enumerate(trainer.args.adaptive_num_remains):
            metrics[f"gfpo/k_quartile_{q}"].append(float(k_q))
            metrics[f"gfpo/groups_quartile_{q}"].append((quartile == q).float().mean().item())
        metrics["gfpo/mean_k"].append(k.float().mean().item())
