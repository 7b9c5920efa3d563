"""Triton row kernels of the fused linear GRPO loss (their torch twins are in linear_grpo_torch.py).

Both work on one stage of projected logits, fp32 (rows, V), raw (before the model's soft cap, when it has one
(Gemma 2: z -> cap * tanh(z / cap), applied on the fly as TRL's fused head does), and before the temperature):
- stage_statistics (logprob_entropy): per row, an online log-sum-exp over the vocabulary with per-lane running
  maxima (no cross-lane reduction inside the loop), giving log p(target), the entropy and the log-partition. A
  stage holds a few hundred rows (chunk_plan.plan_chunks), too few for one program per row to keep a GPU's memory
  busy, so each row is cut into vocabulary spans (programs (row, span)) and a second kernel folds the
  spans, writes the row's results where the fused loss keeps them, and, for a token-local loss, computes its
  g = d(loss)/d(logp) in closed form (grpo_loss_math.token_loss_gradient, its torch twin).
- grad_logits: logits -> d(loss)/d(logits) = g_row * (onehot(target) - p) / temperature (times the cap's
  derivative 1 - tanh^2(z / cap)), where g_row = d(loss)/d(log p(target)) of that row; in place, or rounded once
  into a half-precision buffer (the gradient GEMMs' operand), which saves the separate conversion pass: 6 bytes
  moved per logit instead of 14.

And two elementwise kernels for backward:
- scale_into: an fp32 gradient accumulator times the incoming gradient, rounded once into the parameter's half
  precision dtype. torch.mul(acc, scale, out=bf16) does the same in one pass but with PyTorch's casting
  elementwise kernel, which is not vectorized (about half the memory bandwidth; docs/performance.md).
- scale_in_place: a gradient already in the parameter's dtype times the incoming gradient, in place, skipped on
  the device when that is 1 (the usual loss.backward()): no pass over the (V, H) gradient and no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import on_device

# -1.0e30 in the kernels is a finite stand-in for -inf: exp(-1e30 - m) is exactly 0 and no inf - inf makes a NaN.
BLOCK_V = 1024
# log-prob pass: programs to aim for when a stage has few rows (16 per SM of an H100), and the fewest blocks a
# vocabulary span may have
_TARGET_PROGRAMS = 2048
_MIN_BLOCKS_PER_SPLIT = 8


@triton.jit
def _fold(m, s, d):
    """Running (max m, sum s of exp(z - m), sum d of exp(z - m) * (z - m)) of several lanes or spans -> the same
    three for their union, re-centred on its maximum."""
    big_m = tl.max(m, axis=0)
    w = tl.exp(m - big_m)
    return big_m, tl.sum(s * w, axis=0), tl.sum(w * (d + s * (m - big_m)), axis=0)


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh that the interpreter runs too; TRL's fused head does the same)
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def _logsumexp_partial_kernel(
    logits_ptr, stride, m_ptr, s_ptr, d_ptr, V, span, inv_t, softcap, SPLITS, BLOCK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr
):
    # program (row, split): columns [split * span, (split + 1) * span) of the row
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = logits_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    m = tl.full([BLOCK], -1.0e30, tl.float32)  # running max of each lane
    s = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m)
    d = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m) * (z - m): the entropy term, relative to m
    for start in range(lo, hi, BLOCK):
        cols = start + lanes
        ok = cols < hi
        if HAS_SOFTCAP:  # padded lanes load 0 (no overflow in the cap's exp), then take the -inf stand-in
            z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
            z = tl.where(ok, softcap * _tanh(z / softcap), -1.0e30)
        else:
            z = tl.load(base + cols, mask=ok, other=-1.0e30).to(tl.float32)
        z = z * inv_t
        new_m = tl.maximum(m, z)
        shift = m - new_m
        scale = tl.exp(shift)
        e = tl.where(ok, tl.exp(z - new_m), 0.0)
        # re-centre the running sums on new_m, then add this block
        d = scale * (d + s * shift) + e * (z - new_m)
        s = scale * s + e
        m = new_m
    big_m, total, total_d = _fold(m, s, d)
    out = row * SPLITS + split
    tl.store(m_ptr + out, big_m)
    tl.store(s_ptr + out, total)
    tl.store(d_ptr + out, total_d)


# LOSS of the log-prob pass without a loss gradient; with one, LOSS is the policy term's triton_branch
# (loss_types.PolicyTerm: 1 clipped, 2 cispo, 3 sapo, 4 vespo), each a branch of _token_loss_gradient
NO_GRAD = 0


@triton.jit
def _token_loss_gradient(logp, adv, weight, old, ref, ratio, phi, clip_low, clip_high, delta, tau_pos, tau_neg, beta,
                         LOSS: tl.constexpr, HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_RATIO: tl.constexpr,
                         HAS_KL: tl.constexpr, BIAS_KL: tl.constexpr):
    """d(loss)/d(logp) of one token: grpo_loss_math.token_loss_gradient, term by term (the policy term's
    loss_gradient in loss_types, then the vLLM ratio where the term takes it (HAS_RATIO), the KL term, the
    normaliser's weight). clip_low / clip_high: the term's clip_bounds, computed on the host and rounded once to
    fp32 as torch.clamp rounds its bounds (1.0 + eps in fp32 here would round twice and may be an ulp off); the
    clamps pass NaN through, as torch's do."""
    if HAS_OLD:
        coef_1 = tl.exp(logp - old)
    else:
        coef_1 = logp * 0.0 + 1.0
    if LOSS == 1:  # clipped: -min(clamp(coef_1, max=delta) * adv, clamp(coef_1, 1 - eps_low, 1 + eps_high) * adv)
        coef_2 = tl.clamp(coef_1, clip_low, clip_high, propagate_nan=tl.PropagateNan.ALL)
        if HAS_DELTA:
            clipped_1 = tl.minimum(coef_1, delta, propagate_nan=tl.PropagateNan.ALL)
        else:
            clipped_1 = coef_1
        a = clipped_1 * adv
        b = coef_2 * adv
        share_a = tl.where(a > b, 0.0, tl.where(a == b, 0.5, 1.0))  # torch.min's gradient splits a tie
        share_b = tl.where(a < b, 0.0, tl.where(a == b, 0.5, 1.0))
        # what reaches coef_1 through each side, summed, then times d(coef_1)/d(logp) = coef_1 (autograd's order:
        # an overflowed or NaN ratio gives NaN, not 0)
        through_a = share_a * adv
        if HAS_DELTA:
            through_a = tl.where(coef_1 <= delta, through_a, 0.0)
        through_b = tl.where((coef_1 >= clip_low) & (coef_1 <= clip_high), share_b * adv, 0.0)
        d_loss = -(through_a + through_b) * coef_1
    elif LOSS == 2:  # cispo: -clamp(coef_1, max=eps_high).detach() * adv * logp (clip_high: eps_high itself)
        d_loss = -tl.minimum(coef_1, clip_high, propagate_nan=tl.PropagateNan.ALL) * adv
    elif LOSS == 3:  # sapo: -sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        s = tl.sigmoid(tau * (coef_1 - 1))
        d_loss = -4 * adv * s * (1 - s) * coef_1
    elif LOSS == 4:  # vespo: -phi * adv * logp, phi detached
        d_loss = -phi * adv
    else:
        tl.static_assert(False, "no branch for this policy term (loss_types.PolicyTerm.triton_branch)")
    if HAS_RATIO:
        d_loss = d_loss * ratio
    if HAS_KL:  # beta * (exp(ref - logp) - (ref - logp) - 1) (* coef_1)
        e = tl.exp(ref - logp)
        d_kl = 1 - e
        if BIAS_KL:
            d_kl = d_kl * coef_1 + (e - (ref - logp) - 1) * coef_1
        d_loss = d_loss + beta * d_kl
    return weight * d_loss


@triton.jit
def _logprob_entropy_combine_kernel(
    logits_ptr, stride, targets_ptr, m_ptr, s_ptr, d_ptr, logp_ptr, entropy_ptr, lse_ptr, positions_ptr,
    adv_ptr, weight_ptr, old_ptr, ref_ptr, ratio_ptr, phi_ptr, g_ptr,
    inv_t, softcap, SPLITS, clip_low, clip_high, delta, tau_pos, tau_neg, beta,
    BLOCK_S: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCATTER: tl.constexpr, LOSS: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_RATIO: tl.constexpr, HAS_KL: tl.constexpr,
    BIAS_KL: tl.constexpr, HAS_PHI: tl.constexpr,
):
    # one program per row: the spans' (max, sum, entropy term) folded as each span folded its lanes; then the row's
    # log-prob and entropy (at its flat position when SCATTER) and, for a loss (LOSS != 0), g = d(loss)/d(logp)
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_S)
    ok = k < SPLITS
    m = tl.load(m_ptr + row * SPLITS + k, mask=ok, other=-1.0e30)
    s = tl.load(s_ptr + row * SPLITS + k, mask=ok, other=0.0)
    d = tl.load(d_ptr + row * SPLITS + k, mask=ok, other=0.0)
    big_m, total, total_d = _fold(m, s, d)
    log_total = tl.log(total)
    lse = big_m + log_total
    target = tl.load(targets_ptr + row)
    z_t = tl.load(logits_ptr + row * stride + target).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * _tanh(z_t / softcap)
    z_t = z_t * inv_t
    logp = z_t - lse
    out = row
    if SCATTER:
        out = tl.load(positions_ptr + row)
    tl.store(logp_ptr + out, logp)
    tl.store(entropy_ptr + out, log_total - total_d / total)
    tl.store(lse_ptr + row, lse)
    if LOSS != 0:
        adv = tl.load(adv_ptr + row)
        weight = tl.load(weight_ptr + row)
        old = logp
        ref = logp
        ratio = logp
        phi = logp
        if HAS_OLD:
            old = tl.load(old_ptr + row)
        if HAS_KL:
            ref = tl.load(ref_ptr + row)
        if HAS_RATIO:
            ratio = tl.load(ratio_ptr + row)
        if HAS_PHI:
            phi = tl.load(phi_ptr + row)
        g = _token_loss_gradient(logp, adv, weight, old, ref, ratio, phi, clip_low, clip_high, delta, tau_pos,
                                 tau_neg, beta, LOSS, HAS_OLD, HAS_DELTA, HAS_RATIO, HAS_KL, BIAS_KL)
        tl.store(g_ptr + row, g)


