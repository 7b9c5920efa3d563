"""torchrun worker (gloo, CPU): a tiny Qwen2 under real DeepSpeed ZeRO-3 (`deepspeed.initialize`, every parameter
partitioned), the fused loss through the patched forward on a different batch per process, `engine.backward`
and one SGD step after clipping the gradient norm; writes the loss, the full head-weight gradient and the
parameters after the step, with the unsharded model's (the losses of every process's batch, their mean's gradient =
the DDP average, one plain torch clipped SGD step) for comparison.

argv: out_dir. Four engines in turn, written to <head>_<load>/rank<r>.pt: head "untied" or "tied" (lm_head.weight
is embed_tokens.weight); load "init", the model loaded by `from_pretrained` under a live ZeRO-3 config (so inside
`deepspeed.zero.Init`: partitioned when the fused forward is installed), or "plain", a model built outside it
(partitioned by `deepspeed.initialize` after the install)."""

import functools
import importlib
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import Qwen2ForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from gfpo_test_utils import end_worker_process
from gfpo_trainer.fused_head import install_fused_loss_forward
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer
from mp_fsdp2_worker import _loss, batch_for_rank  # the same batches and loss as the FSDP2 check

LR = 0.5
MAX_GRAD_NORM = 1.0  # TRL's default max_grad_norm: the clip by the global norm over the shards is compared too


def ds_config(world):
    return {
        "train_batch_size": 3 * world,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM,
        # threshold 0: the tiny model's parameters are all partitioned (by default small ones stay whole)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "model_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }


def run(model, rank, vocab_size):
    input_ids, extra = batch_for_rank(rank, vocab_size)
    loss, _, _ = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                       gfpo_loss_fn=functools.partial(_loss, **extra), gfpo_logits_to_keep=extra["target_ids"].size(1))
    return loss


def make_model(tokenizer, tied):
    """The tiny Qwen2, its LM head tied to the input embedding or not, the same weights on every call."""
    model = make_tiny_model(tokenizer, seed=0)
    if tied:  # the LM head's weight is embed_tokens' (as in Qwen2.5 0.5B-3B): the embedding's own hooks gather it
        model.config.tie_word_embeddings = True
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(model.config)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def main(out_dir):
    # DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce (deepspeed_shm_comm, with ninja) on the
    # first init, minutes on 2 cores; without it the communication is gloo's, which is all this test needs
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch is torch)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    config = ds_config(world)
    # what accelerate/transformers hold under a ZeRO-3 config: is_deepspeed_zero3_enabled() reads it
    hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841 (a weak reference is kept: it must stay alive)
    for head in ("untied", "tied"):
        expected = unsharded_expected(head == "tied", world)
        for load in ("init", "plain"):
            train_zero3(Path(out_dir, f"{head}_{load}"), load, head == "tied", config, expected)
            dist.barrier()


def unsharded_expected(tied, world):
    """The unsharded model on every process's batch: the losses, the mean's gradient (what data parallelism
    averages to) and the parameters after one clipped SGD step."""
    reference = make_model(make_tokenizer(), tied)
    install_fused_loss_forward(reference)
    losses = [run(reference, r, reference.config.vocab_size) for r in range(world)]
    torch.stack(losses).mean().backward()
    expected = {"losses": torch.stack(losses).detach(), "head_grad": reference.lm_head.weight.grad.clone()}
    torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    expected["params"] = {name: p.detach().clone() for name, p in reference.named_parameters()}
    return expected


def train_zero3(out_dir, load, tied, config, expected):
    rank, tokenizer = dist.get_rank(), make_tokenizer()
    out_dir.mkdir(exist_ok=True)
    if load == "init":
        # from_pretrained under a live ZeRO-3 HfDeepSpeedConfig builds the model inside deepspeed.zero.Init
        path = Path(out_dir, "model")
        if rank == 0:  # save_pretrained writes on the main process only
            make_model(tokenizer, tied).save_pretrained(path)
        dist.barrier()
        model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = make_model(tokenizer, tied)
    partitioned_at_install = model.lm_head.weight.numel() == 0
    install_fused_loss_forward(model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                           config=config)
    head = engine.module.lm_head.weight
    assert head.numel() == 0, "the LM head is not partitioned: the test would not exercise the ZeRO-3 gather"
    loss = run(engine, rank, model.config.vocab_size)
    engine.backward(loss)
    head_grad = deepspeed.utils.safe_get_full_grad(head).clone()
    engine.step()
    named = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(named.values())):
        params = {name: p.detach().clone() for name, p in named.items()}
    torch.save({"loss": loss.detach(), "head_grad": head_grad, "params": params, "expected": expected,
                "partitioned_at_install": partitioned_at_install}, Path(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
