"""The TRL surfaces GFPOTrainer hooks into, checked at construction.

A copy of `GRPOTrainer._generate_and_score_completions` breaks on every GRPO rewrite (docs/trl-compatibility.md), so
we copy nothing: we wrap `_calculate_rewards`, `_get_per_token_logps_and_entropies` (to defer the no-grad
log-prob passes to the kept rows), `_generate_single_turn` (to stop completions the length filter will
drop) and `_generate` (to read the tool masks), post-process the dict `_generate_and_score_completions` returns, and override `compute_loss`. If TRL
changes one of these, `check_trl_surfaces` raises naming the surface instead of training on a silently wrong
batch.

Which TRL: that check decides, not the packaging. The `trainer` extra asks for TRL's lower bound only, so installing
gfpo never replaces a newer TRL a user has; a TRL outside TESTED_TRL whose hooked surfaces all match trains, with a
one-time warning naming the tested range and how to install it, and one whose surfaces moved is refused. The `test`
extra holds TRL to TESTED_TRL, so the suite runs on the releases it was written against.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import NamedTuple

import trl
from packaging.version import Version
from trl import GRPOTrainer

# the TRL releases the suite tests (pyproject.toml's `test` extra; below 1.14.2 `_generate_single_turn` lacks
# `num_generations`, which is also the `trainer` extra's lower bound)
TESTED_TRL = (">=1.14.2", "<1.17")
# releases the trainer tests ran against (CI: 1.14.2 via scripts/test_oldest_trl.sh, 1.16.0 in .venv)
KNOWN_WORKING_TRL = ("1.14.2", "1.15.0", "1.16.0")
# what installs a tested TRL (the untested-TRL warning and the refusals name it); with vLLM, TRL's extra keeps the vLLM
# in that TRL's range
TESTED_TRL_INSTALL = f"pip install 'trl{','.join(TESTED_TRL)}'"
TESTED_TRL_VLLM_INSTALL = f"pip install 'trl[vllm]{','.join(TESTED_TRL)}'"
# the vLLM releases GFPO's vLLM paths ran on (the CPU engine's tests: scripts/test_vllm_cpu.sh, both ends); outside
# them the surfaces are still checked when the trainer is built, with a one-time warning
TESTED_VLLM = ("0.22.1", "0.31.0")
_warned_untested_vllm: set[str] = set()
# set to 1 to use the fused kernels on a TRL outside TESTED_TRL (check_fused_kernels_trl)
FUSED_ON_UNTESTED_TRL_ENV = "GFPO_FUSED_KERNELS_ON_UNTESTED_TRL"
_warned_untested: set[str] = set()
# the vLLM releases each tested TRL release generates with (its `vllm` extra; TRL warns outside them): GFPO's
# `vllm` extra installs `trl[vllm]`, so a user gets the range of the TRL they have (for an untested TRL, the range
# its own metadata declares: declared_vllm)
VLLM_RANGE_BY_TRL = {"1.14": ("0.20.0", "0.30.0"), "1.15": ("0.21.0", "0.31.0"), "1.16": ("0.22.0", "0.31.0")}
# distributions that install the `vllm` module: upstream's, and its CPU build on PyPI (the CI engine)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# what installs vLLM for GFPO, as docs/vllm.md's install section says (the messages and the env report name it)
VLLM_INSTALL_HINT = "pip install --no-build-isolation '.[trainer,vllm]' in gfpo's source tree (docs/vllm.md)"

# method -> parameters it must accept, in order (after self). A method may instead forward the tail of these as
# `*args` (TRL 1.14's `_get_per_token_logps_and_entropies(model, *args, batch_size=None, ...)`); GFPO therefore
# always passes `batch_size` by keyword.
_SURFACES = {
    "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["inputs"],
    "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "_compute_loss": ["model", "inputs"],
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations"],
    "_generate": ["prompts"],
    "_save_checkpoint": ["model", "trial"],  # transformers' (TRL overrides it too); GFPO adds its state file
    "_get_train_sampler": ["dataset"],  # GFPO makes each epoch's order resumable (state.replay_epoch_order)
}
# keys of the dict `_generate_and_score_completions` returns that GFPO reads or rewrites
OUTPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch")
# per-row keys GFPO knows how to filter and rebalance: name -> (padding value, pads on the left)
ROW_KEYS = {
    "prompt_ids": (None, True),  # None: the tokenizer's pad id
    "prompt_mask": (0, True),
    "completion_ids": (None, False),
    "completion_mask": (0, False),
    "advantages": (0.0, False),
    "old_per_token_logps": (0.0, False),
    "ref_per_token_logps": (0.0, False),
    "sampling_per_token_logps": (0.0, False),
    "importance_sampling_ratio": (1.0, False),
    "tool_mask": (1, False),
}
# batch keys GRPOTrainer._compute_loss passes to the model beside the token ids (images and their layout): the fused
# loss path does not pass them, so a batch that carries one is refused there
MULTIMODAL_INPUT_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                         "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
# multimodal batch keys with one column per token of the prompt and the completion, (B, P + T): GRPOTrainer appends T
# zero columns for the completion to the processor's token types (a model that reads them, e.g. Qwen2-VL's M-RoPE,
# needs them as wide as its input ids)
PROMPT_COMPLETION_KEYS = ("token_type_ids", "mm_token_type_ids")
# the loss metrics GRPOTrainer._compute_loss logs as means over the scored tokens (or the sequences) of every process
# (0 when there is none); kl, the clip ratios and vespo's weight where the loss has them
TOKEN_MEAN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                      "cispo_clip_ratio", "vespo/phi_seq_mean")
# the metrics GRPOTrainer logs once per generation batch over its completions (_generate: the lengths;
# _generate_and_score_completions: the rewards, with "rewards/{name}/mean" and "/std" per reward function); with the
# length filter GFPO recomputes them over the kept rows (selection.log_trl_metrics_of_kept_rows)
COMPLETION_METRICS = ("completions/mean_length", "completions/min_length", "completions/max_length",
                      "completions/clipped_ratio", "completions/mean_terminated_length",
                      "completions/min_terminated_length", "completions/max_terminated_length")
REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std")


def batch_metric_names(trainer) -> list[str]:
    """The metrics GRPOTrainer logs once per generation batch over its completions (COMPLETION_METRICS,
    REWARD_METRICS and the per-function reward metrics)."""
    per_function = [f"rewards/{name}/{stat}" for name in trainer.reward_func_names for stat in ("mean", "std")]
    return [*COMPLETION_METRICS, *REWARD_METRICS, *per_function]


# GRPOTrainer attributes GFPO reads
_ATTRIBUTES = ("num_generations", "reward_weights", "scale_rewards", "beta", "ref_model", "temperature", "loss_type",
               "eos_token_ids", "use_vllm", "vllm_mode", "use_transformers_continuous_batching", "tools", "pad_to_multiple_of",
               "_get_output_dir", "reward_func_names", "_metrics")


class TRLSurfaceError(RuntimeError):
    """A TRL internal that GFPOTrainer hooks into has changed shape."""


def _supported() -> str:
    """The tested range and what installs it, for the end of a message."""
    return (f"gfpo is tested on trl {','.join(TESTED_TRL)} ({', '.join(KNOWN_WORKING_TRL)}): {TESTED_TRL_INSTALL} "
            f"(with vLLM: {TESTED_TRL_VLLM_INSTALL})")


def is_tested_trl(version: str) -> bool:
    """Whether `version` lies in TESTED_TRL (the range CI tests at both ends); a pre-release of the excluded upper
    release (1.17.0.dev0) is outside it, since its internals are the next release's."""
    low, high = (Version(bound.lstrip("<>=")) for bound in TESTED_TRL)
    return low <= Version(Version(version).base_version) < high


