"""GFPO's three generation paths, one interface: each stands in for the `generate` that TRL's
`GRPOTrainer._generate_single_turn` calls, for that one call.

- `HFStoppingPath`: HF generate; the unwrapped model's `generate` gets the early-stop logits processor
  (early_stop.StopDroppedCompletions).
- `ColocatePath`: vLLM in colocate mode; `LLM.generate` becomes `VLLMGroupGeneration.generate` (vllm_stop.py):
  one seeded request per completion, and with the rule the engine loop that aborts the requests the filter drops.
- `ServerPath`: vLLM in server mode; on the main process `VLLMClient.generate` becomes
  `ServerGroupGeneration.generate` (vllm_server.py), and the rows it cut are broadcast to every process.

A path is a context manager entered around TRL's single `super()._generate_single_turn(...)` call. It installs its
stand-in on entry (`replaced_attribute`) and puts the original back on exit; after a block that raised nothing it
tells whether TRL called the stand-in (`called`; `not_called` is the TRLSurfaceError message where it did not), this
process's rows the rule cut (`stopped_rows`, None where the rule did not run) and its metrics. The trainer picks the
path (GFPOTrainer._generation_path) and runs the sequence: seed, own random stream, path, TRL's call, checks.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from accelerate.utils import broadcast_object_list
from transformers import LogitsProcessorList

from .early_stop import StopDroppedCompletions
from ._compat import check_server_vllm_version
from .vllm_server import ServerGroupGeneration, ServerLimits, Transport, probe_streaming, server_vllm_version
from .vllm_stop import SEED_BOUND, VLLMGroupGeneration, request_seeds

logger = logging.getLogger(__name__)

_ABSENT = object()


@contextlib.contextmanager
def replaced_attribute(owner, name: str, value):
    """Sets `owner.name = value` for the block, then restores it exactly: the instance attribute `owner` had, or none
    (its class's attribute shows through again), also when the block raises.

    Args:
        owner: an object with a `__dict__` (a model, vLLM's `LLM`, TRL's `VLLMClient`).
        name: the attribute replaced.
        value: what `owner.name` is inside the block.
    """
    own = vars(owner).get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def generation_seed(colocated=None, process_index: int = 0) -> int:
    """The seed of a generation batch's own random stream, drawn from the CPU generator.

    Args:
        colocated: TRL's colocated vLLM generation (None: another path). With tensor parallelism the TP group's first
            rank sends its seed to the others before any stream is seeded with it, so the ranks generate the same
            requests (one whose CPU stream drifted would otherwise sample differently).
        process_index: this process's index (finds the TP group's first rank).

    Returns:
        An int in [0, vllm_stop.SEED_BOUND).
    """
    seed = int(torch.randint(0, SEED_BOUND, (1,)).item())
    if colocated is not None and colocated.tensor_parallel_size > 1:
        box = [seed]
        first_rank = process_index - process_index % colocated.tensor_parallel_size
        torch.distributed.broadcast_object_list(box, src=first_rank, group=colocated.tp_group)
        seed = box[0]
    return seed


@contextlib.contextmanager
def own_random_stream(seed: int, device: torch.device):
    """The CPU generator and `device`'s (where it is a CUDA device: generation samples there) seeded with `seed`, both
    restored afterwards. No other device's generator is touched (torch.manual_seed would reseed every CUDA device,
    and fork_rng restores only those it is given)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        for cuda_device in devices:
            torch.cuda.default_generators[cuda_device.index or 0].manual_seed(seed)
        yield


def stop_strings_with_tensor_parallelism(generation, args) -> str | None:
    """The warning for stop strings with tensor parallelism in colocate mode, or None where it does not apply.

    vLLM detects a stop string in its frontend and aborts the requests that ended on one itself, all of an engine
    step's in one call; its scheduler frees the requests of one call in the order of a set of their ids, which carry a
    random suffix per rank, so the ranks of a TP group return those KV blocks in different orders, and under KV-cache
    pressure with prefix caching can evict different blocks, schedule different batches and hang in a collective.
    GFPO's own aborts are one request a call (the same order on every rank); vLLM's are not its to change.

    Args:
        generation: TRL's colocated vLLM generation (`tensor_parallel_size`).
        args: the trainer's config (`generation_kwargs`, where TRL takes `stop` from).
    """
    stop = (getattr(args, "generation_kwargs", None) or {}).get("stop")
    if generation.tensor_parallel_size <= 1 or not stop:
        return None
    return (f"generation_kwargs['stop']={stop!r} with vllm_tensor_parallel_size={generation.tensor_parallel_size}: "
            "vLLM aborts the requests that end on a stop string itself, a step's in one call, and each rank's "
            "scheduler frees them in an order of its own (a set of ids that differ between ranks); under KV-cache "
            "pressure with prefix caching the ranks can then evict different blocks and hang in a collective. End "
            "completions on token ids instead (EOS, stop_token_ids), or generate with vllm_tensor_parallel_size=1 "
            "(docs/vllm.md, tensor parallelism)")


