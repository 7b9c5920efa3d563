"""One GFPO training step (G=16 sampled, k=8 kept) with use_gfpo_kernels on and off: generation and scoring of a
generation batch, then the loss and its backward over the kept rows, with the split of a step into generation,
scoring and loss + backward in extra_info. Random-init Qwen2-style models: a tiny one
everywhere, and a ~0.5B one (Qwen2-0.5B dimensions) on CUDA."""

import time

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_study.demo import correctness_reward  # noqa: E402
from gfpo_trainer.tiny import make_tokenizer  # noqa: E402

from bench_utils import ON_GPU, sync  # noqa: E402

# name -> (hidden, layers, heads, kv heads, intermediate, vocab, prompts per step, max completion length)
MODELS = {"tiny": (64, 2, 4, 2, 128, None, 2, 16)}
if ON_GPU:
    MODELS["qwen2-0.5b-random"] = (896, 24, 14, 2, 4864, 151936, 8, 256)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    tokenizer = make_tokenizer()
    dirs = {}
    for name, (hidden, layers, heads, kv, inter, vocab, _, _) in MODELS.items():
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=vocab or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                             tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        path = tmp_path_factory.mktemp(name)
        Qwen2ForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[name] = str(path)
    return tokenizer, dirs


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "gfpo-kernels"])
@pytest.mark.parametrize("model", list(MODELS))
def test_gfpo_train_step(benchmark, model_dirs, tmp_path, model, use_kernels):
    tokenizer, dirs = model_dirs
    _, _, _, _, _, _, prompts_per_step, max_len = MODELS[model]
    benchmark.group = f"gfpo train step {model} G16 k8"
    args = GFPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=16 * prompts_per_step, num_generations=16,
        num_remains_in_group=8, group_filter="length", max_completion_length=max_len, report_to="none",
        use_cpu=not ON_GPU, bf16=ON_GPU, save_strategy="no", loss_type="dapo", use_gfpo_kernels=use_kernels,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = GFPOTrainer(model=dirs[model], reward_funcs=correctness_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    trainer.current_gradient_accumulation_steps = 1
    model_ = trainer.accelerator.prepare(trainer.model)
    model_.train()
    batch = [{"prompt": p} for p in prompts[:prompts_per_step] for _ in range(16)]

    def step():
        torch.manual_seed(0)
        inputs = trainer._generate_and_score_completions(batch)
        loss = trainer.compute_loss(model_, inputs)
        loss.backward()
        model_.zero_grad(set_to_none=True)
        sync()
        return loss

    loss = benchmark.pedantic(step, rounds=3, warmup_rounds=1)
    assert torch.isfinite(loss)
    benchmark.extra_info["kept_fraction"] = trainer._metrics["train"]["gfpo/kept_fraction"][-1]
    # the split of a step, from one more step synchronised at the phase boundaries (outside the timed rounds)
    generation, scoring, loss_backward = _step_split(trainer, model_, batch)
    benchmark.extra_info.update(generation_s=generation, scoring_s=scoring, loss_backward_s=loss_backward)
    assert min(generation, scoring, loss_backward) > 0


def _step_split(trainer, model, batch):
    """(generation, scoring, loss + backward) seconds of one step: scoring is everything in
    _generate_and_score_completions besides generation (rewards, filter, advantages, old/reference log-probs)."""
    phases = {}
    generate = trainer._generate

    def timed_generate(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        sync()
        phases["generation"] = time.perf_counter() - start
        return out

    trainer._generate = timed_generate
    try:
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        inputs = trainer._generate_and_score_completions(batch)
        sync()
        t1 = time.perf_counter()
        trainer.compute_loss(model, inputs).backward()
        model.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
    finally:
        del trainer._generate  # the class's method again
    return phases["generation"], t1 - t0 - phases["generation"], t2 - t1