def vllm_version() -> str | None:
    """The installed vLLM's version (from whichever distribution of VLLM_DISTRIBUTIONS installed it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def supported_vllm(trl_version: str) -> tuple[str, str] | None:
    """The (lowest, highest) vLLM release, both included, that `trl_version` generates with; None for a TRL
    outside VLLM_RANGE_BY_TRL."""
    release = Version(trl_version).release
    return VLLM_RANGE_BY_TRL.get(f"{release[0]}.{release[1]}")


def _installed_trl_metadata() -> tuple[str, list[str]] | None:
    """The installed TRL distribution's version and requirement lines, or None where none is installed."""
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        return version("trl"), requires("trl") or []
    except PackageNotFoundError:
        return None


def declared_vllm(trl_version: str):
    """The vLLM versions (a packaging SpecifierSet) that TRL's own `vllm` extra asks for, read from the installed
    TRL's metadata where that TRL is `trl_version`: what `pip install 'trl[vllm]'` installs, and the range of a TRL
    outside VLLM_RANGE_BY_TRL. None where the installed TRL is another release or declares no vLLM."""
    from packaging.requirements import InvalidRequirement, Requirement

    installed = _installed_trl_metadata()
    if installed is None or Version(installed[0]) != Version(trl_version):
        return None
    for line in installed[1]:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if (requirement.name == "vllm" and requirement.marker is not None
                and requirement.marker.evaluate({"extra": "vllm"})):
            return requirement.specifier
    return None


