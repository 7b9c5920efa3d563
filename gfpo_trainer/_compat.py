"""The TRL surfaces GFPOTrainer hooks into, checked at construction.

TRL's own GFPOTrainer copied `GRPOTrainer._generate_and_score_completions` and broke on every GRPO rewrite. We
copy nothing: we wrap `_calculate_rewards`, `_get_per_token_logps_and_entropies` (to defer the no-grad
log-prob passes to the kept rows) and `_generate_single_turn` (to stop completions the length filter will
drop), post-process the dict `_generate_and_score_completions` returns, and override `compute_loss`. If TRL
changes one of these, `check_trl_surfaces` raises naming the surface instead of training on a silently wrong
batch.
"""

from __future__ import annotations

import inspect

import trl
from trl import GRPOTrainer

SUPPORTED_TRL = (">=1.16", "<1.17")

# method -> parameters it must accept, in order (after self)
_SURFACES = {
    "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["inputs"],
    "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "_compute_loss": ["model", "inputs"],
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations"],
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
# GRPOTrainer attributes GFPO reads
_ATTRIBUTES = ("num_generations", "reward_weights", "scale_rewards", "beta", "ref_model", "temperature", "loss_type",
               "eos_token_ids", "use_vllm", "use_transformers_continuous_batching", "tools")


class TRLSurfaceError(RuntimeError):
    """A TRL internal that GFPOTrainer hooks into has changed shape."""


def check_trl_surfaces(trainer_cls=GRPOTrainer) -> None:
    """Raises TRLSurfaceError naming the first GRPOTrainer surface that no longer looks as GFPO expects."""
    for name, expected in _SURFACES.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            raise TRLSurfaceError(
                f"trl {trl.__version__}: GRPOTrainer.{name} no longer exists; GFPOTrainer supports trl "
                f"{','.join(SUPPORTED_TRL)}"
            )
        params = list(inspect.signature(method).parameters)[1 : 1 + len(expected)]
        if params != expected:
            raise TRLSurfaceError(
                f"trl {trl.__version__}: GRPOTrainer.{name} takes {params}, GFPOTrainer expects {expected}; "
                f"supported trl {','.join(SUPPORTED_TRL)}"
            )


def check_trainer_attributes(trainer) -> None:
    for name in _ATTRIBUTES:
        if not hasattr(trainer, name):
            raise TRLSurfaceError(f"trl {trl.__version__}: GRPOTrainer no longer sets self.{name}, which GFPO reads")


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


def lm_head_gather_context(*params):
    """A context in which ZeRO-3 partitioned LM-head parameters are gathered (a null context otherwise): TRL's
    `maybe_gather_lm_head_ctx` where this TRL has it, else the same gather done here."""
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
