"""TRL's GRPO loss types, one spec each: the table every other place reads.

A loss type is two parts that vary independently:
- its policy term (PolicyTerm): how the importance ratio coef_1 = exp(logp - old) enters the per-token loss (clipped,
  cispo, sapo, vespo), with its closed-form derivative d(per-token loss)/d(logp), the Triton branch that computes
  that derivative inside the log-prob pass, its logged statistics, and what makes a zero-advantage token's gradient
  exactly 0;
- its normaliser (Normaliser): how the per-token losses reduce to the loss, in TRL's floating-point order, and what
  that means for a trainer that pads or skips rows.

Readers: grpo_loss_math (the loss, its closed-form gradient, the zero-gradient tokens), linear_grpo_triton's dispatch
(LossTypeSpec.term.triton_branch), scripts/triton_aot.py (one compiled configuration per branch), the trainer's row
weights and skipping (trained_rows_normalisation, called by gfpo_trainer/rows.py) and its config checks
(gfpo_trainer/config.py, fused_head.py).

Adding a loss type: a row in LOSS_SPECS; with a new policy term, a PolicyTerm subclass here and its branch in
linear_grpo_triton._token_loss_gradient (the kernel's `LOSS` constant is the term's triton_branch).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from ._validation import did_you_mean

# vespo's log-space clamps (TRL's get_gamma_weights): log(1e-8) below, 20 above
_VESPO_LOG_MIN = math.log(1e-8)
_VESPO_LOG_MAX = 20.0


class TermInputs(NamedTuple):
    """What a policy term reads of a batch: the ratio coef_1 (B, T) (or (B, 1) at sequence level), the advantages
    (B, 1) or (B, T), the log-probabilities (B, T), the log-ratios (0 at masked positions), the mask (float) and
    the vLLM ratio (None, or 1 at masked positions)."""

    coef_1: torch.Tensor
    adv: torch.Tensor
    logps: torch.Tensor
    log_ratio: torch.Tensor
    mask: torch.Tensor
    is_ratio: torch.Tensor | None


class PolicyTerm:
    """How the importance ratio enters a loss type's per-token loss.

    triton_branch: the `LOSS` constant of linear_grpo_triton._token_loss_gradient that computes loss_gradient.
    takes_is_ratio: the vLLM ratio multiplies the per-token loss (vespo puts it into its weight phi instead).
    zero_at_zero_advantage: the per-token loss is the advantage times a finite factor, so a token of advantage 0
        has gradient 0 (without a KL term): the fused loss skips its gradient work, a trainer may leave the row out.
    ratio_in_gradient: that factor's derivative holds the ratio exp(logp - old) unclamped, so it is finite (and the
        zero-advantage gradient 0, not inf x 0) only while old > -87 (grpo_loss_math.zero_gradient_tokens).
    sequence_weight: a detached weight of the sequence's summed log-ratios multiplies the term (vespo's phi), so given
        old log-probabilities d(loss)/d(logp[t]) depends on the sequence's other tokens: not token-local.
    """

    name = ""
    triton_branch = 0
    takes_is_ratio = True
    zero_at_zero_advantage = True
    ratio_in_gradient = True
    sequence_weight = False

    def per_token_loss(self, x: TermInputs, o, with_stats: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(per-token loss, differentiable in x.logps; its detached per-token statistics by logged name)."""
        raise NotImplementedError

    def loss_gradient(self, coef_1: torch.Tensor, adv: torch.Tensor, phi: torch.Tensor | None, o) -> torch.Tensor:
        """d(per-token loss)/d(logp) of scored tokens as autograd takes it through per_token_loss (without the vLLM
        ratio, the KL term and the normaliser's weight, which grpo_loss_math.token_loss_gradient applies)."""
        raise NotImplementedError

    def clip_bounds(self, o) -> tuple[float, float]:
        """The ratio's clamp bounds (low, high) as the Triton branch reads them (0, 0: none). Computed on the host in
        float64 and rounded once to fp32 by the kernel's argument, as torch.clamp rounds its bounds."""
        return 0.0, 0.0

    def sequence_weights(self, adv: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor | None, o
                         ) -> torch.Tensor | None:
        """A sequence_weight term's detached weight without old log-probabilities (every log-ratio 0), (B, 1) or
        (B, T); None for the other terms."""
        return None


