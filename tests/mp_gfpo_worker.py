"""Worker of tests/test_trainer_multiprocess.py, run by torchrun with 2 CPU processes (gloo): for each scenario
given, a trainer of its own scores one global batch whose groups straddle the processes, dumps what each process
keeps, then trains. One launch runs every scenario the tests need: starting the two processes costs more than most
scenarios."""

import json
import os
import random
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from gfpo_test_utils import end_worker_process
from gfpo_trainer import GFPOConfig, GFPOTrainer
from gfpo_trainer._compat import batch_metric_names
from gfpo_trainer.tiny import make_tokenizer

PROMPTS = ["1+2=", "3*4=", "5-1=", "9+9=", "2*3=", "7-4="]


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


def constant_first_group(prompts, completions, **kwargs):
    """Every completion of PROMPTS[0] gets the same reward: a zero-variance group (advantage exactly 0)."""
    return [1.0 if p == PROMPTS[0] else r for p, r in zip(prompts, digit_reward(completions))]


def main(out_dir, model_dir, use_kernels, stop_dropped, random_filter=False, skip=None, rejected_in_loss=None):
    """rejected_in_loss: None, or "skip" (beta 0: the rejected rows counted, not trained) or "kl" (beta 0.04: the
    KL reaches them, trained at advantage 0): one batch's loss and gradients with loss_includes_rejected, and TRL's
    over every row; no training."""
    if rejected_in_loss is not None:
        skip = rejected_in_loss == "skip"
    args = GFPOConfig(
        output_dir=out_dir, per_device_train_batch_size=12, num_generations=8, num_remains_in_group=3,
        group_filter=None if random_filter else "length", max_completion_length=8, max_steps=2 if skip is None else 1, report_to="none", use_cpu=True, bf16=False,
        logging_steps=1, save_strategy="no", seed=0, loss_type="grpo", beta=0.04 if not skip else 0.0,
        use_gfpo_kernels=use_kernels, gfpo_stop_dropped_generations=stop_dropped,
        skip_zero_gradient_rows=bool(skip), learning_rate=1e-2, loss_includes_rejected=rejected_in_loss is not None,
    )
    filter_calls = []

    def random_scores(group_completions, group_rewards):
        """Non-deterministic on purpose: each process would draw different scores."""
        scores = [[rng.random() for _ in group] for group in group_completions]
        filter_calls.append(scores)
        return scores

    trainer = GFPOTrainer(model=model_dir, reward_funcs=digit_reward if skip is None else constant_first_group, args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                          processing_class=make_tokenizer(), group_filter_func=random_scores if random_filter else None)
    rank, P = trainer.accelerator.process_index, trainer.accelerator.num_processes
    rng = random.Random(1000 + rank)
    global_inputs = [{"prompt": p} for p in PROMPTS[:3] for _ in range(8)]  # 3 groups of 8 = 24 rows
    local = global_inputs[rank * 12 : (rank + 1) * 12]  # process 0: group 0 and half of group 1

    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        out = original(inputs, prompts, completions, completion_ids_list)
        seen["ids"] = gather_object([list(x) for x in completion_ids_list])
        seen["rewards"] = out.sum(dim=1).tolist()
        return out

    trainer._calculate_rewards = spy
    trainer.model.train()
    torch.manual_seed(rank)
    trl_outputs = []
    generate_and_score = GRPOTrainer._generate_and_score_completions

    def keeping_trls_output(self, inputs):
        output = generate_and_score(self, inputs)
        trl_outputs.append(dict(output))  # GFPO's post-processing replaces the dict's rows
        return output

    GRPOTrainer._generate_and_score_completions = keeping_trls_output
    try:
        output = trainer._generate_and_score_completions(local)
    finally:
        GRPOTrainer._generate_and_score_completions = generate_and_score
    if rejected_in_loss is not None:
        result = _loss_over_every_row(trainer, output, trl_outputs[0], model_dir, out_dir)
        result.update(num_rows=int(output["gfpo_real_row"].numel()), n_real=int(output["gfpo_real_row"].sum()),
                      stopped_early=trainer._metrics["train"].get("gfpo/stopped_early_fraction", [None])[-1],
                      all_ids=seen["ids"])
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        return
    real = output["gfpo_real_row"]
    mask = output["completion_mask"].bool()
    rows = [output["completion_ids"][i][mask[i]].tolist() for i in range(real.numel()) if real[i]]
    metrics = trainer._metrics["train"]
    result = dict(rank=rank, processes=P, num_rows=int(real.numel()), rows=rows,
                  advantages=output["advantages"][real].tolist(), all_ids=seen["ids"], all_rewards=seen["rewards"],
                  logp_rows=trainer.gfpo_logp_rows_seen, ref_logps=output["ref_per_token_logps"].tolist() if "ref_per_token_logps" in output else None,
                  stopped_early=metrics.get("gfpo/stopped_early_fraction", [None])[-1],
                  trl_metrics={name: metrics[name][-1] for name in batch_metric_names(trainer)},
                  filter_scores=filter_calls[:1])
    trainer._calculate_rewards = original
    trainer.train()  # TRL's loss gathers per-sequence metrics: unequal batch sizes would hang here
    result["train_steps"] = trainer.state.global_step
    result["parameters"] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).tolist()
    result["skipped"] = [h.get("gfpo/skipped_zero_gradient_fraction") for h in trainer.state.log_history if "loss" in h]
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _averaged_loss_and_grads(trainer, batch):
    """The loss and gradients of one micro-batch, averaged over the processes as DDP averages them."""
    import torch.distributed as dist

    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    flat = torch.cat([loss.detach().reshape(1)] + [p.grad.flatten() for p in trainer.model.parameters()
                                                    if p.grad is not None])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    return flat[0].item(), flat[1:].tolist()


