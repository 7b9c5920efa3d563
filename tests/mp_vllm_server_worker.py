"""Worker of tests/test_vllm_server.py, run by torchrun with 2 CPU processes (gloo): GFPOTrainer in vLLM server mode
scores one global batch of 3 groups of 16 (group 1 straddles the processes) with the early-stop rule on, and dumps
what each process generated, was told was cut, and kept.

Only the main process talks to the server. TRL's NCCL weight push is replaced as in test_vllm_server.py (it needs
CUDA; at global step 0 the server's weights are the policy's)."""

import json
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from trl.generation.vllm_client import VLLMClient

import gfpo_trainer.generation_paths as generation_paths
from gfpo_test_utils import end_worker_process
from gfpo_trainer import GFPOConfig, GFPOTrainer
from gfpo_trainer.tiny import make_tokenizer

G, K = 16, 4
PROMPTS = ("3+4=", "2+5=", "6+1=")


def length_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


class RecordingGeneration(generation_paths.ServerGroupGeneration):
    """The main process's stand-in for VLLMClient.generate, kept for its `stopped` (every row of the batch)."""

    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordingGeneration.made.append(self)


def main(out_dir, model_dir, url):
    VLLMClient.init_communicator = lambda self, device=0: None
    VLLMClient.update_named_params = lambda self, metadata, named_params: None
    generation_paths.ServerGroupGeneration = RecordingGeneration
    args = GFPOConfig(
        output_dir=out_dir, per_device_train_batch_size=24, num_generations=G, num_remains_in_group=K,
        group_filter="length", max_completion_length=24, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", seed=0, loss_type="grpo", max_steps=1, disable_tqdm=True,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30,
        skip_zero_gradient_rows=False,  # every kept row stays in the batch (groups of equal rewards included)
    )
    trainer = GFPOTrainer(model=model_dir, reward_funcs=length_reward, args=args, processing_class=make_tokenizer(),
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    rank = trainer.accelerator.process_index
    global_inputs = [{"prompt": p} for p in PROMPTS for _ in range(G)]
    local = global_inputs[rank * 24 : (rank + 1) * 24]  # process 0: group 0 and half of group 1
    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        seen["ids"] = [list(x) for x in completion_ids_list]
        return original(inputs, prompts, completions, completion_ids_list)

    trainer._calculate_rewards = spy
    trainer.model.train()
    torch.manual_seed(7)
    output = trainer._generate_and_score_completions(local)
    real, mask = output["gfpo_real_row"], output["completion_mask"].bool()
    result = dict(
        local_ids=seen["ids"], all_ids=gather_object(seen["ids"]), stopped=trainer._gfpo_batch.stopped_rows.tolist(),
        main_stopped=RecordingGeneration.made[-1].stopped if rank == 0 else None,
        kept=[output["completion_ids"][i][mask[i]].tolist() for i in range(real.numel()) if real[i]],
    )
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    end_worker_process()