@triton.jit
def _grad_logits_kernel(
    logits_ptr, stride, out_ptr, out_stride, targets_ptr, lse_ptr, g_ptr, V, inv_t, softcap, BLOCK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    z = tl.load(logits_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        t = _tanh(z / softcap)
        z = softcap * t
    p = tl.exp(z * inv_t - tl.load(lse_ptr + row))
    g = tl.load(g_ptr + row)
    onehot = (cols == tl.load(targets_ptr + row)).to(tl.float32)
    grad = g * (onehot - p) * inv_t
    if HAS_SOFTCAP:
        grad = grad * (1 - t * t)  # d(cap * tanh(z / cap)) / dz
    # out may be the logits themselves (fp32) or a bf16/fp16 buffer: rounded once to nearest even, as torch's
    # tensor.to() does (cvt.rn in the PTX, tests/test_triton_aot.py; Triton's interpreter truncates to bf16)
    if out_ptr.dtype.element_ty == tl.float32:
        tl.store(out_ptr + row * out_stride + cols, grad, mask=ok)
    else:
        tl.store(out_ptr + row * out_stride + cols, grad.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=ok)


@triton.jit
def _scale_into_kernel(src_ptr, scale_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    x = tl.load(src_ptr + offsets, mask=ok) * tl.load(scale_ptr)
    tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)


@triton.jit
def _scale_in_place_kernel(x_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    # a fixed grid of programs, each striding over the blocks: when the scale is 1 every program returns after one
    # load, whatever the size
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
            offsets = start + tl.arange(0, BLOCK)
            ok = offsets < numel
            x = tl.load(x_ptr + offsets, mask=ok).to(tl.float32) * scale
            tl.store(x_ptr + offsets, x.to(x_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)


SCALE_BLOCK = 4096
# scale_in_place's grid: enough programs to stream at full bandwidth when it must scale (4 per SM of a 132-SM H100)
_SCALE_PROGRAMS = 528


def _split_span(rows: int, V: int, block: int) -> tuple[int, int]:
    """(splits, span): each row's vocabulary is cut into `splits` spans of `span` columns (a multiple of the block)
    so that a stage of few rows still gives the GPU about _TARGET_PROGRAMS programs (one program per row of 256 rows
    would leave most SMs idle); no more spans than _MIN_BLOCKS_PER_SPLIT blocks each would give (a span may
    then hold fewer blocks after rounding)."""
    splits = max(1, min(triton.cdiv(_TARGET_PROGRAMS, max(rows, 1)), triton.cdiv(V, _MIN_BLOCKS_PER_SPLIT * block)))
    span = triton.cdiv(triton.cdiv(V, splits), block) * block
    return triton.cdiv(V, span), span


def logprob_entropy_triton(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None = None):
    """(rows, V) fp32 logits -> (log p(target), entropy, log-partition), each (rows,) fp32, of the soft-capped logits
    (softcap None: none) over the temperature: a partial online log-sum-exp per (row, span of the vocabulary), then
    one combining program per row."""
    rows = logits.shape[0]
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
    stage_statistics_triton(logits, targets, inv_t, softcap, logps=logp, entropy=entropy, lse=lse)
    return logp, entropy, lse


def stage_statistics_triton(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, softcap: float | None, *,
                            logps: torch.Tensor, entropy: torch.Tensor, lse: torch.Tensor,
                            positions: torch.Tensor | None = None, g: torch.Tensor | None = None, g_inputs=None,
                            options=None) -> None:
    """The log-prob pass of one stage of (rows, V) fp32 logits, written where the fused loss keeps its results: log
    p(target) and entropy into `logps` / `entropy` (at the flat `positions` of the rows, or rows 0..rows-1), the
    log-partition into `lse` (rows,), and with `g`, d(loss)/d(logp) of each row from `g_inputs`
    (grpo_loss_math.TokenGradInputs of these rows) and the loss `options` (a token-local loss): no torch op. A
    partial online log-sum-exp per (row, span of the vocabulary), then one combining program per row."""
    rows, V = logits.shape
    if not rows:
        return
    block = min(BLOCK_V, triton.next_power_of_2(V))
    splits, span = _split_span(rows, V, block)
    partial_m, partial_s, partial_d = torch.empty(3, rows, splits, dtype=torch.float32, device=logits.device)
    cap = 1.0 if softcap is None else float(softcap)
    loss, scalars, flags = NO_GRAD, (0.0,) * 6, dict(HAS_OLD=False, HAS_DELTA=False, HAS_RATIO=False, HAS_KL=False,
                                                     BIAS_KL=False, HAS_PHI=False)
    inputs = [lse] * 7  # (adv, weight, old, ref, ratio, phi, g): unread where their flag is off
    if g is not None:
        o, i = options, g_inputs
        term = o.spec.term  # an unknown loss type is a ValueError here, never a default branch
        loss = term.triton_branch
        scalars = (*term.clip_bounds(o), 1.0 if o.delta is None else o.delta, o.sapo_temperature_pos,
                   o.sapo_temperature_neg, o.beta)
        flags = dict(HAS_OLD=i.old is not None, HAS_DELTA=o.delta is not None,
                     HAS_RATIO=i.is_ratio is not None and term.takes_is_ratio, HAS_KL=o.beta != 0.0,
                     BIAS_KL=o.use_bias_correction_kl, HAS_PHI=i.phi is not None)
        inputs = [x if x is not None else lse for x in (i.adv, i.weight, i.old, i.ref, i.is_ratio, i.phi)] + [g]
    with on_device(logits.device):
        _logsumexp_partial_kernel[(rows, splits)](
            logits, logits.stride(0), partial_m, partial_s, partial_d, V, span, float(inv_t), cap, splits,
            BLOCK=block, HAS_SOFTCAP=softcap is not None,
        )
        _logprob_entropy_combine_kernel[(rows,)](
            logits, logits.stride(0), targets, partial_m, partial_s, partial_d, logps, entropy, lse,
            lse if positions is None else positions, *inputs, float(inv_t), cap, splits,
            *(float(x) for x in scalars), BLOCK_S=triton.next_power_of_2(splits), HAS_SOFTCAP=softcap is not None,
            SCATTER=positions is not None, LOSS=loss, **flags,
        )


def grad_logits_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    inv_t: float,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """fp32 logits (rows, V) -> d(loss)/d(logits) (the raw logits', through the soft cap when there is one): in
    place, or into `out` (rows, V) of any float dtype, rounded once. Returns the tensor written."""
    rows, V = logits.shape
    out = logits if out is None else out
    assert out.shape == logits.shape and out.stride(1) == 1, (out.shape, out.stride())
    block = min(BLOCK_V, triton.next_power_of_2(V))
    if rows:
        g = g.float().contiguous()
        with on_device(logits.device):
            _grad_logits_kernel[(rows, triton.cdiv(V, block))](
                logits, logits.stride(0), out, out.stride(0), targets, lse, g, V, float(inv_t),
                1.0 if softcap is None else float(softcap), BLOCK=block, HAS_SOFTCAP=softcap is not None,
            )
    return out


def scale_in_place_triton(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale (x: contiguous, fp32/bf16/fp16, rounded once to nearest even; scale: one fp32 value on x's
    device), unless the scale is 1: the kernel reads it and returns at once, so the common case costs one small
    launch and no host sync."""
    assert x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.numel():
        scale = scale.to(x.device, torch.float32).reshape(1)
        with on_device(x.device):
            _scale_in_place_kernel[(min(_SCALE_PROGRAMS, triton.cdiv(x.numel(), SCALE_BLOCK)),)](
                x, scale, x.numel(), BLOCK=SCALE_BLOCK, num_warps=8
            )
    return x


def scale_into_triton(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc * scale (acc: fp32, contiguous; scale: one fp32 value on acc's device, read there, so the host never
    waits for it) as a new tensor of the half-precision `dtype`, rounded once to nearest even."""
    assert acc.dtype == torch.float32 and acc.is_contiguous() and dtype in (torch.bfloat16, torch.float16)
    out = torch.empty_like(acc, dtype=dtype)
    if acc.numel():
        scale = scale.to(acc.device, torch.float32).reshape(1)
        with on_device(acc.device):
            _scale_into_kernel[(triton.cdiv(acc.numel(), SCALE_BLOCK),)](
                acc, scale, out, acc.numel(), BLOCK=SCALE_BLOCK, num_warps=8
            )
    return out
