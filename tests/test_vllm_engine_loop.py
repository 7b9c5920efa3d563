"""GFPO's colocate engine loop (gfpo_trainer/vllm_stop.py) on a fake engine: no vLLM needed, so these run in the main
suite. The fake stands in for what the loop drives of vLLM's `LLM` and `LLMEngine`, as vLLM 0.22 to 0.31 do it:
`LLM.enqueue` (each prompt rendered to an engine input, one request per prompt, the output kind set to final only,
the engine's ids returned), `add_request` (the engine's id is the caller's with a random suffix, its frontend state
registered before the engine core's request), `step`, `abort_request` (by the engine's ids with `internal=True`,
else by the callers'), `has_unfinished_requests`, the output processor (`request_states` with each request's
detokenizer length and make_request_output, `process_outputs`), a scheduler that frees the requests of one abort
call in the order of a set of their ids, with KV blocks from a free list, preemption, the engine core's scheduler in
process (each request's `num_output_placeholders`), and vLLM's async scheduling (a batch queue of 2: a step launches
the next batch before it returns the previous one's output; the tokens a launched batch held for a request aborted
after its launch are counted as they are dropped, the truth the discarded-token count is checked against). Each
request's tokens are a function of its seed and position, as a seeded request's are on vLLM, so a request generates
the same tokens whatever shares its steps. The real engine is tested in tests/test_vllm.py.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from gfpo_kernels import reference as ref
from gfpo_trainer import vllm_stop
from gfpo_trainer.vllm_stop import VLLMGroupGeneration, VLLMSurfaceError, check_outputs, request_seeds

FINAL_ONLY, ABORT = "final-only", "abort"
EOS = 0
BLOCK = 4  # tokens per KV block of the fake scheduler


@pytest.fixture(autouse=True)
def fake_enums(monkeypatch):
    monkeypatch.setattr(vllm_stop, "vllm_enums", lambda: (FINAL_ONLY, ABORT))


@dataclass
class Params:
    """The SamplingParams fields the loop reads and sets."""

    n: int = 1
    seed: int | None = None
    output_kind: str = "cumulative"
    detokenize: bool = True
    stop: list = field(default_factory=list)
    logprobs: int | None = 0

    def clone(self):
        return Params(self.n, self.seed, self.output_kind, self.detokenize, list(self.stop), self.logprobs)


@dataclass
class Completion:
    token_ids: list
    logprobs: list | None
    finish_reason: str | None


@dataclass
class Output:
    request_id: str
    outputs: list
    finished: bool


def planned_length(seed: int, cap: int) -> int:
    """How many tokens the request of `seed` generates (its last one EOS, unless it reaches `cap`)."""
    return min(cap, random.Random(seed).randint(2, 24))


def token(seed: int, position: int, length: int) -> int:
    return EOS if position == length - 1 else 1 + (seed * 31 + position * 7) % 50


def set_order(engine_id: str) -> bytes:
    """Where vLLM's scheduler, which frees the requests of one abort call in the order of a set of their ids, puts a
    request: a Python set of strings iterates in the order of their hashes (here a fixed hash of the id)."""
    return hashlib.sha256(engine_id.encode()).digest()


class Detokenizer:
    def __init__(self):
        self.output_token_ids = []

    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class State:
    """The frontend's state of a request (vLLM's RequestState): the tokens and log-probabilities it received."""

    fail_abort_output = False  # True: building a cut request's output fails (FakeEngine(fail_cut=True))

    def __init__(self, external_id: str, params: Params, number: int, top_n: int):
        self.external_req_id, self.params, self.number, self.top_n = external_id, params, number, top_n
        self.detokenizer = Detokenizer()
        self.logprobs = []

    def receive(self, tokens: list[int]) -> None:
        for sampled in tokens:
            position = len(self.detokenizer.output_token_ids)
            self.detokenizer.output_token_ids.append(sampled)
            # vLLM's per-token entry: the sampled token and the top N (here N made-up others)
            entry = {sampled: -0.1 * (position + 1)}
            entry.update({100 + j: -5.0 - j for j in range(self.top_n)})
            self.logprobs.append(entry)

    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason):
        if self.fail_abort_output and finish_reason == ABORT:
            raise RuntimeError("building the output of a cut request failed")
        finished = finish_reason is not None
        assert self.params.output_kind == FINAL_ONLY and finished and new_token_ids == [] and pooling_output is None
        logprobs = list(self.logprobs) if self.params.logprobs is not None else None
        return Output(self.external_req_id,
                      [Completion(list(self.detokenizer.output_token_ids), logprobs, str(finish_reason))], True)


class OutputProcessor:
    """vLLM's: the running requests' states, and `process_outputs`, which hands each request its new tokens and
    returns the outputs of those that finished (an output for a request without a state is dropped)."""

    def __init__(self, engine):
        self.request_states = {}
        self.engine = engine

    def process_outputs(self, engine_core_outputs):
        finished = []
        for engine_id, tokens, done in engine_core_outputs:
            state = self.request_states.get(engine_id)
            if state is None:
                continue
            state.receive(tokens)
            if done:
                output = state.make_request_output([], None, "stop", None)
                if self.engine.extra_logprob_row == state.number:
                    output.outputs[0].logprobs = output.outputs[0].logprobs + [{1: -1.0}]
                finished += [output] * (2 if self.engine.twice_row == state.number else 1)
                del self.request_states[engine_id]
        return finished


@dataclass
class CoreRequest:
    """The engine core's request: its seed and length, the tokens computed and scheduled, its KV blocks, and the step
    until which it is preempted (waiting again, its blocks freed)."""

    seed: int
    length: int
    number: int
    computed: int = 0
    scheduled: int = 0
    blocks: list = field(default_factory=list)
    preempted_until: int = 0

    @property
    def num_output_placeholders(self) -> int:
        """vLLM's count of the tokens scheduled for the request in launched batches and not yet returned."""
        return self.scheduled - self.computed