class VLLMRange(NamedTuple):
    """The vLLM releases a TRL generates with: `text` for messages ("0.22.0 to 0.31.0", or the declared specifier),
    `specifier` (a packaging SpecifierSet), and whether it was read from an untested TRL's metadata (`declared`)."""

    text: str
    specifier: object
    declared: bool

    def contains(self, vllm: str) -> bool:
        """Whether vLLM `vllm` lies in the range, pre- and post-releases and local builds (0.31.0+cpu) by their base
        version, as TRL compares them."""
        return self.specifier.contains(Version(vllm).base_version, prereleases=True)

    def describe(self, trl_version: str) -> str:
        """"vllm X to Y (trl V's range)", or for an untested TRL the range its metadata declares, saying so."""
        if self.declared:
            return f"vllm {self.text} (the range trl {trl_version} declares; gfpo has not tested that trl)"
        return f"vllm {self.text} (trl {trl_version}'s range)"


def vllm_range(trl_version: str) -> VLLMRange | None:
    """The vLLM range of `trl_version`: VLLM_RANGE_BY_TRL's for a tested release, else the range the installed TRL's
    metadata declares (declared_vllm); None where neither says."""
    from packaging.specifiers import SpecifierSet

    bounds = supported_vllm(trl_version)
    if bounds is not None:
        low, high = bounds
        return VLLMRange(f"{low} to {high}", SpecifierSet(f">={low},<={high}"), declared=False)
    declared = declared_vllm(trl_version)
    return None if declared is None else VLLMRange(str(declared), declared, declared=True)


def is_supported_vllm(vllm: str, trl_version: str) -> bool:
    """Whether vLLM `vllm` lies in the range of `trl_version` (vllm_range; pre- and post-releases by their base
    version, as TRL compares them)."""
    known = vllm_range(trl_version)
    return known is not None and known.contains(vllm)


def check_vllm_version() -> None:
    """With use_vllm=True: vLLM is installed, in the range of the installed TRL (vllm_range). Otherwise an
    ImportError of one line naming the version found and the versions supported."""
    found = vllm_version()
    known = vllm_range(trl.__version__)
    supported = known.describe(trl.__version__) if known else f"the vllm of a tested trl ({_supported()})"
    if found is None:
        raise ImportError(f"use_vllm=True needs {supported}, and vLLM is not installed: {VLLM_INSTALL_HINT}")
    if known is None or not known.contains(found):
        raise ImportError(f"use_vllm=True: vllm {found} is installed, GFPOTrainer supports {supported}: "
                          f"{VLLM_INSTALL_HINT} installs one")
    low, high = (Version(v) for v in TESTED_VLLM)
    if not low.release <= Version(found).release <= high.release and found not in _warned_untested_vllm:
        _warned_untested_vllm.add(found)
        warnings.warn(
            f"gfpo: vllm {found} is untested: GFPO's vLLM paths ran on vllm {TESTED_VLLM[0]} to {TESTED_VLLM[1]}; the "
            "vLLM surfaces they read are checked when the trainer is built, the engine's behaviour behind them is not",
            UserWarning,
            stacklevel=3,
        )


