"""The model adapter of `use_gfpo_kernels=True`: the fused linear GRPO loss computed inside the model's forward.

`install_fused_loss_forward` patches the model so that `model(..., gfpo_loss_fn=f, gfpo_logits_to_keep=n)` runs
the backbone and returns `f(hidden, weight, bias)` on the hidden states that predict the last n tokens (the loss
is computed inside the forward, so DDP/FSDP see every parameter used); `fused_compute_loss` is the trainer's
`compute_loss` on that path; `check_fused_loss_supported` refuses the TRL options the fused loss lacks.
"""

from __future__ import annotations

import functools
import types

import torch

import gfpo_kernels
from gfpo_kernels.grpo_loss_math import LOSS_TYPES

from .config import GFPOConfig
from .sharded_head import full_head_parameters


def fused_compute_loss(trainer, model, inputs) -> torch.Tensor:
    """TRL's `_compute_loss` for one micro-batch, computed by the fused linear GRPO loss through the LM head."""
    mode = "train" if trainer.model.training else "eval"
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    num_items = None
    if trainer.loss_type in ("cispo", "dapo"):
        # TRL's normaliser: num_items_in_batch spans the generation batch of every process
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * accumulation / trainer.args.steps_per_generation
    use_is = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    loss_fn = functools.partial(
        _fused_loss_on_head,
        target_ids=completion_ids,
        mask=mask,
        advantages=inputs["advantages"],
        old_logps=inputs.get("old_per_token_logps"),
        ref_logps=inputs.get("ref_per_token_logps"),
        beta=trainer.beta,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=trainer.args.delta,
        temperature=trainer.temperature,
        loss_type=trainer.loss_type,
        importance_sampling_level=trainer.importance_sampling_level,
        num_items_in_batch=num_items,
        max_completion_length=trainer.max_completion_length,
        vllm_is_ratio=inputs.get("importance_sampling_ratio") if use_is else None,
        use_bias_correction_kl=trainer.args.use_bias_correction_kl,
        sapo_temperature_pos=trainer.args.sapo_temperature_pos,
        sapo_temperature_neg=trainer.args.sapo_temperature_neg,
    )
    with trainer.accelerator.autocast():
        loss, stats = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            gfpo_loss_fn=loss_fn,
            gfpo_logits_to_keep=completion_ids.size(1),
        )
    if trainer.loss_type not in ("cispo", "dapo"):
        loss = loss / accumulation
    _log_loss_stats(trainer, mode, stats, mask)
    return loss


def _log_loss_stats(trainer, mode: str, stats: dict, mask: torch.Tensor) -> None:
    """TRL's loss metrics: entropy as a token-weighted mean over every process, the rest averaged."""
    mask = mask.float()
    totals = trainer.accelerator.reduce(torch.stack([(stats["entropy"] * mask).sum(), mask.sum()]), reduction="sum")
    trainer._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    for name, value in stats.items():
        if value.dim() == 0:
            trainer._metrics[mode][name].append(trainer.accelerator.gather(value.reshape(1)).nanmean().item())


def _fused_loss_on_head(hidden, weight, bias, **kwargs):
    return gfpo_kernels.fused_linear_grpo_loss(hidden, weight, kwargs.pop("target_ids"), kwargs.pop("mask"),
                                               kwargs.pop("advantages"), bias=bias, **kwargs)


def install_fused_loss_forward(model) -> None:
    """model(..., gfpo_loss_fn=f, gfpo_logits_to_keep=n) runs the backbone and returns f(hidden, weight, bias) on
    the hidden states that predict the last n tokens: the loss is computed inside the forward, so DDP/FSDP see
    every parameter used. Without gfpo_loss_fn the forward is the one before (TRL's fused head included)."""
    original = model.forward

    @functools.wraps(original)
    def forward(self, *args, gfpo_loss_fn=None, gfpo_logits_to_keep=None, **kwargs):
        if gfpo_loss_fn is None:
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        hidden = hidden[:, -gfpo_logits_to_keep - 1 : -1]
        with full_head_parameters(self.get_output_embeddings()) as (weight, bias):
            return gfpo_loss_fn(hidden.to(weight.dtype), weight, bias)

    model.forward = types.MethodType(forward, model)


def check_fused_loss_supported(args: GFPOConfig) -> None:
    """Options of TRL's loss that the fused loss does not implement: refuse them rather than ignore them."""
    unsupported = {
        "top_entropy_quantile": (args.top_entropy_quantile, 1.0),
        "off_policy_mask_threshold": (args.off_policy_mask_threshold, None),
        "entropy_coef": (getattr(args, "entropy_coef", 0.0), 0.0),
        "use_adaptive_entropy": (getattr(args, "use_adaptive_entropy", False), False),
    }
    for name, (value, default) in unsupported.items():
        if value != default:
            raise ValueError(f"use_gfpo_kernels=True does not support {name}={value!r} (only {default!r})")
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"use_gfpo_kernels=True does not support loss_type={args.loss_type!r}")
