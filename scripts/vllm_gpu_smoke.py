"""GPU smoke test of GFPO's colocate generation on vLLM: on a machine with CUDA GPUs and vLLM (docs/vllm.md's GPU
recipe), the seeded batch generated with the early-stop rule on (GFPO's engine loop) and off (LLM.generate) must
keep the same rows, token for token, on vLLM's Model Runner V2 and on its V1 runner, each with synchronous and with
async scheduling (vLLM's GPU default), all in batch-invariant mode (VLLM_BATCH_INVARIANT=1), and with vLLM's tensor
parallelism (TP=2) where two GPUs exist. GFPO's counters are checked in both scheduling modes: with every request
running from the first step, the engine steps of the call without the rule are its longest completion's length
(the steps that returned model output, whatever the mode), and the tokens GFPO counts discarded (vLLM's count of the
tokens in flight for each cut request, read before its abort) must be what vLLM's scheduler received for requests
already cut, measured here apart (one per cut where the engine had launched the next batch with every request in it,
none with synchronous scheduling). Each configuration runs in a process
of its own (vLLM reads its environment when the engine starts) with the engine core in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), as TRL's external launcher runs it in training: GFPO's loop then steps the
engine core itself, and the scheduler is there to be measured. A configuration is stopped (its whole process group)
after --timeout seconds; one line per configuration, and the exit status is the number that failed.

TP=2 here is vLLM's own: one process runs the loop on `LLM(tensor_parallel_size=2)`, whose workers vLLM starts (the
loop aborts one request a call there, as a rank of the trainer's TP group does). It is not the trainer's TP path,
where TRL's external launcher makes every training rank an engine rank, each rank runs GFPO's loop on the same
requests, and the seed is broadcast from the group's first rank: that path is tested only with two ranks simulated on
a fake engine (tests/test_vllm_engine_loop.py).

    python scripts/vllm_gpu_smoke.py [--model DIR] [--prompts 16] [--G 16] [--k 8] [--max-tokens 256]
        [--timeout 1200]

Without --model: the tiny Qwen2 of the tests (head dimension 64), warmed up on the demo task on the GPU so that
its completions end at varied lengths (what makes the rule cut anything); a real checkpoint tests real numerics.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

# (name, environment, engine options): each runner with each scheduling mode, named explicitly (vLLM's default on a
# GPU is async scheduling, where nothing turns it off)
CONFIGS = [
    (f"{runner} runner, {mode} scheduling", {"VLLM_USE_V2_MODEL_RUNNER": flag}, {"async_scheduling": mode == "async"})
    for runner, flag in (("V2", "1"), ("V1", "0")) for mode in ("synchronous", "async")
]


def tiny_model(directory: str) -> str:
    """The tests' tiny model (hidden 64, one head), warmed up on pair sums on the GPU, saved to `directory`."""
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer, warm_up_on_pair_sums

    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, hidden_size=64, num_heads=1)
    warm_up_on_pair_sums(model, tokenizer, [(a, b) for a in range(10) for b in range(10)], 80, "cuda")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def kept(lengths: list[int], stopped: list[bool], G: int, k: int) -> list[int]:
    """The rows the length filter keeps: per group the k shortest, a stopped row ranked one token longer than it
    holds, ties to the lower index (gfpo_kernels.group_topk_mask)."""
    rows = []
    for start in range(0, len(lengths), G):
        group = range(start, start + G)
        rows += sorted(sorted(group, key=lambda i: (lengths[i] + stopped[i], i))[:k])
    return rows


