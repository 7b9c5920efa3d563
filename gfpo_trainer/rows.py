"""Rows: the kept rows of the global batch, shared out over processes, padded, and weighted in the loss.

Every process takes an equal, steps_per_generation-divisible share of the kept rows, in global order: TRL's
`split_tensor_dict` would drop a remainder, and its loss gathers per-sequence metrics across processes and hangs
on unequal sizes. Missing rows are copies of a kept row with an all-zero completion mask and advantage 0: they
add nothing to the loss, whose per-sequence normalisation is corrected for them by `weight_loss`.
"""

from __future__ import annotations

import math

import torch

from ._compat import ROW_KEYS

# Loss types whose value is a mean over the sequences of a micro-batch (or divides by their number)
PER_SEQUENCE_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
REAL_ROW_KEY = "gfpo_real_row"


def take_kept_rows(trainer, output: dict, keep: torch.Tensor, advantages: torch.Tensor) -> int:
    """Replaces the per-row tensors of `output` (this process's rows) by this process's share of the kept rows of
    the global batch, padded; returns how many of them are real (not padding)."""
    P, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
    kept = keep.nonzero().squeeze(1)
    spg = trainer.args.steps_per_generation
    share = math.ceil(math.ceil(kept.numel() / P) / spg) * spg
    mine = kept[rank * share : (rank + 1) * share]
    n_real = mine.numel()
    # padding rows copy a kept row (a valid forward) and are masked out below
    rows = torch.cat([mine, kept[:1].expand(share - n_real)]) if kept.numel() else mine
    # every process holds the global advantages already; the other row tensors are gathered
    output["advantages"] = advantages[rows]
    row_keys = [k for k in output if k in ROW_KEYS and k != "advantages" and isinstance(output[k], torch.Tensor)]
    for key in row_keys:
        output[key] = take_global_rows(trainer, key, output[key], rows)
    real = torch.arange(share, device=rows.device) < n_real
    output["completion_mask"] = output["completion_mask"] * real.unsqueeze(1).to(output["completion_mask"].dtype)
    output["advantages"] = torch.where(real, output["advantages"], 0.0)
    output[REAL_ROW_KEY] = real
    # Drop the padding columns past the longest kept completion: less work in the loss, and the batch no
    # longer depends on how long the dropped completions ran (see gfpo_stop_dropped_generations).
    T = output["completion_ids"].size(1)
    width = max(1, int(output["completion_mask"].sum(dim=1).max())) if share else T
    for key in row_keys:
        if not ROW_KEYS[key][1] and output[key].dim() > 1 and output[key].size(1) == T:
            output[key] = output[key][:, :width]
    return n_real


def take_global_rows(trainer, key: str, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor's rows at global indices `rows` (local rows of every process, in process order).

    Only the requested rows travel (an all-to-all), so a process receives its own rows, not the global batch;
    tensors of different widths are padded to the widest process's width first (on the left for prompts)."""
    if trainer.accelerator.num_processes == 1:
        return tensor[rows]
    pad_value, pad_left = ROW_KEYS[key]
    if pad_value is None:
        pad_value = trainer._tokenizer.pad_token_id
    plan = getattr(trainer, "_gfpo_row_exchange_plan", None)
    if plan is None or plan.rows is not rows:  # `rows` is the same object for every key of one batch
        plan = RowExchangePlan(rows, tensor.size(0))
        trainer._gfpo_row_exchange_plan = plan
    return plan.exchange(tensor, pad_value, pad_left)


class RowExchangePlan:
    """Who sends which local rows to whom, so that this process receives the global rows `rows`; built once per
    batch from two tiny collectives (the local row counts, the requested indices), reused for every tensor."""

    def __init__(self, rows: torch.Tensor, num_local_rows: int):
        import torch.distributed as dist

        self.rows = rows
        world = dist.get_world_size()
        device = rows.device
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([num_local_rows], dtype=torch.long, device=device))
        ends = torch.cat(counts).cumsum(0)
        if rows.numel() and int(rows.max()) >= int(ends[-1]):
            raise ValueError(f"rows asks for global row {int(rows.max())}; the processes hold {int(ends[-1])} rows")
        owner = torch.searchsorted(ends, rows.long(), right=True)
        local = rows.long() - (ends - torch.cat(counts))[owner]
        # requests grouped by owning process; `order` puts the received rows back in the order of `rows`
        self.order = torch.argsort(owner, stable=True)
        self.recv_splits = torch.bincount(owner, minlength=world).tolist()
        send_counts = torch.empty(world, dtype=torch.long, device=device)
        dist.all_to_all_single(send_counts, torch.tensor(self.recv_splits, dtype=torch.long, device=device))
        self.send_splits = send_counts.tolist()
        self.send_index = torch.empty(sum(self.send_splits), dtype=torch.long, device=device)
        dist.all_to_all_single(self.send_index, local[self.order].contiguous(), output_split_sizes=self.send_splits,
                               input_split_sizes=self.recv_splits)

    def exchange(self, tensor: torch.Tensor, pad_value, pad_left: bool) -> torch.Tensor:
        """This process's rows of `tensor` (its local rows on every process), padded to the widest width."""
        import torch.distributed as dist

        if tensor.dim() > 1:
            width = torch.tensor([tensor.size(1)], dtype=torch.long, device=tensor.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            tensor = pad_to_width(tensor, int(width), pad_value, pad_left)
        dtype = tensor.dtype
        if dtype == torch.bool:  # not every backend reduces or moves bool: move bytes
            tensor = tensor.to(torch.uint8)
        received = tensor.new_empty((len(self.rows),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(received, tensor[self.send_index].contiguous(), output_split_sizes=self.recv_splits,
                               input_split_sizes=self.send_splits)
        out = torch.empty_like(received)
        out[self.order] = received
        return out.to(dtype)


def pad_to_width(tensor: torch.Tensor, width: int, pad_value, pad_left: bool) -> torch.Tensor:
    """`tensor` padded along dim 1 to `width` with `pad_value`, on the left or the right."""
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    pad = tensor.new_full((tensor.size(0), missing) + tuple(tensor.shape[2:]), pad_value)
    return torch.cat([pad, tensor] if pad_left else [tensor, pad], dim=1)


def weight_loss(loss: torch.Tensor, inputs: dict, loss_type: str) -> torch.Tensor:
    """The micro-batch loss with padding rows not counted by the per-sequence losses."""
    real = inputs.get(REAL_ROW_KEY)
    if real is not None and loss_type in PER_SEQUENCE_LOSSES:
        # these losses average over (or divide by) the micro-batch's rows: count only the real ones
        n_real = int(real.sum())
        if 0 < n_real < real.numel():
            loss = loss * (real.numel() / n_real)
    return loss