def check_server_version(generation, accelerator) -> None:
    """Server mode: the main process asks the server which vLLM it runs (vllm_server.server_vllm_version, with TRL's
    client session) and tells every process (a collective where there are several), and each checks it against the
    installed TRL's vLLM range (_compat.check_server_vllm_version: a ValueError outside it, on every process alike;
    a warning where it is untested, differs from the installed vLLM, or could not be read)."""
    box = [None]
    if accelerator.is_main_process:
        client = generation.vllm_client
        try:
            box[0] = (client.base_url, server_vllm_version(client.base_url, client.session), None)
        except (OSError, ValueError, TypeError, AttributeError) as error:  # requests' errors are OSErrors
            box[0] = (client.base_url, None, f"{type(error).__name__}: {error}")
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    check_server_vllm_version(*box[0])


class GenerationPath:
    """One generation call's stand-in for a `generate` of TRL's (see the module docstring). Subclasses give
    `_target` (what to replace, or None on a process that replaces nothing) and `_settle` (sets `called`,
    `stopped_rows` and `metrics` once TRL's call has returned)."""

    not_called: str  # the TRLSurfaceError message where TRL did not call the stand-in

    def __init__(self):
        self.called = False
        self.stopped_rows: torch.Tensor | None = None  # (local rows,) bool on the accelerator's device
        self.metrics: dict[str, float] = {}  # logged under "train" once per generation call
        self._replacement = contextlib.ExitStack()

    def _target(self) -> tuple[object, str, object] | None:
        raise NotImplementedError

    def _settle(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> GenerationPath:
        target = self._target()
        if target is not None:
            self._replacement.enter_context(replaced_attribute(*target))
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._replacement.close()
        if exc_type is None:
            self._settle()
        return False


class HFStoppingPath(GenerationPath):
    """HF generate with the early-stop rule: StopDroppedCompletions appended to the logits processors of the one call
    of the unwrapped model's `generate`. The processor runs at the first decoding step, so `called` also says that
    TRL generated with that model.

    Args:
        model: the model TRL generates with (`trainer.model`; its unwrapped model's `generate` is replaced).
        accelerator: the trainer's (unwraps the model; its process index and device place the rows).
        n_local: this process's rows (prompt x completion) in the call.
        eos_token_ids, group_size, k: as for StopDroppedCompletions.
    """

    not_called = ("GRPOTrainer._generate_single_turn did not generate with "
                  "accelerator.unwrap_model(trainer.model).generate, where GFPO's early-stop rule "
                  "(gfpo_stop_dropped_generations) is installed")

    def __init__(self, model, accelerator, *, n_local: int, eos_token_ids: list[int], group_size: int, k: int):
        super().__init__()
        self.model, self.device = accelerator.unwrap_model(model), accelerator.device
        self.stopper = StopDroppedCompletions(eos_token_ids, group_size, k,
                                              first_row=accelerator.process_index * n_local)

    def _target(self):
        original, stopper = self.model.generate, self.stopper

        def generate(*args, **kwargs):
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(stopper)
            return original(*args, logits_processor=processors, **kwargs)

        return self.model, "generate", generate

    def _settle(self) -> None:
        self.called = self.stopper.stopped is not None
        if self.called:
            self.stopped_rows = self.stopper.stopped.to(self.device)


class ColocatePath(GenerationPath):
    """vLLM in colocate mode: one request per completion, seeded from `base_seed`, and with the rule the running
    requests of a group aborted once the filter is certain to drop them (vllm_stop.py); without the rule, vLLM's own
    `LLM.generate` with the seeded parameters. Every rank of a TP group generates the group's gathered prompts and
    keeps its own share, and aborts one request a call, in row order (every rank frees the same KV blocks in the same
    order). Metrics: `gfpo/vllm_engine_steps` (engine steps that handed the frontend new tokens) and, with the rule,
    `gfpo/vllm_discarded_tokens` (the tokens vLLM had scheduled for the requests the rule cut and not yet returned,
    which it drops: vLLM's own count, read before each abort; 0 with synchronous scheduling; not logged where the
    engine core runs in a process of its own).

    Args:
        generation: TRL's colocated vLLM generation (`llm`, `tensor_parallel_size`).
        accelerator: the trainer's (process index and count, device).
        n_local: this process's rows (prompt x completion) in the call.
        group_size, k: completions per prompt; those the length filter keeps.
        base_seed: the seed the request seeds come from (vllm_stop.request_seeds); None leaves them unseeded.
        stop: whether the early-stop rule runs.
    """

    not_called = ("GRPOTrainer._generate_single_turn did not call LLM.generate of its colocated vLLM engine "
                  "(trl.generation.vllm_generation); GFPO's seeded, stopping generation did not run")

    def __init__(self, generation, accelerator, *, n_local: int, group_size: int, k: int, base_seed: int | None,
                 stop: bool):
        super().__init__()
        tp = generation.tensor_parallel_size
        rank_in_tp = accelerator.process_index % tp
        first_row = (accelerator.process_index - rank_in_tp) * n_local  # of the TP group's gathered prompts
        seeds = None if base_seed is None else request_seeds(base_seed, first_row, n_local * tp,
                                                             n_local * accelerator.num_processes)
        self.llm, self.device, self.stop = generation.llm, accelerator.device, stop
        self.local = slice(rank_in_tp * n_local, (rank_in_tp + 1) * n_local)
        self.plan = VLLMGroupGeneration(self.llm, group_size=group_size, k=k, first_row=first_row, seeds=seeds,
                                        stop=stop, tensor_parallel_size=tp)

    def _target(self):
        return self.llm, "generate", self.plan.generate  # TRL's colocate path calls self.llm.generate(...)

    def _settle(self) -> None:
        self.called = self.plan.called
        if self.called and self.stop:
            self.stopped_rows = torch.tensor(self.plan.stopped[self.local], dtype=torch.bool, device=self.device)
        self.metrics = {"gfpo/vllm_engine_steps": float(self.plan.engine_steps)}
        if self.called and self.stop and self.plan.discarded_tokens is not None:
            self.metrics["gfpo/vllm_discarded_tokens"] = float(self.plan.discarded_tokens)


class ServerPath(GenerationPath):
    """vLLM in server mode: one request per completion of the global batch, seeded from the main process's
    `base_seed` (on one process, the seeds colocate mode gives the same rows), and with the rule streamed and cut
    once the filter is certain to drop it (vllm_server.py). Only the main process talks to the server; TRL
    broadcasts the completions, and on exit the main process broadcasts whether its stand-in ran and the rows it cut
    (a collective: every process exits its path).

    Args:
        generation: TRL's vLLM generation (its `vllm_client` is read on the main process only).
        accelerator: the trainer's (which process is the main one, process index and count, device).
        n_local: this process's rows in the call.
        group_size, k: completions per prompt; those the length filter keeps.
        base_seed: the seed the request seeds come from; None leaves them unseeded.
        stop: whether the early-stop rule runs.
        limits: the client's limits (GFPOConfig.gfpo_vllm_server_*).
    """

    not_called = ("GRPOTrainer._generate_single_turn did not call VLLMClient.generate of its vLLM server client "
                  "(trl.generation.vllm_generation); GFPO's seeded, stopping generation did not run")

    def __init__(self, generation, accelerator, *, n_local: int, group_size: int, k: int, base_seed: int | None,
                 stop: bool, limits: ServerLimits):
        super().__init__()
        self.accelerator, self.n_local, self.stop = accelerator, n_local, stop
        self.client = self.plan = None
        if accelerator.is_main_process:
            self.client = generation.vllm_client
            self.plan = ServerGroupGeneration(self.client.base_url, self.client.model, group_size=group_size, k=k,
                                              base_seed=base_seed, stop=stop, limits=limits,
                                              transport=Transport.of_session(self.client.session,
                                                                             self.client.base_url))

    @staticmethod
    def stop_unavailable(generation, accelerator, args, rule_configured: bool) -> str | None:
        """Why the server cannot run the early-stop rule (it does not stream what the rule reads), or None: it can,
        or the rule is not asked for (`rule_configured` False). The main process asks the server once, warns where
        it cannot, and tells every process (a collective where there are several). The trainer calls it when built,
        and it checks the client's limits in `args` (GFPOConfig.gfpo_vllm_server_*) first, so a bad one fails there.
        """
        limits = ServerLimits.from_config(args)
        if not rule_configured:
            return None
        box = [None]
        if accelerator.is_main_process:
            client = generation.vllm_client
            box[0] = probe_streaming(client.base_url, client.model, Transport.of_session(client.session,
                                                                                         client.base_url), limits)
            if box[0] is not None:
                logger.warning(f"gfpo_stop_dropped_generations is not applied with the vLLM server at "
                               f"{client.base_url}: {box[0]}. Every completion is generated to its end (one request "
                               "each, seeded as with the rule off)")
        if accelerator.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        return box[0]

    def _target(self):
        # TRL's server path calls self.vllm_client.generate(...) on the main process only
        return None if self.plan is None else (self.client, "generate", self.plan.generate)

    def _settle(self) -> None:
        box = [None if self.plan is None else (self.plan.called, self.plan.stopped if self.stop else None)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        self.called, stopped = box[0]
        if stopped is not None:
            first = self.accelerator.process_index * self.n_local
            self.stopped_rows = torch.tensor(stopped[first : first + self.n_local], dtype=torch.bool,
                                             device=self.accelerator.device)