class ClippedTerm(PolicyTerm):
    """PPO's clipped surrogate: -min(clamp(coef_1, max=delta) * adv, clamp(coef_1, 1 - eps_low, 1 + eps_high) * adv)."""

    name = "clipped"
    triton_branch = 1

    def per_token_loss(self, x, o, with_stats):
        coef_1, adv = x.coef_1, x.adv
        coef_2 = torch.clamp(coef_1, 1 - o.epsilon_low, 1 + o.eps_high)
        if o.delta is not None:
            coef_1 = torch.clamp(coef_1, max=o.delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        stats = {}
        if with_stats:
            with torch.no_grad():
                low = ((coef_1 < 1 - o.epsilon_low) & (adv < 0)).to(x.logps.dtype)
                high = ((coef_1 > 1 + o.eps_high) & (adv > 0)).to(x.logps.dtype)
                stats = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                         "clip_ratio/region_mean": torch.maximum(low, high)}
        return per_token_loss, stats

    def loss_gradient(self, coef_1, adv, phi, o):
        low, high = self.clip_bounds(o)
        coef_2 = torch.clamp(coef_1, low, high)
        clipped_1 = coef_1 if o.delta is None else torch.clamp(coef_1, max=o.delta)
        a, b = clipped_1 * adv, coef_2 * adv
        # torch.min passes half the gradient to each side of a tie
        share_a = torch.where(a == b, 0.5, 1.0).masked_fill(a > b, 0.0)
        share_b = torch.where(a == b, 0.5, 1.0).masked_fill(a < b, 0.0)
        # what reaches coef_1 through each side (a clamp passes it inside its bounds, bounds included), summed, then
        # times d(coef_1)/d(logp) = coef_1 as autograd's exp does: an overflowed or NaN ratio that both clamps cut off
        # gives 0 * inf = NaN there, as in TRL, not 0
        through_a = share_a * adv if o.delta is None else torch.where(coef_1 <= o.delta, share_a * adv, 0.0)
        through_b = torch.where((coef_1 >= low) & (coef_1 <= high), share_b * adv, 0.0)
        return -(through_a + through_b) * coef_1

    def clip_bounds(self, o):
        return 1 - o.epsilon_low, 1 + o.eps_high


class CispoTerm(PolicyTerm):
    """CISPO: -clamp(coef_1, max=eps_high).detach() * adv * logp (the clamped ratio a detached weight)."""

    name = "cispo"
    triton_branch = 2
    ratio_in_gradient = False  # clamped above: finite whatever old is

    def per_token_loss(self, x, o, with_stats):
        clamped_ratios = torch.clamp(x.coef_1, max=o.eps_high).detach()
        per_token_loss = -clamped_ratios * x.adv * x.logps
        stats = {}
        if with_stats:
            with torch.no_grad():
                stats = {"cispo_clip_ratio": ((x.coef_1 > o.eps_high) & (x.adv > 0)).to(x.logps.dtype)}
        return per_token_loss, stats

    def loss_gradient(self, coef_1, adv, phi, o):
        return -torch.clamp(coef_1, max=self.clip_bounds(o)[1]) * adv

    def clip_bounds(self, o):
        return 0.0, o.eps_high