def check_fused_kernels_trl() -> None:
    """use_gfpo_kernels=True: the fused loss and the group kernel reproduce the loss and advantages of the tested TRL
    releases; on another TRL a changed formula behind unchanged methods would train differently without a word, so
    it is refused (a ValueError naming the ways out) unless FUSED_ON_UNTESTED_TRL_ENV is set to 1."""
    if is_tested_trl(trl.__version__) or os.environ.get(FUSED_ON_UNTESTED_TRL_ENV) == "1":
        return
    raise ValueError(
        f"use_gfpo_kernels=True: trl {trl.__version__} is untested, and the fused kernels reproduce the loss and "
        f"advantages of trl {','.join(TESTED_TRL)} only. Set use_gfpo_kernels=False (TRL's own loss, GFPO's filter "
        f"kept), install a tested TRL ({TESTED_TRL_INSTALL}; with vLLM: {TESTED_TRL_VLLM_INSTALL}), or set "
        f"{FUSED_ON_UNTESTED_TRL_ENV}=1 to use them anyway"
    )


def check_vllm_generation(trainer) -> None:
    """The colocated vLLM engine GFPO's seeded, stopping generation drives (use_vllm=True, vllm_mode="colocate",
    group_filter="length"): TRL's VLLMGeneration attributes it reads, then the vLLM surfaces (the engine loop's only
    where the early-stop rule can run: GFPOTrainer._early_stop_configured, and no tools)."""
    from .vllm_stop import check_vllm_surfaces

    generation = getattr(trainer, "vllm_generation", None)
    for name in ("llm", "tensor_parallel_size") + (("tp_group",) if getattr(generation, "tensor_parallel_size", 1) > 1
                                                   else ()):
        if not hasattr(generation, name):
            raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer.vllm_generation no longer has {name!r}, which "
                                  f"GFPO's vLLM generation reads; {_supported()}")
    check_vllm_surfaces(generation.llm, engine_loop=trainer._early_stop_configured() and not trainer.tools)


# the parameters of VLLMClient.generate that TRL's server path passes and GFPO's stand-in takes (vllm_server.py)
_CLIENT_GENERATE_PARAMETERS = ("prompts", "features", "n", "repetition_penalty", "temperature", "top_p", "top_k",
                               "min_p", "max_tokens", "logprobs", "structured_outputs_regex", "generation_kwargs")


def check_vllm_server_generation(trainer) -> None:
    """The TRL surfaces GFPO's generation through a vLLM server drives (use_vllm=True, vllm_mode="server",
    group_filter="length"): TRL's VLLMGeneration and, on the main process (the one that talks to the server), its
    VLLMClient with the parameters GFPO's stand-in for `VLLMClient.generate` takes; TRL's parse of the server's
    log-probabilities, which the stand-in returns as TRL's client does; the client's requests session, whose headers,
    proxy and TLS settings GFPO's requests carry; aiohttp, which streams the requests."""
    from .vllm_server import _aiohttp

    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or not callable(getattr(generation, "generate", None)):
        raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer.vllm_generation.generate no longer exists, which "
                              f"GFPO's vLLM server generation wraps; {_supported()}")
    try:
        from trl.generation.vllm_client import VLLMClient, parse_logprobs
    except ImportError as error:
        raise TRLSurfaceError(f"trl {trl.__version__}: {error}; GFPO's vLLM server generation needs "
                              f"trl.generation.vllm_client.VLLMClient and parse_logprobs; {_supported()}") from None
    if not callable(parse_logprobs):
        raise TRLSurfaceError(f"trl {trl.__version__}: trl.generation.vllm_client.parse_logprobs is not a function")
    parameters = list(inspect.signature(VLLMClient.generate).parameters)[1:]
    if parameters != list(_CLIENT_GENERATE_PARAMETERS):
        raise TRLSurfaceError(f"trl {trl.__version__}: VLLMClient.generate takes {parameters}, GFPO's vLLM server "
                              f"generation stands in for one taking {list(_CLIENT_GENERATE_PARAMETERS)}; "
                              f"{_supported()}")
    if trainer.accelerator.is_main_process:
        client = getattr(generation, "vllm_client", None)
        for name in ("base_url", "model", "generate", "session"):
            if not hasattr(client, name):
                raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer.vllm_generation.vllm_client no longer has "
                                      f"{name!r}, which GFPO's vLLM server generation reads; {_supported()}")
    _aiohttp()


