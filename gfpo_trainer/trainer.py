"""GFPOTrainer: Group Filtered Policy Optimization on TRL's GRPOTrainer.

This module is the list of TRL hooks; each delegates to a module of its own: selection.py (scores, k, the kernel
call), rows.py (exchange across processes, padding, row weights), fused_head.py (the model adapter of the fused
loss), generation_paths.py (with early_stop.py, vllm_stop.py, vllm_server.py), adaptive.py; TRL differences live in
_compat.py. What the hooks learn about a generation batch lives in one GenerationBatch (batch.py), made by
_generate_and_score_completions.

How it hooks into GRPO (see _compat.py for why these surfaces and no others):
1. `_calculate_rewards` (wrapped): once the rewards of the global batch are known, score every completion
   (built-in filter on device, or the user's `group_filter_func`), choose k (fixed, or per group with Adaptive
   Difficulty), and compute the kept mask and the advantages over the kept rows in one call of
   `gfpo_filter_advantages` (the fused kernel, or the reference with use_gfpo_kernels=False). A reward function that
   raises or returns what is not a number is named in the error; a group with a non-finite reward trains nothing
   (rewards.py).
2. `_get_per_token_logps_and_entropies` (wrapped): during scoring, the no-grad passes of the old policy and the
   reference model are deferred and later run on the kept rows only.
3. `_generate_and_score_completions` (post-processed): its dict keeps only the rows to train (the kept rows with
   GFPO's advantages, or every row with loss_includes_rejected, the rejected at advantage 0; less those of
   advantage exactly 0 where skip_zero_gradient_rows applies, also without a filter), rebalanced so every process
   holds the same number of rows and that number divides by steps_per_generation (TRL's split_tensor_dict would
   drop a remainder; its loss gathers per-sequence metrics across processes and hangs on unequal sizes). Missing
   rows are copies of a trained row with an all-zero completion mask and advantage 0; every row is weighed as in an
   evenly divided batch (rows.py).
4. `compute_loss` (overridden): the micro-batch cropped to its longest completion (TRL pads every micro-batch to
   the generation batch's longest), then TRL's loss, or with use_gfpo_kernels the fused linear GRPO loss through the
   model's LM head.
5. `_generate` (wrapped): reads the tool masks, so the length filters count the model's tokens only.
6. `_generate_single_turn` (wrapped, length filter only): generation draws from its own random stream, and
   completions the filter is certain to drop stop early, on one of three generation paths
   (gfpo_trainer/generation_paths.py: HF generate, vLLM colocate, vLLM server).
7. `train`, `_save_checkpoint` and `_get_train_sampler` (wrapped): GFPO's state goes into every checkpoint and comes
   back on resume, and each epoch's prompt order is replayed, so a resumed run is the run that did not stop (state.py).
"""

from __future__ import annotations

import functools
import logging
from collections import deque

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from ._compat import (
    TRLSurfaceError, check_fused_kernels_trl, check_output, check_trainer_attributes, check_trl_surfaces,
    check_vllm_generation, check_vllm_server_generation, check_vllm_version, keep_model_forward_under_liger,
    quiet_known_noise, tool_mask_of
)
from .adaptive import AdaptiveDifficulty
from .batch import GenerationBatch
from .config import GFPOConfig
from .filters import GROUP_FILTERS, GroupFilterSpec, group_filter_spec
from .fused_head import check_fused_loss_supported, fused_compute_loss, install_fused_loss_forward, router_aux_term
from .generation_paths import (
    ColocatePath, GenerationPath, HFStoppingPath, ServerPath, check_server_version, generation_seed,
    own_random_stream, stop_strings_with_tensor_parallelism,
)
from .rows import (
    crop_to_longest_completion, no_metrics_from_padding_only, plan_trained_rows, restore_shuffle_rng,
    shuffle_replay_after_skipping, take_trained_rows, weight_loss, zero_gradient_skip_applies
)
from .rewards import reward_errors_named
from .selection import log_selection, log_trl_metrics_of_kept_rows, logged_metric_counts, select
from .state import load_gfpo_state, replay_epoch_order, save_gfpo_state
from .vllm_server import ServerLimits

