"""Generation on vLLM (colocate mode) with the length filter: one seeded request per completion, and the running
requests of a group aborted once the filter is certain to drop them.

TRL's colocate path sends one `n=1` request per completion through `LLM.generate` and waits for all of them. For
one generation call GFPO puts `VLLMGroupGeneration.generate` in the place of that method (the trainer's
`_generate_single_turn`), and drives the engine step by step itself: `LLMEngine.add_request` with a copy of TRL's
sampling parameters that streams its tokens (`RequestOutputKind.DELTA`) and carries the completion's own seed,
`LLMEngine.step`, and `LLMEngine.abort_request`. It returns what `LLM.generate` returns, one `RequestOutput` per
prompt in order, so TRL reads the completions and their log-probabilities as it always does.

The rule (the same guarantee as early_stop.py on HF generate): the length filter keeps the k completions of a group
with the fewest tokens, ties to the lower index. Once k completions of a group have finished, let L be the k-th
smallest of their lengths. A running request of that group holding L tokens or more has not ended within L tokens,
so it will end longer than L, longer than k finished completions: it is dropped whatever it goes on to say, and is
aborted at once (waiting for it to pass L would cost every such request one more token and the engine one more
step). It comes back with the tokens and log-probabilities it had (L or more), marked stopped: the length filter
ranks a stopped completion as one token longer than it holds (selection.py), as it would have been at least, so it
ranks below those k even under the tie rule. A request waiting for a slot, or holding fewer than L tokens, runs on
until it finishes or reaches L.

Why the kept completions do not change: each completion is its own request with its own seed, so the tokens a
request samples depend on its seed and its logits alone, not on which other requests share a step (vLLM's sampler
draws a seeded request's noise from that request's generator). Its logits do not depend on the batch either where
vLLM's numerics are batch-invariant: the CPU engine, or batch-invariant mode on a GPU (docs/vllm.md). The kept rows
finished before the rule touched their group, so they are the same completions with the rule on or off.

Tensor parallelism: every rank of a TP group runs this loop on the same requests with the same seeds, and its
decisions are a function of the sampled tokens alone, which all ranks share, so every rank aborts the same requests
at the same step. A group that straddles processes: each process counts only the rows it generates (conservative:
it stops less, never wrongly).
"""

from __future__ import annotations

import uuid
import torch

# seeds are drawn below 2**62: vLLM seeds a torch.Generator with them, and other engines take a signed 64-bit int
SEED_BOUND = 2**62


class VLLMSurfaceError(RuntimeError):
    """A vLLM internal that GFPO's early stop drives has changed shape."""


# vLLM surfaces the engine loop uses: (object description, attribute)
_ENGINE_METHODS = ("add_request", "step", "abort_request", "has_unfinished_requests")


def check_vllm_surfaces(llm) -> None:
    """Raises VLLMSurfaceError naming the first vLLM surface the engine loop needs that this vLLM lacks."""
    import vllm
    from vllm import RequestOutput, SamplingParams

    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        raise VLLMSurfaceError(f"vllm {vllm.__version__}: LLM has no llm_engine, which GFPO's early stop drives")
    for name in _ENGINE_METHODS:
        if not callable(getattr(engine, name, None)):
            raise VLLMSurfaceError(f"vllm {vllm.__version__}: {type(engine).__name__}.{name} no longer exists; "
                                   "GFPO's early stop drives the engine with it")
    try:
        from vllm.sampling_params import RequestOutputKind
    except ImportError:
        raise VLLMSurfaceError(f"vllm {vllm.__version__}: vllm.sampling_params.RequestOutputKind no longer exists") from None
    if not hasattr(RequestOutputKind, "DELTA"):
        raise VLLMSurfaceError(f"vllm {vllm.__version__}: RequestOutputKind has no DELTA (streamed tokens)")
    for owner, name in ((SamplingParams, "clone"), (RequestOutput, "add")):
        if not callable(getattr(owner, name, None)):
            raise VLLMSurfaceError(f"vllm {vllm.__version__}: {owner.__name__}.{name} no longer exists")
    for name in ("seed", "output_kind", "n"):
        if not hasattr(SamplingParams(), name):
            raise VLLMSurfaceError(f"vllm {vllm.__version__}: SamplingParams has no {name!r}")


def request_seeds(base_seed: int, first_row: int, num_rows: int, total_rows: int) -> list[int]:
    """The seeds of global rows [first_row, first_row + num_rows) of a batch of `total_rows` completions: one draw
    of `total_rows` seeds from a generator seeded with `base_seed`, so every process (and every rank of a TP group)
    that has the same base seed gives a row the same seed, and no two rows of the batch share a generator."""
    generator = torch.Generator().manual_seed(base_seed)
    seeds = torch.randint(0, SEED_BOUND, (total_rows,), generator=generator, dtype=torch.int64)
    return seeds[first_row : first_row + num_rows].tolist()


