"""Generation on vLLM (colocate mode) with the length filter: one seeded request per completion, and the running
requests of a group aborted once the filter is certain to drop them.

TRL's colocate path sends one `n=1` request per completion through `LLM.generate` and waits for all of them. For one
generation call GFPO puts `VLLMGroupGeneration.generate` in the place of that method
(generation_paths.ColocatePath). With the early-stop rule off it hands the call back to `LLM.generate`, with one
copy of TRL's sampling parameters per request carrying the completion's own seed (or TRL's parameters unchanged
without seeds): vLLM's own loop, nothing of GFPO's per engine step. With the rule on it drives the engine itself, as
`LLM.generate` does: the requests are added through `LLM.enqueue`, `LLM.generate`'s own first half (each prompt
rendered to vLLM's engine input, the request's output kind set to `RequestOutputKind.FINAL_ONLY`: an engine step
returns the requests that finished, no output per running request), then `LLMEngine.step` until none is left. After
a step it reads the running lengths of the groups the rule watches from the engine's per-request state
(`LLMEngine.output_processor.request_states`, keyed by the engine's own request ids, which `LLM.enqueue` returns),
and aborts the requests it cuts by those ids (`LLMEngine.abort_request(ids, internal=True)`, as `LLM` aborts) after
taking their tokens and log-probabilities from that state, as vLLM's own final output of an aborted request. It
returns what `LLM.generate` returns, one `RequestOutput` per prompt in order, so TRL reads the completions and their
log-probabilities as it always does. An output for a request already cut (an abort that did not take) is an error
naming the request, never a row overwritten.

The rule (the same guarantee as early_stop.py on HF generate): the length filter keeps the k completions of a group
with the fewest tokens, ties to the lower index. Once k completions of a group have finished, let L be the k-th
smallest of their lengths. A running request of that group holding L tokens or more has not ended within L tokens,
so it will end longer than L, longer than k finished completions: it is dropped whatever it goes on to say, and is
aborted at once (waiting for it to pass L would cost every such request one more token and the engine one more
step). It comes back with the tokens and log-probabilities it had (L or more), marked stopped: the length filter
ranks a stopped completion as one token longer than it holds (selection.py), as it would have been at least, so it
ranks below those k even under the tie rule. A request waiting for a slot, or holding fewer than L tokens, runs on
until it finishes or reaches L. Only the groups with a limit and running requests are looked at after a step, so
the rule's host work per step is a length read per running request of those groups (usually none: a group's
requests start together and are cut in the step that sets the limit).

Why the kept completions do not change: each completion is its own request with its own seed, so the tokens a
request samples depend on its seed and its logits alone, not on which other requests share a step (vLLM's sampler
draws a seeded request's noise from that request's generator). Its logits do not depend on the batch either where
vLLM's numerics are batch-invariant: the CPU engine, or batch-invariant mode on a GPU (docs/vllm.md). The kept rows
finished before the rule touched their group, so they are the same completions with the rule on or off.

Tensor parallelism: every rank of a TP group runs this loop on the same requests with the same seeds, and its
decisions are a function of the sampled tokens alone, which all ranks share, so every rank aborts the same requests
at the same step. Each rank's engine must also free their KV blocks in the same order (the ranks' schedulers, and
with prefix caching the blocks they evict, must stay identical: vLLM's external launcher runs one collective per
step). vLLM's scheduler frees the requests of one abort call in the order of a set of their ids, and the ids carry a
random suffix per rank, so with TP > 1 the loop aborts one request a call, in row order. A group that straddles
processes: each process counts only the rows it generates (conservative: it stops less, never wrongly).

Scheduling: with vLLM's async scheduling (its default on a GPU) an engine step launches the next batch before it
returns the previous one's output, so a call's first step only launches, and a request the rule cuts may already be
in the launched batch, whose tokens for it vLLM computes and then drops. The counters, each as it is:
`engine_steps` counts the engine steps whose output handed the frontend at least one request's new tokens (a step
that only launched a batch, or whose batch held only prefill chunks or requests already cut, is not counted), the
same in both modes; `generated_tokens` the tokens returned (a cut request's included, what it held); and
`discarded_tokens` the tokens vLLM had scheduled for the requests the rule cuts and not yet returned when they were
cut: vLLM's own count of them, `Request.num_output_placeholders` of the engine core's scheduler, read just before
each abort (one a launched batch that holds the request, more with speculative decoding's draft tokens; 0 for a
request preempted or left out of the launched batch by the token budget, and always 0 with synchronous scheduling).
vLLM drops those tokens when their batch returns. It is read where the engine core runs in this process (TRL's
colocate mode: the external launcher keeps it there); elsewhere `discarded_tokens` is None.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

# seeds are drawn below 2**62: vLLM seeds a torch.Generator with them, and other engines take a signed 64-bit int
SEED_BOUND = 2**62


class VLLMSurfaceError(RuntimeError):
    """A vLLM internal that GFPO's early stop drives has changed shape."""