class FakeEngine:
    """A seeded engine: `tokens_per_step(step, n)` tokens a step for the n-th request added (0: it waits; > 1: a
    speculative step); at most `max_running` requests run at once, the others wait for a slot in order.
    `async_scheduling`: each step schedules and launches a batch, then returns the output of the batch launched
    before it (vLLM's batch queue of 2), so a call's first step returns nothing and a request aborted after a step is
    already in the launched batch (its tokens there are computed and discarded: `discarded_by_abort`).
    `preempt(step, n)`: the n-th request, running, is preempted at that step (its KV blocks freed; it waits 2 steps,
    then resumes where it was). The engine core is in process: `engine_core.engine_core.scheduler.requests` maps the
    engine ids of the requests in the core to their `CoreRequest` (`in_process_core=False`: an engine core in a
    process of its own, no scheduler to read). `discarded_by_abort` is the truth the loop's counter is checked
    against: the tokens a launched batch held for a request aborted after its launch, counted when that batch
    executes (`drain()` executes the batches still in flight after a call).
    `rank`: the stream of the random suffixes of the engine's ids (each TP rank has its own). Faults: `fail_add_at`,
    `fail_step_at`, `fail_cut`, `extra_logprob_row` (one log-probability entry too many), `twice_row` (a final output
    returned twice), `abort_ignores_internal_ids`."""

    def __init__(self, *, cap=32, tokens_per_step=None, max_running=10**9, top_n=0, fail_add_at=None,
                 fail_step_at=None, extra_logprob_row=None, rank=0, fail_cut=False, async_scheduling=False,
                 abort_ignores_internal_ids=False, twice_row=None, preempt=None, in_process_core=True):
        self.output_processor = OutputProcessor(self)
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
        self.cap, self.max_running, self.top_n = cap, max_running, top_n
        self.tokens_per_step = tokens_per_step or (lambda step, n: 1)
        self.fail_add_at, self.fail_step_at = fail_add_at, fail_step_at
        self.extra_logprob_row, self.fail_cut, self.twice_row = extra_logprob_row, fail_cut, twice_row
        self.async_scheduling, self.abort_ignores_internal_ids = async_scheduling, abort_ignores_internal_ids
        self.suffixes = random.Random(f"rank{rank}")
        self.core: dict[str, CoreRequest] = {}  # engine id -> request, in the order added (the scheduler's queue)
        self.preempt = preempt or (lambda step, n: False)
        if in_process_core:
            scheduler = SimpleNamespace(requests=self.core)
            self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))
        self.aborted_ids = set()
        self.preemptions = 0
        self.free_blocks = deque(range(10_000))
        self.freed = []  # KV block ids, in the order returned to the free list
        self.batches = deque()  # async scheduling: launched batches, the newest first
        self.number_of = {}  # engine id -> the order it was added in
        self.prompts = []  # what reached add_request
        self.steps = self.forward_passes = self.added = self.discarded_by_abort = 0
        self.aborts = []  # each abort_request call's ids

    @property
    def states(self):
        return self.output_processor.request_states

    def rows(self, engine_ids) -> list[int]:
        return [self.number_of[engine_id] for engine_id in engine_ids]

    def add_request(self, request_id, prompt, params, **kwargs):
        engine_id = f"{request_id}-{self.suffixes.getrandbits(32):08x}"
        number = self.number_of[engine_id] = self.added
        self.added += 1
        self.prompts.append(prompt)
        params = params.clone()  # vLLM's input processor keeps a copy
        self.states[engine_id] = State(request_id, params, number, self.top_n)
        self.states[engine_id].fail_abort_output = self.fail_cut
        if self.fail_add_at is not None and self.added == self.fail_add_at:
            raise ValueError("add_request failed after registering the request")  # vLLM's half-way failure
        seed = params.seed if params.seed is not None else number  # the engine's own stream otherwise
        self.core[engine_id] = CoreRequest(seed, planned_length(seed, self.cap), number)
        return engine_id

    def _schedule(self) -> list[tuple[str, int]]:
        """A batch: each of the first `max_running` requests gets its tokens of this step (none past its planned
        length, none while preempted), and the KV blocks for them."""
        batch = []
        for engine_id, request in list(self.core.items())[: self.max_running]:
            if request.preempted_until > self.steps:
                continue
            if request.scheduled and self.preempt(self.steps, request.number):
                self.preemptions += 1
                request.preempted_until = self.steps + 2
                for block in reversed(request.blocks):
                    self.free_blocks.append(block)
                    self.freed.append(block)
                request.blocks = []
                continue
            count = min(self.tokens_per_step(self.steps, request.number), request.length - request.scheduled)
            if count:
                request.scheduled += count
                while len(request.blocks) * BLOCK < request.scheduled:
                    request.blocks.append(self.free_blocks.popleft())
                batch.append((engine_id, count))
        return batch

    def _execute(self, batch) -> list:
        """The batch's engine-core outputs (engine id, new tokens, finished) for the requests still in the core; a
        request ends at its planned length."""
        self.forward_passes += bool(batch)
        outputs = []
        for engine_id, count in batch:
            request = self.core.get(engine_id)
            if request is None:  # aborted after the batch was launched: its tokens here are computed and dropped
                self.discarded_by_abort += count if engine_id in self.aborted_ids else 0
                continue
            new = []
            while len(new) < count and request.computed < request.length:
                new.append(token(request.seed, request.computed, request.length))
                request.computed += 1
            done = request.computed == request.length
            if done:
                self._free(engine_id)
            outputs.append((engine_id, new, done))
        return outputs

    def _free(self, engine_id: str) -> None:
        request = self.core.pop(engine_id)
        for block in reversed(request.blocks):  # as vLLM's block pool: the request's last block first
            self.free_blocks.append(block)
            self.freed.append(block)

    def step(self):
        self.steps += 1
        if self.fail_step_at == self.steps:
            raise RuntimeError("the model runner failed")
        core_outputs = []
        if not self.async_scheduling:
            core_outputs = self._execute(self._schedule())
        else:  # vLLM's EngineCore.step_with_batch_queue, with a queue of 2
            launched = bool(self.core)
            if launched:
                self.batches.appendleft(self._schedule())
            if self.batches and not (launched and len(self.batches) < 2):
                core_outputs = self._execute(self.batches.pop())
        return self.output_processor.process_outputs(core_outputs)

    def abort_request(self, request_ids, internal=False):
        self.aborts.append(list(request_ids))
        if internal and not self.abort_ignores_internal_ids:
            engine_ids = [e for e in request_ids if e in self.states or e in self.core]
        else:  # callers' ids (or, with abort_ignores_internal_ids, engine ids read as callers': none matches)
            wanted = set(request_ids)
            engine_ids = [e for e, state in self.states.items() if state.external_req_id in wanted]
        for engine_id in engine_ids:
            self.states.pop(engine_id, None)
        for engine_id in sorted(set(engine_ids), key=set_order):  # the scheduler frees in set order
            if engine_id in self.core:
                self.aborted_ids.add(engine_id)
                self._free(engine_id)

    def drain(self) -> None:
        """Executes the batches still in flight (async scheduling), as the engine's next step would."""
        while self.batches:
            self.output_processor.process_outputs(self._execute(self.batches.pop()))

    def has_unfinished_requests(self):
        return bool(self.states)