def _loss_over_every_row(trainer, output, trl_output, model_dir, out_dir):
    """loss_includes_rejected: GFPO's loss and gradients on its trained rows, and TRL's GRPOTrainer's over every row
    of this process with GFPO's advantages (0 for the rejected rows), both averaged over the processes."""
    gfpo_loss, gfpo_grads = _averaged_loss_and_grads(trainer, output)  # first: TRL's trainer draws random numbers
    rank, n_local = trainer.accelerator.process_index, trl_output["completion_ids"].size(0)
    trl = GRPOTrainer(model=model_dir, reward_funcs=digit_reward, processing_class=make_tokenizer(),
                      train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                      args=GRPOConfig(**{k: getattr(trainer.args, k) for k in (
                          "per_device_train_batch_size", "num_generations", "max_completion_length", "report_to",
                          "use_cpu", "bf16", "seed", "loss_type", "beta")}, output_dir=f"{out_dir}/trl", max_steps=1))
    trl.model.train()
    reference = dict(trl_output, advantages=trainer._gfpo_batch.selection.advantages[rank * n_local:(rank + 1) * n_local])
    if trl.beta != 0.0:  # deferred by GFPO while TRL built the batch: TRL's pass, on every row
        ids = torch.cat([reference["prompt_ids"], reference["completion_ids"]], dim=1)
        mask = torch.cat([reference["prompt_mask"], reference["completion_mask"]], dim=1)
        with torch.no_grad():
            reference["ref_per_token_logps"], _, _ = trl._get_per_token_logps_and_entropies(
                trl.ref_model, ids, mask, reference["completion_ids"].size(1))
    trl_loss, trl_grads = _averaged_loss_and_grads(trl, reference)
    return dict(gfpo_loss=gfpo_loss, gfpo_grads=gfpo_grads, trl_loss=trl_loss, trl_grads=trl_grads,
                num_items_in_batch=int(output["num_items_in_batch"]))


if __name__ == "__main__":
    # arguments: out_dir model_dir, then one NAME:USE_KERNELS:STOP_DROPPED:VARIANT per scenario (results in out_dir/NAME)
    for spec in sys.argv[3:]:
        name, use_kernels, stop_dropped, variant = spec.split(":")
        os.makedirs(os.path.join(sys.argv[1], name), exist_ok=True)
        main(os.path.join(sys.argv[1], name), sys.argv[2], use_kernels == "1", stop_dropped == "1",
             variant == "random_filter", skip={"skip_on": True, "skip_off": False}.get(variant),
             rejected_in_loss={"rejected_skip": "skip", "rejected_kl": "kl"}.get(variant))
    end_worker_process()