# vLLM surfaces the engine loop uses: (object description, attribute)
_ENGINE_METHODS = ("step", "abort_request", "has_unfinished_requests")
# RequestState.make_request_output's leading parameters (vLLM 0.22 to 0.31): the loop passes them by position
_MAKE_OUTPUT_PARAMETERS = ["new_token_ids", "pooling_output", "finish_reason", "stop_reason"]
# the parameters the loop passes to LLM.enqueue, by name
_ENQUEUE_PARAMETERS = ("prompts", "sampling_params", "use_tqdm")
# attributes read on instances of vLLM classes, checked on each class's constructor, which takes each of them under
# its own name and keeps it (an instance only exists once a request runs): (module, class, attributes, who reads them)
_OUTPUT_FIELDS = (
    ("vllm.outputs", "RequestOutput", ("request_id", "outputs", "finished"), "GFPO's vLLM generation"),
    ("vllm.outputs", "CompletionOutput", ("token_ids", "logprobs"), "GFPO's vLLM generation"),
)
_ENGINE_LOOP_FIELDS = (
    ("vllm.v1.engine.output_processor", "RequestState", ("detokenizer", "external_req_id"),
     "GFPO's early stop (a running request's length, read from its detokenizer, and the id its output carries)"),
)


def _check_fields(surfaces, version: str) -> None:
    """Raises VLLMSurfaceError naming the first class of `surfaces` (as _OUTPUT_FIELDS) that is gone or whose
    constructor no longer takes one of the attributes read on its instances."""
    import importlib

    for module, name, attributes, reader in surfaces:
        try:
            cls = getattr(importlib.import_module(module), name)
            parameters = inspect.signature(cls.__init__).parameters
        except (ImportError, AttributeError, TypeError, ValueError) as error:
            raise VLLMSurfaceError(f"vllm {version}: {module}.{name} is gone or unreadable ({error}); {reader} reads "
                                   "its instances") from None
        for attribute in attributes:
            if attribute not in parameters:
                raise VLLMSurfaceError(f"vllm {version}: {name} no longer takes {attribute!r}, which {reader} reads "
                                       f"on its instances ({module})")


def _parameters(function) -> list[str]:
    """`function`'s parameter names ([] where unreadable)."""
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []


def vllm_enums():
    """(RequestOutputKind.FINAL_ONLY, FinishReason.ABORT) of the installed vLLM: the output kind the loop's requests
    stream with, and the finish reason of a request the rule cuts."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import FinishReason

    return RequestOutputKind.FINAL_ONLY, FinishReason.ABORT


def async_scheduling(engine) -> bool:
    """Whether `engine` (an `LLMEngine`) schedules asynchronously (`vllm_config.scheduler_config.async_scheduling`,
    resolved when the engine was built: vLLM's default on a GPU, always off on its CPU platform). Raises
    VLLMSurfaceError where the setting cannot be read."""
    value = getattr(getattr(getattr(engine, "vllm_config", None), "scheduler_config", None), "async_scheduling", None)
    if not isinstance(value, bool):
        raise VLLMSurfaceError(f"{type(engine).__name__}.vllm_config.scheduler_config.async_scheduling is {value!r}, "
                               "not a bool (GFPO's vLLM generation counts its engine steps and discarded tokens "
                               "by it)")
    return value


def engine_scheduler(engine):
    """The engine core's scheduler of `engine` (an `LLMEngine`) where the engine core runs in this process
    (`engine.engine_core.engine_core.scheduler`, whose `requests` maps the engine's request ids to vLLM's `Request`:
    TRL's colocate mode, whose external launcher keeps the engine core in process), else None (an engine core in a
    process of its own)."""
    scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
    return scheduler if isinstance(getattr(scheduler, "requests", None), dict) else None


def check_vllm_surfaces(llm, engine_loop: bool = True) -> None:
    """Raises VLLMSurfaceError naming the first vLLM surface GFPO's generation needs that this vLLM lacks:
    `LLM.generate`, seeded copies of `SamplingParams`, the outputs' fields and what counts the engine steps
    (`output_processor.process_outputs`, the scheduling mode) always, and with `engine_loop` (the early-stop rule can
    run) every surface the loop drives or reads: `LLM.enqueue`, the engine's step and abort by its own ids, the
    running requests' state."""
    import vllm
    from vllm import SamplingParams

    version = vllm.__version__
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        raise VLLMSurfaceError(f"vllm {version}: LLM has no llm_engine, which GFPO's generation drives")
    if not callable(getattr(llm, "generate", None)):
        raise VLLMSurfaceError(f"vllm {version}: LLM.generate no longer exists")
    if not callable(getattr(SamplingParams, "clone", None)):
        raise VLLMSurfaceError(f"vllm {version}: SamplingParams.clone no longer exists")
    for name in ("seed", "output_kind", "n", "detokenize", "stop"):
        if not hasattr(SamplingParams(), name):
            raise VLLMSurfaceError(f"vllm {version}: SamplingParams has no {name!r}")
    _check_fields(_OUTPUT_FIELDS, version)
    process_outputs = getattr(getattr(engine, "output_processor", None), "process_outputs", None)
    if not callable(process_outputs) or _parameters(process_outputs)[:1] != ["engine_core_outputs"]:
        raise VLLMSurfaceError(f"vllm {version}: {type(engine).__name__}.output_processor.process_outputs no longer "
                               "takes the engine core's outputs first (GFPO counts the engine steps that returned "
                               "model output with it)")
    async_scheduling(engine)
    if not engine_loop:
        return
    enqueue = getattr(llm, "enqueue", None)
    if not callable(enqueue) or not set(_ENQUEUE_PARAMETERS) <= set(_parameters(enqueue)):
        raise VLLMSurfaceError(f"vllm {version}: LLM.enqueue no longer exists or no longer takes "
                               f"{list(_ENQUEUE_PARAMETERS)} (GFPO's early stop adds its requests with it)")
    for name in _ENGINE_METHODS:
        if not callable(getattr(engine, name, None)):
            raise VLLMSurfaceError(f"vllm {version}: {type(engine).__name__}.{name} no longer exists; "
                                   "GFPO's early stop drives the engine with it")
    if "internal" not in _parameters(engine.abort_request):
        raise VLLMSurfaceError(f"vllm {version}: {type(engine).__name__}.abort_request no longer takes 'internal' "
                               "(GFPO's early stop aborts by the engine's own request ids, as LLM does)")
    try:
        vllm_enums()
    except (ImportError, AttributeError) as error:
        raise VLLMSurfaceError(f"vllm {version}: {error} (GFPO's early stop asks for final outputs only, "
                               "RequestOutputKind.FINAL_ONLY, and ends the requests it cuts with "
                               "FinishReason.ABORT)") from None
    states = getattr(engine.output_processor, "request_states", None)
    if not isinstance(states, dict):
        raise VLLMSurfaceError(f"vllm {version}: {type(engine).__name__}.output_processor.request_states "
                               "(the running requests' state, where GFPO's early stop reads their lengths) no longer "
                               "exists")
    try:
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        from vllm.v1.engine.output_processor import RequestState
    except ImportError as error:
        raise VLLMSurfaceError(f"vllm {version}: {error}; GFPO's early stop reads a running request's "
                               "RequestState") from None
    _check_fields(_ENGINE_LOOP_FIELDS, version)
    if not callable(getattr(IncrementalDetokenizer, "num_output_tokens", None)):
        raise VLLMSurfaceError(f"vllm {version}: IncrementalDetokenizer.num_output_tokens no longer exists "
                               "(GFPO's early stop reads a running request's length with it)")
    make_output = getattr(RequestState, "make_request_output", None)
    if not callable(make_output) or _parameters(make_output)[1:5] != _MAKE_OUTPUT_PARAMETERS:
        raise VLLMSurfaceError(f"vllm {version}: RequestState.make_request_output no longer takes "
                               f"{_MAKE_OUTPUT_PARAMETERS} first (GFPO's early stop builds the output of a request it "
                               "cuts with it)")


def request_seeds(base_seed: int, first_row: int, num_rows: int, total_rows: int) -> list[int]:
    """The seeds of global rows [first_row, first_row + num_rows) of a batch of `total_rows` completions: one draw
    of `total_rows` seeds from a generator seeded with `base_seed`, so every process (and every rank of a TP group)
    that has the same base seed gives a row the same seed, and no two rows of the batch share a generator."""
    generator = torch.Generator().manual_seed(base_seed)
    seeds = torch.randint(0, SEED_BOUND, (total_rows,), generator=generator, dtype=torch.int64)
    return seeds[first_row : first_row + num_rows].tolist()


def check_outputs(outputs: list) -> None:
    """One log-probability entry per completion token in every output that has log-probabilities (TRL pairs them
    position by position): raises VLLMSurfaceError naming the first request (its vLLM id and its prompt's position
    in the call) where that fails."""
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        if completion.logprobs is not None and len(completion.logprobs) != len(completion.token_ids):
            raise VLLMSurfaceError(f"vLLM returned {len(completion.logprobs)} log-probability entries for the "
                                   f"{len(completion.token_ids)} tokens of request {output.request_id!r} (prompt {i} "
                                   "of the call)")


class VLLMGroupGeneration:
    """One generation call of TRL's colocate path: `LLM.generate` with per-request seeds, or with the early-stop rule
    GFPO's engine loop on `llm`'s engine.

    Args:
        llm: the `vllm.LLM` TRL generates with (its `generate` and `enqueue` are read here, before the trainer
            replaces `generate`).
        group_size: completions per prompt (rows [g * group_size, (g + 1) * group_size) of the global batch form
            group g).
        k: the completions the length filter keeps per group.
        first_row: the global index of the first prompt `generate` receives (with tensor parallelism, of the TP
            group's gathered prompts).
        seeds: one seed per prompt `generate` receives, or None to leave sampling unseeded (vLLM's own stream).
        stop: whether to abort the requests the filter is certain to drop (GFPO's engine loop); False hands the call
            to `LLM.generate` (the seeds then still make the run the one with the rule on).
        tensor_parallel_size: the ranks sharing the engine; above 1 every abort is one call per request, in row
            order, so that every rank frees the same KV blocks in the same order.

    After `generate`: `stopped` (per prompt, aborted by the rule), `engine_steps` (engine steps whose output handed
    the frontend at least one request's tokens or end), `generated_tokens` (the tokens of the outputs returned, a cut
    request's as it held them), `discarded_tokens` (the tokens vLLM had scheduled for the requests the rule cut and
    not yet returned when each was cut, which it drops: vLLM's own count, see the module docstring; 0 with the rule
    off; None where the engine core is not in this process) and, after the rule's loop, `request_ids` (the engine's
    own id of each prompt's request). During the rule's loop, `watched` maps each group with k finished completions
    and running requests to the k-th shortest finished length (bench/vllm_host_cost.py fills it to measure the rule's
    worst case).
    """

    def __init__(self, llm, *, group_size: int, k: int, first_row: int, seeds: list[int] | None, stop: bool,
                 tensor_parallel_size: int = 1):
        self.engine = llm.llm_engine
        self.llm_generate = llm.generate  # vLLM's own, called with the rule off
        self.llm_enqueue = getattr(llm, "enqueue", None)  # LLM.generate's adding half, for the rule's loop
        self.group_size, self.k, self.first_row, self.seeds, self.stop = group_size, k, first_row, seeds, stop
        self.tensor_parallel_size = tensor_parallel_size
        self.stopped: list[bool] = []
        self.engine_steps = 0
        self.generated_tokens = 0
        self.discarded_tokens: int | None = 0
        self.request_ids: list[str] = []
        self.called = False
        self.watched: dict[int, int] = {}

    def generate(self, prompts, sampling_params=None, *, use_tqdm=False, **unsupported):
        """Stands in for `LLM.generate(prompts, sampling_params=..., use_tqdm=...)` as TRL's colocate path calls it:
        one `RequestOutput` per prompt, in order."""
        if unsupported:
            raise VLLMSurfaceError(f"TRL called LLM.generate with {sorted(unsupported)}, which GFPO's vLLM generation "
                                   "does not pass on")
        if self.called:
            raise VLLMSurfaceError("TRL's vLLM generation called LLM.generate twice in one generation call")
        self.called = True
        if sampling_params is None or isinstance(sampling_params, (list, tuple)):
            raise VLLMSurfaceError("TRL's vLLM generation no longer passes one SamplingParams for every prompt")
        if sampling_params.n != 1:
            raise VLLMSurfaceError(f"TRL's colocate generation asked for n={sampling_params.n} completions a request; "
                                   "GFPO's vLLM generation sends one request per completion (n=1)")
        prompts = list(prompts)
        if self.seeds is not None and len(self.seeds) != len(prompts):
            raise VLLMSurfaceError(f"TRL's vLLM generation sent {len(prompts)} prompts, {len(self.seeds)} were "
                                   "expected")
        self.stopped = [False] * len(prompts)
        with self._counting_engine_steps():
            if self.stop:
                outputs = self._run(prompts, sampling_params)
            else:
                outputs = self._generate_unchanged(prompts, sampling_params, use_tqdm)
        if len(outputs) != len(prompts):
            raise VLLMSurfaceError(f"LLM.generate returned {len(outputs)} outputs for {len(prompts)} prompts")
        check_outputs(outputs)
        self.generated_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        return outputs

    @contextlib.contextmanager
    def _counting_engine_steps(self):
        """Counts into `engine_steps`, for the block, the engine steps whose engine-core output holds at least one
        request's output (new tokens, or its end): `output_processor.process_outputs`, which every `LLMEngine.step`
        calls, wrapped on the instance (and restored after). A step that only launched a batch (async scheduling), or
        whose batch held only prefill chunks or requests already cut, hands it nothing."""
        processor = self.engine.output_processor
        own = vars(processor).get("process_outputs")
        process = processor.process_outputs

        def counted(engine_core_outputs, *args, **kwargs):
            if engine_core_outputs:
                self.engine_steps += 1
            return process(engine_core_outputs, *args, **kwargs)

        processor.process_outputs = counted
        try:
            yield
        finally:
            if own is None:
                del processor.process_outputs
            else:
                processor.process_outputs = own

    def _seeded(self, params, i: int):
        """A copy of `params` carrying prompt i's seed."""
        params = params.clone()
        params.seed = int(self.seeds[i])
        return params

    def _generate_unchanged(self, prompts: list, sampling_params, use_tqdm) -> list:
        """The rule off: vLLM's `LLM.generate`, with one seeded copy of the parameters per prompt where seeds are
        given."""
        params = sampling_params if self.seeds is None else [self._seeded(sampling_params, i)
                                                               for i in range(len(prompts))]
        return self.llm_generate(prompts, sampling_params=params, use_tqdm=use_tqdm)

    def _add_requests(self, prompts: list, sampling_params) -> list[str]:
        """Adds one request per prompt through `LLM.enqueue` (a copy of `sampling_params` that returns its output
        once, when it finishes, with the prompt's seed); returns the engine's own id of each. If adding fails,
        `LLM.enqueue` aborts the requests it added, and every request the engine still holds (one vLLM registered
        before failing; the engine held none before the call) is aborted too."""
        if not callable(self.llm_enqueue):  # checked when the trainer is built
            raise VLLMSurfaceError("LLM.enqueue no longer exists; GFPO's early stop adds its requests with it")
        final_only, _ = vllm_enums()
        per_request = []
        for i in range(len(prompts)):
            params = sampling_params.clone() if self.seeds is None else self._seeded(sampling_params, i)
            params.output_kind = final_only  # as LLM.generate: no output per running request and step
            if not params.stop:
                # TRL reads token ids only (it decodes them itself): no detokenizing, but for stop strings
                params.detokenize = False
            per_request.append(params)
        try:
            engine_ids = list(self.llm_enqueue(prompts, sampling_params=per_request, use_tqdm=False))
            if len(engine_ids) != len(prompts) or not all(isinstance(x, str) for x in engine_ids):
                raise VLLMSurfaceError(f"LLM.enqueue returned {engine_ids[:3]}... ({len(engine_ids)} ids) for "
                                       f"{len(prompts)} prompts, not one request id each")
        except BaseException:
            self._abort(list(self.engine.output_processor.request_states))
            raise
        return engine_ids

    def _abort(self, engine_ids: list[str]) -> None:
        """Aborts requests by the engine's own ids, as `LLM` does; with tensor parallelism one call per request, in
        the order given (vLLM's scheduler frees the requests of one call in the order of a set of their ids, which
        differ between ranks)."""
        if self.tensor_parallel_size > 1:
            for engine_id in engine_ids:
                self.engine.abort_request([engine_id], internal=True)
        elif engine_ids:
            self.engine.abort_request(engine_ids, internal=True)

    def _run(self, prompts: list, sampling_params) -> list:
        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("gfpo: the vLLM engine holds unfinished requests before a generation call; GFPO's "
                               "engine loop would run them too")
        n = len(prompts)
        # group -> its k-th shortest finished length, while it has running rows
        watched = self.watched = {}
        self.discarded_tokens = 0 if engine_scheduler(engine) is not None else None
        engine_ids = self.request_ids = self._add_requests(prompts, sampling_params)
        outputs: list = [None] * n
        group_of = [(self.first_row + i) // self.group_size for i in range(n)]
        running: dict[int, set[int]] = {}  # group -> its rows still generating
        for i, group in enumerate(group_of):
            running.setdefault(group, set()).add(i)
        finished_lengths: dict[int, list[int]] = {group: [] for group in running}
        try:
            states = engine.output_processor.request_states
            row_of = {}  # the id a request's output carries (the id LLM.enqueue gave it) -> its row
            for i, engine_id in enumerate(engine_ids):
                state = states.get(engine_id)
                if state is None:
                    raise VLLMSurfaceError(f"the vLLM engine holds no state for request {engine_id!r}, which "
                                           "LLM.enqueue just added")
                row_of[state.external_req_id] = i
            while engine.has_unfinished_requests():
                for output in engine.step():
                    i = row_of.get(output.request_id)
                    if i is None:
                        raise VLLMSurfaceError(f"the vLLM engine returned an output for request {output.request_id!r}, "
                                               "which GFPO did not add")
                    if outputs[i] is not None:
                        name = f"request {engine_ids[i]!r} (prompt {i} of the call)"
                        if self.stopped[i]:
                            raise VLLMSurfaceError(f"the vLLM engine returned an output for {name}, which the "
                                                   "early-stop rule had aborted: vLLM's abort_request did not stop it")
                        raise VLLMSurfaceError(f"the vLLM engine returned a second final output for {name}")
                    if not output.finished:
                        raise VLLMSurfaceError(f"the vLLM engine returned an unfinished output for request "
                                               f"{engine_ids[i]!r}, asked for its final output only")
                    outputs[i] = output
                    group = group_of[i]
                    running[group].discard(i)
                    lengths = finished_lengths[group]
                    lengths.append(len(output.outputs[0].token_ids))
                    if len(lengths) >= self.k and running[group]:
                        watched[group] = sorted(lengths)[self.k - 1]
                    elif not running[group]:
                        watched.pop(group, None)
                if watched:
                    self._abort_dropped(engine_ids, outputs, running, watched)
        except BaseException:
            self._abort([engine_ids[i] for i in sorted(i for rows in running.values() for i in rows)])
            raise
        for i, output in enumerate(outputs):
            if output is None:  # cannot happen: every request finishes or is cut with its output taken
                raise RuntimeError(f"gfpo: vLLM returned no output for request {engine_ids[i]}")
        return outputs

    def _in_flight(self, engine_ids: list[str]) -> int:
        """The tokens the engine core's scheduler has scheduled for these requests and not yet returned (vLLM's
        `Request.num_output_placeholders`: the requests' share of the batches launched and still in flight, which
        vLLM drops once the requests are aborted); a request the scheduler no longer holds has none."""
        requests = engine_scheduler(self.engine).requests
        total = 0
        for engine_id in engine_ids:
            request = requests.get(engine_id)
            if request is None:
                continue
            in_flight = getattr(request, "num_output_placeholders", None)
            if not isinstance(in_flight, int):
                raise VLLMSurfaceError(f"vLLM's scheduler request {engine_id!r} has num_output_placeholders="
                                       f"{in_flight!r}, not an int (GFPO counts the tokens of a cut request that vLLM "
                                       "discards with it)")
            total += in_flight
        return total

    def _abort_dropped(self, engine_ids, outputs, running, watched) -> int:
        """Aborts every running request that holds as many tokens as the k-th shortest finished completion of its
        group, or more (in row order); its output (the tokens and log-probabilities it holds, finish reason "abort")
        is taken from the engine's state of the request first, and the tokens vLLM has in flight for it are added to
        `discarded_tokens`. Returns the requests cut."""
        _, abort = vllm_enums()
        states = self.engine.output_processor.request_states
        cut = []  # (row, group, its output); a row leaves `running` only once aborted (an error before: the caller
        # aborts every running row)
        for group, limit in watched.items():
            for i in running[group]:
                state = states.get(engine_ids[i])
                if state is None:
                    raise VLLMSurfaceError(f"the vLLM engine holds no state for running request {engine_ids[i]!r}")
                try:
                    length = state.detokenizer.num_output_tokens()
                except AttributeError as error:  # checked when the trainer is built; a vLLM that differs at run time
                    raise VLLMSurfaceError(f"GFPO's early stop cannot read the length of running request "
                                           f"{engine_ids[i]!r} from vLLM's RequestState: {error}") from None
                if length >= limit:
                    cut.append((i, group, state.make_request_output([], None, abort, None)))
        if cut:
            cut.sort(key=lambda item: item[0])
            if self.discarded_tokens is not None:
                self.discarded_tokens += self._in_flight([engine_ids[i] for i, _, _ in cut])
            self._abort([engine_ids[i] for i, _, _ in cut])
            for i, group, output in cut:
                running[group].discard(i)
                outputs[i] = output
                self.stopped[i] = True
                if not running[group]:
                    watched.pop(group, None)
        return len(cut)
