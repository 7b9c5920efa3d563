"""Worker of tests/test_vllm.py's two-process test, run by torchrun with 2 CPU processes (gloo): each process
generates with its own colocated vLLM engine (TRL's external launcher, tensor_parallel_size=1), on a global batch
whose groups straddle the processes, with the early-stop rule off and then on; dumps what each run generated,
stopped and kept, and trains one step of the second run (its next generation syncs the weights)."""

import json
import os
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset

from gfpo_test_utils import end_worker_process, run_vllm_engines_eagerly
from gfpo_trainer import GFPOConfig, GFPOTrainer
from gfpo_trainer.tiny import make_tokenizer
from gfpo_trainer.vllm_cpu import keep_linear_weights

G, K = 8, 3
PROMPTS = ["3+4=", "2+5=", "6+1="]


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


def run(out_dir, model_dir, stop):
    args = GFPOConfig(
        output_dir=out_dir, per_device_train_batch_size=12, num_generations=G, num_remains_in_group=K,
        group_filter="length", max_completion_length=24, max_steps=1, report_to="none", use_cpu=True, bf16=False,
        logging_steps=1, save_strategy="no", seed=0, loss_type="grpo", gfpo_stop_dropped_generations=stop,
        skip_zero_gradient_rows=False, learning_rate=1e-2, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_max_model_length=128,
    )
    trainer = GFPOTrainer(model=model_dir, reward_funcs=digit_reward, args=args, processing_class=make_tokenizer(),
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    rank = trainer.accelerator.process_index
    global_inputs = [{"prompt": p} for p in PROMPTS for _ in range(G)]  # 3 groups of 8 = 24 rows
    local = global_inputs[rank * 12 : (rank + 1) * 12]  # process 0: group 0 and half of group 1
    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        out = original(inputs, prompts, completions, completion_ids_list)
        seen["ids"] = gather_object([list(x) for x in completion_ids_list])
        stopped = trainer._gfpo_batch.stopped_rows
        seen["stopped"] = gather_object(stopped.tolist() if stopped is not None else [False] * len(completion_ids_list))
        seen["rewards"] = out.sum(dim=1).tolist()
        return out

    trainer._calculate_rewards = spy
    trainer.model.train()
    torch.manual_seed(100 + rank)
    output = trainer._generate_and_score_completions(local)
    real = output["gfpo_real_row"]
    mask = output["completion_mask"].bool()
    rows = [output["completion_ids"][i][mask[i]].tolist() for i in range(real.numel()) if real[i]]
    result = dict(rank=rank, rows=rows, advantages=output["advantages"][real].tolist(), all_ids=seen["ids"],
                  all_stopped=seen["stopped"], all_rewards=seen["rewards"])
    trainer._calculate_rewards = original
    if stop:
        trainer.train()  # TRL's loss gathers per-sequence metrics: unequal batch sizes would hang here
        result["train_steps"] = trainer.state.global_step
    return result


def main(out_dir, model_dir):
    keep_linear_weights()
    with run_vllm_engines_eagerly():  # as in tests/test_vllm.py
        results = {"off": run(out_dir, model_dir, stop=False), "on": run(out_dir, model_dir, stop=True)}
    with open(os.path.join(out_dir, f"rank{results['on']['rank']}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_worker_process()
