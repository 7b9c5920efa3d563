"""gfpo_stop_dropped_generations: generated tokens and generation wall time with the rule on and off, G=16 and
k=4 / k=8, for the length filter. The model is the demo's tiny LM after a short supervised warm-up, so its
completions end at varied lengths (as a trained policy's do); a random-init model rarely emits EOS at all.
Each case records the completion tokens generated per batch and the decode steps of the batch."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer.batch import GenerationBatch  # noqa: E402
from gfpo_study.demo import correctness_reward  # noqa: E402
from gfpo_trainer.tiny import warm_up_on_pair_sums  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402

from bench_utils import ON_GPU, sync  # noqa: E402

PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    tokenizer = make_tokenizer()
    device = "cuda" if ON_GPU else "cpu"
    model = make_tiny_model(tokenizer, hidden_size=64).to(device)
    warm_up_on_pair_sums(model, tokenizer, [(a, b) for a in range(10) for b in range(10)], 300 if ON_GPU else 150,
                         device)
    path = tmp_path_factory.mktemp("warm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.mark.parametrize("stop", [False, True], ids=["rule-off", "rule-on"])
@pytest.mark.parametrize("k", [4, 8])
def test_generation_with_early_stop(benchmark, warm_model, tmp_path, k, stop):
    model_dir, tokenizer = warm_model
    prompts_per_batch = 8
    benchmark.group = f"generation G16 k{k} (length filter)"
    args = GFPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16 * prompts_per_batch,
                      num_generations=16, num_remains_in_group=k, group_filter="length", max_completion_length=64,
                      report_to="none", use_cpu=not ON_GPU, bf16=False, save_strategy="no",
                      gfpo_stop_dropped_generations=stop)
    trainer = GFPOTrainer(model=model_dir, reward_funcs=correctness_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    trainer.model.train()
    prompt_ids, _, _ = trainer._tokenize_prompts([p for p in PROMPTS[:prompts_per_batch] for _ in range(16)])
    counts = {}

    def generate():
        torch.manual_seed(0)
        # the state _generate_and_score_completions makes for each generation batch, which the rule reports into
        trainer._gfpo_batch = GenerationBatch(filtering=True, skip_zero=False)
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, 16)
        sync()
        counts["tokens"] = sum(map(len, completion_ids))
        counts["steps"] = max(map(len, completion_ids))
        return completion_ids

    benchmark.pedantic(generate, rounds=5, warmup_rounds=1)
    benchmark.extra_info["generated_tokens"] = counts["tokens"]
    benchmark.extra_info["decode_steps"] = counts["steps"]