def _accepts(method, expected: list[str]) -> bool:
    """`method` takes `expected` in order after self, or takes a prefix of them and forwards the rest through
    `*args` while still naming the others as keywords (so GFPO's keyword `batch_size` reaches the same place)."""
    params = list(inspect.signature(method).parameters.values())[1:]
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if named[: len(expected)] == expected:
        return True
    forwards = any(p.kind is p.VAR_POSITIONAL for p in params)
    keywords = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    prefix = len(named)
    return forwards and named == expected[:prefix] and expected[-1] in keywords | set(named)


def check_trl_surfaces(trainer_cls=GRPOTrainer) -> None:
    """Raises TRLSurfaceError naming the first GRPOTrainer surface that no longer looks as GFPO expects. A TRL
    outside TESTED_TRL whose surfaces all pass gets a one-time warning that it is untested, naming the tested range
    and what installs it."""
    for name, expected in _SURFACES.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer.{name} no longer exists; {_supported()}")
        if not _accepts(method, expected):
            params = list(inspect.signature(method).parameters)[1:]
            raise TRLSurfaceError(
                f"trl {trl.__version__}: GRPOTrainer.{name} takes {params}, GFPOTrainer expects {expected}; "
                f"{_supported()}"
            )
    if not is_tested_trl(trl.__version__) and trl.__version__ not in _warned_untested:
        _warned_untested.add(trl.__version__)
        warnings.warn(
            f"gfpo: trl {trl.__version__} is untested: the GRPOTrainer surfaces GFPOTrainer hooks all match it, but "
            f"the loss math and batch semantics are verified only on the tested releases; {_supported()}",
            UserWarning,
            stacklevel=3,
        )


def check_trainer_attributes(trainer) -> None:
    """Raises TRLSurfaceError naming the first GRPOTrainer attribute GFPO reads that the trainer no longer sets."""
    for name in _ATTRIBUTES:
        if not hasattr(trainer, name):
            raise TRLSurfaceError(
                f"trl {trl.__version__}: GRPOTrainer no longer sets self.{name}, which GFPO reads; {_supported()}"
            )


def check_output(output: dict, num_rows: int) -> None:
    """The dict `_generate_and_score_completions` returned: the keys GFPO needs, and no per-row key it does not
    know how to filter (filtering some row tensors and not others would misalign the batch)."""
    for key in OUTPUT_KEYS:
        if key not in output:
            raise TRLSurfaceError(
                f"trl {trl.__version__}: GRPOTrainer._generate_and_score_completions no longer returns {key!r}"
            )
    for key, value in output.items():
        is_row_tensor = getattr(value, "dim", lambda: 0)() > 0 and value.shape[0] == num_rows
        if key not in ROW_KEYS and (is_row_tensor or (isinstance(value, list) and len(value) == num_rows)):
            raise TRLSurfaceError(
                f"trl {trl.__version__}: GRPOTrainer._generate_and_score_completions returns a per-row {key!r} that "
                "GFPO does not know how to filter (multimodal inputs are not supported by GFPO filtering)"
            )


# position of the tool mask in the tuple GRPOTrainer._generate returns (prompt_ids, completion_ids, tool_mask, ...)
_GENERATE_TOOL_MASK_INDEX = 2