class FakeLLM:
    """vllm.LLM's `llm_engine`, `enqueue` (counted) and `generate` (counted): enqueue renders each prompt to an engine
    input, sets each request's output kind to final only and adds it under the next number of the LLM's counter,
    returning the engine's ids (what it added is aborted by them where adding fails); generate enqueues copies of
    the parameters and drives the engine to the end."""

    def __init__(self, engine):
        self.llm_engine = engine
        self.generate_calls = []
        self.enqueued = 0
        self.counter = itertools.count()

    def enqueue(self, prompts, sampling_params=None, use_tqdm=True):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        added = []
        try:
            for prompt, p in zip(prompts, params):
                p.output_kind = FINAL_ONLY
                added.append(self.llm_engine.add_request(str(next(self.counter)),
                                                         {"type": "token", "prompt_token_ids": list(prompt)}, p))
                self.enqueued += 1
        except Exception:
            if added:
                self.llm_engine.abort_request(added, internal=True)
            raise
        return added

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.generate_calls.append(sampling_params)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        engine = self.llm_engine
        self.enqueue(prompts, [p.clone() for p in params], use_tqdm)
        done = []
        while engine.has_unfinished_requests():
            done += engine.step()
        return sorted(done, key=lambda output: int(output.request_id))


G, K = 8, 3


def generate(engine, *, stop=True, seeds=None, first_row=0, rows=2 * G, params=None, tp=1):
    seeds = request_seeds(11, first_row, rows, 4 * G) if seeds is None else seeds
    llm = FakeLLM(engine)
    plan = VLLMGroupGeneration(llm, group_size=G, k=K, first_row=first_row, seeds=seeds, stop=stop,
                               tensor_parallel_size=tp)
    outputs = plan.generate([[1, 2]] * rows, sampling_params=params or Params(), use_tqdm=False)
    engine.drain()  # the truth of the tokens discarded is complete once the batches in flight have executed
    return outputs, plan, llm


