"""The model adapter of `use_gfpo_kernels=True`: the fused linear GRPO loss computed inside the model's forward.

`install_fused_loss_forward` patches the model so that `model(..., gfpo_loss_fn=f, gfpo_logits_to_keep=n)` runs
the backbone and returns `f(hidden, weight, bias, logit_softcap=cap)` on the hidden states that predict the last n
tokens (the loss is computed inside the forward, so DDP/FSDP see every parameter used); `fused_compute_loss` is the
trainer's `compute_loss` on that path; `check_fused_loss_supported` refuses the TRL options the fused loss lacks.
"""

from __future__ import annotations

import functools
import types
from contextlib import nullcontext

import torch

import gfpo_kernels
from gfpo_kernels.grpo_loss_math import GRPOLossOptions, soft_capped
from gfpo_kernels.loss_types import loss_spec

from ._compat import MULTIMODAL_INPUT_KEYS, TOKEN_MEAN_METRICS
from .config import GFPOConfig
from .sharded_head import full_head_parameters


def fused_compute_loss(trainer, model, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's `_compute_loss` for one micro-batch, computed by the fused linear GRPO loss through the LM head, with
    the router auxiliary loss term it holds (None without one)."""
    image_inputs = [key for key in MULTIMODAL_INPUT_KEYS if inputs.get(key) is not None]
    if image_inputs:
        # the patched forward passes the token ids only: the loss would be that of the text without its images
        raise ValueError(
            f"use_gfpo_kernels=True cannot train {type(trainer.accelerator.unwrap_model(model)).__name__} on a "
            f"multimodal batch (it carries {', '.join(image_inputs)}, which the fused loss path does not pass to the "
            "model). Use use_gfpo_kernels=False."
        )
    mode = "train" if trainer.model.training else "eval"
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    num_items, loss_scale = None, 1.0
    token_count = loss_spec(trainer.loss_type).normaliser.token_count
    if token_count:
        # TRL's normaliser: num_items_in_batch (the generation batch of every process), clamped to 1, over the
        # processes and, in training, times accumulation / steps_per_generation. The fused loss divides by the
        # clamped count and the rest is a factor on its loss: passed as one normaliser, a value below 1 would be
        # clamped a second time by the fused loss
        num_items = inputs["num_items_in_batch"].clamp(min=1.0)
        loss_scale = trainer.accelerator.num_processes
        if mode == "train":
            loss_scale = loss_scale * trainer.args.steps_per_generation / accumulation
    use_is = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    loss_fn = functools.partial(
        _fused_loss_on_head,
        target_ids=completion_ids,
        mask=mask,
        advantages=inputs["advantages"],
        old_logps=inputs.get("old_per_token_logps"),
        ref_logps=inputs.get("ref_per_token_logps"),
        num_items_in_batch=num_items,
        vllm_is_ratio=inputs.get("importance_sampling_ratio") if use_is else None,
        **fused_loss_options(trainer.args),
    )
    with trainer.accelerator.autocast():
        loss, stats, aux_loss = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            gfpo_loss_fn=loss_fn,
            gfpo_logits_to_keep=completion_ids.size(1),
            gfpo_aux_loss=trainer.aux_loss_enabled,
        )
    loss = loss * loss_scale if token_count else loss / accumulation
    aux_term = None
    if aux_loss is not None:  # an MoE model's router load-balancing loss, added as TRL adds it
        aux_term = router_aux_term(trainer, aux_loss)
        loss = loss + aux_term
        trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather(aux_loss.detach()).mean().item())
    _log_loss_stats(trainer, mode, stats, mask)
    return loss, aux_term


def router_aux_term(trainer, aux_loss: torch.Tensor) -> torch.Tensor:
    """The MoE router auxiliary loss term TRL's `_compute_loss` adds: router_aux_loss_coef * aux_loss over the
    gradient accumulation steps (none in eval)."""
    accumulation = trainer.current_gradient_accumulation_steps if trainer.model.training else 1
    return trainer.router_aux_loss_coef * aux_loss / accumulation


def _log_loss_stats(trainer, mode: str, stats: dict, mask: torch.Tensor) -> None:
    """The loss metrics TRL's `_compute_loss` logs, with its names and reductions: kl, entropy, the clip ratios and
    vespo's weight phi as token-weighted means over every process (one value per sequence at sequence-level
    importance sampling, and for phi), and the extreme per-sequence clip ratios clip_ratio/low_min and
    clip_ratio/high_max over every process. One all-reduce and one gather per call (TRL: one collective per metric),
    and one host transfer for all the values."""
    mask = mask.float()
    per_token = {"entropy": stats["entropy"]}
    per_token.update({name: stats["per_token/" + name] for name in TOKEN_MEAN_METRICS
                      if "per_token/" + name in stats})
    names = [name for name in TOKEN_MEAN_METRICS if name in per_token]
    sums_and_counts = []
    for name in names:
        x = per_token[name].float()
        if x.shape[1] == 1:  # sequence-level importance sampling: one value per sequence
            sums_and_counts += [x.sum(), x.new_tensor(float(x.shape[0]))]
        else:
            sums_and_counts += [(x * mask).sum(), mask.sum()]
    totals = trainer.accelerator.reduce(torch.stack(sums_and_counts), reduction="sum").view(-1, 2)
    values = totals[:, 0] / totals[:, 1].clamp(min=1.0)
    if "clip_ratio/low_mean" in per_token:
        per_sequence = torch.stack([_sequence_means(per_token[name].float(), mask)
                                    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean")], dim=1)
        gathered = trainer.accelerator.gather(per_sequence)
        names += ["clip_ratio/low_min", "clip_ratio/high_max"]
        values = torch.cat([values, _nan_extreme(gathered[:, 0], "min"), _nan_extreme(gathered[:, 1], "max")])
    for name, value in zip(names, values.tolist()):
        trainer._metrics[mode][name].append(value)


def _sequence_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence masked means, NaN for a sequence without scored tokens (as TRL's masked_seq_mean)."""
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


