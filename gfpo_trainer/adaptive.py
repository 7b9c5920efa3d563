"""Adaptive Difficulty GFPO: k per group from the quartile of the group's difficulty.

A group's difficulty is its mean reward (lower = harder). Quartiles of it are tracked over training with a
t-digest (the `fastdigest` package, a maintained streaming-quantile sketch in Rust with wheels for every platform), so
memory stays bounded however long training runs and no quantile code of ours needs testing against it. Every
process sees the same global rewards in the same order and updates its own digest identically: the digest draws no
random numbers and sorts each batch before merging it, so all processes choose the same k whatever their random
states.

Accuracy: with `max_centroids` = d, fastdigest's merge closes a centroid once the cumulative weight passes
n * q(k), q(k) = 2 (k/d)^2 below the median (mirrored above it), so one centroid never spans more than
q(d/2) - q(d/2 - 1) < 2/d of the ranks: the t-digest's size bound (Dunning and Ertl, "Computing Extremely Accurate
Quantiles Using t-Digests", 2019, section 2: every centroid's k-size is at most 1). A quantile estimate interpolates
between the two centroids whose middles surround q, so its rank is within 3/d of q (the left centroid's width and
half the right one's); with d = 1000 the quartile thresholds lie within 0.003 in rank of the exact quartiles.

A checkpoint may also hold a digest in the `tdigest` package's format ({"n", "delta", "K", "centroids"}, beside the
random state that package drew from; docs/trainer.md, "Adaptive difficulty"): its centroids are the same
`{"m", "c"}` records and load as they are (see AdaptiveDifficulty.load_state_dict).
"""

from __future__ import annotations

import torch
from fastdigest import TDigest

# the digest's size; fixed here (not fastdigest's default) so that a new fastdigest release cannot change which
# quartile a group falls in. 1000 centroids: quartile ranks within 0.3% (module docstring), 40 kB in a checkpoint
MAX_CENTROIDS = 1000
QUARTILES = (0.25, 0.5, 0.75)


class AdaptiveDifficulty:
    """Maps group mean rewards to k: quartile 0 (hardest, lowest mean reward) gets `num_remains[0]`."""

    def __init__(self, num_remains: list[int]):
        if len(num_remains) != 4:
            raise ValueError(f"num_remains must hold 4 values (one per quartile), got {num_remains!r}")
        self.num_remains = list(num_remains)
        self.digest = TDigest(max_centroids=MAX_CENTROIDS)

    def state_dict(self) -> dict:
        """The digest as JSON-able data (fastdigest's to_dict), saved with every checkpoint (see GFPOTrainer)."""
        digest = self.digest.to_dict()
        if self.digest.is_empty():  # its min and max are NaN, which strict JSON readers refuse; from_dict infers them
            digest = {"max_centroids": digest["max_centroids"], "centroids": []}
        return {"num_remains": self.num_remains, "digest": digest}

    def load_state_dict(self, state: dict) -> None:
        """Restores the digest exactly: its centroids are put back as they were, not re-inserted (re-inserting would
        merge them and change the quartiles a resumed run sees). Takes what state_dict writes and a digest in the
        `tdigest` format (the same {"m", "c"} centroid records, beside that package's random state)."""
        if list(state["num_remains"]) != self.num_remains:
            raise ValueError(
                f"the checkpoint's adaptive_num_remains={state['num_remains']} differs from this run's {self.num_remains}"
            )
        digest = TDigest.from_dict(state["digest"])
        # a tdigest dict carries no max_centroids (fastdigest would take its default): the size is this module's
        digest.max_centroids = MAX_CENTROIDS
        self.digest = digest

    def quartile_thresholds(self) -> tuple[float, float, float]:
        """The digest's estimates of the 25th, 50th and 75th percentiles of the group mean rewards seen so far."""
        return tuple(float(value) for value in self.digest.quantile_vec(list(QUARTILES)))

    def update_and_assign(self, group_mean_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds this batch's group difficulties to the digest, then returns (quartile per group, k per group),
        int64 tensors on the input's device. NaN means (groups with no scorable completion) count as hardest
        and are not added to the digest."""
        means = group_mean_rewards.detach().float()
        finite = means[torch.isfinite(means)]
        if finite.numel():
            self.digest.batch_update(finite.cpu().double().tolist())
        if self.digest.is_empty():
            quartile = torch.zeros_like(means, dtype=torch.int64)
        else:
            thresholds = torch.tensor(self.quartile_thresholds(), dtype=means.dtype, device=means.device)
            # quartile = how many thresholds lie strictly below the mean: ties with a threshold go to the harder side
            quartile = (torch.nan_to_num(means, nan=-float("inf"))[:, None] > thresholds[None, :]).sum(dim=1)
        k = torch.tensor(self.num_remains, dtype=torch.int64, device=means.device)[quartile]
        return quartile, k
