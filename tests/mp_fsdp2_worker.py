"""torchrun worker (gloo, CPU): a tiny Qwen2 sharded with FSDP2 (`fully_shard`, the LM head a unit of its own so
its weight is a sharded DTensor in the root's forward), the fused loss through the patched forward; writes the
loss and the full head-weight gradient to head_alone<0|1>/rank<r>.pt for comparison with the unsharded model. Both
layouts in one launch (the head in the root unit: 0; a unit of its own: 1), each with a model of its own."""

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import gfpo_kernels
from gfpo_test_utils import end_worker_process
from gfpo_trainer.fused_head import install_fused_loss_forward
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer


def batch_for_rank(rank, vocab_size, completion=4):
    gen = torch.Generator().manual_seed(10 + rank)  # a different batch on every process
    input_ids = torch.randint(0, vocab_size, (3, 9), generator=gen)
    extra = {"target_ids": input_ids[:, -completion:], "mask": torch.ones(3, completion),
             "advantages": torch.randn(3, generator=gen)}
    return input_ids, extra


def _loss(hidden, weight, bias, **extra):
    return gfpo_kernels.fused_linear_grpo_loss(hidden, weight, extra["target_ids"], extra["mask"],
                                               extra["advantages"], bias=bias, loss_type="grpo")


def run(model, rank):
    input_ids, extra = batch_for_rank(rank, model.config.vocab_size)
    loss, _, _ = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                    gfpo_loss_fn=functools.partial(_loss, **extra), gfpo_logits_to_keep=extra["target_ids"].size(1))
    return loss


def main(out_dir, head_alone):
    rank = dist.get_rank()
    world = dist.get_world_size()
    model = make_tiny_model(make_tokenizer(), seed=0)
    install_fused_loss_forward(model)
    # the unsharded model on every process's batch: FSDP2 averages the gradients over processes
    losses = [run(model, r) for r in range(world)]
    torch.stack(losses).mean().backward()
    expected = {"losses": torch.stack(losses).detach(), "head_grad": model.lm_head.weight.grad.clone()}
    model.zero_grad(set_to_none=True)
    for layer in model.model.layers:
        fully_shard(layer)
    if head_alone == "1":
        fully_shard(model.lm_head)
    fully_shard(model)
    loss = run(model, rank)
    loss.backward()
    grad = model.lm_head.weight.grad.full_tensor()
    folder = Path(out_dir, f"head_alone{head_alone}")
    folder.mkdir(exist_ok=True)
    torch.save({"loss": loss.detach(), "head_grad": grad, "expected": expected}, folder / f"rank{rank}.pt")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for head_alone in ("0", "1"):
        main(sys.argv[1], head_alone)
    end_worker_process()
