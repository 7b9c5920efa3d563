"""GFPOConfig: TRL's GRPOConfig plus the fields of Group Filtered Policy Optimization."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from trl import GRPOConfig

from gfpo_kernels._validation import did_you_mean
from gfpo_kernels.grpo_loss_math import check_loss_kind
from gfpo_kernels.loss_types import loss_spec

from .filters import GROUP_FILTER_SPECS, group_filter_spec

SCALE_REWARDS = ("group", "batch", "none")
# GFPOConfig's on/off fields: each must be a bool
GFPO_SWITCHES = ("use_gfpo_kernels", "adaptive_difficulty", "skip_zero_gradient_rows", "gfpo_stop_dropped_generations",
                 "gfpo_vllm_request_seeds", "loss_includes_rejected")


@dataclass
class GFPOConfig(GRPOConfig):
    r"""
    Configuration of [`GFPOTrainer`]: every field of TRL's `GRPOConfig`, plus the fields below (docs/trainer.md
    has each in full). One difference: `bf16` left unset is on only where the device supports it (TRL: always
    on), so one config runs on a CPU and on a GPU; and two defaults that only warn are set quietly (the
    `activation_checkpointing` name for TRL's default `gradient_checkpointing=True`, no `dataloader_pin_memory`
    without an accelerator, where torch ignores it).

    Parameters:
        num_remains_in_group (`int` or `None`, *optional*, defaults to `None`):
            k, the completions of each group kept and trained on; 2 <= k < num_generations (with k = 1 every
            advantage would be 0). `None`: no filtering (plain GRPO).
        group_filter (`str` or `None`, *optional*, defaults to `None`):
            A built-in filter, one of `GROUP_FILTERS` (gfpo_trainer/filters.py): `"length"` keeps the k shortest
            completions, `"token_efficiency"` the k with the most reward per token. With `num_remains_in_group`
            set, exactly one of this and the trainer's `group_filter_func` is required.
        use_gfpo_kernels (`bool`, *optional*, defaults to `False`):
            The fused filter + advantage kernel and the fused linear GRPO loss through the LM head, a drop-in:
            the same kept rows and advantages as `False` (the reference filter and TRL's loss).
        adaptive_difficulty (`bool`, *optional*, defaults to `False`):
            k per group from the quartile of its mean reward among the groups seen so far (a streaming t-digest).
        adaptive_num_remains (`list[int]` or `None`, *optional*, defaults to `None`):
            k per difficulty quartile, hardest first: 4 values, each 2 <= k <= num_generations. Required with
            `adaptive_difficulty`.
        gfpo_stop_dropped_generations (`bool`, *optional*, defaults to `True`):
            With `group_filter="length"`, stop generating a group's other completions once k have ended: the
            filter drops them anyway, so the kept rows and the loss are unchanged and generation ends sooner.
            Off, with a one-time warning, where it cannot hold (docs/trainer.md, "Stopping completions").
        gfpo_vllm_request_seeds (`bool`, *optional*, defaults to `True`):
            With vLLM and `group_filter="length"`, one request per completion seeded from the trainer's random
            stream, so the same completions are kept with early stop on or off (docs/vllm.md). `False`: vLLM's
            own random stream, as in TRL.
        skip_zero_gradient_rows (`bool`, *optional*, defaults to `True`):
            Leave rows whose loss gradient is exactly 0 (advantage 0, `beta == 0`, no entropy term) out of the
            old-policy pass and the policy forward/backward while every normaliser still counts them: the same
            loss and gradients for less work. Where that equality cannot hold every row is trained.
        loss_includes_rejected (`bool`, *optional*, defaults to `False`):
            The paper's objective (arXiv 2508.09726, Eq. 2): rejected completions stay in the loss with
            advantage 0, so the normaliser counts every sampled completion. `False` trains and divides by the
            kept rows only. Turns the early-stop rule off (one warning): the loss counts full lengths.
        gfpo_vllm_server_max_in_flight (`int` or `None`, *optional*, defaults to `None`):
            vLLM server mode with the length filter (one request per completion): the requests open at once.
            `None`: the server's `--max-num-queued-reqs` (from its `/server_info`) where it has one, else every
            completion of the call. Also bounded by the process's open-file limit.
        gfpo_vllm_server_retry_deadline (`float`, *optional*, defaults to `300.0`):
            Seconds within which a request the server turns away before any token (503, 429, 502, 504, a refused
            or dropped connection) is sent again, with growing pauses; past it the step fails naming the server,
            the completion and the answer. `0`: no retry.
        gfpo_vllm_server_read_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds the server may send nothing on every open request before the step fails (with early stop off
            the requests are unstreamed: set it above the longest completion's generation time).
    """

    num_remains_in_group: int | None = field(
        default=None,
        metadata={"help": "k: completions kept per group (2 <= k < num_generations); None disables filtering."},
    )
    group_filter: str | None = field(
        default=None,
        metadata={"help": "Built-in filter: " + "; ".join(f"{name!r} keeps {spec.summary}"
                                                          for name, spec in GROUP_FILTER_SPECS.items()) + "."},
    )
    use_gfpo_kernels: bool = field(
        default=False,
        metadata={"help": "Use the fused filter/advantage kernel and the fused linear GRPO loss."},
    )
    adaptive_difficulty: bool = field(
        default=False, metadata={"help": "Choose k per group from the quartile of its mean reward."}
    )
    adaptive_num_remains: list[int] | None = field(
        default=None, metadata={"help": "k per difficulty quartile, hardest first (4 values)."}
    )
    skip_zero_gradient_rows: bool = field(
        default=True,
        metadata={"help": "Do not train on rows whose loss gradient is exactly zero (advantage 0, beta 0, ...)."},
    )
    gfpo_stop_dropped_generations: bool = field(
        default=True,
        metadata={"help": "With the length filter, stop generating completions the filter is certain to drop."},
    )

    gfpo_vllm_request_seeds: bool = field(
        default=True,
        metadata={"help": "With vLLM and the length filter, seed every completion's request from the trainer's "
                          "random stream (the same completions with early stop on or off)."},
    )
    loss_includes_rejected: bool = field(
        default=False,
        metadata={"help": "The paper's objective: rejected completions stay in the loss with advantage 0 (its "
                          "normaliser counts every sampled completion; the KL and entropy terms reach them)."},
    )
    gfpo_vllm_server_max_in_flight: int | None = field(
        default=None,
        metadata={"help": "vLLM server mode, length filter: requests open at once (None: the server's "
                          "max_num_queued_reqs where it reports one, else every completion)."},
    )
    gfpo_vllm_server_retry_deadline: float = field(
        default=300.0,
        metadata={"help": "vLLM server mode, length filter: seconds within which a request the server turns away "
                          "(503, 429, 502, 504, refused connection) is sent again; 0: never."},
    )
    gfpo_vllm_server_read_timeout: float = field(
        default=600.0,
        metadata={"help": "vLLM server mode, length filter: seconds the server may send nothing on every open "
                          "request before the step fails."},
    )

    def __post_init__(self):
        # TRL takes any value here and fails only at the first training step (GFPO's kernels then name `scale`);
        # these are the values its advantage code accepts (True/False map to "group"/"none" in GRPOConfig)
        s = self.scale_rewards
        try:
            mapped = {True: "group", False: "none"}.get(s, s)  # TRL's own mapping (1/0 and numpy bools included)
        except TypeError:  # unhashable
            mapped = s
        if not (isinstance(mapped, str) and mapped in SCALE_REWARDS):
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, True or False, got scale_rewards={s!r}"
                             f"{did_you_mean(s, SCALE_REWARDS)}")
        # GRPOConfig takes any loss_type and fails at the first training step; TRL 1.14.2 to 1.16 compute the same
        # loss types, every one of them the fused loss's too (gfpo_kernels.loss_types.LOSS_SPECS)
        check_loss_kind(self.loss_type, self.importance_sampling_level)
        if self.bf16 is None and not self.fp16:
            # TRL turns bf16 on by default, which fails on a machine without bf16 hardware (CPU only, older GPUs):
            # left unset, bf16 is on only where the device supports it, so one config runs everywhere
            from transformers.utils import is_torch_bf16_gpu_available

            self.bf16 = not self.use_cpu and is_torch_bf16_gpu_available()
        self._quiet_defaults()
        generation_batch_given, steps_given = self.generation_batch_size is not None, self.steps_per_generation
        try:
            super().__post_init__()
        except ValueError:
            if not generation_batch_given:  # TRL's message names generation_batch_size, a field not set here
                self._check_generation_batch("steps_per_generation" if steps_given else "gradient_accumulation_steps")
            raise
        G = self.num_generations
        k = self.num_remains_in_group
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 2 <= k < G):
            raise ValueError(
                f"num_remains_in_group must be an int with 2 <= k < num_generations={G} (with k = 1 every advantage is "
                "0), "
                f"got num_remains_in_group={k!r}"
            )
        filter_spec = group_filter_spec(self.group_filter)  # ValueError naming the choices
        for name in GFPO_SWITCHES:  # a string such as "false" would read as true
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be one of (True, False), got {name}={getattr(self, name)!r}")
        if self.adaptive_difficulty:
            if k is None:
                raise ValueError("adaptive_difficulty=True needs num_remains_in_group (it turns filtering on)")
            ks = self.adaptive_num_remains
            if (
                not isinstance(ks, (list, tuple))
                or len(ks) != 4
                or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 2 <= x <= G for x in ks)
            ):
                raise ValueError(
                    "adaptive_num_remains must be 4 ints (k per difficulty quartile, hardest first), each "
                    f"2 <= k <= num_generations={G}, got adaptive_num_remains={ks!r}"
                )
            self.adaptive_num_remains = [int(x) for x in ks]
        elif self.adaptive_num_remains is not None:
            raise ValueError("adaptive_num_remains is set but adaptive_difficulty=False; set adaptive_difficulty=True")
        entropy_coef, adaptive_entropy = getattr(self, "entropy_coef", 0.0), getattr(self, "use_adaptive_entropy", False)
        # with the rejected rows in the loss every row is trained where these terms are on (no row is skipped)
        uneven = not self.loss_includes_rejected and (
            self.adaptive_difficulty or (k is not None and self.per_device_train_batch_size * k % G != 0))
        # The kept rows then need padding rows to fill equal micro-batches, and weights for the per-sequence losses
        # (gfpo_trainer/rows.py). Terms normalised per micro-batch inside TRL's loss cannot be kept as an even split
        # would have them: the entropy bonus (a mean over a micro-batch's tokens) and bnpo (a micro-batch's token
        # mean over gradient_accumulation_steps: padding-only micro-batches would shrink the gradient).
        needs_even = []
        if entropy_coef or adaptive_entropy:
            needs_even.append(f"the entropy bonus (entropy_coef={entropy_coef}, use_adaptive_entropy={adaptive_entropy})")
        if loss_spec(self.loss_type).normaliser.micro_batch_tokens:
            needs_even.append(f"loss_type={self.loss_type!r} (it divides by each micro-batch's tokens; dapo "
                              "normalises by the whole batch's tokens and pads exactly)")
        if k is not None and uneven and needs_even:
            raise ValueError(
                f"{' and '.join(needs_even)} needs the kept rows to divide evenly into micro-batches: "
                "per_device_train_batch_size * num_remains_in_group divisible by num_generations (got "
                f"{self.per_device_train_batch_size} * {k} and {G}), and no adaptive_difficulty (got "
                f"{self.adaptive_difficulty}); change one of them, or the loss options"
            )
        if k is not None and self.use_vllm and filter_spec is not None and filter_spec.own_generation:
            generation_kwargs = self.generation_kwargs or {}
            if self.gfpo_vllm_request_seeds and generation_kwargs.get("seed") is not None:
                raise ValueError(
                    f"generation_kwargs={{'seed': {generation_kwargs['seed']!r}}} gives every vLLM request one seed, "
                    "and GFPO seeds each completion's request itself (gfpo_vllm_request_seeds=True, so the kept "
                    "completions are the same with early stop on or off): remove the seed, or set "
                    "gfpo_vllm_request_seeds=False"
                )
            if self.vllm_mode == "server" and generation_kwargs.get("seed") is not None:
                raise ValueError(
                    f"generation_kwargs={{'seed': {generation_kwargs['seed']!r}}} with vllm_mode='server': GFPO sends "
                    "one request per completion there, and one seed for every request would make the completions of "
                    "a prompt all the same; remove the seed (gfpo_vllm_request_seeds=True seeds each completion from "
                    "the trainer's random stream)"
                )
            if generation_kwargs.get("n", 1) != 1:
                raise ValueError(
                    f"generation_kwargs={{'n': {generation_kwargs['n']!r}}}: TRL's vLLM generation sends one request "
                    "per completion (num_generations sets how many a prompt gets); remove n"
                )
        if k is not None and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "GFPO normalises the summed reward over the kept completions; multi_objective_aggregation="
                f"{self.multi_objective_aggregation!r} is not supported with num_remains_in_group (use "
                "'sum_then_normalize')"
            )

    def _quiet_defaults(self):
        """Two defaults that warn on every run, about nothing the config set, changed where that changes no result:
        transformers 5 renamed gradient_checkpointing to activation_checkpointing and warns (FutureWarning) when the
        old name is set, which TRL's GRPOConfig does by default (True): the new name takes that default (a value the
        config gives the old name itself still warns). And page-locked memory needs an accelerator: without one
        torch ignores dataloader_pin_memory and warns (UserWarning) at every data loader."""
        import torch

        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if ("activation_checkpointing" in defaults and self.activation_checkpointing is None
                and self.gradient_checkpointing == defaults["gradient_checkpointing"]):
            self.activation_checkpointing = self.gradient_checkpointing
        if self.dataloader_pin_memory and not torch.accelerator.is_available():
            self.dataloader_pin_memory = False

    def _check_generation_batch(self, steps_name: str):
        """Where the generation batch TRL derived (per_device_train_batch_size x processes x steps per generation,
        `steps_name`: the field those steps come from) holds no whole number of groups, a ValueError in the fields
        the config set, with values that work."""
        G, batch = self.num_generations, self.generation_batch_size
        if not (isinstance(G, int) and G >= 1 and isinstance(batch, int) and batch % G):
            return
        per_device, steps = self.per_device_train_batch_size, self.steps_per_generation or 1
        processes = batch // (per_device * steps)
        unit = G // math.gcd(G, processes * steps)  # per_device_train_batch_size must be a multiple of it
        sizes = sorted({size for size in (per_device // unit * unit, -(-per_device // unit) * unit) if size > 0})
        step_unit = G // math.gcd(G, per_device * processes)
        k = self.num_remains_in_group if isinstance(self.num_remains_in_group, int) else 1
        generations = [g for g in range(max(2, k + 1), batch + 1) if batch % g == 0]
        generations = sorted(sorted(generations, key=lambda g: (abs(g - G), g))[:3])
        others = [f"{steps_name}={-(-steps // step_unit) * step_unit}"]
        if generations:
            others.append(f"num_generations={_one_of(generations)}")
        raise ValueError(
            f"per_device_train_batch_size={per_device} x {processes} process{'es' * (processes != 1)} x "
            f"{steps_name}={steps} = {batch} completions per generation batch, which must hold whole groups of "
            f"num_generations={G}: make that product a multiple of {G}, e.g. per_device_train_batch_size="
            f"{_one_of(sizes)} (or {', or '.join(others)})"
        ) from None


def _one_of(values: list[int]) -> str:
    """[4] -> "4", [4, 8] -> "4 or 8", [2, 3, 6] -> "2, 3 or 6"."""
    return " or ".join([", ".join(map(str, values[:-1])), str(values[-1])] if len(values) > 1 else [str(values[0])])