class VLLMGroupGeneration:
    """One generation call of TRL's colocate path, run request by request on `llm`'s engine.

    Args:
        llm: the `vllm.LLM` TRL generates with.
        group_size: completions per prompt (rows [g * group_size, (g + 1) * group_size) of the global batch form
            group g).
        k: the completions the length filter keeps per group.
        first_row: the global index of the first prompt `generate` receives (with tensor parallelism, of the TP
            group's gathered prompts).
        seeds: one seed per prompt `generate` receives, or None to leave sampling unseeded (vLLM's own stream).
        stop: whether to abort the requests the filter is certain to drop; False generates every completion to its
            end (the seeds then still make the run the one with the rule on).

    After `generate`: `stopped` (per prompt, aborted by the rule), `engine_steps` and `generated_tokens`.
    """

    def __init__(self, llm, *, group_size: int, k: int, first_row: int, seeds: list[int] | None, stop: bool):
        self.engine = llm.llm_engine
        self.group_size, self.k, self.first_row, self.seeds, self.stop = group_size, k, first_row, seeds, stop
        self.stopped: list[bool] = []
        self.engine_steps = 0
        self.generated_tokens = 0
        self.called = False

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
        if self.seeds is not None and len(self.seeds) != len(prompts):
            raise VLLMSurfaceError(f"TRL's vLLM generation sent {len(prompts)} prompts, {len(self.seeds)} were expected")
        return self._run(list(prompts), sampling_params)

    def _run(self, prompts: list, sampling_params) -> list:
        from vllm.sampling_params import RequestOutputKind

        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("gfpo: the vLLM engine holds unfinished requests before a generation call; GFPO's "
                               "engine loop would run them too")
        n = len(prompts)
        call = uuid.uuid4().hex
        request_ids = [f"gfpo-{call}-{i}" for i in range(n)]
        row_of = {request_id: i for i, request_id in enumerate(request_ids)}
        added = 0
        try:
            for i, prompt in enumerate(prompts):
                params = sampling_params.clone()
                params.output_kind = RequestOutputKind.DELTA  # each step's new tokens: the running lengths
                if not params.stop:
                    # TRL reads token ids only (it decodes them itself); the text of every step would be detokenized
                    # and concatenated for nothing. Stop strings need it.
                    params.detokenize = False
                if self.seeds is not None:
                    params.seed = int(self.seeds[i])
                engine.add_request(request_ids[i], prompt, params)
                added += 1
        except BaseException:
            engine.abort_request(request_ids[:added])
            raise

        outputs: list = [None] * n
        self.stopped = [False] * n
        group_of = [(self.first_row + i) // self.group_size for i in range(n)]
        running: dict[int, set[int]] = {}  # group -> its rows still generating
        for i, group in enumerate(group_of):
            running.setdefault(group, set()).add(i)
        finished_lengths: dict[int, list[int]] = {group: [] for group in running}
        limits: dict[int, int] = {}  # group -> its k-th shortest finished length, once k have finished
        try:
            while engine.has_unfinished_requests():
                step_outputs = engine.step()
                self.engine_steps += 1
                for output in step_outputs:
                    i = row_of.get(output.request_id)
                    if i is None:
                        raise VLLMSurfaceError(f"the vLLM engine returned an output for request {output.request_id!r}, "
                                               "which GFPO did not add")
                    if outputs[i] is None:
                        outputs[i] = output
                    else:
                        outputs[i].add(output, aggregate=True)
                    if output.finished:
                        group = group_of[i]
                        running[group].discard(i)
                        finished_lengths[group].append(len(outputs[i].outputs[0].token_ids))
                        if len(finished_lengths[group]) >= self.k:
                            limits[group] = sorted(finished_lengths[group])[self.k - 1]
                if self.stop and limits:
                    self._abort_dropped(request_ids, outputs, running, limits)
        except BaseException:
            engine.abort_request([request_ids[i] for rows in running.values() for i in rows])
            raise
        for i, output in enumerate(outputs):
            if output is None:  # cannot happen: the rule aborts a request only once it holds L >= 1 tokens
                raise RuntimeError(f"gfpo: vLLM returned no output for request {request_ids[i]}")
            if self.stopped[i]:
                output.finished = True
                output.outputs[0].finish_reason = "abort"
        self.generated_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        return outputs

    def _abort_dropped(self, request_ids, outputs, running, limits) -> None:
        """Aborts, in one call, every running request that holds as many tokens as the k-th shortest finished
        completion of its group, or more."""
        to_abort = []
        for group, limit in limits.items():
            rows = running[group]
            cut = [i for i in rows if outputs[i] is not None and len(outputs[i].outputs[0].token_ids) >= limit]
            for i in cut:
                rows.discard(i)
                self.stopped[i] = True
                to_abort.append(request_ids[i])
        if to_abort:
            self.engine.abort_request(to_abort)