class SapoTerm(PolicyTerm):
    """SAPO's soft gate: -sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv, tau by the advantage's sign."""

    name = "sapo"
    triton_branch = 3

    def per_token_loss(self, x, o, with_stats):
        temperatures = torch.where(x.adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        return -(torch.sigmoid(temperatures * (x.coef_1 - 1)) * 4 / temperatures) * x.adv, {}

    def loss_gradient(self, coef_1, adv, phi, o):
        temperature = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        s = torch.sigmoid(temperature * (coef_1 - 1))
        return -4 * adv * s * (1 - s) * coef_1


class VespoTerm(PolicyTerm):
    """VESPO: -phi * adv * logp with phi a detached gamma weight of the sequence ratio (vespo_gamma_weights)."""

    name = "vespo"
    triton_branch = 4
    takes_is_ratio = False  # the vLLM ratio enters phi
    ratio_in_gradient = False  # phi is finite (TRL zeroes a non-finite one)
    sequence_weight = True

    def per_token_loss(self, x, o, with_stats):
        phi_seq = vespo_gamma_weights(x.adv, x.log_ratio, x.mask, x.is_ratio, o)
        return -phi_seq * x.adv * x.logps, ({"vespo/phi_seq_mean": phi_seq} if with_stats else {})

    def loss_gradient(self, coef_1, adv, phi, o):
        return -phi * adv

    def sequence_weights(self, adv, mask, is_ratio, o):
        return vespo_gamma_weights(adv, torch.zeros_like(mask), mask, is_ratio, o)


@torch.no_grad()
def vespo_gamma_weights(adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor | None,
                        options) -> torch.Tensor:
    """vespo's detached weight phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1) of the sequence ratio w, the
    product of the token ratios pi/pi_old and of the vLLM ratios, in log space with TRL's clamps; (k, lambda) by
    the advantage's sign; non-finite phi becomes 0. TRL's `get_gamma_weights` (TRL 1.16). The caller gives
    `log_ratio` 0 and `is_ratio` 1 at masked positions: TRL sums log(ratio) over every position, and its ratio
    there is exp(0) = 1 clipped to [C_min, C_max] (so 1, unless C_min > 1 or C_max < 1, where TRL lets masked
    positions weigh in phi and this function does not). A ratio per sequence ((B, 1)) enters once, as in TRL."""
    o = options
    seq_log_ratio = (torch.clamp(log_ratio, -_VESPO_LOG_MAX, _VESPO_LOG_MAX) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(is_ratio), _VESPO_LOG_MIN, _VESPO_LOG_MAX)
        seq_log_ratio = seq_log_ratio + log_is_ratio.sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, _VESPO_LOG_MIN, _VESPO_LOG_MAX)
    nonneg = adv >= 0
    k = torch.where(nonneg, o.vespo_k_pos, o.vespo_k_neg)
    lam = torch.where(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class Normaliser:
    """How a loss type reduces its per-token loss ((B, T), or (B, 1) at sequence level) to the loss, in TRL's
    floating-point order. The loss is linear in the per-token loss, so each token's weight d(loss)/d(per-token
    loss) comes from `reduce` too (grpo_loss_math.token_grad_inputs).

    per_sequence: the loss is a mean over the micro-batch's sequences, or divides by their number: a trainer that
        pads micro-batches with rows of its own weights each real row (gfpo_trainer/rows.py).
    micro_batch_tokens: it divides by its micro-batch's token count, so which rows share a micro-batch changes every
        row's weight: a trainer can neither pad nor skip rows (gfpo_trainer/config.py refuses uneven splits).
    token_count: it divides by num_items_in_batch (None: the mask's token count), which the trainer passes as
        TRL does (gfpo_trainer/fused_head.py).
    """

    per_sequence = False
    micro_batch_tokens = False
    token_count = False

    def reduce(self, per_token_loss: torch.Tensor, mask: torch.Tensor, o,
               num_items_in_batch: torch.Tensor | float | None) -> torch.Tensor:
        raise NotImplementedError


class SequenceMean(Normaliser):
    """Each sequence's mean over its tokens, then the mean over sequences (grpo, sapo)."""

    per_sequence = True

    def reduce(self, per_token_loss, mask, o, num_items_in_batch):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


class BatchTokenMean(Normaliser):
    """The sum over the batch's tokens over their count (bnpo)."""

    micro_batch_tokens = True

    def reduce(self, per_token_loss, mask, o, num_items_in_batch):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


class MaxLengthMean(Normaliser):
    """The sum over the batch's tokens over B * max_completion_length (dr_grpo; None: the batch's T)."""

    per_sequence = True

    def reduce(self, per_token_loss, mask, o, num_items_in_batch):
        max_len = o.max_completion_length if o.max_completion_length is not None else mask.shape[1]
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)


class TokenCountMean(Normaliser):
    """The sum over the batch's tokens over num_items_in_batch, clamped to at least 1 (dapo, cispo, vespo)."""

    token_count = True

    def reduce(self, per_token_loss, mask, o, num_items_in_batch):
        n = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=mask.dtype)
        return (per_token_loss * mask).sum() / n.to(device=mask.device, dtype=mask.dtype).clamp(min=1.0)


class SequenceSumMean(Normaliser):
    """Each sequence's sum over its tokens, then the mean over sequences (luspo)."""

    per_sequence = True

    def reduce(self, per_token_loss, mask, o, num_items_in_batch):
        return (per_token_loss * mask).sum(-1).mean()


class TrainedRowsNormalisation(NamedTuple):
    """What a loss over a trainer's chosen rows divides by, and what each of its rows weighs (see
    trained_rows_normalisation)."""

    num_items_in_batch: torch.Tensor  # (), the token count a token_count normaliser divides by (TRL's key)
    row_weights: torch.Tensor  # (B,) float32, a factor on each trained row's loss: 0 for padding rows