def check_rule(on_outputs, on, off_outputs, first_row=0, exact_cut=True):
    """The rule's promise on these outputs: a cut row is a prefix of the completion it would have made and holds at
    least the k-th shortest finished length of its group (exactly that many when every request gains one token a
    step from the first), which it would have outgrown; the others are the same completions; the length filter keeps
    the same rows."""
    ids_on = [list(o.outputs[0].token_ids) for o in on_outputs]
    ids_off = [list(o.outputs[0].token_ids) for o in off_outputs]
    rows = len(ids_on)
    group_of = [(first_row + i) // G for i in range(rows)]
    for i in range(rows):
        if on.stopped[i]:
            finished = sorted(len(ids_on[j]) for j in range(rows) if group_of[j] == group_of[i] and not on.stopped[j])
            assert ids_off[i][: len(ids_on[i])] == ids_on[i] and len(ids_off[i]) > finished[K - 1]
            assert len(ids_on[i]) == finished[K - 1] if exact_cut else len(ids_on[i]) >= finished[K - 1]
            assert on_outputs[i].finished and on_outputs[i].outputs[0].finish_reason == ABORT
            assert on_outputs[i].outputs[0].logprobs == off_outputs[i].outputs[0].logprobs[: len(ids_on[i])]
        else:
            assert ids_on[i] == ids_off[i]
            assert on_outputs[i].outputs[0].logprobs == off_outputs[i].outputs[0].logprobs
    for group in sorted(set(group_of)):
        members = [i for i in range(rows) if group_of[i] == group]
        if len(members) == G:
            on_lengths = torch.tensor([len(ids_on[i]) + on.stopped[i] for i in members], dtype=torch.float32)
            off_lengths = torch.tensor([len(ids_off[i]) for i in members], dtype=torch.float32)
            assert torch.equal(ref.group_topk_mask(on_lengths, G, K, largest=False),
                               ref.group_topk_mask(off_lengths, G, K, largest=False))
    return ids_on, ids_off


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("first_row", [0, 4])
def test_the_rule_cuts_only_what_the_filter_drops(first_row, async_scheduling):
    """Every request gains one token a step: a cut row holds exactly the k-th shortest finished length of its group.
    first_row=4: groups 0 and 2 have 4 local rows each (they straddle processes): the rule counts only those. The
    requests are added through LLM.enqueue, each prompt rendered there (the loop hands it the raw prompts and adds
    nothing itself); the same with async scheduling."""
    off_outputs, off, _ = generate(FakeEngine(async_scheduling=async_scheduling), stop=False, first_row=first_row)
    engine = FakeEngine(async_scheduling=async_scheduling)
    on_outputs, on, llm = generate(engine, first_row=first_row)
    assert not any(off.stopped) and any(on.stopped)
    check_rule(on_outputs, on, off_outputs, first_row)
    assert on.engine_steps < off.engine_steps and on.generated_tokens < off.generated_tokens
    assert llm.generate_calls == []  # the rule drives the engine itself
    assert llm.enqueued == engine.added == 2 * G and all(p["type"] == "token" for p in engine.prompts)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steps_without_tokens_and_steps_of_several_tokens(async_scheduling):
    """Requests that wait for a slot (steps with no new token for them) and speculative steps (up to 3 tokens a
    request): the rule still cuts only rows that would have ended longer than k finished ones, each holding at least
    that many tokens; the same with async scheduling."""

    def tokens_per_step(step, row):
        return 1 + (row + step) % 3

    options = dict(tokens_per_step=tokens_per_step, max_running=5, async_scheduling=async_scheduling)
    off_outputs, off, _ = generate(FakeEngine(**options), stop=False)
    on_outputs, on, _ = generate(FakeEngine(**options))
    assert any(on.stopped)
    check_rule(on_outputs, on, off_outputs, exact_cut=False)
    # rows of a request that had not started when its group's limit was set still ran until they reached it
    assert off.engine_steps > on.engine_steps


def test_top_n_logprobs_come_back_per_token():
    """logprobs=2: every token's entry holds the sampled token and the top 2; a cut row's entries are those of the
    tokens it holds."""
    on_outputs, on, _ = generate(FakeEngine(top_n=2), params=Params(logprobs=2))
    assert any(on.stopped)
    for output in on_outputs:
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(len(entry) == 3 and sampled in entry for entry, sampled in zip(completion.logprobs,
                                                                                    completion.token_ids))


def test_logprobs_not_matching_the_tokens_is_an_error():
    """A row with one log-probability entry too many (vLLM 0.22 repeats the history for a delta with no tokens) is
    refused, naming the request."""
    with pytest.raises(VLLMSurfaceError, match=r"returned 4 log-probability entries for the 3 tokens of request "):
        check_outputs([Output("r", [Completion([5, 6, 0], [{5: -1.0}, {6: -1.0}, {0: -1.0}, {1: -1.0}], "stop")],
                              True)])
    with pytest.raises(VLLMSurfaceError, match=r"log-probability entries for the \d+ tokens of request '3' \(prompt 3 "
                                               r"of the call\)$"):
        generate(FakeEngine(extra_logprob_row=3), stop=False)
    seeds = request_seeds(11, 0, 2 * G, 4 * G)
    shortest = min(range(G), key=lambda i: planned_length(seeds[i], 32))  # never cut: it ends first in its group
    with pytest.raises(VLLMSurfaceError, match=rf"log-probability entries for the \d+ tokens of request '\d+' \(prompt "
                                               rf"{shortest} of the call\)$"):
        generate(FakeEngine(extra_logprob_row=shortest))
    check_outputs([Output("r", [Completion([5], None, "stop")], True)])  # no log-probabilities asked for: nothing


@pytest.mark.parametrize("fail_add_at", [1, 5])
def test_a_failing_add_request_leaves_no_request(fail_add_at):
    """add_request fails on the 1st or 5th request after registering it (as vLLM can, half-way): the error comes
    through; LLM.enqueue aborts the requests it added, and the loop the one registered half-way."""
    engine = FakeEngine(fail_add_at=fail_add_at)
    with pytest.raises(ValueError, match="add_request failed"):
        generate(engine)
    assert not engine.has_unfinished_requests()
    assert sorted(engine.rows(sum(engine.aborts, []))) == list(range(fail_add_at))


@pytest.mark.parametrize("fail_step_at", [1, 9])
def test_a_failing_step_leaves_no_request(fail_step_at):
    """step fails on the 1st engine step, or on the 9th (after requests finished and the rule cut some): every
    request still running is aborted, and the engine holds none."""
    engine = FakeEngine(fail_step_at=fail_step_at)
    with pytest.raises(RuntimeError, match="the model runner failed"):
        generate(engine)
    assert not engine.has_unfinished_requests()
    assert len(engine.aborts[-1]) == (2 * G if fail_step_at == 1 else len(engine.aborts[-1])) > 0


def test_a_failure_while_cutting_leaves_no_request():
    """Building a cut request's output fails: the error comes through and every running request, the ones being cut
    included, is aborted."""
    engine = FakeEngine(fail_cut=True)
    with pytest.raises(RuntimeError, match="building the output of a cut request failed"):
        generate(engine)
    assert not engine.has_unfinished_requests() and len(engine.aborts) == 1


def test_a_request_state_without_its_length_is_a_surface_error(monkeypatch):
    """A vLLM whose running request state no longer answers the length the rule reads (checked when the trainer is
    built; here it changes after): one VLLMSurfaceError naming the request, and every request aborted."""
    monkeypatch.delattr(Detokenizer, "num_output_tokens")
    engine = FakeEngine()
    with pytest.raises(VLLMSurfaceError, match=r"cannot read the length of running request '.+' from vLLM's "
                                                r"RequestState: .*num_output_tokens"):
        generate(engine)
    assert not engine.has_unfinished_requests()


def _two_ranks(tp: int) -> list[FakeEngine]:
    """The engines of two ranks of a TP group, each after the loop ran on it: the same requests and seeds, each
    engine's ids with its own random suffixes."""
    engines = []
    for rank in (0, 1):
        engine = FakeEngine(rank=rank, tokens_per_step=lambda step, n: 1 + (n * step) % 2, max_running=11)
        generate(engine, tp=tp)
        engines.append(engine)
    return engines


def test_tensor_parallel_ranks_free_the_same_blocks_in_the_same_order():
    """Two ranks with tensor_parallel_size=2: every abort is one call of one request, in row order within a step, the
    same rows on both ranks, and the two engines return the same KV blocks to their free lists in the same order (so
    they allocate the same blocks next). With one abort call for a step's cuts (tensor_parallel_size=1) the same rows
    are aborted, but each scheduler frees them in the order of a set of its own ids, and the ranks' orders differ: what
    one call a request prevents."""
    ranks = _two_ranks(tp=2)
    calls = [[engine.rows(call) for call in engine.aborts] for engine in ranks]
    assert calls[0] == calls[1] and len(calls[0]) > 4 and all(len(call) == 1 for call in calls[0])
    assert ranks[0].freed == ranks[1].freed and ranks[0].freed
    # row order within each step's cuts: the rows of consecutive calls rise, but where a later step begins
    assert sum(a[0] > b[0] for a, b in zip(calls[0], calls[0][1:])) < len(calls[0]) // 2
    one_call = _two_ranks(tp=1)
    batched = [[engine.rows(call) for call in engine.aborts] for engine in one_call]
    assert batched[0] == batched[1] and any(len(call) > 1 for call in batched[0])
    assert sum(batched[0], []) == sum(calls[0], [])  # the same rows, in the same order, aborted either way
    assert one_call[0].freed != one_call[1].freed


def test_an_abort_that_does_not_take_is_an_error():
    """An engine whose abort_request no longer reads the engine's own ids as such (internal=True ignored): the cut
    requests run on, and the first output that arrives for one is a VLLMSurfaceError naming it, not a row
    overwritten; every request still running is aborted."""
    engine = FakeEngine(abort_ignores_internal_ids=True)
    with pytest.raises(VLLMSurfaceError, match=r"returned an output for request '\d+-[0-9a-f]{8}' \(prompt \d+ of "
                                               r"the call\), which the early-stop rule had aborted: vLLM's "
                                               r"abort_request did not stop it"):
        generate(engine)
    engine.abort_ignores_internal_ids = False
    engine.abort_request(list(engine.states), internal=True)  # what the loop's own abort could not reach


def test_a_second_final_output_is_an_error():
    """An engine that returns a request's final output twice: a VLLMSurfaceError naming the request, and every request
    still running aborted."""
    engine = FakeEngine(twice_row=5)
    with pytest.raises(VLLMSurfaceError, match=r"returned a second final output for request '5-[0-9a-f]{8}' \(prompt 5 "
                                               r"of the call\)$"):
        generate(engine)
    assert not engine.has_unfinished_requests()


def test_enqueue_not_returning_one_id_a_request_is_an_error():
    """LLM.enqueue returning other than one request id per prompt: a VLLMSurfaceError, and what it added aborted."""
    engine = FakeEngine()
    llm = FakeLLM(engine)
    enqueue = llm.enqueue
    llm.enqueue = lambda prompts, sampling_params=None, use_tqdm=True: enqueue(prompts, sampling_params)[:-1]
    plan = VLLMGroupGeneration(llm, group_size=G, k=K, first_row=0, seeds=None, stop=True)
    with pytest.raises(VLLMSurfaceError, match=r"LLM.enqueue returned .* \(15 ids\) for 16 prompts"):
        plan.generate([[1, 2]] * 2 * G, sampling_params=Params())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("stop", [False, True], ids=["rule-off", "rule-on"])
def test_counters_under_async_scheduling(stop):
    """The same seeded batch on an engine that schedules synchronously and on one that schedules as vLLM's async
    scheduling does (a call's first step only launches a batch; a request cut after a step is already in the next,
    launched batch): the same completions and cuts, the same engine steps counted (the steps that returned model
    output: with every request running from the first step and one token a step, the longest completion's length
    with the rule off), and the tokens of cut requests that were in a launched batch counted: one per cut with async
    scheduling, none without."""
    runs = {}
    for mode in (False, True):
        engine = FakeEngine(async_scheduling=mode)
        outputs, plan, _ = generate(engine, stop=stop)
        runs[mode] = ([list(o.outputs[0].token_ids) for o in outputs], plan, engine)
    (ids_sync, sync, engine_sync), (ids_async, asynchronous, engine_async) = runs[False], runs[True]
    assert ids_sync == ids_async and sync.stopped == asynchronous.stopped
    assert sync.engine_steps == asynchronous.engine_steps == engine_sync.steps
    assert engine_async.steps == engine_sync.steps + 1  # vLLM's step calls: the first one only launched a batch
    if not stop:
        assert sync.engine_steps == max(map(len, ids_sync))
    cuts = sum(asynchronous.stopped)
    assert (cuts > 0) == stop
    assert asynchronous.discarded_tokens == engine_async.discarded_by_abort == cuts
    assert sync.discarded_tokens == engine_sync.discarded_by_abort == 0


def test_rule_off_is_one_call_of_llm_generate():
    """The rule off: one LLM.generate call with a seeded copy of the parameters per request (or the one given,
    without seeds), its engine steps counted; the same completions the rule-on loop leaves uncut."""
    seeds = request_seeds(11, 0, 2 * G, 4 * G)
    params = Params()
    outputs, plan, llm = generate(FakeEngine(), stop=False, params=params)
    (passed,) = llm.generate_calls
    assert [p.seed for p in passed] == seeds and params.seed is None and not any(plan.stopped)
    assert plan.engine_steps == max(planned_length(seed, 32) for seed in seeds)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [planned_length(seed, 32) for seed in seeds]
    assert "process_outputs" not in vars(llm.llm_engine.output_processor)  # the step counter is gone after the call
    llm = FakeLLM(FakeEngine())
    plan = VLLMGroupGeneration(llm, group_size=G, k=K, first_row=0, seeds=None, stop=False)
    plan.generate([[1, 2]] * 4, sampling_params=params)
    assert llm.generate_calls == [params]


def test_what_trl_passes_is_checked():
    llm = FakeLLM(FakeEngine())
    plan = VLLMGroupGeneration(llm, group_size=G, k=K, first_row=0, seeds=[1, 2], stop=True)
    with pytest.raises(VLLMSurfaceError, match="sent 3 prompts, 2 were expected"):
        plan.generate([[1]] * 3, sampling_params=Params())
    plan = VLLMGroupGeneration(llm, group_size=G, k=K, first_row=0, seeds=None, stop=True)
    with pytest.raises(VLLMSurfaceError, match="asked for n=2 completions a request"):
        plan.generate([[1]] * 3, sampling_params=Params(n=2))
    with pytest.raises(VLLMSurfaceError, match="called LLM.generate twice"):
        plan.generate([[1]] * 3, sampling_params=Params())
    engine = FakeEngine()
    engine.add_request("someone-else", [1], Params(seed=1))
    plan = VLLMGroupGeneration(FakeLLM(engine), group_size=G, k=K, first_row=0, seeds=None, stop=True)
    with pytest.raises(RuntimeError, match="holds unfinished requests before a generation call"):
        plan.generate([[1]] * 3, sampling_params=Params())


# --------------------------------------------------------------------------- the trainer's colocate path, TP simulated

class World:
    """Two ranks of one TP group, run one after the other: what TRL's colocate path gathers in the group, and the
    seed rank 0 broadcasts."""

    def __init__(self, turns: list[list[list]]):
        self.turns = turns  # per generation turn, each rank's prompts
        self.sent = None
        self.broadcasts = []
        self.stream_draws = {0: [], 1: []}

    def broadcast_object_list(self, box, src, group):
        self.broadcasts.append((src, group))
        if self.rank == src:
            self.sent = list(box)
        else:
            box[:] = self.sent


def trl_generate(world):
    """Stands in for GRPOTrainer._generate with TRL's tool loop: the first turn on every prompt (num_generations=G),
    then a tool turn on the rows that called a tool (num_generations=1), a different number on each rank."""

    def _generate(self, prompts):
        ids, _ = self._generate_single_turn(world.turns[0][world.rank], None, {}, G)
        if len(world.turns) > 1:
            self._generate_single_turn(world.turns[1][world.rank], None, {}, 1)
        return [[1]] * len(ids), ids, None

    return _generate


def trl_single_turn(world):
    """Stands in for GRPOTrainer._generate_single_turn's colocate path with TP: the group's prompts gathered in rank
    order, one LLM.generate call with one SamplingParams, this rank's share back."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turn = 0 if num_generations == G else 1
        gathered = [p for rank_prompts in world.turns[turn] for p in rank_prompts]
        outputs = self.vllm_generation.llm.generate(gathered, sampling_params=Params(), use_tqdm=False)
        world.stream_draws[world.rank].append(int(torch.randint(0, 2**30, (1,))))  # the random stream it runs in
        start = world.rank * len(prompt_ids)
        ids = [list(o.outputs[0].token_ids) for o in outputs][start : start + len(prompt_ids)]
        return ids, [[0.0] * len(x) for x in ids]

    return _generate_single_turn


def stub_trainer(rank: int, llm, *, tools: bool):
    """A GFPOTrainer with only what its colocate generation path reads: rank `rank` of 2 processes, one TP group."""
    from collections import defaultdict
    from types import SimpleNamespace

    from gfpo_trainer import GFPOTrainer
    from gfpo_trainer.batch import GenerationBatch

    trainer = GFPOTrainer.__new__(GFPOTrainer)
    trainer.args = SimpleNamespace(num_remains_in_group=K, group_filter="length", gfpo_stop_dropped_generations=True,
                                   adaptive_difficulty=False, gfpo_vllm_request_seeds=True,
                                   loss_includes_rejected=False)
    trainer.model = SimpleNamespace(training=True)
    trainer.use_vllm, trainer.vllm_mode, trainer.num_generations = True, "colocate", G
    trainer.vllm_generation = SimpleNamespace(llm=llm, tensor_parallel_size=2, tp_group="tp-group")
    trainer.accelerator = SimpleNamespace(process_index=rank, num_processes=2, device=torch.device("cpu"))
    trainer.tools = [print] if tools else None
    trainer.use_transformers_continuous_batching = False
    trainer._gfpo_warned, trainer._metrics = set(), {"train": defaultdict(list)}
    trainer._gfpo_batch = GenerationBatch(filtering=True, skip_zero=False)
    return trainer


class SeedLog(FakeEngine):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seeds = []

    def add_request(self, request_id, prompt, params):
        self.seeds.append(params.seed)
        return super().add_request(request_id, prompt, params)


@pytest.mark.parametrize("tools, async_scheduling", [(False, False), (False, True), (True, False)],
                         ids=["rule", "rule-async", "tools"])
def test_tensor_parallel_ranks_generate_alike(monkeypatch, tools, async_scheduling):
    """Two TP ranks whose CPU random streams drifted apart: rank 0's generation seed reaches rank 1 before either
    seeds its stream, so both seed the same requests the same way, draw the same numbers in the generation stream,
    and (the rule on) abort the same rows, one request a call. With tools (the rule off there): the first turn is one
    LLM.generate call with per-request seeds; the tool turn, 3 rows on rank 0 and 5 on rank 1, is TRL's own call,
    unseeded. The metrics: the engine steps that returned model output, and with the rule the tokens discarded (one
    per cut with async scheduling)."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    turns = [[[[1, 2]] * G, [[1, 3]] * G]]
    if tools:
        turns.append([[[4, 5]] * 3, [[6, 7]] * 5])
    world = World(turns)
    monkeypatch.setattr(GRPOTrainer, "_generate", trl_generate(world))
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", trl_single_turn(world))
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", world.broadcast_object_list)
    engines, trainers = [], []
    for rank in (0, 1):
        world.rank = rank
        torch.manual_seed(100 + rank)  # the ranks' trainer streams differ
        engine = SeedLog(rank=rank, async_scheduling=async_scheduling)
        llm = FakeLLM(engine)
        trainer = stub_trainer(rank, llm, tools=tools)
        trainer._generate([None] * G)
        engines.append(engine)
        trainers.append(trainer)
        first_turn = llm.generate_calls[0] if tools else None
        metrics = trainer._metrics["train"]
        if tools:  # the rule off: LLM.generate, seeded per request; the tool turn: TRL's parameters as they were
            assert len(llm.generate_calls) == 2 and len(first_turn) == 2 * G
            assert llm.generate_calls[1].seed is None and not isinstance(llm.generate_calls[1], list)
            assert trainer._gfpo_batch.stopped_rows is None and trainer._gfpo_batch.turns == 2
            assert "gfpo/vllm_discarded_tokens" not in metrics
        else:
            assert llm.generate_calls == [] and trainer._gfpo_batch.stopped_rows is not None
            cuts = sum(map(len, engine.aborts))
            assert metrics["gfpo/vllm_discarded_tokens"] == [float(cuts if async_scheduling else 0)] and cuts
            assert all(len(call) == 1 for call in engine.aborts)
        # the first turn's steps that returned model output: with the rule, every step of its loop but an async
        # engine's first; without it (one token a step, every request from the first step) its longest completion
        longest = max(planned_length(seed, 32) for seed in engine.seeds[: 2 * G])
        steps = longest if tools else engine.steps - async_scheduling
        assert metrics["gfpo/vllm_engine_steps"] == [float(steps)]
    assert world.broadcasts == [(0, "tp-group")] * 2  # once per rank, from the group's first rank
    first_turn_seeds = [engine.seeds[: 2 * G] for engine in engines]
    assert first_turn_seeds[0] == first_turn_seeds[1] and len(set(first_turn_seeds[0])) == 2 * G
    assert world.stream_draws[0][0] == world.stream_draws[1][0]
    if tools:
        assert engines[0].seeds[2 * G :] == [None] * 8 == engines[1].seeds[2 * G :]
    else:
        aborted = [[engine.rows(call) for call in engine.aborts] for engine in engines]
        assert aborted[0] == aborted[1] and aborted[0]
        stopped = [t._gfpo_batch.stopped_rows.tolist() for t in trainers]
        assert stopped[0] == [i in sum(aborted[0], []) for i in range(G)]
        assert stopped[1] == [i in sum(aborted[0], []) for i in range(G, 2 * G)]


def _smoke_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "vllm_gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("vllm_gpu_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    return smoke


def test_gpu_smoke_script_keeps_what_the_filter_keeps():
    """scripts/vllm_gpu_smoke.py's kept rows (its verdict on a GPU) are the length filter's: group_topk_mask of the
    lengths, a stopped row ranked one token longer, ties to the lower index."""
    smoke = _smoke_script()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 6, (4 * G,), generator=generator)  # many ties
    stopped = torch.rand(4 * G, generator=generator) < 0.3
    want = ref.group_topk_mask((lengths + stopped).float(), G, K, largest=False).nonzero().squeeze(1).tolist()
    assert smoke.kept(lengths.tolist(), stopped.tolist(), G, K) == want


