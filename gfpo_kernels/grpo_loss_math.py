"""The GRPO loss as a function of per-token log-probabilities: TRL's `GRPOTrainer._compute_loss` (TRL 1.16)
for one process, no gradient accumulation, steps_per_generation=1.

The loss types' parts come from the table in loss_types (each type's policy term and normaliser); this module puts
them together. The reference computes log-probabilities from full logits and calls grpo_loss_from_logps; the fused
loss computes them stage by stage and takes d(loss)/d(logp) in closed form (token_loss_gradient, the Triton log-prob
pass its twin) for token-local losses, else by autograd through grpo_loss_from_logps. Autograd through
grpo_loss_from_logps is the closed form's oracle, and tests/test_grpo_loss_math.py checks the loss against TRL's own
`_compute_loss`.

Masked positions (mask == 0: padding, tool output) take no part in any exp, ratio, clip or KL: the log-ratio, the
KL's ref - logp and the vLLM ratio are replaced there by their neutral values (0, 0, 1) before any exp, whatever
old_logps, ref_logps or vllm_is_ratio hold (-1e4, +-inf, NaN). TRL computes real log-probabilities there and
multiplies the per-token loss by the mask afterwards, which gives the same loss wherever TRL's is finite; callers
that leave 0 there (the fused loss scores masked positions not at all) would otherwise get exp(0 - old) = inf and
inf x 0 = NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import NamedTuple

import torch

from ._validation import did_you_mean
from .loss_types import LOSS_TYPES, TermInputs, loss_spec, vespo_gamma_weights

__all__ = ["IMPORTANCE_SAMPLING_LEVELS", "LOSS_TYPES", "GRPOLossOptions", "TokenGradInputs", "check_loss_kind",
           "grpo_loss_from_logps", "soft_capped", "token_grad_inputs", "token_loss_gradient", "vespo_gamma_weights",
           "zero_gradient_tokens"]

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def soft_capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), the final logit soft cap of Gemma 2 (GRPOLossOptions.logit_softcap); None: the
    logits unchanged."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _positive(value, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 or value != value:
        raise ValueError(f"{name} must be a float > 0, got {name}={value!r}")


def _finite(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {name}={value!r}")


def check_loss_kind(loss_type, importance_sampling_level) -> None:
    """ValueError naming the value unless loss_type and importance_sampling_level are among TRL's."""
    loss_spec(loss_type)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                         f"importance_sampling_level={importance_sampling_level!r}"
                         f"{did_you_mean(importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)}")