def verdict(off: dict, on: dict, G: int, k: int, async_scheduling: bool, all_start_together: bool) -> list[str]:
    """What is wrong with one configuration's two runs (`ids`, `logps`, `stopped`, `steps`, `discarded` of the run
    with the rule off and on, and what vLLM did: `step_calls`, its `LLMEngine.step` calls, and `received`, the tokens
    its scheduler received for requests already aborted): the kept rows, the cut rows, and GFPO's counters for the
    scheduling mode the engine ran (`all_start_together`: every request fitted the first step, so the run without the
    rule took as many steps that returned model output as its longest completion has tokens, and every running
    request was in each launched batch)."""
    rows = len(off["ids"])
    keep_off = kept([len(x) for x in off["ids"]], off["stopped"], G, k)
    keep_on = kept([len(x) for x in on["ids"]], on["stopped"], G, k)
    problems = []
    if keep_on != keep_off:
        problems.append("the length filter keeps other rows with the rule on")
    if any(on["ids"][i] != off["ids"][i] or on["logps"][i] != off["logps"][i] for i in keep_off):
        problems.append("a kept row's tokens or log-probabilities differ with the rule on")
    if any(on["ids"][i] != off["ids"][i][: len(on["ids"][i])] for i in range(rows) if on["stopped"][i]):
        problems.append("a cut row is not a prefix of its completion with the rule off")
    if not any(on["stopped"]):
        problems.append("the rule cut nothing (completions all of one length?)")
    if all_start_together and off["steps"] != max(map(len, off["ids"])):
        problems.append(f"{off['steps']} engine steps counted without the rule, for a longest completion of "
                        f"{max(map(len, off['ids']))} tokens")
    if off["discarded"] != 0 or (not async_scheduling and on["discarded"] != 0):
        problems.append(f"{on['discarded']} tokens counted discarded with the rule and {off['discarded']} without "
                        "(none expected with synchronous scheduling, and none without the rule)")
    if on["discarded"] != on["received"]:
        problems.append(f"{on['discarded']} tokens counted discarded with the rule, where vLLM's scheduler received "
                        f"{on['received']} for the requests it cut")
    # a cut request is in the batch launched before the cut where the engine launches ahead (a step call that
    # returned no model output); with every request running, in each launched batch
    launched_ahead = async_scheduling and on["step_calls"] > on["steps"]
    want = sum(on["stopped"]) if launched_ahead else 0
    if off["received"] != 0 or (on["received"] != want if all_start_together else on["received"] > want):
        problems.append(f"vLLM's scheduler received {on['received']} tokens for requests the rule had cut "
                        f"({want} expected: one per cut where the engine had launched the next batch, none "
                        f"without; GFPO counted {on['discarded']})")
    return problems


def child_environment(environment: dict) -> dict:
    """The environment of one configuration's process: the caller's, batch-invariant numerics, the configuration's
    own settings, and the engine core in the process that drives it (VLLM_ENABLE_V1_MULTIPROCESSING=0, which vLLM sets
    itself for TRL's external launcher): without it `LLM` runs the engine core in a process of its own that steps on
    its own, ahead of GFPO's loop, which is not how the trainer runs it."""
    return {**os.environ, "VLLM_BATCH_INVARIANT": "1", **environment, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def measure_engine(llm):
    """Counts, on `llm`'s in-process engine, its `LLMEngine.step` calls (`step_calls`) and the tokens its scheduler
    receives for requests already aborted (`received`: computed in a batch launched before the abort, and
    discarded). Returns (the counters, which the caller resets between runs; vLLM's own step, uncounted, which
    collects a batch still in flight after a call: it holds the last step's cuts)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # the in-process client's EngineCore
    counts = {"step_calls": 0, "received": 0}
    aborted: set[str] = set()
    step, abort, update = engine.step, engine.abort_request, scheduler.update_from_output

    def counted_step():
        counts["step_calls"] += 1
        return step()

    def recorded_abort(request_ids, internal=False):
        aborted.update(request_ids)
        return abort(request_ids, internal=internal)

    def recorded_update(scheduler_output, model_output):
        counts["received"] += sum(n for request_id, n in scheduler_output.num_scheduled_tokens.items()
                                  if request_id in aborted)
        return update(scheduler_output, model_output)

    engine.step, engine.abort_request, scheduler.update_from_output = counted_step, recorded_abort, recorded_update
    return counts, step


def child(options) -> dict:
    """One configuration: the same seeded batch with the rule off, then on; what the parent prints."""
    import vllm

    from gfpo_trainer.vllm_stop import VLLMGroupGeneration, async_scheduling, request_seeds

    extra = json.loads(options.engine_options)
    llm = vllm.LLM(options.model, tensor_parallel_size=options.tp, seed=0, logprobs_mode="processed_logprobs",
                   gpu_memory_utilization=0.5, max_model_len=64 + options.max_tokens, **extra)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(f"{a}+{a + 1}=", add_special_tokens=False).input_ids}
               for a in range(options.prompts) for _ in range(options.G)]
    params = vllm.SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=options.max_tokens,
                                 logprobs=0)
    seeds = request_seeds(1234, 0, len(prompts), len(prompts))
    counts, collect_in_flight = measure_engine(llm)
    runs = {}
    for stop in (False, True):
        plan = VLLMGroupGeneration(llm, group_size=options.G, k=options.k, first_row=0, seeds=seeds, stop=stop,
                                   tensor_parallel_size=options.tp)
        counts["step_calls"] = counts["received"] = 0
        start = time.perf_counter()
        outputs = plan.generate(prompts, sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - start
        step_calls = counts["step_calls"]
        collect_in_flight()
        runs[stop] = dict(ids=[list(o.outputs[0].token_ids) for o in outputs], stopped=plan.stopped,
                          seconds=seconds, steps=plan.engine_steps, tokens=plan.generated_tokens,
                          discarded=plan.discarded_tokens, step_calls=step_calls, received=counts["received"],
                          logps=[[next(iter(step.values())).logprob for step in o.outputs[0].logprobs]
                                 for o in outputs])
    off, on = runs[False], runs[True]
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    mode = async_scheduling(llm.llm_engine)
    fits = (len(prompts) <= scheduler.max_num_seqs
            and sum(len(p["prompt_token_ids"]) for p in prompts) <= scheduler.max_num_batched_tokens)
    problems = verdict(off, on, options.G, options.k, mode, fits)
    if "async_scheduling" in extra and mode != extra["async_scheduling"]:
        problems.append(f"vLLM ran with async_scheduling={mode}, {extra['async_scheduling']} asked for")
    return {"problems": problems, "cut": sum(on["stopped"]), "rows": len(prompts),
            "steps": [off["steps"], on["steps"]], "tokens": [off["tokens"], on["tokens"]],
            "discarded": on["discarded"], "received": on["received"],
            "seconds": [round(off["seconds"], 2), round(on["seconds"], 2)]}


def _stop_group(process: subprocess.Popen) -> None:
    """Kills every process left in `process`'s session (the engine's workers hold GPUs)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # none left
        pass