def test_gpu_smoke_script_checks_the_counters_of_both_scheduling_modes():
    """scripts/vllm_gpu_smoke.py's verdict on one configuration, on runs of the fake engine in each scheduling mode
    (what vLLM did measured as the script measures it: the step calls, and the tokens the scheduler received for
    requests already aborted): none on runs as GFPO's loop makes them; a wrong step count (a step counted that
    returned no model output), a discarded-token count that is not what the scheduler received, tokens discarded
    with synchronous scheduling, or a received count that does not fit the mode, is named. Its configurations cover
    both modes on both runners."""
    smoke = _smoke_script()
    configs = sorted((env["VLLM_USE_V2_MODEL_RUNNER"], engine["async_scheduling"]) for _, env, engine in smoke.CONFIGS)
    assert configs == [("0", False), ("0", True), ("1", False), ("1", True)]
    for mode in (False, True):
        runs = {}
        for stop in (False, True):
            engine = FakeEngine(async_scheduling=mode)
            outputs, plan, _ = generate(engine, stop=stop)
            runs[stop] = dict(ids=[list(o.outputs[0].token_ids) for o in outputs], stopped=plan.stopped,
                              steps=plan.engine_steps, discarded=plan.discarded_tokens, step_calls=engine.steps,
                              received=engine.discarded_by_abort,
                              logps=[[next(iter(entry.values())) for entry in o.outputs[0].logprobs] for o in outputs])
        assert smoke.verdict(runs[False], runs[True], G, K, mode, all_start_together=True) == []
        cuts = sum(runs[True]["stopped"])
        assert runs[True]["discarded"] == (cuts if mode else 0)  # one token a step, every request from the first
        if mode:  # async scheduling's count read as synchronous scheduling's: tokens discarded where none can be
            assert smoke.verdict(runs[False], runs[True], G, K, False, all_start_together=True)[0] == (
                f"{cuts} tokens counted discarded with the rule and 0 without (none expected with synchronous "
                "scheduling, and none without the rule)")
        # GFPO's count not what vLLM's scheduler received: named, with both figures
        miscounted = dict(runs[True], discarded=runs[True]["discarded"] + 1)
        assert smoke.verdict(runs[False], miscounted, G, K, True, all_start_together=True)[0] == (
            f"{miscounted['discarded']} tokens counted discarded with the rule, where vLLM's scheduler received "
            f"{runs[True]['received']} for the requests it cut")
        # GFPO's count what the scheduler received, but that not what the mode makes (a cut that reached vLLM late,
        # or an engine that did not launch ahead): named, with both figures
        measured, want = dict(runs[True], received=cuts + 1 if mode else 1), cuts if mode else 0
        measured["discarded"] = measured["received"]
        assert smoke.verdict(runs[False], measured, G, K, True, all_start_together=True) == [
            f"vLLM's scheduler received {measured['received']} tokens for requests the rule had cut ({want} "
            f"expected: one per cut where the engine had launched the next batch, none without; GFPO counted "
            f"{measured['discarded']})"]
        if mode:  # fewer received than cut: fine only where not every request ran from the first step
            fewer = dict(runs[True], received=cuts - 1, discarded=cuts - 1)
            assert smoke.verdict(runs[False], fewer, G, K, mode, all_start_together=True)
            assert smoke.verdict(runs[False], fewer, G, K, mode, all_start_together=False) == []
        runs[False]["steps"] += 1  # as counting every step call would with async scheduling
        assert smoke.verdict(runs[False], runs[True], G, K, mode, all_start_together=True)[0].startswith(
            f"{runs[False]['steps']} engine steps counted without the rule, for a longest completion of")
        assert smoke.verdict(runs[False], runs[True], G, K, mode, all_start_together=False) == []