logger = logging.getLogger(__name__)


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
        reward_funcs=None,
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
        quiet_known_noise()
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GFPOConfig(f"{name.split('/')[-1]}-GFPO")
        if not isinstance(args, GFPOConfig):
            raise TypeError(f"args must be a GFPOConfig, got {type(args).__name__}")
        if args.num_remains_in_group is not None:
            if (args.group_filter is None) == (group_filter_func is None):
                raise ValueError(
                    "num_remains_in_group is set: give exactly one of GFPOConfig.group_filter "
                    f"(one of {GROUP_FILTERS}; got {args.group_filter!r}) and group_filter_func (got "
                    f"{'a function' if group_filter_func is not None else None})"
                )
        elif args.group_filter is not None or group_filter_func is not None:
            raise ValueError("a group filter is given but num_remains_in_group is None: set num_remains_in_group=k")
        if group_filter_func is not None and not callable(group_filter_func):
            raise TypeError(f"group_filter_func must be callable, got {type(group_filter_func).__name__}")
        if args.use_vllm:
            check_vllm_version()
        if args.use_gfpo_kernels:
            check_fused_kernels_trl()
            check_fused_loss_supported(args)
            keep_model_forward_under_liger(args)

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
        if self.use_vllm and self.vllm_mode == "server":  # the server's vLLM, not only the one installed here
            check_server_version(self.vllm_generation, self.accelerator)
        own_generation = self._filter_spec is not None and self._filter_spec.own_generation
        if self.use_vllm and self.vllm_mode == "colocate" and own_generation:
            check_vllm_generation(self)
        self._server_stop_unavailable: str | None = None  # why the vLLM server cannot run the early-stop rule
        if self.use_vllm and self.vllm_mode == "server" and own_generation:
            check_vllm_server_generation(self)
            self._server_stop_unavailable = ServerPath.stop_unavailable(self.vllm_generation, self.accelerator,
                                                                        args, self._early_stop_configured())
        self.group_filter_func = group_filter_func
        self.adaptive_difficulty = AdaptiveDifficulty(args.adaptive_num_remains) if args.adaptive_difficulty else None
        # the generation batch being built or trained (made by _generate_and_score_completions; None before)
        self._gfpo_batch: GenerationBatch | None = None
        self._gfpo_aux_loss = None  # a micro-batch's router auxiliary loss, from TRL's log-prob pass of its loss
        self._gfpo_warned: set[str] = set()  # the one-time warnings given (_warn_once)
        self.gfpo_logp_rows_seen = 0  # rows the deferred no-grad log-prob passes ran on (tests read it)
        self.gfpo_nonfinite_reward_groups_total = 0  # groups dropped for a non-finite reward so far (state.py saves it)
        spec = self._filter_spec
        if (args.loss_includes_rejected and args.num_remains_in_group is not None and spec is not None
                and spec.early_stop and args.gfpo_stop_dropped_generations and not args.adaptive_difficulty):
            logger.warning("gfpo_stop_dropped_generations is not applied with loss_includes_rejected=True: the rule "
                           "cuts the completions the filter rejects short, and the loss then covers them, so it "
                           "would train on cut text and count cut lengths; every completion is generated to its end")
        if args.use_gfpo_kernels:
            install_fused_loss_forward(self.model.get_base_model() if _is_peft_model(self.model) else self.model,
                                       cast_lm_head_to_fp32=getattr(args, "cast_lm_head_to_fp32", False))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # GFPO's own state (the adaptive-difficulty digest) comes back with the checkpoint, before the first batch
        load_gfpo_state(self, resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _get_train_sampler(self, dataset=None):
        # each epoch's prompt order as TRL draws it, from the seed and the epoch alone: a run resumed in a later epoch
        # sees the order the run that did not stop saw (state.replay_epoch_order)
        return replay_epoch_order(super()._get_train_sampler(dataset))

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        save_gfpo_state(self, trial)

    def _warn_once(self, key: str, message: str) -> None:
        """Logs `message` as a warning the first time `key` is given, and never again for this trainer."""
        if key not in self._gfpo_warned:
            self._gfpo_warned.add(key)
            logger.warning(message)

    # ------------------------------------------------------------------ selection
    def _filtering(self) -> bool:
        return self.args.num_remains_in_group is not None and self.model.training

    @property
    def _filter_spec(self) -> GroupFilterSpec | None:
        """The built-in filter's spec (gfpo_trainer/filters.py); None with a group_filter_func or no filter."""
        return group_filter_spec(self.args.group_filter)

    def _generate(self, prompts):
        result = super()._generate(prompts)
        self._gfpo_batch.tool_mask = tool_mask_of(result)  # the filters count the model's tokens, not tool output
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with reward_errors_named(self):  # a reward function that raises is named in the error
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        batch = self._gfpo_batch
        if batch.filtering:
            batch.selection = select(self, batch, rewards_per_func, completions, completion_ids_list, prompts)
        return rewards_per_func

    # ------------------------------------------------------------------ deferred log-prob passes
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        extra = {k: v for k, v in kwargs.items() if v is not None and v is not False}
        if self._gfpo_batch is not None and self._gfpo_batch.deferring and not extra:
            # A no-grad scoring pass (old policy or reference model): run it later, on the kept rows only.
            return self._gfpo_batch.defer(model, input_ids, logits_to_keep, batch_size), None, None
        result = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kwargs
        )
        if kwargs.get("compute_aux_loss"):
            self._gfpo_aux_loss = result[2]  # the loss's router auxiliary loss: compute_loss keeps it unweighted
        return result

    def _can_defer(self) -> bool:
        # vLLM importance sampling reads the old log-probs at once; a PEFT reference runs under an adapter context
        return not (self.use_vllm and self.vllm_importance_sampling_correction) and not _is_peft_model(self.model)

    # ------------------------------------------------------------------ generation (gfpo_trainer/generation_paths.py)
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        trl_generate = functools.partial(super()._generate_single_turn, prompt_ids, images, multimodal_fields,
                                         num_generations, has_tool_images)
        batch = self._gfpo_batch  # None outside _generate_and_score_completions: nothing to hand the stopped rows to
        first_turn = batch is not None and batch.turns == 0
        if batch is not None:
            batch.turns += 1
        if self.use_vllm and self.vllm_mode == "colocate":  # vLLM's own stop-string aborts (every generation call)
            warning = stop_strings_with_tensor_parallelism(self.vllm_generation, self.args)
            if warning is not None:
                self._warn_once("vllm-tp-stop-strings", warning)
        if not (first_turn and self._filtering() and self._filter_spec is not None
                and self._filter_spec.own_generation):
            # Tool turns (TRL's tool loop calls again with the rows that called a tool, a different subset on each
            # process), the other filters, and a call from outside a generation batch: TRL's own generation
            return trl_generate()
        # Generation draws from its own random stream, seeded from the trainer's: stopping rows early then
        # changes neither the kept completions nor what later draws (TRL's shuffle, the next batch) see, so a
        # run with gfpo_stop_dropped_generations on is the same run as with it off.
        colocated = self.vllm_generation if self.use_vllm and self.vllm_mode == "colocate" else None
        seed = generation_seed(colocated, self.accelerator.process_index)
        with own_random_stream(seed, self.accelerator.device):
            path = self._generation_path(seed, len(prompt_ids))
            if path is None:
                return trl_generate()
            with path:
                result = trl_generate()
        if not path.called:
            raise TRLSurfaceError(path.not_called)
        batch.stopped_rows = path.stopped_rows
        for name, value in path.metrics.items():
            self._metrics["train"][name].append(value)
        return result

    def _generation_path(self, seed: int, n_local: int) -> GenerationPath | None:
        """The generation path of a first turn with a filter that owns generation, or None for TRL's own call (run
        inside GFPO's own random stream all the same): HF generate with the early-stop rule; vLLM in colocate mode
        (one request per completion, seeded from `seed` with gfpo_vllm_request_seeds; without the rule, vLLM's own
        LLM.generate); vLLM in server mode with seeds or the rule. `n_local`: this process's rows."""
        args, group = self.args, dict(group_size=self.num_generations, k=self.args.num_remains_in_group)
        base_seed = seed if args.gfpo_vllm_request_seeds else None
        if not self.use_vllm:
            if not self._early_stop_wanted():
                return None
            return HFStoppingPath(self.model, self.accelerator, n_local=n_local, eos_token_ids=self.eos_token_ids,
                                  **group)
        if self.vllm_mode == "colocate":
            return ColocatePath(self.vllm_generation, self.accelerator, n_local=n_local, base_seed=base_seed,
                                stop=self._early_stop_wanted(), **group)
        if self.vllm_mode == "server":
            stop = self._early_stop_wanted() and self._server_stop_unavailable is None
            if not stop and base_seed is None:
                return None  # TRL's own request (one per prompt, n=num_generations)
            return ServerPath(self.vllm_generation, self.accelerator, n_local=n_local, base_seed=base_seed, stop=stop,
                              limits=ServerLimits.from_config(args), **group)
        return None

    def _early_stop_configured(self) -> bool:
        """Whether the options ask for the early-stop rule: gfpo_stop_dropped_generations, a filter that allows it
        (GroupFilterSpec.early_stop), no adaptive difficulty (whose difficulty reads every completion's reward), the
        rejected rows not in the loss (it would cut them short: see __init__'s warning)."""
        spec = self._filter_spec
        return (self.args.gfpo_stop_dropped_generations and spec is not None and spec.early_stop
                and not self.args.adaptive_difficulty and not self.args.loss_includes_rejected)

    def _early_stop_wanted(self) -> bool:
        """Whether the early-stop rule should run on this batch; logs once, and returns False, where this generation
        path cannot run it."""
        if not self._early_stop_configured():
            return False
        unsupported = (
            "tool calling" if self.tools
            else "continuous batching" if self.use_transformers_continuous_batching and not self.use_vllm
            else "beam search (the rule sees batch x beams rows)"
            if not self.use_vllm and (getattr(self.generation_config, "num_beams", None) or 1) > 1
            else None
        )
        if unsupported is None:
            return True
        self._warn_once("no early stop", f"gfpo_stop_dropped_generations is not applied with {unsupported}: every "
                        "completion is generated to its end, as in GRPO")
        return False

    # ------------------------------------------------------------------ filtering the generated batch
    def _generate_and_score_completions(self, inputs):
        filtering = self._filtering()
        # rows of advantage 0 leave the batch (plain GRPO too) when that changes neither loss nor gradients
        skip_zero = self.model.training and zero_gradient_skip_applies(self)
        batch = self._gfpo_batch = GenerationBatch(filtering=filtering, skip_zero=skip_zero)
        batch.deferring = (filtering or skip_zero) and self._can_defer()
        metric_counts = logged_metric_counts(self) if filtering else None  # before TRL logs this batch
        # the completions table's advantages: TRL logs its GRPO advantages of every row into this deque; with a filter
        # they are replaced by GFPO's, so TRL writes this batch's into an empty one first (to count them)
        logged_advantages = self._logs["advantages"]
        if filtering:
            self._logs["advantages"] = deque()  # unbounded: every entry TRL writes is counted
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            batch.deferring = False
            trl_advantages, self._logs["advantages"] = self._logs["advantages"], logged_advantages
        if not (filtering or skip_zero):
            return output
        selection = batch.selection
        if filtering and selection is None:
            raise TRLSurfaceError("GRPOTrainer._generate_and_score_completions did not call _calculate_rewards")
        if filtering and len(trl_advantages) != selection.keep.numel():
            raise TRLSurfaceError(f"GRPOTrainer logged {len(trl_advantages)} advantages for a generation batch of "
                                  f"{selection.keep.numel()} completions; GFPO replaces them by its own")
        return self._filter_output(output, batch, metric_counts)

    def _filter_output(self, output: dict, batch: GenerationBatch, metric_counts: dict | None = None) -> dict:
        """The batch of the rows to train (without a selection: every row with TRL's advantages, less the skipped
        ones). `metric_counts`: how many values TRL's per-batch metrics held before this batch (with a selection)."""
        n_local = output["prompt_ids"].size(0)
        deferred = batch.take_deferred(output)
        check_output(output, n_local)
        P = self.accelerator.num_processes
        selection = batch.selection
        if selection is None:
            advantages = self.accelerator.gather(output["advantages"])
            keep = torch.ones_like(advantages, dtype=torch.bool)
        else:
            keep, advantages = selection.keep, selection.advantages
        if keep.numel() != n_local * P:
            raise TRLSurfaceError(f"the global batch holds {keep.numel()} rows, {P} processes x {n_local} were "
                                  "expected")

        plan = plan_trained_rows(keep, advantages, batch.skip_zero, P, self.accelerator.process_index,
                                 self.args.steps_per_generation,
                                 rejected_in_loss=selection is not None and self.args.loss_includes_rejected)
        take_trained_rows(self, output, keep, advantages, plan)
        if batch.skip_zero:
            self._metrics["train"]["gfpo/skipped_zero_gradient_fraction"].append(plan.skipped_fraction)
            batch.shuffle_replay = shuffle_replay_after_skipping(plan)
        for key, deferred_pass in deferred.items():
            output[key] = self._deferred_logps(deferred_pass.model, deferred_pass.batch_size, output, plan.n_real)
        if selection is None:
            return output
        stopped = None
        if batch.stopped_rows is not None:
            stopped = self.accelerator.gather(batch.stopped_rows)
            if (stopped & keep).any():  # the rule's promise; a failure here is a bug, never a silent wrong batch
                raise RuntimeError("gfpo: a completion stopped early by gfpo_stop_dropped_generations was kept")
        log_selection(self, selection, stopped)
        if self._filter_spec is not None and self._filter_spec.trl_metrics_over_kept_rows:  # rule on or off alike
            log_trl_metrics_of_kept_rows(self, selection, metric_counts)
        # the completions table shows what was trained: GFPO's advantages, 0 for dropped rows (in place of TRL's GRPO
        # advantages of every row, which _generate_and_score_completions counted and set aside)
        self._logs["advantages"].extend(selection.advantages.tolist())
        return output

    def _forwards_in_lockstep(self) -> bool:
        """Whether every process must run as many forwards: a sharded model (FSDP, DeepSpeed ZeRO-3) gathers its
        parameters in each forward, a collective that waits for every process."""
        if self.accelerator.num_processes == 1:
            return False
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return self.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3)

    @torch.no_grad()
    def _deferred_logps(self, model, batch_size, output: dict, n_real: int) -> torch.Tensor:
        # The real rows only, where the forwards need no lockstep; otherwise every row, padding included (the
        # same number on every process), and the padding rows' values are then dropped
        rows = output["completion_ids"].size(0) if self._forwards_in_lockstep() else n_real
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)[:rows]
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)[:rows]
        logits_to_keep = output["completion_ids"].size(1)
        logps = torch.zeros(output["completion_ids"].shape, device=prompt_completion_ids.device)
        self.gfpo_logp_rows_seen += rows
        if rows:
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                logps[:rows], _, _ = super()._get_per_token_logps_and_entropies(
                    model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
            logps[n_real:] = 0.0
        return logps

    # ------------------------------------------------------------------ loss
    def _crop_micro_batch(self, inputs: dict) -> dict:
        """TRL pads every micro-batch to the generation batch's longest completion: this one's padding does no work
        (rows.crop_to_longest_completion)."""
        return crop_to_longest_completion(self, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        restore_shuffle_rng(self._gfpo_batch)  # after skipped rows, later draws as with the skip off (see rows.py)
        if return_outputs:
            raise ValueError("The GFPOTrainer does not support returning outputs")
        inputs = self._crop_micro_batch(inputs)
        with no_metrics_from_padding_only(self, inputs):
            if self.args.use_gfpo_kernels:
                loss, aux_term = fused_compute_loss(self, model, inputs)
            else:
                self._gfpo_aux_loss = None
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                # the router loss term TRL added to the rows' loss
                aux_term = None if self._gfpo_aux_loss is None else router_aux_term(self, self._gfpo_aux_loss)
        return weight_loss(loss, inputs, self.loss_type, unweighted=aux_term)