def run_child(command: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(exit status, or None where `timeout` seconds passed; stdout; stderr) of `command`, run in a session of its
    own, which is stopped whatever ends the call (its end, the timeout, Ctrl-C here): no engine worker outlives it."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        _stop_group(process)
        stdout, stderr = process.communicate()
        return None, stdout, stderr
    finally:
        _stop_group(process)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory vLLM loads (default: the tests' tiny model, warmed up)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--G", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds a configuration may take (engine start included) before it is stopped and fails")
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--engine-options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print("RESULT " + json.dumps(child(options)), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("vllm_gpu_smoke: no CUDA GPU here; on a CPU, scripts/test_vllm_cpu.sh runs GFPO's vLLM tests")
        return 1
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = options.model or tiny_model(tmp)
        tps = [1, 2] if torch.cuda.device_count() >= 2 else [1]
        for name, environment, engine_options in CONFIGS:
            for tp in tps:
                command = [sys.executable, __file__, "--child", "--model", model, "--prompts", str(options.prompts),
                           "--G", str(options.G), "--k", str(options.k), "--max-tokens", str(options.max_tokens),
                           "--tp", str(tp), "--engine-options", json.dumps(engine_options)]
                returncode, stdout, stderr = run_child(command, child_environment(environment), options.timeout)
                lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
                label = f"{name}, TP={tp}" + (" (vLLM's, one process)" if tp > 1 else "")
                if returncode != 0 or not lines:
                    failed += 1
                    tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
                    status = f"stopped after {options.timeout:.0f} s" if returncode is None else f"exit {returncode}"
                    print(f"FAIL {label}: {status}: {tail}", flush=True)
                    continue
                result = json.loads(lines[-1][len("RESULT "):])
                status = "FAIL" if result["problems"] else "ok"
                failed += bool(result["problems"])
                print(f"{status} {label}: {result['cut']} of {result['rows']} rows cut; engine steps off/on "
                      f"{result['steps'][0]}/{result['steps'][1]}, tokens {result['tokens'][0]}/{result['tokens'][1]} "
                      f"(+{result['discarded']} discarded; vLLM's scheduler received {result['received']} for cut "
                      f"requests), seconds {result['seconds'][0]}/{result['seconds'][1]}"
                      + "".join(f"; {p}" for p in result["problems"]), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