def _nan_extreme(values: torch.Tensor, which: str) -> torch.Tensor:
    """min or max over the non-NaN values, NaN when there are none, as a 1-element tensor (no host sync)."""
    finite = ~torch.isnan(values)
    fill = float("inf") if which == "min" else float("-inf")
    masked = torch.where(finite, values, torch.full_like(values, fill))
    extreme = masked.amin() if which == "min" else masked.amax()
    return torch.where(finite.any(), extreme, torch.full_like(extreme, float("nan"))).reshape(1)


def _fused_loss_on_head(hidden, weight, bias, **kwargs):
    return gfpo_kernels.fused_linear_grpo_loss(hidden, weight, kwargs.pop("target_ids"), kwargs.pop("mask"),
                                               kwargs.pop("advantages"), bias=bias, **kwargs)


def logit_transform_of(model) -> tuple[float, float | None]:
    """(scale, softcap): the model's own forward multiplies its logits by `scale` (1.0 for most models), then
    soft-caps them, cap * tanh(logits / cap), when `softcap` is not None (Gemma 2's final_logit_softcapping); read
    from the config keys TRL's fused head reads. The fused path folds the scale into the hidden states, which scales
    h W^T but not a head bias (a model with both is refused by the probe), and passes the cap to the fused loss."""
    config = model.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    softcap = None if softcap is None else float(softcap)
    for key in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(config, key, None) is not None:
            return float(getattr(config, key)), softcap
    if getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        return (scaling if config.model_type == "hyperclovax" else 1.0 / scaling), softcap
    return 1.0, softcap


