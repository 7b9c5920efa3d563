"""Adaptive Difficulty GFPO: k per group from the quartile of the group's difficulty.

A group's difficulty is its mean reward (lower = harder). Quartiles of it are tracked over training with a
t-digest (the `tdigest` package: a maintained streaming-quantile sketch, so memory stays bounded however long
training runs and no quantile code of ours needs testing against it). Every process sees the same global
rewards and updates its own digest identically, so all processes choose the same k.
"""

from __future__ import annotations

import torch
from tdigest import TDigest
from tdigest.tdigest import Centroid


class AdaptiveDifficulty:
    """Maps group mean rewards to k: quartile 0 (hardest, lowest mean reward) gets `num_remains[0]`."""

    def __init__(self, num_remains: list[int]):
        if len(num_remains) != 4:
            raise ValueError(f"num_remains must hold 4 values (one per quartile), got {num_remains!r}")
        self.num_remains = list(num_remains)
        self.digest = TDigest()

    def state_dict(self) -> dict:
        """The digest as JSON-able data, saved with every checkpoint (see GFPOTrainer)."""
        return {"num_remains": self.num_remains, "digest": self.digest.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores the digest exactly: the centroids are put back as they were, not re-inserted (TDigest's own
        update_from_dict merges them, which would change the quartiles a resumed run sees)."""
        if list(state["num_remains"]) != self.num_remains:
            raise ValueError(
                f"the checkpoint's adaptive_num_remains={state['num_remains']} differs from this run's {self.num_remains}"
            )
        saved = state["digest"]
        digest = TDigest(delta=saved["delta"], K=saved["K"])
        for centroid in saved["centroids"]:
            digest._add_centroid(Centroid(centroid["m"], centroid["c"]))
        digest.n = saved["n"]
        self.digest = digest

    def quartile_thresholds(self) -> tuple[float, float, float]:
        return tuple(float(self.digest.percentile(q)) for q in (25, 50, 75))

    def update_and_assign(self, group_mean_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds this batch's group difficulties to the digest, then returns (quartile per group, k per group),
        int64 tensors on the input's device. NaN means (groups with no scorable completion) count as hardest
        and are not added to the digest."""
        means = group_mean_rewards.detach().float()
        finite = means[torch.isfinite(means)]
        if finite.numel():
            self.digest.batch_update(finite.cpu().double().tolist())
        if self.digest.n == 0:
            quartile = torch.zeros_like(means, dtype=torch.int64)
        else:
            thresholds = torch.tensor(self.quartile_thresholds(), dtype=means.dtype, device=means.device)
            # quartile = how many thresholds lie strictly below the mean: ties with a threshold go to the harder side
            quartile = (torch.nan_to_num(means, nan=-float("inf"))[:, None] > thresholds[None, :]).sum(dim=1)
        k = torch.tensor(self.num_remains, dtype=torch.int64, device=means.device)[quartile]
        return quartile, k