def test_gpu_smoke_script_runs_the_engine_core_in_process(monkeypatch):
    """Each configuration's process runs vLLM's engine core in itself (VLLM_ENABLE_V1_MULTIPROCESSING=0, what vLLM
    sets for TRL's external launcher), whatever the caller's environment says: GFPO's loop steps the engine core as
    in training, and the scheduler the script measures is in that process. Batch-invariant numerics, the
    configuration's own settings."""
    smoke = _smoke_script()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    for _, environment, _ in smoke.CONFIGS:
        env = smoke.child_environment(environment)
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_BATCH_INVARIANT"] == "1"
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == environment["VLLM_USE_V2_MODEL_RUNNER"]


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("child_sleeps", [120, 0], ids=["past-timeout", "exits-leaving-a-worker"])
def test_gpu_smoke_script_stops_a_configuration_and_its_workers(tmp_path, child_sleeps):
    """A configuration that outlives --timeout is reported as stopped (None), one that exits is reported with its
    status; either way the processes it started (the engine's workers) are killed with it."""
    import os
    import sys
    import time

    pid_file = tmp_path / "worker.pid"
    child = ("import subprocess, sys, time; "
             "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); "
             f"open({str(pid_file)!r}, 'w').write(str(w.pid)); print('RESULT {{}}', flush=True); "
             f"time.sleep({child_sleeps})")
    status, stdout, _ = _smoke_script().run_child([sys.executable, "-c", child], dict(os.environ), timeout=5)
    assert status == (None if child_sleeps else 0) and stdout.strip() == "RESULT {}"
    worker = int(pid_file.read_text())
    for _ in range(100):
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


