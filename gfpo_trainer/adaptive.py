"""Adaptive Difficulty GFPO: k per group from the quartile of the group's difficulty.

A group's difficulty is its mean reward (lower = harder). Quartiles of it are tracked over training with a
t-digest (the `tdigest` package: a maintained streaming-quantile sketch, so memory stays bounded however long
training runs and no quantile code of ours needs testing against it). Every process sees the same global
rewards and updates its own digest identically, so all processes choose the same k. The digest draws from
Python's global `random` (its merge order), which TRL seeds differently on every process and other code draws
from between steps: the digest's draws come from a private state instead, seeded alike on every process and saved
with the checkpoint.
"""

from __future__ import annotations

import random

import torch
from tdigest import TDigest
from tdigest.tdigest import Centroid


_DIGEST_SEED = 0


class AdaptiveDifficulty:
    """Maps group mean rewards to k: quartile 0 (hardest, lowest mean reward) gets `num_remains[0]`."""

    def __init__(self, num_remains: list[int]):
        if len(num_remains) != 4:
            raise ValueError(f"num_remains must hold 4 values (one per quartile), got {num_remains!r}")
        self.num_remains = list(num_remains)
        self.digest = TDigest()
        self.rng = random.Random(_DIGEST_SEED)  # the digest's draws: the same on every process

    def state_dict(self) -> dict:
        """The digest and its random state as JSON-able data, saved with every checkpoint (see GFPOTrainer)."""
        version, internal, gauss = self.rng.getstate()
        return {"num_remains": self.num_remains, "digest": self.digest.to_dict(),
                "rng_state": [version, list(internal), gauss]}

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
        if "rng_state" in state:  # checkpoints of GFPO before it kept the digest's random state start it afresh
            version, internal, gauss = state["rng_state"]
            self.rng.setstate((version, tuple(internal), gauss))
        else:
            self.rng.seed(_DIGEST_SEED)

    def quartile_thresholds(self) -> tuple[float, float, float]:
        return tuple(float(self.digest.percentile(q)) for q in (25, 50, 75))

    def update_and_assign(self, group_mean_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds this batch's group difficulties to the digest, then returns (quartile per group, k per group),
        int64 tensors on the input's device. NaN means (groups with no scorable completion) count as hardest
        and are not added to the digest."""
        means = group_mean_rewards.detach().float()
        finite = means[torch.isfinite(means)]
        if finite.numel():
            values = finite.cpu().double().tolist()
            outside = random.getstate()  # the digest draws from the global random: lend it the private state
            random.setstate(self.rng.getstate())
            try:
                self.digest.batch_update(values)
            finally:
                self.rng.setstate(random.getstate())
                random.setstate(outside)
        if self.digest.n == 0:
            quartile = torch.zeros_like(means, dtype=torch.int64)
        else:
            thresholds = torch.tensor(self.quartile_thresholds(), dtype=means.dtype, device=means.device)
            # quartile = how many thresholds lie strictly below the mean: ties with a threshold go to the harder side
            quartile = (torch.nan_to_num(means, nan=-float("inf"))[:, None] > thresholds[None, :]).sum(dim=1)
        k = torch.tensor(self.num_remains, dtype=torch.int64, device=means.device)[quartile]
        return quartile, k