def trained_rows_normalisation(spec: LossTypeSpec, keep: torch.Tensor, row_tokens: torch.Tensor, real: torch.Tensor,
                               num_processes: int, *, rejected_in_loss: bool = False) -> TrainedRowsNormalisation:
    """The normaliser of a loss over a subset of a generation batch's rows, so that every row weighs what it would in
    TRL's loss over the rows in the loss divided evenly: the subset is what a trainer trains (the rows in the loss,
    less those it skips as zero-gradient, padded with masked rows so that every process holds `real.numel()` rows
    and every micro-batch as many). Two cases of rows in the loss: the `keep` rows (GFPO trains the kept rows only),
    or every row (`rejected_in_loss`, the paper's objective: the rejected rows are in the loss with advantage 0, as in
    TRL's loss over all rows with their advantages zeroed).

    Skipped rows still count: a token_count normaliser divides by the tokens of every row in the loss (padding rows
    hold none; vespo's weight phi reads its own row only), so its rows weigh 1. A per_sequence normaliser divides
    each micro-batch by its row count B = B_real + padding, where an even split of the K rows in the loss would have
    K / (P * steps_per_generation): every real row gets the factor P * (rows per process) / K. A micro_batch_tokens
    normaliser (bnpo) cannot be corrected per row: the trainer neither pads nor skips for it, and its rows weigh 1.

    Args:
        spec: the loss type's spec (LOSS_SPECS).
        keep: (N,) bool, the kept rows of the global batch.
        row_tokens: (N,) integer, each global row's loss tokens (completion mask x tool mask, summed).
        real: (B,) bool, this process's trained rows: True for a real row, False for a padding row.
        num_processes: P, the processes sharing the global batch.
        rejected_in_loss: every row of the global batch is in the loss, not the `keep` rows only.
    Returns:
        TrainedRowsNormalisation: num_items_in_batch (), row_weights (B,) float32.
    """
    in_loss = torch.ones_like(keep) if rejected_in_loss else keep
    num_in_loss = int(in_loss.sum())
    weight = num_processes * real.numel() / max(num_in_loss, 1) if spec.normaliser.per_sequence else 1.0
    return TrainedRowsNormalisation(num_items_in_batch=row_tokens[in_loss].sum(), row_weights=real.float() * weight)


CLIPPED, CISPO, SAPO, VESPO = ClippedTerm(), CispoTerm(), SapoTerm(), VespoTerm()


@dataclasses.dataclass(frozen=True)
class LossTypeSpec:
    """One TRL loss_type: its policy term and its normaliser."""

    name: str
    term: PolicyTerm
    normaliser: Normaliser

    @property
    def zero_advantage_rows_skip(self) -> bool:
        """A trainer may leave a row of advantage 0 out of the batch (beta == 0): its gradient is exactly 0 and no
        other row's weight depends on it being there."""
        return self.term.zero_at_zero_advantage and not self.normaliser.micro_batch_tokens


# TRL 1.16's loss types, in its order
LOSS_SPECS: dict[str, LossTypeSpec] = {spec.name: spec for spec in (
    LossTypeSpec("grpo", CLIPPED, SequenceMean()),
    LossTypeSpec("bnpo", CLIPPED, BatchTokenMean()),
    LossTypeSpec("dr_grpo", CLIPPED, MaxLengthMean()),
    LossTypeSpec("dapo", CLIPPED, TokenCountMean()),
    LossTypeSpec("cispo", CISPO, TokenCountMean()),
    LossTypeSpec("sapo", SAPO, SequenceMean()),
    LossTypeSpec("luspo", CLIPPED, SequenceSumMean()),
    LossTypeSpec("vespo", VESPO, TokenCountMean()),
)}
LOSS_TYPES = tuple(LOSS_SPECS)
# the distinct policy terms, each with its Triton branch
POLICY_TERMS = tuple({id(spec.term): spec.term for spec in LOSS_SPECS.values()}.values())


def loss_spec(loss_type) -> LossTypeSpec:
    """The spec of `loss_type`; ValueError naming the value for any other (a kernel never falls back to a default)."""
    spec = LOSS_SPECS.get(loss_type) if isinstance(loss_type, str) else None
    if spec is None:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got loss_type={loss_type!r}"
                         f"{did_you_mean(loss_type, LOSS_TYPES)}")
    return spec