def tool_mask_of(generate_result) -> list | None:
    """The per-row tool masks (1 = model token, 0 = tool output) from what GRPOTrainer._generate returned, or None
    when there was no tool call."""
    if not isinstance(generate_result, tuple) or len(generate_result) <= _GENERATE_TOOL_MASK_INDEX:
        raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer._generate no longer returns a tuple with the tool "
                              f"mask at position {_GENERATE_TOOL_MASK_INDEX}")
    tool_mask, completion_ids = generate_result[_GENERATE_TOOL_MASK_INDEX], generate_result[1]
    if tool_mask is None:
        return None
    if not isinstance(tool_mask, list) or len(tool_mask) != len(completion_ids) or any(
        len(mask) != len(ids) for mask, ids in zip(tool_mask, completion_ids)
    ):
        raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer._generate's third output is not one tool mask per "
                              "completion")
    return tool_mask


def keep_model_forward_under_liger(args) -> None:
    """With use_liger_kernel=True, transformers applies Liger's kernels to the model when training starts, and
    Liger's fused linear cross-entropy (on by default) replaces the model's forward, the one the fused GRPO loss
    (use_gfpo_kernels=True) has patched by then (TRL 1.14: a crash in the first loss). TRL >= 1.15 turns that kernel
    off itself (its own fused LM head patches the forward too) and refuses it when asked for; on TRL 1.14 it is
    turned off here the same way, and refused when asked for. Liger's layer kernels (RMSNorm, RoPE, SwiGLU) stay."""
    if not args.use_liger_kernel:
        return
    config = args.liger_kernel_config or {}
    if config.get("fused_linear_cross_entropy"):
        raise ValueError(
            'use_gfpo_kernels=True does not support liger_kernel_config={"fused_linear_cross_entropy": True}: it '
            "replaces the model's forward, which the fused GRPO loss patches (TRL >= 1.15 refuses it for its own "
            "fused LM head too). Leave it unset: Liger's other kernels still apply."
        )
    args.liger_kernel_config = {**config, "fused_linear_cross_entropy": False}


def lm_head_gather_context(*params):
    """A context in which ZeRO-3 partitioned LM-head parameters are gathered (a null context otherwise): TRL's
    `maybe_gather_lm_head_ctx` where this TRL has it, else the same gather done here. Only ZeRO-3 parameters (those
    with a `ds_status`) are passed on: under a ZeRO-3 config a model built outside `zero.Init` holds plain
    parameters until `deepspeed.initialize`, and TRL's context reads `ds_status` on every parameter."""
    params = tuple(p for p in params if p is not None and hasattr(p, "ds_status"))
    if not params:
        import contextlib

        return contextlib.nullcontext()
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError:
        return _gather_zero3_params(params)
    return maybe_gather_lm_head_ctx(*params)


def _gather_zero3_params(params):
    import contextlib

    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # once each (tied or shared parameters repeat), and only those not already gathered by their owning module
    to_gather = {id(p): p for p in params if p is not None and p.ds_status != ZeroParamStatus.AVAILABLE}
    return deepspeed.zero.GatheredParameters(list(to_gather.values())) if to_gather else contextlib.nullcontext()


# Warnings the libraries give on every run that neither a config nor gfpo's code can act on, filtered by message,
# category and the module that warns, nothing wider: (message regex, category, module regex, where it comes from).
KNOWN_NOISE = (
    (r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated and "
     r"will be removed in v6", FutureWarning, r"transformers\.modeling_utils",
     "TRL's disable_gradient_checkpointing, which GRPOTrainer (each generation) and GFPOTrainer's deferred log-prob "
     "pass use, calls transformers' old names; TRL's own wrapper of them (selective activation checkpointing) is "
     "why gfpo calls it rather than the new names"),
)


def quiet_known_noise() -> None:
    """Adds KNOWN_NOISE to the warning filters (once each: warnings replaces an identical filter)."""
    for message, category, module, _ in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)

