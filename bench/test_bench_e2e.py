"""Whole training steps on realistic lengths: TRL's GRPOTrainer with G=8 against GFPOTrainer with G=16,
k=8, with every saving of this package off, with its defaults and use_gfpo_kernels=True, and with the
token-efficiency filter. The arms, the split of a step and the counts: bench/e2e_driver.py; the model, prompts,
reward and EOS offset: bench/e2e_inputs.py. Each case times its arm's steps one after another (a dedicated GPU);
on a machine shared with other jobs, `python bench/e2e_driver.py run` steps the arms in turn.

Sizes: cpu-small on CPU (CI runs it with --benchmark-disable: one step per arm, checked below), Qwen2-0.5B (random
weights, bf16, 16 prompts, completions up to 1024 tokens) on CUDA. GFPO_E2E_SIZE picks another, GFPO_E2E_ROUNDS sets
the timed steps (default 3 on CUDA, 5 on CPU, after one warm-up step), GFPO_E2E_ARMS (space-separated) the arms, of
e2e_driver.ARMS or ARM/VARIANT (e2e_driver.VARIANTS), and of e2e_driver.VLLM_ARMS.

The vLLM arms (test_e2e_step_vllm: TRL's colocate mode) skip where vLLM is not installed. Their size: GFPO_E2E_SIZE
on CUDA, cpu-small-vllm on CPU (cpu-small's head dimension, 16, is one vLLM's CPU attention lacks), or
GFPO_E2E_VLLM_SIZE. The vLLM CI step (scripts/test_vllm_cpu.sh) runs them with --benchmark-disable: one step each."""

import copy
import gc
import os

import pytest
import torch

pytest.importorskip("trl")

from gfpo_trainer.tiny import make_tokenizer  # noqa: E402

from bench_utils import DEVICE, ON_GPU  # noqa: E402
from e2e_driver import (ARMS, CPU_THREADS, VLLM_ARMS, StepDriver, make_trainer, prepare_vllm, saved_model,  # noqa: E402
                        summary)
from e2e_inputs import SIZES, eos_offset, make_model, make_prompts  # noqa: E402

SIZE = os.environ.get("GFPO_E2E_SIZE", "qwen2-0.5b" if ON_GPU else "cpu-small")
VLLM_SIZE = os.environ.get("GFPO_E2E_VLLM_SIZE", SIZE if ON_GPU else "cpu-small-vllm")
ROUNDS = int(os.environ.get("GFPO_E2E_ROUNDS", 3 if ON_GPU else 5))
_ARMS = os.environ.get("GFPO_E2E_ARMS", "").split()
CASES = [arm for arm in _ARMS if arm.partition("/")[0] in ARMS] if _ARMS else list(ARMS)
VLLM_CASES = [arm for arm in _ARMS if arm in VLLM_ARMS] if _ARMS else list(VLLM_ARMS)
if set(_ARMS) - set(CASES) - set(VLLM_CASES):
    raise ValueError(f"GFPO_E2E_ARMS names unknown arms {sorted(set(_ARMS) - set(CASES) - set(VLLM_CASES))}: "
                     f"of {list(ARMS)} (or ARM/VARIANT) and {list(VLLM_ARMS)}")
# TRL builds its colocated engine with max_num_batched_tokens=4096 (trl/generation/vllm_generation.py)
TRL_ENGINE_TOKEN_BUDGET = 4096


@pytest.fixture(scope="module")
def template():
    threads = torch.get_num_threads()
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    tokenizer = make_tokenizer()
    yield tokenizer, make_model(SIZES[SIZE], tokenizer, device=DEVICE)
    torch.set_num_threads(threads)


