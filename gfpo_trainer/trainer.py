"""GFPOTrainer: Group Filtered Policy Optimization on TRL's GRPOTrainer.

How it hooks into GRPO (see _compat.py for why these surfaces and no others):
1. `_calculate_rewards` (wrapped): once the rewards of the global batch are known, score every completion
   (built-in filter on device, or the user's `group_filter_func`), choose k (fixed, or per group with Adaptive
   Difficulty), and compute the kept mask and the advantages over the kept rows in one call of
   `gfpo_filter_advantages` (the fused kernel, or the reference with use_gfpo_kernels=False).
2. `_get_per_token_logps_and_entropies` (wrapped): during scoring, the no-grad passes of the old policy and the
   reference model are deferred and later run on the kept rows only.
3. `_generate_and_score_completions` (post-processed): its dict keeps only the kept rows, with GFPO's
   advantages, rebalanced so every process holds the same number of rows and that number divides by
   steps_per_generation (TRL's split_tensor_dict would drop a remainder; its loss gathers per-sequence metrics
   across processes and hangs on unequal sizes). Missing rows are copies of a kept row with an all-zero
   completion mask and advantage 0: they add nothing to the loss, whose per-sequence normalisation is
   corrected for them in `compute_loss`.
4. `compute_loss` (overridden): TRL's loss, or with use_gfpo_kernels the fused linear GRPO loss through the
   model's LM head.
5. `_generate_single_turn` (wrapped, length filter only): generation draws from its own random stream, and
   completions the filter is certain to drop stop early (gfpo_trainer/early_stop.py).
"""

from __future__ import annotations

import functools
import logging
import math
import types

import torch
from accelerate.utils import gather_object
from transformers import LogitsProcessorList
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

import gfpo_kernels
from gfpo_kernels import reference as gfpo_reference
from gfpo_kernels.grpo_loss_math import LOSS_TYPES

from ._compat import ROW_KEYS, TRLSurfaceError, check_output, check_trainer_attributes, check_trl_surfaces
from .adaptive import AdaptiveDifficulty
from .config import GFPOConfig
from .early_stop import StopDroppedCompletions

logger = logging.getLogger(__name__)

# Loss types whose value is a mean over the sequences of a micro-batch (or divides by their number)
_PER_SEQUENCE_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
_REAL_ROW_KEY = "gfpo_real_row"


