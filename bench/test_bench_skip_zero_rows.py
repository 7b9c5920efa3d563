"""Skipping rows whose gradient is exactly zero (GFPOConfig.skip_zero_gradient_rows): the policy forward and
backward of one generation batch (plain GRPO, G=8) at 0%, 30% and 60% zero-variance groups, skip on vs off. The
time saved should track the skipped fraction. Random-init Qwen2-style model: tiny on CPU, ~0.5B dimensions on CUDA."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer.tiny import make_tokenizer  # noqa: E402

from bench_utils import ON_GPU, sync  # noqa: E402

G = 8
PROMPTS_PER_STEP = 10
# hidden, layers, heads, kv heads, intermediate, vocab, max completion length
MODEL = (896, 24, 14, 2, 4864, 151936, 256) if ON_GPU else (64, 2, 4, 2, 128, None, 24)
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)][:PROMPTS_PER_STEP]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = make_tokenizer()
    hidden, layers, heads, kv, inter, vocab, _ = MODEL
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("skip-model")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer, str(path)


@pytest.mark.parametrize("skip", [False, True], ids=["skip-off", "skip-on"])
@pytest.mark.parametrize("zero_fraction", [0.0, 0.3, 0.6])
def test_train_step_with_zero_variance_groups(benchmark, model_dir, tmp_path, zero_fraction, skip):
    tokenizer, path = model_dir
    constant = set(PROMPTS[: round(zero_fraction * PROMPTS_PER_STEP)])

    def reward(prompts, completions, **kwargs):  # constant groups: advantage exactly 0
        return [1.0 if p in constant else float(len(c) % 5) for p, c in zip(prompts, completions)]

    benchmark.group = f"policy forward+backward, {zero_fraction:.0%} zero-variance groups"
    args = GFPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=G * PROMPTS_PER_STEP, num_generations=G,
                      max_completion_length=MODEL[-1], report_to="none", use_cpu=not ON_GPU, bf16=ON_GPU,
                      save_strategy="no", loss_type="dapo", skip_zero_gradient_rows=skip)
    trainer = GFPOTrainer(model=path, reward_funcs=reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.accelerator.prepare(trainer.model)
    model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])

    def step():
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync()
        return loss

    loss = benchmark.pedantic(step, rounds=5, warmup_rounds=1)
    assert torch.isfinite(loss)
    benchmark.extra_info["rows_trained"] = int(inputs["completion_ids"].shape[0])
    benchmark.extra_info["rows_generated"] = G * PROMPTS_PER_STEP
