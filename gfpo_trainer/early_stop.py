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
    rows `[g * group_size, (g + 1) * group_size)` (global) form group g.

    It must see every decoding step (it keeps which rows have ended from the last token of each), and it never reads
    a value back to the host: a step costs a few small kernels and one pass over the scores, no synchronisation."""

    def __init__(self, eos_token_ids: list[int], group_size: int, k: int, first_row: int = 0):
        self.eos = torch.tensor(eos_token_ids)
        self.group_size = group_size
        self.k = k
        self.first_row = first_row
        self.prompt_length: int | None = None
        self.stopped: torch.Tensor | None = None  # rows this processor ended early

    def _start(self, input_ids: torch.LongTensor) -> None:
        rows, device = input_ids.shape[0], input_ids.device
        self.prompt_length = self._seen_length = input_ids.shape[1]
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self._ended = torch.zeros(rows, dtype=torch.bool, device=device)
        self._eos = self.eos.to(device)
        first_group = self.first_row // self.group_size
        self._group = (self.first_row + torch.arange(rows, device=device)) // self.group_size - first_group
        self._num_groups = (self.first_row + rows - 1) // self.group_size - first_group + 1  # host arithmetic

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self._start(input_ids)
        if input_ids.shape[1] == self.prompt_length:
            return scores
        if input_ids.shape[1] != self._seen_length + 1:
            raise RuntimeError(f"StopDroppedCompletions saw {input_ids.shape[1] - self._seen_length} new tokens at "
                               "once; it must be called at every decoding step")
        self._seen_length = input_ids.shape[1]
        self._ended |= torch.isin(input_ids[:, -1], self._eos)
        ended = torch.zeros(self._num_groups, dtype=torch.long, device=input_ids.device)
        ended.index_add_(0, self._group, self._ended.long())
        stop = ~self._ended & (ended[self._group] >= self.k)
        self.stopped |= stop
        # a stopped row's only choice is the first EOS token (written without asking whether any row stops)
        scores = scores.masked_fill(stop.unsqueeze(1), -float("inf"))
        eos = self._eos[:1]
        scores[:, eos] = torch.where(stop.unsqueeze(1), 0.0, scores[:, eos])
        return scores