def _is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class GFPOTrainer(GRPOTrainer):
    """GRPOTrainer that samples `num_generations` completions per prompt and trains on the `num_remains_in_group`
    best of each group by a filter.

    Args:
        model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
        callbacks, optimizers, peft_config, **grpo_kwargs: as for TRL's GRPOTrainer (`args` a `GFPOConfig`).
        group_filter_func: `f(group_completions, group_rewards, **kwargs) -> list[list[float]]`, TRL's
            signature: one list of G scores per group, higher kept. It receives the completions and summed
            rewards of the global batch grouped by prompt, and `group_completion_ids` as a keyword.
    """

    def __init__(
        self,
        model,
        reward_funcs,
        args: GFPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        group_filter_func=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        **grpo_kwargs,
    ):
        check_trl_surfaces()
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GFPOConfig(f"{name.split('/')[-1]}-GFPO")
        if not isinstance(args, GFPOConfig):
            raise TypeError(f"args must be a GFPOConfig, got {type(args).__name__}")
        if args.num_remains_in_group is not None:
            if (args.group_filter is None) == (group_filter_func is None):
                raise ValueError(
                    "num_remains_in_group is set: give exactly one of GFPOConfig.group_filter "
                    f"(got {args.group_filter!r}) and group_filter_func (got "
                    f"{'a function' if group_filter_func is not None else None})"
                )
        elif args.group_filter is not None or group_filter_func is not None:
            raise ValueError("a group filter is given but num_remains_in_group is None: set num_remains_in_group=k")
        if group_filter_func is not None and not callable(group_filter_func):
            raise TypeError(f"group_filter_func must be callable, got {type(group_filter_func).__name__}")
        if args.use_gfpo_kernels:
            _check_fused_loss_supported(args)

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            **grpo_kwargs,
        )
        check_trainer_attributes(self)
        self.group_filter_func = group_filter_func
        self.adaptive_difficulty = AdaptiveDifficulty(args.adaptive_num_remains) if args.adaptive_difficulty else None
        self._gfpo_selection = None  # set by _calculate_rewards, consumed by _generate_and_score_completions
        self._deferring = False
        self._deferred: list[tuple[torch.Tensor, object, int | None]] = []
        self.gfpo_logp_rows_seen = 0  # rows the deferred no-grad log-prob passes ran on (tests read it)
        self._stopped_rows: torch.Tensor | None = None  # local rows the early-stop rule ended, this batch
        self._warned_no_early_stop = False
        if args.use_gfpo_kernels:
            _install_fused_loss_forward(self.model.get_base_model() if _is_peft_model(self.model) else self.model)

    # ------------------------------------------------------------------ selection
    def _filtering(self) -> bool:
        return self.args.num_remains_in_group is not None and self.model.training

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._filtering():
            self._gfpo_selection = self._select(rewards_per_func, completions, completion_ids_list)
        return rewards_per_func

    def _select(self, rewards_per_func, completions, completion_ids_list) -> dict:
        """Kept mask and advantages of the global batch (every process computes the same)."""
        G = self.num_generations
        device = rewards_per_func.device
        # TRL's summed reward; a row whose every reward function returned None is unscorable (NaN): it ranks last
        # under the reward-based filters and gets advantage 0
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        local_lengths = torch.tensor([len(ids) for ids in completion_ids_list], device=device, dtype=torch.float32)
        lengths = self.accelerator.gather(local_lengths)
        if lengths.numel() != rewards.numel():
            raise TRLSurfaceError(
                f"GRPOTrainer._calculate_rewards returned {rewards.numel()} rows, the batch holds {lengths.numel()}"
            )
        if self.args.group_filter == "length":
            scores, largest = lengths, False
        elif self.args.group_filter == "token_efficiency":
            scores, largest = rewards / lengths.clamp(min=1.0), True
        else:
            scores, largest = self._scores_from_func(completions, completion_ids_list, rewards), True

        quartile = None
        if self.adaptive_difficulty is not None:
            group_means = torch.nanmean(rewards.view(-1, G), dim=1)
            quartile, k = self.adaptive_difficulty.update_and_assign(group_means)
        else:
            k = self.args.num_remains_in_group
        ops = gfpo_kernels if self.args.use_gfpo_kernels else gfpo_reference
        keep, advantages = ops.gfpo_filter_advantages(rewards, scores, G, k, largest=largest, scale=self.scale_rewards)
        return {"keep": keep, "advantages": advantages, "lengths": lengths, "k": k, "quartile": quartile}

    def _scores_from_func(self, completions, completion_ids_list, rewards) -> torch.Tensor:
        G = self.num_generations
        all_completions = gather_object(completions)
        all_ids = gather_object(list(completion_ids_list))
        num_groups = len(all_completions) // G
        scores = self.group_filter_func(
            group_completions=[all_completions[g * G : (g + 1) * G] for g in range(num_groups)],
            group_rewards=rewards.view(-1, G).tolist(),
            group_completion_ids=[all_ids[g * G : (g + 1) * G] for g in range(num_groups)],
        )
        try:
            scores = torch.as_tensor(scores, dtype=torch.float64)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"group_filter_func must return {num_groups} lists of {G} numbers (one score per completion), "
                f"got something that is not a rectangular list of numbers: {error}"
            ) from None
        if tuple(scores.shape) != (num_groups, G):
            raise ValueError(
                f"group_filter_func must return {num_groups} lists of {G} scores (groups x num_generations), "
                f"got shape {tuple(scores.shape)}"
            )
        bad = ~torch.isfinite(scores)
        if bad.any():
            g, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"group_filter_func returned a non-finite score {scores[g, i].item()} (group {g}, completion {i})")
        return scores.flatten().to(rewards.device)

    # ------------------------------------------------------------------ deferred log-prob passes
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        extra = {k: v for k, v in kwargs.items() if v is not None and v is not False}
        if self._deferring and not extra:
            # A no-grad scoring pass (old policy or reference model): run it later, on the kept rows only.
            placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
            self._deferred.append((placeholder, model, batch_size))
            return placeholder, None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
        )

    def _can_defer(self) -> bool:
        # vLLM importance sampling reads the old log-probs at once; a PEFT reference runs under an adapter context
        return not (self.use_vllm and self.vllm_importance_sampling_correction) and not _is_peft_model(self.model)

    # ------------------------------------------------------------------ stopping completions that will be dropped
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not (self._filtering() and self.args.group_filter == "length"):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        # Generation draws from its own random stream, seeded from the trainer's: stopping rows early then
        # changes neither the kept completions nor what later draws (TRL's shuffle, the next batch) see, so a
        # run with gfpo_stop_dropped_generations on is the same run as with it off.
        seed = int(torch.randint(0, 2**62, (1,)).item())
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self._generate_single_turn_stopping(prompt_ids, images, multimodal_fields, num_generations,
                                                       has_tool_images)

    def _generate_single_turn_stopping(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """Filtering with the length filter: generation, stopping the completions the filter will drop."""
        if not self.args.gfpo_stop_dropped_generations or self.args.adaptive_difficulty:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        unsupported = (
            "vLLM generation (its API gives no per-group abort here)" if self.use_vllm
            else "continuous batching" if self.use_transformers_continuous_batching
            else "tool calling" if self.tools
            else None
        )
        if unsupported is not None:
            if not self._warned_no_early_stop:
                logger.warning(f"gfpo_stop_dropped_generations is not applied with {unsupported}: every completion "
                               "is generated to its end, as in GRPO")
                self._warned_no_early_stop = True
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

        stopper = StopDroppedCompletions(self.eos_token_ids, self.num_generations, self.args.num_remains_in_group,
                                         first_row=self.accelerator.process_index * len(prompt_ids))
        model = self.accelerator.unwrap_model(self.model)
        had_own_generate = "generate" in vars(model)
        original = model.generate

        def generate(*args, **kwargs):
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(stopper)
            return original(*args, logits_processor=processors, **kwargs)

        model.generate = generate
        try:
            result = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            if had_own_generate:
                model.generate = original
            else:
                del model.generate
        device = self.accelerator.device
        stopped = stopper.stopped if stopper.stopped is not None else torch.zeros(len(prompt_ids), dtype=torch.bool)
        self._stopped_rows = stopped.to(device)
        return result

    # ------------------------------------------------------------------ filtering the generated batch
    def _generate_and_score_completions(self, inputs):
        filtering = self._filtering()
        self._gfpo_selection, self._deferred, self._stopped_rows = None, [], None
        self._deferring = filtering and self._can_defer()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._deferring = False
        if not filtering:
            return output
        if self._gfpo_selection is None:
            raise TRLSurfaceError("GRPOTrainer._generate_and_score_completions did not call _calculate_rewards")
        selection, self._gfpo_selection = self._gfpo_selection, None
        return self._filter_output(output, selection)

    def _filter_output(self, output: dict, selection: dict) -> dict:
        n_local = output["prompt_ids"].size(0)
        deferred = {}
        for key, value in list(output.items()):
            for placeholder, model, batch_size in self._deferred:
                if value is placeholder:
                    deferred[key] = (model, batch_size)
                    del output[key]
        if len(deferred) != len(self._deferred):
            raise TRLSurfaceError("a deferred log-prob pass of GRPOTrainer did not end up in its output dict")
        check_output(output, n_local)
        P, rank = self.accelerator.num_processes, self.accelerator.process_index
        keep = selection["keep"]
        if keep.numel() != n_local * P:
            raise TRLSurfaceError(f"the global batch holds {keep.numel()} rows, {P} processes x {n_local} were expected")

        # Every process takes an equal, steps_per_generation-divisible share of the kept rows, in global order.
        kept = keep.nonzero().squeeze(1)
        spg = self.args.steps_per_generation
        share = math.ceil(math.ceil(kept.numel() / P) / spg) * spg
        mine = kept[rank * share : (rank + 1) * share]
        n_real = mine.numel()
        # padding rows copy a kept row (a valid forward) and are masked out below
        rows = torch.cat([mine, kept[:1].expand(share - n_real)]) if kept.numel() else mine
        # every process holds the global advantages already; the other row tensors are gathered
        output["advantages"] = selection["advantages"][rows]
        row_keys = [k for k in output if k in ROW_KEYS and k != "advantages" and isinstance(output[k], torch.Tensor)]
        for key in row_keys:
            output[key] = self._take_global_rows(key, output[key], rows)
        real = torch.arange(share, device=rows.device) < n_real
        output["completion_mask"] = output["completion_mask"] * real.unsqueeze(1).to(output["completion_mask"].dtype)
        output["advantages"] = torch.where(real, output["advantages"], 0.0)
        output[_REAL_ROW_KEY] = real
        # Drop the padding columns past the longest kept completion: less work in the loss, and the batch no
        # longer depends on how long the dropped completions ran (see gfpo_stop_dropped_generations).
        T = output["completion_ids"].size(1)
        width = max(1, int(output["completion_mask"].sum(dim=1).max())) if share else T
        for key in row_keys:
            if not ROW_KEYS[key][1] and output[key].dim() > 1 and output[key].size(1) == T:
                output[key] = output[key][:, :width]

        for key, (model, batch_size) in deferred.items():
            output[key] = self._deferred_logps(model, batch_size, output, n_real)
        loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum().reshape(1)).sum()
        stopped = None
        if self._stopped_rows is not None:
            stopped = self.accelerator.gather(self._stopped_rows)
            if (stopped & keep).any():  # the rule's promise; a failure here is a bug, never a silent wrong batch
                raise RuntimeError("gfpo: a completion stopped early by gfpo_stop_dropped_generations was kept")
        self._log_selection(selection, keep, stopped)
        return output

    def _take_global_rows(self, key: str, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """tensor's rows at global indices `rows` (local rows of every process, in process order)."""
        if self.accelerator.num_processes == 1:
            return tensor[rows]
        pad_value, pad_left = ROW_KEYS[key]
        if pad_value is None:
            pad_value = self._tokenizer.pad_token_id
        if tensor.dim() > 1:
            tensor = self.accelerator.pad_across_processes(tensor, dim=1, pad_index=pad_value, pad_first=pad_left)
        return self.accelerator.gather(tensor.contiguous())[rows]

    @torch.no_grad()
    def _deferred_logps(self, model, batch_size, output: dict, n_real: int) -> torch.Tensor:
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)[:n_real]
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)[:n_real]
        logits_to_keep = output["completion_ids"].size(1)
        logps = torch.zeros(output["completion_ids"].shape, device=prompt_completion_ids.device)
        self.gfpo_logp_rows_seen += n_real
        if n_real:
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                logps[:n_real], _, _ = super()._get_per_token_logps_and_entropies(
                    model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
        return logps

    def _log_selection(self, selection: dict, keep: torch.Tensor, stopped: torch.Tensor | None) -> None:
        metrics = self._metrics["train"]
        lengths = selection["lengths"]
        metrics["gfpo/kept_fraction"].append(keep.float().mean().item())
        metrics["gfpo/kept_completion_length"].append(lengths[keep].mean().item() if keep.any() else float("nan"))
        dropped = ~keep
        dropped_length = lengths[dropped].mean().item() if dropped.any() else float("nan")
        if stopped is None:
            metrics["gfpo/dropped_completion_length"].append(dropped_length)
        else:
            # early-stopped completions were cut short: their lengths (here and in TRL's completions/*) are truncated
            metrics["gfpo/dropped_completion_length_truncated"].append(dropped_length)
            metrics["gfpo/stopped_early_fraction"].append(stopped.float().mean().item())
        if selection["quartile"] is not None:
            quartile, k = selection["quartile"], selection["k"]
            for q, k_q in enumerate(self.args.adaptive_num_remains):
                metrics[f"gfpo/k_quartile_{q}"].append(float(k_q))
                metrics[f"gfpo/groups_quartile_{q}"].append((quartile == q).float().mean().item())
            metrics["gfpo/mean_k"].append(k.float().mean().item())

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.use_gfpo_kernels:
            if return_outputs:
                raise ValueError("The GFPOTrainer does not support returning outputs")
            loss = self._fused_compute_loss(model, inputs)
        else:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        real = inputs.get(_REAL_ROW_KEY)
        if real is not None and self.loss_type in _PER_SEQUENCE_LOSSES:
            # these losses average over (or divide by) the micro-batch's rows: count only the real ones
            n_real = int(real.sum())
            if 0 < n_real < real.numel():
                loss = loss * (real.numel() / n_real)
        return loss

    def _fused_compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        if self.loss_type in ("cispo", "dapo"):
            # TRL's normaliser: num_items_in_batch spans the generation batch of every process
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        use_is = self.use_vllm and self.vllm_importance_sampling_correction
        loss_fn = functools.partial(
            _fused_loss_on_head,
            target_ids=completion_ids,
            mask=mask,
            advantages=inputs["advantages"],
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps"),
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            temperature=self.temperature,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            num_items_in_batch=num_items,
            max_completion_length=self.max_completion_length,
            vllm_is_ratio=inputs.get("importance_sampling_ratio") if use_is else None,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            sapo_temperature_pos=self.args.sapo_temperature_pos,
            sapo_temperature_neg=self.args.sapo_temperature_neg,
        )
        with self.accelerator.autocast():
            loss, stats = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                gfpo_loss_fn=loss_fn,
                gfpo_logits_to_keep=completion_ids.size(1),
            )
        if self.loss_type not in ("cispo", "dapo"):
            loss = loss / accumulation
        self._log_loss_stats(mode, stats, mask)
        return loss

    def _log_loss_stats(self, mode: str, stats: dict, mask: torch.Tensor) -> None:
        """TRL's loss metrics: entropy as a token-weighted mean over every process, the rest averaged."""
        mask = mask.float()
        totals = self.accelerator.reduce(torch.stack([(stats["entropy"] * mask).sum(), mask.sum()]), reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        for name, value in stats.items():
            if value.dim() == 0:
                self._metrics[mode][name].append(self.accelerator.gather(value.reshape(1)).nanmean().item())


def _fused_loss_on_head(hidden, weight, bias, **kwargs):
    return gfpo_kernels.fused_linear_grpo_loss(hidden, weight, kwargs.pop("target_ids"), kwargs.pop("mask"),
                                               kwargs.pop("advantages"), bias=bias, **kwargs)


def _install_fused_loss_forward(model) -> None:
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
        head = self.get_output_embeddings()
        return gfpo_loss_fn(hidden.to(head.weight.dtype), head.weight, head.bias)

    model.forward = types.MethodType(forward, model)


def _check_fused_loss_supported(args: GFPOConfig) -> None:
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