def _router_aux_loss(model, backbone_outputs, attention_mask):
    """The MoE load-balancing loss the model's own forward adds (the Mixtral form every MoE family shares)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    return load_balancing_loss_func(backbone_outputs.router_logits, config.num_experts, config.num_experts_per_tok,
                                    attention_mask)


def install_fused_loss_forward(model, cast_lm_head_to_fp32: bool = False) -> None:
    """model(..., gfpo_loss_fn=f, gfpo_logits_to_keep=n, gfpo_aux_loss=b) runs the backbone and returns
    (*f(hidden, weight, bias, logit_softcap=cap), aux_loss) on the hidden states that predict the last n tokens,
    with the model's logit scale applied, its logit soft cap (or None) for f to apply and, when b, the MoE router
    auxiliary loss (else None): the loss is computed inside the forward, so DDP/FSDP see every parameter used.
    Without gfpo_loss_fn the forward is the one before (TRL's fused head included). `cast_lm_head_to_fp32`
    (GRPOConfig's): the head runs in fp32 outside autocast, as TRL's head does then. Refuses (ValueError naming the
    model class) a model whose logits the fused path does not reproduce on a probe of a few tokens."""
    _check_plain_linear_head(model)
    scale, softcap = logit_transform_of(model)
    original = model.forward

    @functools.wraps(original)
    def forward(self, *args, gfpo_loss_fn=None, gfpo_logits_to_keep=None, gfpo_aux_loss=False, **kwargs):
        if gfpo_loss_fn is None:
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        if gfpo_aux_loss:
            kwargs["output_router_logits"] = True
        outputs = self.base_model(*args, **kwargs)
        hidden = outputs.last_hidden_state[:, -gfpo_logits_to_keep - 1 : -1]
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
        if scale != 1.0:
            hidden = hidden * scale
        aux_loss = _router_aux_loss(self, outputs, kwargs.get("attention_mask")) if gfpo_aux_loss else None
        # cast_lm_head_to_fp32: fp32 hidden and head with autocast off, so the GEMMs run in fp32 as TRL's do then.
        # Otherwise hidden as the backbone gives it: the fused loss runs its GEMMs in the dtype TRL's head would
        # (the autocast dtype under autocast), not cast to the head's dtype (an fp32 head would run fp32 GEMMs).
        fp32_head = torch.autocast(hidden.device.type, enabled=False) if cast_lm_head_to_fp32 else nullcontext()
        with full_head_parameters(self.get_output_embeddings()) as (weight, bias), fp32_head:
            if cast_lm_head_to_fp32:
                weight, bias = weight.float(), None if bias is None else bias.float()
            return (*gfpo_loss_fn(hidden, weight, bias, logit_softcap=softcap), aux_loss)

    model.forward = types.MethodType(forward, model)
    _probe(model, original)


def _check_plain_linear_head(model) -> None:
    """The fused loss multiplies by the head's `weight` (and `bias`) itself, so the head must be a plain
    nn.Linear whose forward is h W^T + b. A PEFT adapter on the head (LoRA, trainable tokens and the like) adds
    its own term in its forward: read as the bare weight it would be left out of the loss and never trained, and
    the probe cannot see it, since such adapters start as a no-op. PEFT's `modules_to_save` copy of the head is a
    plain Linear: its wrapper's `weight` is the active copy's, so it is accepted."""
    head = model.get_output_embeddings()
    modules = [head]
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:
        ModulesToSaveWrapper = ()
    if isinstance(head, ModulesToSaveWrapper):
        modules = [head.original_module, *head.modules_to_save.values()]
    plain = all(isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward for m in modules)
    if not plain:
        raise ValueError(
            f"use_gfpo_kernels=True cannot train {type(model).__name__}: its LM head is a "
            f"{type(head).__module__}.{type(head).__name__}, not a plain torch.nn.Linear, and the fused loss reads "
            "the head's weight directly, so what the head adds in its forward (a PEFT adapter such as LoRA on "
            "lm_head) would be left out of the loss and never trained. Leave the LM head out of the adapter's "
            "target_modules (TRL >= 1.15 refuses an adapter there too), or use use_gfpo_kernels=False."
        )


@torch.no_grad()
def _probe(model, original_forward, num_tokens: int = 8) -> None:
    """Checks on a few tokens that the fused path's logits are the model's own: a model that transforms its logits
    in a way not read from its config would otherwise train on a different loss, silently."""
    weight = model.get_output_embeddings().weight
    if weight.numel() == 0:  # partitioned at load time (ZeRO-3 zero.Init): only the config checks above apply
        return
    device, vocab = weight.device, weight.shape[0]
    input_ids = torch.randint(0, vocab, (2, num_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.eval()
    try:
        want = original_forward(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
        got, _, _ = model(input_ids=input_ids, gfpo_loss_fn=lambda h, w, b, logit_softcap: (
            soft_capped(torch.nn.functional.linear(h, w, b).float(), logit_softcap), None),
            gfpo_logits_to_keep=num_tokens - 1)
    finally:
        model.train(was_training)
    tolerance = 1e-4 if model.get_output_embeddings().weight.dtype == torch.float32 else 2e-2
    scale = want.abs().max().clamp(min=1.0)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tolerance, atol=tolerance * scale):
        difference = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
        raise ValueError(
            f"use_gfpo_kernels=True cannot train {type(model).__name__}: on a probe of {num_tokens} tokens the fused "
            f"path's logits differ from the model's own by up to {difference:.3g} (its forward transforms the "
            "logits in a way the fused loss does not reproduce). Use use_gfpo_kernels=False."
        )


def fused_loss_options(args: GFPOConfig) -> dict:
    """The fused loss's scalar options from the config, as TRL's GRPOTrainer reads them (epsilon_high None: epsilon)."""
    return dict(
        beta=args.beta, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high, delta=args.delta,
        temperature=args.temperature, loss_type=args.loss_type,
        importance_sampling_level=args.importance_sampling_level, max_completion_length=args.max_completion_length,
        use_bias_correction_kl=args.use_bias_correction_kl, sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
    )


def check_fused_loss_supported(args: GFPOConfig) -> None:
    """Options of TRL's loss that the fused loss does not implement: refuse them rather than ignore them; and the
    loss options themselves, checked here at construction rather than at the first loss, after a generation."""
    GRPOLossOptions(**fused_loss_options(args))
    unsupported = {
        "top_entropy_quantile": (args.top_entropy_quantile, 1.0),
        "off_policy_mask_threshold": (args.off_policy_mask_threshold, None),
        "entropy_coef": (getattr(args, "entropy_coef", 0.0), 0.0),
        "use_adaptive_entropy": (getattr(args, "use_adaptive_entropy", False), False),
    }
    for name, (value, default) in unsupported.items():
        if value != default:
            raise ValueError(f"use_gfpo_kernels=True does not support {name}={value!r} (only {default!r})")