def _benchmark_steps(benchmark, group: str, arm: str, size_name: str, model, tokenizer, tmp_path) -> StepDriver:
    """Times ROUNDS training steps of `arm` (after one warm-up step) on a copy of `model`, puts their summary into
    the benchmark's extra_info, and returns the driver with its records (its trainer released)."""
    size = SIZES[size_name]
    benchmark.group = f"{group} {size_name}"
    driver = StepDriver(make_trainer(arm, size_name, copy.deepcopy(model), tokenizer, str(tmp_path)))
    try:
        benchmark.pedantic(driver.step, rounds=ROUNDS, warmup_rounds=1)
    finally:
        driver.close()
    warmup = len(driver.records) - ROUNDS if not benchmark.disabled else 0
    info = summary(driver, warmup, size.max_completion_length)
    benchmark.extra_info.update(info, size=size_name, eos_offset=eos_offset(size), warmup_rounds=warmup,
                                interleaved=False)
    driver.trainer = None
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
    return driver


@pytest.mark.parametrize("arm", CASES)
def test_e2e_step(benchmark, template, tmp_path, arm):
    tokenizer, model = template
    size = SIZES[SIZE]
    record = _benchmark_steps(benchmark, "e2e step", arm, SIZE, model, tokenizer, tmp_path).records[-1]

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


@pytest.fixture(scope="module")
def vllm_template(tmp_path_factory):
    """The vLLM arms' model, saved to disk (TRL's colocate engine loads it from there), and the tokenizer."""
    pytest.importorskip("vllm", reason="the vLLM arms need vLLM (on a CPU: scripts/test_vllm_cpu.sh)")
    prepare_vllm()
    threads = torch.get_num_threads()
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    tokenizer = make_tokenizer()
    model = make_model(SIZES[VLLM_SIZE], tokenizer, device=DEVICE)
    yield tokenizer, saved_model(model, tokenizer, str(tmp_path_factory.mktemp("e2e-vllm-model")))
    torch.set_num_threads(threads)  # (vLLM's CPU worker makes this a no-op once an engine exists: harmless)


@pytest.mark.parametrize("arm", VLLM_CASES)
def test_e2e_step_vllm(benchmark, vllm_template, tmp_path, arm):
    tokenizer, model = vllm_template
    size = SIZES[VLLM_SIZE]
    driver = _benchmark_steps(benchmark, "e2e step vllm", arm, VLLM_SIZE, model, tokenizer, tmp_path)
    record, lengths, stopped = driver.records[-1], driver.lengths[-1], driver.stopped[-1]

    # the counts mean what they say (the vLLM CI step runs this at one step per arm)
    spec = VLLM_ARMS[arm]
    P, G, L, k = size.prompts_per_step, spec["num_generations"], size.max_completion_length, 8
    assert record["rows_generated"] == record["requests"] == P * G  # one request per completion
    assert record["tokens_generated"] == sum(lengths) and max(lengths) == record["decode_steps"] <= L
    # an engine step adds at most one token to a request; when every prompt fits the first step's token budget,
    # every request starts there and the engine runs exactly as many steps as the longest completion has tokens
    assert record["engine_steps"] >= record["decode_steps"]
    prompt_tokens = sum(len(row["prompt"]) for row in make_prompts(size)) * G  # one token per character
    if prompt_tokens <= TRL_ENGINE_TOKEN_BUDGET:
        assert record["engine_steps"] == record["decode_steps"]
    assert record["weight_sync"] > 0 and 0 < record["engine"] <= record["generation"]
    if spec["trainer"] == "gfpo":  # the trainer's own counts agree with the driver's
        assert record["gfpo/generated_tokens"] == record["tokens_generated"]
        assert record["gfpo/vllm_engine_steps"] == record["engine_steps"]
    if not spec.get("gfpo_stop_dropped_generations", spec["trainer"] == "gfpo"):
        assert record["requests_aborted"] == 0 and stopped is None
        return
    # the early-stop rule: it aborted exactly the rows it reports stopped, each in a group where k completions had
    # ended, holding at least as many tokens as the k-th shortest of them, and none of them is kept
    assert record["requests_aborted"] == sum(stopped) > 0
    assert record["gfpo/stopped_early_fraction"] == pytest.approx(sum(stopped) / (P * G))
    for g in range(P):
        rows = range(g * G, (g + 1) * G)
        ended = sorted(lengths[i] for i in rows if not stopped[i])
        assert all(lengths[i] >= ended[k - 1] for i in rows if stopped[i]) and len(ended) >= k
