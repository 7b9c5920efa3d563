"""GFPO's colocate engine loop (gfpo_trainer/vllm_stop.py) on a fake engine: no vLLM needed, so these run in the main
suite. The fake stands in for what the loop drives of vLLM's `LLMEngine` (add_request, step, abort_request,
has_unfinished_requests, output_processor.request_states with each request's detokenizer length and
make_request_output) and for its two enums; each request's tokens are a function of its seed and position, as a
seeded request's are on vLLM, so a request generates the same tokens whatever shares its steps. The real engine is
tested in tests/test_vllm.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from gfpo_kernels import reference as ref
from gfpo_trainer import vllm_stop
from gfpo_trainer.vllm_stop import VLLMGroupGeneration, VLLMSurfaceError, check_outputs, request_seeds

FINAL_ONLY, ABORT = "final-only", "abort"
EOS = 0


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


class Detokenizer:
    def __init__(self):
        self.output_token_ids = []

    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class State:
    def __init__(self, external_id: str, params: Params, cap: int, unseeded_draw: int):
        self.external_id, self.params = external_id, params
        self.seed = params.seed if params.seed is not None else unseeded_draw  # the engine's own stream otherwise
        self.detokenizer = Detokenizer()
        self.logprobs = []
        self.length = planned_length(self.seed, cap)

    def grow(self, count: int, top_n: int) -> bool:
        """Samples up to `count` tokens; returns whether the request finished."""
        for _ in range(count):
            position = len(self.detokenizer.output_token_ids)
            sampled = token(self.seed, position, self.length)
            self.detokenizer.output_token_ids.append(sampled)
            # vLLM's per-token entry: the sampled token and the top N (here N made-up others)
            entry = {sampled: -0.1 * (position + 1)}
            entry.update({100 + j: -5.0 - j for j in range(top_n)})
            self.logprobs.append(entry)
            if len(self.detokenizer.output_token_ids) == self.length:
                return True
        return False

    fail_abort_output = False  # True: building a cut request's output fails (FakeEngine(fail_cut=True))

    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason):
        if self.fail_abort_output and finish_reason == ABORT:
            raise RuntimeError("building the output of a cut request failed")
        finished = finish_reason is not None
        assert self.params.output_kind == FINAL_ONLY and finished and new_token_ids == [] and pooling_output is None
        logprobs = self.logprobs if self.params.logprobs is not None else None
        return Output(self.external_id, [Completion(self.detokenizer.output_token_ids, logprobs, str(finish_reason))],
                      True)


class OutputProcessor:
    def __init__(self):
        self.request_states = {}


class FakeEngine:
    """A seeded engine: `tokens_per_step(step, row)` tokens a step for each running request (0: it waits; > 1: a
    speculative step); at most `max_running` requests run at once, the others wait for a slot in order."""

    def __init__(self, *, cap=32, tokens_per_step=None, max_running=10**9, top_n=0, fail_add_at=None,
                 fail_step_at=None, keyed_by_caller=False, extra_logprob_row=None, suffix="x", fail_cut=False):
        self.output_processor = OutputProcessor()
        self.cap, self.max_running, self.top_n = cap, max_running, top_n
        self.tokens_per_step = tokens_per_step or (lambda step, row: 1)
        self.fail_add_at, self.fail_step_at = fail_add_at, fail_step_at
        self.keyed_by_caller, self.extra_logprob_row, self.suffix = keyed_by_caller, extra_logprob_row, suffix
        self.fail_cut = fail_cut
        self.order = []  # engine ids, in the order added
        self.steps = 0
        self.aborts = []  # each abort_request call's ids
        self.added = 0

    @property
    def states(self):
        return self.output_processor.request_states

    def add_request(self, request_id, prompt, params):
        engine_id = request_id if self.keyed_by_caller else f"{request_id}-{self.suffix}"
        self.states[engine_id] = State(request_id, params, self.cap, unseeded_draw=self.added)
        self.states[engine_id].fail_abort_output = self.fail_cut
        self.order.append(engine_id)
        self.added += 1
        if self.fail_add_at is not None and self.added == self.fail_add_at:
            raise ValueError("add_request failed after registering the request")  # vLLM's half-way failure
        return None if self.keyed_by_caller else engine_id

    def step(self):
        self.steps += 1
        if self.fail_step_at == self.steps:
            raise RuntimeError("the model runner failed")
        outputs = []
        running = [engine_id for engine_id in self.order if engine_id in self.states][: self.max_running]
        for engine_id in running:
            state = self.states[engine_id]
            row = int(state.external_id.rsplit("-", 1)[1])
            if state.grow(self.tokens_per_step(self.steps, row), self.top_n):
                output = state.make_request_output([], None, "stop", None)
                if self.extra_logprob_row == row:
                    output.outputs[0].logprobs = output.outputs[0].logprobs + [{1: -1.0}]
                outputs.append(output)
                del self.states[engine_id]
        return outputs

    def abort_request(self, request_ids):
        self.aborts.append(list(request_ids))
        for engine_id in [e for e, s in self.states.items() if s.external_id in set(request_ids)]:
            del self.states[engine_id]

    def has_unfinished_requests(self):
        return bool(self.states)


class FakeLLM:
    """vllm.LLM's `llm_engine` and `generate` (counted): LLM.generate drives the engine to the end."""

    def __init__(self, engine):
        self.llm_engine = engine
        self.generate_calls = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.generate_calls.append(sampling_params)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        engine = self.llm_engine
        ids = [f"llm{len(self.generate_calls)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            p = p.clone()
            p.output_kind = FINAL_ONLY
            engine.add_request(request_id, prompt, p)
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                done[output.request_id] = output
        return [done[request_id] for request_id in ids]


G, K = 8, 3


def generate(engine, *, stop=True, seeds=None, first_row=0, rows=2 * G, params=None):
    seeds = request_seeds(11, first_row, rows, 4 * G) if seeds is None else seeds
    llm = FakeLLM(engine)
    plan = VLLMGroupGeneration(llm, group_size=G, k=K, first_row=first_row, seeds=seeds, stop=stop)
    outputs = plan.generate([[1, 2]] * rows, sampling_params=params or Params(), use_tqdm=False)
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


@pytest.mark.parametrize("first_row", [0, 4])
def test_the_rule_cuts_only_what_the_filter_drops(first_row):
    """Every request gains one token a step: a cut row holds exactly the k-th shortest finished length of its group.
    first_row=4: groups 0 and 2 have 4 local rows each (they straddle processes): the rule counts only those."""
    off_outputs, off, _ = generate(FakeEngine(), stop=False, first_row=first_row)
    on_outputs, on, llm = generate(FakeEngine(), first_row=first_row)
    assert not any(off.stopped) and any(on.stopped)
    check_rule(on_outputs, on, off_outputs, first_row)
    assert on.engine_steps < off.engine_steps and on.generated_tokens < off.generated_tokens
    assert llm.generate_calls == []  # the rule drives the engine itself


def test_steps_without_tokens_and_steps_of_several_tokens():
    """Requests that wait for a slot (steps with no new token for them) and speculative steps (up to 3 tokens a
    request): the rule still cuts only rows that would have ended longer than k finished ones, each holding at least
    that many tokens."""

    def tokens_per_step(step, row):
        return 1 + (row + step) % 3

    off_outputs, off, _ = generate(FakeEngine(tokens_per_step=tokens_per_step, max_running=5), stop=False)
    on_outputs, on, _ = generate(FakeEngine(tokens_per_step=tokens_per_step, max_running=5))
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
    with pytest.raises(VLLMSurfaceError, match=r"log-probability entries for the \d+ tokens of request llm1-3$"):
        generate(FakeEngine(extra_logprob_row=3), stop=False)
    seeds = request_seeds(11, 0, 2 * G, 4 * G)
    shortest = min(range(G), key=lambda i: planned_length(seeds[i], 32))  # never cut: it ends first in its group
    with pytest.raises(VLLMSurfaceError,
                       match=rf"log-probability entries for the \d+ tokens of request gfpo-\w+-{shortest}$"):
        generate(FakeEngine(extra_logprob_row=shortest))
    check_outputs([Output("r", [Completion([5], None, "stop")], True)])  # no log-probabilities asked for: nothing


@pytest.mark.parametrize("fail_add_at", [1, 5])
def test_a_failing_add_request_leaves_no_request(fail_add_at):
    """add_request fails on the 1st or 5th request after registering it (as vLLM can, half-way): the error comes
    through, and that request and every one added before it is aborted."""
    engine = FakeEngine(fail_add_at=fail_add_at)
    with pytest.raises(ValueError, match="add_request failed"):
        generate(engine)
    assert not engine.has_unfinished_requests()
    assert len(engine.aborts) == 1 and len(engine.aborts[0]) == fail_add_at


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


def test_two_tensor_parallel_ranks_abort_the_same_requests():
    """Two ranks of a TP group run the loop on their own engines (their own request ids) with the same seeds: the
    same rows aborted in the same calls, in the same order."""
    sequences = []
    for suffix in ("rank0", "rank1"):
        engine = FakeEngine(suffix=suffix, tokens_per_step=lambda step, row: 1 + (row * step) % 2, max_running=11)
        generate(engine)
        sequences.append([[int(request_id.rsplit("-", 1)[1]) for request_id in call] for call in engine.aborts])
    assert sequences[0] == sequences[1] and len(sequences[0]) > 1


def test_an_engine_that_keys_requests_by_the_callers_id():
    """An engine whose add_request returns nothing keeps each request's state under the caller's id: the rule reads
    it there."""
    off_outputs, _, _ = generate(FakeEngine(keyed_by_caller=True), stop=False)
    on_outputs, on, _ = generate(FakeEngine(keyed_by_caller=True))
    assert any(on.stopped)
    check_rule(on_outputs, on, off_outputs)


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
    assert "step" not in vars(llm.llm_engine)  # the step counter is gone after the call
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


@pytest.mark.parametrize("tools", [False, True])
def test_tensor_parallel_ranks_generate_alike(monkeypatch, tools):
    """Two TP ranks whose CPU random streams drifted apart: rank 0's generation seed reaches rank 1 before either
    seeds its stream, so both seed the same requests the same way, draw the same numbers in the generation stream,
    and (the rule on) abort the same rows. With tools (the rule off there): the first turn is one LLM.generate call
    with per-request seeds; the tool turn, 3 rows on rank 0 and 5 on rank 1, is TRL's own call, unseeded."""
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
        engine = SeedLog(suffix=f"rank{rank}")
        llm = FakeLLM(engine)
        trainer = stub_trainer(rank, llm, tools=tools)
        trainer._generate([None] * G)
        engines.append(engine)
        trainers.append(trainer)
        first_turn = llm.generate_calls[0] if tools else None
        if tools:  # the rule off: LLM.generate, seeded per request; the tool turn: TRL's parameters as they were
            assert len(llm.generate_calls) == 2 and len(first_turn) == 2 * G
            assert llm.generate_calls[1].seed is None and not isinstance(llm.generate_calls[1], list)
            assert trainer._gfpo_batch.stopped_rows is None and trainer._gfpo_batch.turns == 2
        else:
            assert llm.generate_calls == [] and trainer._gfpo_batch.stopped_rows is not None
    assert world.broadcasts == [(0, "tp-group")] * 2  # once per rank, from the group's first rank
    first_turn_seeds = [engine.seeds[: 2 * G] for engine in engines]
    assert first_turn_seeds[0] == first_turn_seeds[1] and len(set(first_turn_seeds[0])) == 2 * G
    assert world.stream_draws[0][0] == world.stream_draws[1][0]
    if tools:
        assert engines[0].seeds[2 * G :] == [None] * 8 == engines[1].seeds[2 * G :]
    else:
        aborted = [[[int(i.rsplit("-", 1)[1]) for i in call] for call in engine.aborts] for engine in engines]
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
