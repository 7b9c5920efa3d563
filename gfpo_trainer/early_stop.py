"""Stop generating completions that the length filter is certain to drop.

With `group_filter="length"` the kept set is the k completions of a group with the fewest tokens (ties: lower
index). Once k completions of a group have produced EOS within the first s tokens, every completion of that
group still running will be longer than s tokens, so longer than all k of them: it will be dropped whatever it
goes on to say. `StopDroppedCompletions` forces EOS on those rows at the next step, so the batch (whose wall
time is set by its longest row) ends sooner.

Why the result cannot change: the kept rows finished before the rule touched their group, so their tokens are
already fixed; forcing EOS on other rows does not change the random numbers other rows draw (sampling draws
the same amount of randomness per row whatever its distribution: torch.multinomial with one sample takes one
exponential per vocabulary entry); ties among rows that finished at the same step are left to the filter.
A process sees only its own rows of a group that straddles processes: counting only those is conservative
(it stops less, never wrongly).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class StopDroppedCompletions(LogitsProcessor):
    """A logits processor for `generate`: forces EOS on the running rows of every group in which `k` rows have
    already ended. Rows are the local rows of one generation call, `first_row` the global index of row 0, and
    rows `[g * group_size, (g + 1) * group_size)` (global) form group g."""

    def __init__(self, eos_token_ids: list[int], group_size: int, k: int, first_row: int = 0):
        self.eos = torch.tensor(eos_token_ids)
        self.group_size = group_size
        self.k = k
        self.first_row = first_row
        self.prompt_length: int | None = None
        self.stopped: torch.Tensor | None = None  # rows this processor ended early

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
            self.stopped = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        eos = self.eos.to(input_ids.device)
        finished = torch.isin(generated, eos).any(dim=1)
        rows = self.first_row + torch.arange(input_ids.shape[0], device=input_ids.device)
        group = rows // self.group_size - self.first_row // self.group_size
        ended = torch.zeros(int(group.max()) + 1, dtype=torch.long, device=input_ids.device)
        ended.index_add_(0, group, finished.long())
        stop = ~finished & (ended[group] >= self.k)
        if stop.any():
            scores = scores.clone()
            scores[stop] = -float("inf")
            scores[stop, eos[0]] = 0.0
            self.stopped |= stop
        return scores
