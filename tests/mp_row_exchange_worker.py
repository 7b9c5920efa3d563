"""torchrun worker (gloo, CPU): take_global_rows' all-to-all against the all-gather it replaces, on random row
requests (padding duplicates, empty shares, different widths and dtypes); writes what it saw to rank<r>.json."""

import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from gfpo_test_utils import end_worker_process
from gfpo_trainer import rows as rows_module

PAD_ID = 7


def all_gather_reference(tensor, rows, pad_value, pad_left):
    """The plain exchange, the oracle: pad every process's tensor to the widest width, all-gather, take the rows."""
    world = dist.get_world_size()
    if tensor.dim() > 1:
        width = torch.tensor([tensor.size(1)])
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        tensor = rows_module.pad_to_width(tensor, int(width), pad_value, pad_left)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([tensor.size(0)]))
    most = int(max(sizes))  # gloo gathers equal shapes: pad the rows too, then drop them
    padded = torch.cat([tensor, tensor.new_zeros((most - tensor.size(0),) + tuple(tensor.shape[1:]))])
    parts = [tensor.new_empty(padded.shape) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)])[rows]


def main(out_dir):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(num_processes=world),
                                    _tokenizer=types.SimpleNamespace(pad_token_id=PAD_ID))
    received_bytes = []
    real_all_to_all = dist.all_to_all_single

    def counting_all_to_all(output, input, *args, **kwargs):
        received_bytes.append(output.numel() * output.element_size())
        return real_all_to_all(output, input, *args, **kwargs)

    dist.all_to_all_single = counting_all_to_all
    cases = []
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)  # same on every process: shared sizes, then per-rank data
        n_local = torch.randint(1, 6, (world,), generator=gen)
        total = int(n_local.sum())
        widths = torch.randint(1, 9, (world,), generator=gen)
        shares = torch.randint(0, 5, (world,), generator=gen)
        if seed == 0:
            shares[-1] = 0  # an empty share
        all_rows = [torch.randint(0, total, (int(s),), generator=gen) for s in shares]
        my_rows = all_rows[rank]
        if my_rows.numel():
            my_rows = torch.cat([my_rows, my_rows[:1].expand(2)])  # padding duplicates
        data_gen = torch.Generator().manual_seed(100 * seed + rank)
        n, w = int(n_local[rank]), int(widths[rank])
        batch = {
            "prompt_ids": torch.randint(0, 50, (n, w), generator=data_gen),
            "completion_mask": torch.randint(0, 2, (n, w), generator=data_gen).bool(),
            "old_per_token_logps": torch.randn(n, w, generator=data_gen, dtype=torch.float64).float(),
            "importance_sampling_ratio": torch.rand(n, generator=data_gen).to(torch.bfloat16),
        }
        for key, tensor in batch.items():
            pad_value, pad_left = rows_module.ROW_KEYS[key]
            expected = all_gather_reference(tensor, my_rows, PAD_ID if pad_value is None else pad_value, pad_left)
            received_bytes.clear()
            got = rows_module.take_global_rows(trainer, key, tensor, my_rows)
            cases.append({"seed": seed, "key": key, "equal": bool(torch.equal(got, expected)),
                          "dtype_kept": got.dtype == tensor.dtype, "shape": list(got.shape),
                          "rows": my_rows.numel(), "total_rows": total,
                          # the last all-to-all moved the rows; the plan's few index bytes came once per batch
                          "row_bytes": received_bytes[-1], "row_size": expected[:1].numel() * expected.element_size()
                          if expected.dim() > 1 else expected.element_size()})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(cases))


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
