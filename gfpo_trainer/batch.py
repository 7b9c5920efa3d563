"""One generation batch's GFPO state, in one object.

GFPOTrainer makes a `GenerationBatch` at the start of every `_generate_and_score_completions` and hands it to the
helpers of its hooks (selection.py, rows.py). What they learn about the batch while TRL builds it (the tool masks,
the rows the early-stop rule cut, the selection, the deferred log-prob passes) and what the loss needs of it later
(the random-state replay after skipped rows) is kept there and nowhere else; the next batch starts from a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._compat import TRLSurfaceError


@dataclass
class Selection:
    """The rows of the global batch GFPO trains on, and what they are chosen by (every process holds the same)."""

    keep: torch.Tensor  # (rows,) bool: kept by the group filter
    advantages: torch.Tensor  # (rows,) GFPO's advantages over the kept rows, 0 for dropped ones
    lengths: torch.Tensor  # (rows,) completion lengths in model tokens, as generated (a cut row as far as it ran)
    truncated: torch.Tensor  # (rows,) bool: TRL's clipped test (not ending in EOS or padding)
    rewards: torch.Tensor  # (rows,) TRL's summed reward; NaN where unscorable (every function None, or non-finite)
    rewards_per_func: torch.Tensor  # (rows, reward functions) as TRL computed them
    k: int | torch.Tensor  # rows kept per group: one number, or one per group with Adaptive Difficulty
    quartile: torch.Tensor | None  # each group's difficulty quartile with Adaptive Difficulty, else None
    nonfinite_groups: int = 0  # groups given advantage 0 for a non-finite reward (rewards.py)


@dataclass(eq=False)
class DeferredPass:
    """A no-grad log-prob pass (the old policy's or the reference model's) put off until the rows to train are known.
    `placeholder` stands in TRL's output dict where the pass's log-probs go; it is found there by identity."""

    placeholder: torch.Tensor
    model: object
    batch_size: int | None


@dataclass
class ShuffleReplay:
    """CPU random states around TRL's shuffle of a batch with skipped rows (see rows.restore_shuffle_rng): the state
    the batch was handed over in, the one TRL's shuffle of the trained rows leaves, and the one the shuffle of the
    unskipped batch would have left (put in its place)."""

    handed_over: torch.Tensor
    after_trained_shuffle: torch.Tensor
    after_unskipped_shuffle: torch.Tensor


@dataclass
class GenerationBatch:
    """GFPO's state of the generation batch being built or trained."""

    filtering: bool  # a group filter selects the rows (training with num_remains_in_group set)
    skip_zero: bool  # rows of advantage exactly 0 leave the batch (rows.zero_gradient_skip_applies)
    deferring: bool = False  # while TRL builds the batch: its no-grad log-prob passes are deferred
    tool_mask: list[list[int]] | None = None  # per completion, 0 on tool-output tokens (from TRL's _generate)
    turns: int = 0  # generation calls so far (_generate_single_turn; TRL's tool loop calls it again after tools)
    stopped_rows: torch.Tensor | None = None  # this process's rows the early-stop rule cut; None: it did not run
    selection: Selection | None = None  # from _calculate_rewards, when filtering
    deferred: list[DeferredPass] = field(default_factory=list)
    shuffle_replay: ShuffleReplay | None = None  # set when skipped rows shortened TRL's shuffle; read by the loss

    def model_token_counts(self) -> list[int] | None:
        """Each completion's length in the model's own tokens (tool output excluded); None: every token counts."""
        return None if self.tool_mask is None else [sum(mask) for mask in self.tool_mask]

    def defer(self, model, input_ids: torch.Tensor, logits_to_keep: int, batch_size: int | None) -> torch.Tensor:
        """Records a no-grad log-prob pass to run later on the rows to train; returns its placeholder."""
        placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
        self.deferred.append(DeferredPass(placeholder, model, batch_size))
        return placeholder

    def take_deferred(self, output: dict) -> dict[str, DeferredPass]:
        """Removes the deferred passes' placeholders from TRL's `output` dict; returns the pass of each key."""
        found = {}
        for key, value in list(output.items()):
            for deferred in self.deferred:
                if value is deferred.placeholder:
                    found[key] = deferred
                    del output[key]
        if len(found) != len(self.deferred):
            raise TRLSurfaceError("a deferred log-prob pass of GRPOTrainer did not end up in its output dict")
        return found