# --------------------------------------------------------------------------- the tokens discarded, against the truth

DISCARD_CASES = {
    # five running at once, 1 to 3 tokens a request and step (speculative steps)
    "multi-token": dict(tokens_per_step=lambda step, n: 1 + (n + step) % 3, max_running=5),
    # running requests the token budget leaves out of some steps
    "skipped-steps": dict(tokens_per_step=lambda step, n: 0 if (7 * n + step) % 3 == 0 else 1),
    # running requests preempted (their blocks freed; they wait two steps, then resume)
    "preemption": dict(preempt=lambda step, n: (step + 2 * n) % 7 == 0),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", sorted(DISCARD_CASES))
def test_discarded_tokens_are_the_tokens_the_engine_drops(case, async_scheduling):
    """`discarded_tokens` equals the tokens the engine really computed for cut requests and dropped (the fake's
    truth, counted when each launched batch executes, the batches still in flight after the call included), with
    requests that gain several tokens a step, skip steps or are preempted: not one per cut (a cut request that is
    preempted or left out of the launched batch costs nothing, one in a speculative step costs several). None are
    discarded with synchronous scheduling. The rule still keeps what the filter keeps."""
    options = dict(DISCARD_CASES[case], async_scheduling=async_scheduling)
    off_outputs, _, _ = generate(FakeEngine(**options), stop=False)
    engine = FakeEngine(**options)
    outputs, plan, _ = generate(engine)
    check_rule(outputs, plan, off_outputs, exact_cut=False)
    cuts = sum(plan.stopped)
    assert cuts > 0 and plan.discarded_tokens == engine.discarded_by_abort
    if case == "preemption":
        assert engine.preemptions > 0
    if not async_scheduling:
        assert engine.discarded_by_abort == 0
    else:
        assert engine.discarded_by_abort > 0 and engine.discarded_by_abort != cuts  # "one per cut" would be wrong


def test_discarded_tokens_unknown_without_the_engine_core_in_process():
    """An engine whose core runs in a process of its own (no scheduler to read): the rule runs as ever, and the
    tokens discarded are unknown (None), so ColocatePath logs no `gfpo/vllm_discarded_tokens`; with the core in
    process it logs the count."""
    from gfpo_trainer.generation_paths import ColocatePath

    for in_process, want in ((False, None), (True, 0.0)):
        llm = FakeLLM(FakeEngine(in_process_core=in_process))
        accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"))
        path = ColocatePath(SimpleNamespace(llm=llm, tensor_parallel_size=1), accelerator, n_local=2 * G,
                            group_size=G, k=K, base_seed=11, stop=True)
        with path:
            llm.generate([[1, 2]] * 2 * G, sampling_params=Params(), use_tqdm=False)
        assert path.called and path.stopped_rows.any()
        assert path.metrics.get("gfpo/vllm_discarded_tokens") == want
        assert path.plan.discarded_tokens == (None if want is None else 0)


def test_stop_strings_with_tensor_parallelism_warn_once(monkeypatch, caplog):
    """Stop strings (TRL's generation_kwargs['stop']) with vllm_tensor_parallel_size=2 in colocate mode: one warning
    over two generation calls, naming the setting and the way out; none without stop strings, or with one rank."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    from gfpo_trainer.batch import GenerationBatch
    from gfpo_trainer.generation_paths import stop_strings_with_tensor_parallelism

    world = World([[[[1, 2]] * G, [[1, 3]] * G]])
    world.rank = 0
    monkeypatch.setattr(GRPOTrainer, "_generate", trl_generate(world))
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", trl_single_turn(world))
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", world.broadcast_object_list)
    for stop, warnings in ((["\n\n"], 1), (None, 0)):
        trainer = stub_trainer(0, FakeLLM(FakeEngine()), tools=False)
        trainer.args.generation_kwargs = {"stop": stop, "max_tokens": 32} if stop else {"max_tokens": 32}
        caplog.clear()
        with caplog.at_level("WARNING", logger="gfpo_trainer"):
            for _ in range(2):
                trainer._gfpo_batch = GenerationBatch(filtering=True, skip_zero=False)
                trainer._generate([None] * G)
        messages = [r.getMessage() for r in caplog.records if "stop string" in r.getMessage()]
        assert len(messages) == warnings
        if warnings:
            assert messages[0].startswith("generation_kwargs['stop']=['\\n\\n'] with vllm_tensor_parallel_size=2: ")
            assert "stop_token_ids" in messages[0] and "vllm_tensor_parallel_size=1" in messages[0]
    one_rank = SimpleNamespace(tensor_parallel_size=1)
    assert stop_strings_with_tensor_parallelism(one_rank, SimpleNamespace(generation_kwargs={"stop": ["x"]})) is None
    assert stop_strings_with_tensor_parallelism(SimpleNamespace(tensor_parallel_size=2),
                                                SimpleNamespace(generation_kwargs={"stop": []})) is None


def test_a_scheduler_request_without_its_in_flight_count_is_a_surface_error(monkeypatch):
    """A vLLM whose scheduler requests no longer carry `num_output_placeholders` as an int (what the discarded-token
    count reads at a cut): one VLLMSurfaceError naming the request and the attribute, and every request aborted."""
    monkeypatch.setattr(CoreRequest, "num_output_placeholders", property(lambda self: None))
    engine = FakeEngine(async_scheduling=True)
    with pytest.raises(VLLMSurfaceError, match=r"vLLM's scheduler request '\d+-[0-9a-f]{8}' has "
                                               r"num_output_placeholders=None, not an int"):
        generate(engine)
    assert not engine.has_unfinished_requests()
