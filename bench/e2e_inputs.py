"""Realistic inputs for the end-to-end training-step benchmark (bench/test_bench_e2e.py): a random-weight
Qwen2 whose completions end at long-tailed lengths, prompts, and a 0/1 reward that leaves about a third of the groups
with equal rewards (advantage 0), as reported for math RL.

Lengths. A random-weight model almost never samples EOS: its logits are nearly flat over the vocabulary. The
benchmark adds a constant offset b to the EOS logit during generation (transformers' SequenceBiasLogitsProcessor,
through `generation_kwargs={"sequence_bias": {(eos,): b}}`; the training forward sees the model's own logits, as
with any sampling-time logits processor). With TRL's default pure sampling (temperature 1, top_k 0, top_p 1) the EOS
probability of step t is h_t(b) = sigmoid(d_t + b), d_t = z_eos - logsumexp(z_other), and d_t barely moves with the
position (std ~0.2 over steps and rows), so lengths are close to geometric. b is set so that the median length is a
quarter of max_completion_length; a geometric law then leaves (1/2)^4 = 6.25% of the completions truncated.

Calibration (`python bench/e2e_inputs.py SIZE`), how EOS_OFFSET below was found: sample completions of the
benchmark's prompts with EOS suppressed, recording d_t at every step. Conditioned on not sampling EOS, the other
tokens are drawn exactly as with any offset (the offset moves the EOS logit only), so these trajectories give the
survival curve of every b at once: P(length > n) = mean over rows of prod_{t<=n} (1 - sigmoid(d_t + b)). Bisection
on b puts P(length > L/4) at 1/2; the truncated fraction is P(length > L) (extrapolated with the last steps' mean
hazard when fewer than L steps were sampled). The script then generates with the found b and prints the measured
quantiles. The benchmark prints the quantiles it measures too (arms without early stop). GFPO_E2E_EOS_OFFSET
overrides the committed offset (the GPU run calibrates on the device first, bench/gpu_run.sh).

Reward. `success_reward`: 1 when a hash of (prompt, completion token ids) falls below the prompt's success rate,
else 0: deterministic, independent of the length, and in expectation the prompt's rate. The rates cycle through
SUCCESS_RATES, in which 3 of 8 prompts are never or always solved (all-equal groups whatever is sampled), and the
others are hard enough that a group of 8 rarely comes out all equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import sys

import torch
from transformers import LogitsProcessor, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM

from gfpo_trainer.tiny import make_tokenizer

# A 0/1 success rate per prompt, cycled: 0 and 1 give all-equal groups (3 of 8 = 37.5% of the prompts)
SUCCESS_RATES = (0.0, 0.4, 1.0, 0.6, 0.5, 0.0, 0.35, 0.65)
PROMPT_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.,:;()"

# Qwen2-0.5B's architecture (its config.json), random weights
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)


@dataclasses.dataclass(frozen=True)
class Size:
    """One benchmark size: the model, the batch and the calibrated EOS offset."""

    model: dict  # Qwen2Config fields (vocab_size None: the character tokenizer's)
    prompts_per_step: int
    max_completion_length: int
    prompt_chars: tuple[int, int]  # prompt lengths drawn uniformly in this range (one token per character)
    dtype: torch.dtype
    eos_offset: float  # found by `python bench/e2e_inputs.py SIZE` (see the module docstring)


SIZES = {
    # CPU (CI smoke test and the committed CPU figures): the test suite's tiny Qwen2 shape, 8 prompts per step
    "cpu-small": Size(
        model=dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
        prompts_per_step=8, max_completion_length=64, prompt_chars=(8, 24), dtype=torch.float32,
        # 512 rows (64 per prompt), 64 steps: d_t -4.05 +- 0.15; predicted median 16, 6.4% truncated; measured
        # p10/25/50/75/90 = 3/8/16/31/51 tokens, 4.9% truncated
        eos_offset=0.918,
    ),
    # CPU, vLLM arms: cpu-small with 2 attention heads (head dimension 32, the smallest vLLM's CPU attention
    # supports; cpu-small's is 16), to run the same arms on HF generate and on vLLM's CPU engine with one model
    "cpu-small-vllm": Size(
        model=dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
        prompts_per_step=8, max_completion_length=64, prompt_chars=(8, 24), dtype=torch.float32,
        # 512 rows (64 per prompt), 64 steps: d_t -4.03 +- 0.13; predicted median 17, 6.5% truncated; measured (HF
        # generate) p10/25/50/75/90 = 3/8/16/30/52 tokens, 4.5% truncated
        eos_offset=0.889,
    ),
    # GPU: Qwen2-0.5B, bf16, 16 prompts per step, completions up to 1024 tokens
    "qwen2-0.5b": Size(
        model=QWEN2_05B, prompts_per_step=16, max_completion_length=1024, prompt_chars=(64, 192),
        dtype=torch.bfloat16,
        # found on CPU (bf16, 16 rows, the first 128 steps: d_t -12.40 +- 0.53, the same in the first and last
        # quarter): predicted median 257, 5.8% truncated; to be checked by the GPU run's calibration step
        eos_offset=6.348,
    ),
}


def eos_offset(size: Size) -> float:
    """The committed offset, or GFPO_E2E_EOS_OFFSET where set (a calibration run on the device)."""
    override = os.environ.get("GFPO_E2E_EOS_OFFSET")
    return float(override) if override else size.eos_offset


def make_model(size: Size, tokenizer, seed: int = 0, device: str | torch.device = "cpu") -> Qwen2ForCausalLM:
    """The size's random-weight Qwen2 in its dtype, the same weights for a given seed."""
    fields = dict(size.model)
    fields["vocab_size"] = fields["vocab_size"] or len(tokenizer)
    config = Qwen2Config(**fields, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to(size.dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def make_prompts(size: Size, seed: int = 0) -> list[dict]:
    """`prompts_per_step` dataset rows: a random character string and its success rate."""
    rng = random.Random(seed)
    low, high = size.prompt_chars
    return [
        {"prompt": "".join(rng.choice(PROMPT_CHARACTERS) for _ in range(rng.randint(low, high))),
         "success_rate": SUCCESS_RATES[i % len(SUCCESS_RATES)]}
        for i in range(size.prompts_per_step)
    ]


def _unit_hash(prompt: str, ids) -> float:
    digest = hashlib.blake2b(prompt.encode() + b"\0" + ",".join(map(str, ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def success_reward(prompts, completions, completion_ids, success_rate, **kwargs) -> list[float]:
    """0/1: 1 when the hash of (prompt, completion token ids) is below the prompt's success rate."""
    return [float(_unit_hash(prompt, ids) < rate)
            for prompt, ids, rate in zip(prompts, completion_ids, success_rate, strict=True)]


def generation_kwargs(size: Size, tokenizer, vllm: bool = False) -> dict:
    """TRL's `generation_kwargs` that put the size's offset on the EOS logit: transformers' `sequence_bias` for HF
    generate, vLLM's `logit_bias` (SamplingParams: added to the logits before temperature, top-k and top-p, as
    SequenceBiasLogitsProcessor is; clamped to +-100) for vLLM. The two sample from the same distribution."""
    if vllm:
        return {"logit_bias": {tokenizer.eos_token_id: eos_offset(size)}}
    return {"sequence_bias": {(tokenizer.eos_token_id,): eos_offset(size)}}


def length_stats(lengths, max_completion_length: int) -> dict:
    """Quantiles of completion lengths (tokens, EOS included) and the truncated fraction."""
    x = torch.tensor(sorted(lengths), dtype=torch.float64)
    stats = {f"p{q}": float(torch.quantile(x, q / 100)) for q in (10, 25, 50, 75, 90, 99)}
    stats["mean"] = float(x.mean())
    stats["truncated"] = float((x >= max_completion_length).double().mean())
    return stats


class _EosLogitGap(LogitsProcessor):
    """Records d_t = z_eos - logsumexp(other logits) per row and step, then suppresses EOS."""

    def __init__(self, eos: int):
        self.eos = eos
        self.gaps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        z = scores.float()
        others = torch.cat([z[:, : self.eos], z[:, self.eos + 1 :]], dim=1).logsumexp(dim=1)
        self.gaps.append((z[:, self.eos] - others).cpu())
        scores = scores.clone()
        scores[:, self.eos] = -float("inf")
        return scores


def _generate(model, tokenizer, prompts: list[str], max_new_tokens: int, processors=None, bias=None):
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kwargs = {} if bias is None else {"sequence_bias": {(tokenizer.eos_token_id,): bias}}
    with torch.no_grad():
        out = model.generate(**encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, logits_processor=LogitsProcessorList(processors or []),
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kwargs)
    return out[:, encoded.input_ids.shape[1] :]


def survival(gaps: torch.Tensor, bias: float, max_completion_length: int) -> torch.Tensor:
    """P(length > n) for n = 1..max_completion_length from the recorded gaps (rows, steps); steps past those sampled
    take the last quarter's mean hazard."""
    hazard = torch.sigmoid(gaps.double() + bias)
    survive = torch.cumprod(1 - hazard, dim=1).mean(dim=0)
    missing = max_completion_length - survive.numel()
    if missing > 0:
        tail = hazard[:, -max(1, hazard.shape[1] // 4) :].mean()
        survive = torch.cat([survive, survive[-1] * (1 - tail) ** torch.arange(1, missing + 1, dtype=torch.float64)])
    return survive[:max_completion_length]


def calibrate(size: Size, samples_per_prompt: int, steps: int | None, device: str, measure: bool = True,
              seed: int = 0) -> dict:
    """The EOS offset that puts the median length at max_completion_length / 4 (module docstring), and with
    `measure` the lengths generated with it."""
    tokenizer = make_tokenizer()
    model = make_model(size, tokenizer, seed=seed, device=device).eval()
    L = size.max_completion_length
    steps = min(steps or L, L)
    prompts = [row["prompt"] for row in make_prompts(size) for _ in range(samples_per_prompt)]
    recorder = _EosLogitGap(tokenizer.eos_token_id)
    torch.manual_seed(seed)
    _generate(model, tokenizer, prompts, steps, [recorder])
    gaps = torch.stack(recorder.gaps, dim=1)
    low, high = -20.0, 40.0
    for _ in range(60):  # P(length > L/4) falls as the offset grows
        mid = (low + high) / 2
        low, high = (mid, high) if survival(gaps, mid, L)[L // 4 - 1] > 0.5 else (low, mid)
    offset = round((low + high) / 2, 3)
    predicted = survival(gaps, offset, L)
    result = {
        "offset": offset, "gap_mean": float(gaps.mean()), "gap_std": float(gaps.std()),
        "gap_mean_first_last_quarter": (float(gaps[:, : steps // 4].mean()), float(gaps[:, -(steps // 4) :].mean())),
        "steps_sampled": steps, "rows": len(prompts), "predicted_median": int((predicted > 0.5).sum()) + 1,
        "predicted_truncated": float(predicted[-1]),
    }
    if measure:
        torch.manual_seed(seed + 1)
        completions = _generate(model, tokenizer, prompts, L, bias=offset)
        eos = tokenizer.eos_token_id
        lengths = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else L for row in completions]
        result["measured"] = length_stats(lengths, L)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Calibrate the EOS offset of a benchmark size (module docstring).")
    parser.add_argument("size", choices=list(SIZES))
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="steps sampled for the gaps (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-measure", action="store_true", help="skip generating with the offset found")
    options = parser.parse_args(argv)
    result = calibrate(SIZES[options.size], options.samples_per_prompt, options.steps, options.device,
                       measure=not options.no_measure)
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"GFPO_E2E_EOS_OFFSET={result['offset']}")


if __name__ == "__main__":
    sys.exit(main())
