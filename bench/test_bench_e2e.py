"""Whole training steps on realistic lengths (issue 26): TRL's GRPOTrainer with G=8 against GFPOTrainer with G=16,
k=8, with every saving of this package off, with its defaults and use_gfpo_kernels=True, and with the
token-efficiency filter. The arms, the split of a step and the counts: bench/e2e_driver.py; the model, prompts,
reward and EOS offset: bench/e2e_inputs.py. Each case times its arm's steps one after another (a dedicated GPU);
on a machine shared with other jobs, `python bench/e2e_driver.py run` steps the arms in turn.

Sizes: cpu-small on CPU (CI runs it with --benchmark-disable: one step per arm, checked below), Qwen2-0.5B (random
weights, bf16, 16 prompts, completions up to 1024 tokens) on CUDA. GFPO_E2E_SIZE picks another, GFPO_E2E_ROUNDS sets
the timed steps (default 3 on CUDA, 5 on CPU, after one warm-up step), GFPO_E2E_ARMS (space-separated) the arms, of
e2e_driver.ARMS or ARM/VARIANT (e2e_driver.VARIANTS)."""

import copy
import gc
import os

import pytest
import torch

pytest.importorskip("trl")

from gfpo_trainer.tiny import make_tokenizer  # noqa: E402

from bench_utils import DEVICE, ON_GPU  # noqa: E402
from e2e_driver import ARMS, CPU_THREADS, StepDriver, make_trainer, summary  # noqa: E402
from e2e_inputs import SIZES, eos_offset, make_model, make_prompts  # noqa: E402

SIZE = os.environ.get("GFPO_E2E_SIZE", "qwen2-0.5b" if ON_GPU else "cpu-small")
ROUNDS = int(os.environ.get("GFPO_E2E_ROUNDS", 3 if ON_GPU else 5))
CASES = os.environ.get("GFPO_E2E_ARMS", "").split() or list(ARMS)


@pytest.fixture(scope="module")
def template():
    threads = torch.get_num_threads()
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    tokenizer = make_tokenizer()
    yield tokenizer, make_model(SIZES[SIZE], tokenizer, device=DEVICE)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arm", CASES)
def test_e2e_step(benchmark, template, tmp_path, arm):
    tokenizer, model = template
    size = SIZES[SIZE]
    benchmark.group = f"e2e step {SIZE}"
    driver = StepDriver(make_trainer(arm, SIZE, copy.deepcopy(model), tokenizer, str(tmp_path)))
    try:
        benchmark.pedantic(driver.step, rounds=ROUNDS, warmup_rounds=1)
    finally:
        driver.close()
    warmup = len(driver.records) - ROUNDS if not benchmark.disabled else 0
    info = summary(driver, warmup, size.max_completion_length)
    benchmark.extra_info.update(info, size=SIZE, eos_offset=eos_offset(size), warmup_rounds=warmup, interleaved=False)
    record = driver.records[-1]
    driver.trainer = None
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()

    # the counts mean what they say (CI runs this at one step per arm)
    base = arm.partition("/")[0]
    P, G, L = size.prompts_per_step, ARMS[base]["num_generations"], size.max_completion_length
    assert record["rows_generated"] == P * G
    assert 1 <= record["decode_steps"] <= L
    assert record["tokens_generated"] <= record["generated_row_steps"] == P * G * record["decode_steps"]
    prompt_width = max(len(row["prompt"]) for row in make_prompts(size))  # one token per character
    full_width_tokens = record["rows_trained"] * (prompt_width + record["decode_steps"])
    if base in ("grpo-G8", "gfpo-G16-k8-no-savings"):  # every row (every kept row) at the generated width
        assert record["real_rows_trained"] == record["rows_trained"] == P * 8
        assert record["train_tokens"] == full_width_tokens
    else:  # kept rows of advantage 0 skipped, and the batch cropped to the longest trained completion
        assert record["real_rows_trained"] <= P * 8
        assert record["train_tokens"] <= full_width_tokens
    assert record["pass_rows"] == 0  # beta = 0 and steps_per_generation = gradient_accumulation_steps
    if base == "gfpo-G16-k8":  # the early-stop rule is on
        assert "gfpo/stopped_early_fraction" in record