@dataclasses.dataclass(frozen=True)
class GRPOLossOptions:
    """The scalar options of the GRPO loss (the names of TRL's GRPOConfig fields)."""

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None  # None: epsilon_low
    delta: float | None = None
    temperature: float = 1.0
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None  # dr_grpo; None: the T of the batch
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # vespo's gamma weight phi(w) = exp(lambda) w^k exp(-lambda w) of the sequence ratio w, by advantage sign
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # not a GRPOConfig field: the model's final logit soft cap (Gemma 2's final_logit_softcapping), applied to the
    # logits before the temperature by the log-probability code (fused loss and reference); None: none
    logit_softcap: float | None = None

    def __post_init__(self):
        check_loss_kind(self.loss_type, self.importance_sampling_level)
        if isinstance(self.beta, bool) or not isinstance(self.beta, numbers.Real) or self.beta != self.beta:
            raise ValueError(f"beta must be a float, got beta={self.beta!r}")
        if isinstance(self.epsilon_low, bool) or not isinstance(self.epsilon_low, numbers.Real) or not self.epsilon_low >= 0:
            raise ValueError(f"epsilon_low must be a float >= 0, got epsilon_low={self.epsilon_low!r}")
        if self.epsilon_high is not None and (
            isinstance(self.epsilon_high, bool)
            or not isinstance(self.epsilon_high, numbers.Real)
            or not self.epsilon_high >= 0
        ):
            raise ValueError(f"epsilon_high must be None or a float >= 0, got epsilon_high={self.epsilon_high!r}")
        _positive(self.delta, "delta", allow_none=True)
        _positive(self.temperature, "temperature")
        _positive(self.sapo_temperature_pos, "sapo_temperature_pos")
        _positive(self.sapo_temperature_neg, "sapo_temperature_neg")
        _positive(self.logit_softcap, "logit_softcap", allow_none=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _finite(getattr(self, name), name)
        cap = self.logit_softcap
        if cap is not None and cap == float("inf"):
            raise ValueError(f"logit_softcap must be a finite float > 0 or None, got logit_softcap={cap!r}")
        mcl = self.max_completion_length
        if mcl is not None and (isinstance(mcl, bool) or not isinstance(mcl, numbers.Integral) or mcl < 1):
            raise ValueError(f"max_completion_length must be None or an int >= 1, got max_completion_length={mcl!r}")

    def as_kwargs(self) -> dict:
        return dataclasses.asdict(self)

    @functools.cached_property
    def spec(self):
        """The loss type's row of loss_types.LOSS_SPECS (looked up once: every pass of a call reads it)."""
        return loss_spec(self.loss_type)

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def is_token_local(self, *, with_old_logps: bool) -> bool:
        """True when d(loss)/d(logp[t]) depends on no other token's log-probability, so it can be computed for a
        subset of the tokens at a time: token-level importance sampling, except vespo given old log-probabilities
        (`with_old_logps`), whose weight phi of a sequence (detached) is a function of the sum of its log-ratios,
        so of every log-probability of the sequence. Without them the log-ratios are logp - logp.detach() = 0 and
        phi depends on the advantage and the vLLM ratio only."""
        if self.importance_sampling_level != "token":
            return False
        return not (self.spec.term.sequence_weight and with_old_logps)


def _global_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's `global_masked_mean` for one process: per-sequence values (B, 1) average over sequences."""
    if x.shape[1] == 1:
        return x.sum() / max(x.shape[0], 1)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _masked_is_ratio(vllm_is_ratio: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The vLLM ratio as (B, T) or (B, 1) ((B,): one ratio a sequence), 1 at masked positions and for a sequence
    without a scored token (what TRL computes there)."""
    is_ratio = vllm_is_ratio.unsqueeze(1) if vllm_is_ratio.dim() == 1 else vllm_is_ratio
    return torch.where(live if is_ratio.shape[1] != 1 else live.any(-1, keepdim=True), is_ratio, 1.0)


def grpo_loss_from_logps(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    options: GRPOLossOptions,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    vllm_is_ratio: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    with_stats: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of per-token log-probabilities `logps` (B, T), differentiable in `logps`. vllm_is_ratio: (B, T),
    or one ratio a sequence, (B, 1) or (B,).

    Returns (loss, stats); stats holds detached "kl" (beta != 0), and the clip ratios of the loss type
    ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", or "cispo_clip_ratio") or vespo's
    mean weight "vespo/phi_seq_mean".
    """
    o = options
    live = mask != 0
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)

    # masked positions: log-ratio 0 (ratio 1), before any exp (see the module docstring)
    log_ratio = torch.where(live, logps - old, 0.0)
    if o.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)

    if o.beta != 0.0:
        ref_minus_logps = torch.where(live, ref_logps.to(logps.dtype) - logps, 0.0)
        per_token_kl = torch.exp(ref_minus_logps) - ref_minus_logps - 1
        if o.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    is_ratio = None if vllm_is_ratio is None else _masked_is_ratio(vllm_is_ratio.to(logps.dtype), live)

    spec = o.spec
    per_token_loss, term_stats = spec.term.per_token_loss(
        TermInputs(coef_1, adv, logps, log_ratio, mask, is_ratio), o, with_stats)
    if is_ratio is not None and spec.term.takes_is_ratio:
        per_token_loss = per_token_loss * is_ratio
    if o.beta != 0.0:
        per_token_loss = per_token_loss + o.beta * per_token_kl

    loss = spec.normaliser.reduce(per_token_loss, mask, o, num_items_in_batch)

    stats: dict[str, torch.Tensor] = {}
    if with_stats:
        with torch.no_grad():
            # per-token values (B, T), or (B, 1) at sequence level, under "per_token/...": the trainer averages
            # them over every process as TRL does; the scalars are this process's means
            per_token = {"kl": per_token_kl} if o.beta != 0.0 else {}
            per_token.update(term_stats)
            for name, value in per_token.items():
                stats[name] = _global_masked_mean(value, mask)
                stats["per_token/" + name] = value.detach()
    return loss, stats


class TokenGradInputs(NamedTuple):
    """What d(loss)/d(logp) of each scored token depends on besides its own log-probability, for the token-local
    losses (GRPOLossOptions.is_token_local), one value per scored token (n,), gathered once per call:

    adv: its advantage; weight: d(loss)/d(per-token loss), its mask value over the loss type's normaliser; old: the
    old log-probability (None: this policy's, so the ratio is 1); ref: the reference log-probability (beta != 0);
    is_ratio: the vLLM importance ratio (None: none); phi: vespo's sequence weight (without old log-probabilities
    a function of the advantage and the vLLM ratio only)."""

    adv: torch.Tensor
    weight: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None
    phi: torch.Tensor | None = None

    def rows(self, lo: int, hi: int) -> TokenGradInputs:
        """The inputs of scored tokens [lo, hi): a view of each, taken once per stage (a tuple: no per-field
        lookups)."""
        return TokenGradInputs._make([None if x is None else x[lo:hi] for x in self])


@torch.no_grad()
def token_grad_inputs(
    mask: torch.Tensor,
    positions: torch.Tensor,
    advantages: torch.Tensor,
    options: GRPOLossOptions,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    vllm_is_ratio: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> TokenGradInputs:
    """TokenGradInputs of the scored tokens at flat `positions` (into the (B, T) batch), for a token-local loss:
    the weights d(loss)/d(per-token loss) of the loss type's normaliser (by autograd through its reduce: exactly the
    derivative the oracle takes), its masked-position rules (a vLLM ratio of a sequence applies to its every token)
    and a sequence weight (vespo's phi). Vectorised over the tokens: a handful of kernels per call."""
    o = options
    assert o.is_token_local(with_old_logps=old_logps is not None), "the loss is not token-local"
    B, T = mask.shape
    live = mask != 0
    mask = mask.float()
    flat = lambda x: x.float().reshape(-1).index_select(0, positions)  # noqa: E731
    adv = advantages.float()
    adv_rows = flat(adv if adv.dim() == 2 else adv.unsqueeze(1).expand(B, T))
    with torch.enable_grad():  # the reduction is linear: its gradient at any per-token loss, 0 here
        per_token_loss = torch.zeros_like(mask, requires_grad=True)
        (weight,) = torch.autograd.grad(o.spec.normaliser.reduce(per_token_loss, mask, o, num_items_in_batch),
                                        per_token_loss)
    is_ratio = None
    if vllm_is_ratio is not None:
        ratio = vllm_is_ratio.float()
        ratio = ratio.unsqueeze(1) if ratio.dim() == 1 else ratio
        # a ratio per sequence applies to every token of it; 1 for a sequence without a scored token (never read)
        is_ratio = flat(ratio.expand(B, T))
    phi = None
    if o.spec.term.sequence_weight:  # no old log-probs here (token-local): every log-ratio is 0
        ratio2d = None if vllm_is_ratio is None else _masked_is_ratio(vllm_is_ratio.float(), live)
        adv2d = adv if adv.dim() == 2 else adv.unsqueeze(1)
        phi = flat(o.spec.term.sequence_weights(adv2d, mask, ratio2d, o).expand(B, T))
    return TokenGradInputs(
        adv=adv_rows, weight=flat(weight), old=None if old_logps is None else flat(old_logps),
        ref=None if o.beta == 0.0 else flat(ref_logps), is_ratio=is_ratio, phi=phi,
    )


# an old log-probability above this keeps exp(logp - old) finite in fp32 whatever logp <= 0 is (exp(88.7) overflows)
_OLD_LOGP_FINITE_RATIO = -87.0


@torch.no_grad()
def zero_gradient_tokens(live: torch.Tensor, advantages: torch.Tensor, options: GRPOLossOptions, *,
                         old_logps: torch.Tensor | None = None, vllm_is_ratio: torch.Tensor | None = None
                         ) -> torch.Tensor | None:
    """The scored tokens (`live`, (B, T) bool) whose d(loss)/d(logp) is exactly 0 whatever their log-probability,
    as token_loss_gradient computes it (None where no token can be: beta != 0, whose KL term depends on logp, a
    loss that is not token-local, or a policy term that is not the advantage times a factor). For the others the
    token's advantage is 0 and that factor must be finite: its vLLM ratio finite, and its old log-probability
    (where given) finite, and, where the factor's derivative holds the ratio exp(logp - old) (PolicyTerm.
    ratio_in_gradient: the clipped types, sapo), above -87 so that the ratio cannot overflow (inf x 0 is NaN, as in
    TRL). There is no entropy term in this loss."""
    o = options
    term = o.spec.term
    if o.beta != 0.0 or not term.zero_at_zero_advantage or not o.is_token_local(with_old_logps=old_logps is not None):
        return None
    B, T = live.shape
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    zero = live & (adv == 0)
    if vllm_is_ratio is not None:
        ratio = vllm_is_ratio if vllm_is_ratio.dim() == 2 else vllm_is_ratio.unsqueeze(1)
        zero &= torch.isfinite(ratio)
    if old_logps is not None:
        zero &= torch.isfinite(old_logps)
        if term.ratio_in_gradient:
            zero &= old_logps > _OLD_LOGP_FINITE_RATIO
    return zero


def token_loss_gradient(logp: torch.Tensor, inputs: TokenGradInputs, options: GRPOLossOptions) -> torch.Tensor:
    """d(loss)/d(logp) of scored tokens from their log-probabilities, in closed form: the derivative of
    grpo_loss_from_logps term by term, as autograd takes it (the policy term's loss_gradient, then the vLLM ratio,
    the KL term and the normaliser's weight). The torch twin of the Triton log-prob pass's loss gradient
    (linear_grpo_triton); autograd through grpo_loss_from_logps is its oracle (tests/test_grpo_loss_math.py)."""
    o = options
    term = o.spec.term
    # d(exp(logp - old)) / d(logp) is coef_1 itself, also when old is logp detached (coef_1 = 1)
    coef_1 = torch.ones_like(logp) if inputs.old is None else torch.exp(logp - inputs.old)
    d_loss = term.loss_gradient(coef_1, inputs.adv, inputs.phi, o)
    if inputs.is_ratio is not None and term.takes_is_ratio:
        d_loss = d_loss * inputs.is_ratio
    if o.beta != 0.0:
        e = torch.exp(inputs.ref - logp)
        d_kl = 1 - e  # d(exp(ref - logp) - (ref - logp) - 1) / d(logp)
        if o.use_bias_correction_kl:
            d_kl = d_kl * coef_1 + (e - (inputs.ref - logp) - 1) * coef_1
        d_loss = d_loss + o.beta * d_kl
    return inputs.weight * d_loss
