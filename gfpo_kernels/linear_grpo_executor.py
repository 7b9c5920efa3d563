"""The fused linear GRPO loss's executor: one object per call that owns the call's buffers and runs its passes in
order over the plan's stages and chunks (chunk_plan.Plan):

1. projection: a stage's rows into the fp32 staging buffer (linear_grpo_gemm.project);
2. statistics: the row pass that writes each row's log p(target), entropy and log-partition, and, for a token-local
   loss on a stage of rows with gradients, g = d(loss)/d(logp) in closed form (grpo_loss_math.token_loss_gradient;
   the Triton kernel computes the same inside the pass);
3. grad-logits: the row pass that turns the stage's logits into their gradient from g, rounded once into the
   chunk's buffer in the GEMM operand dtype;
4. gradient GEMMs, once per chunk: grad_h of the chunk's rows over the whole vocabulary, and grad_W over the
   chunk's rows (one chunk: one GEMM writes it in the weight's dtype; several: an fp32 accumulator).

Which passes run follows from the call: without gradients, 1-2 over every stage; with gradients of a token-local
loss, the stages of rows whose loss gradient is 0 take 1-2, then each chunk's stages take 1-3 (g computed in 2)
and the chunk ends with 4; otherwise (sequence-level importance sampling, vespo given old log-probabilities) a
first sweep of 1-2, g of every row by autograd through grpo_loss_math, then a second sweep of 1, 3 and 4.
The staging buffer is freed before the last chunk's GEMMs, where a weight gradient written directly is allocated.
"""

from __future__ import annotations

import enum
from typing import Callable, NamedTuple

import torch

from . import linear_grpo_gemm as gemms
from . import linear_grpo_torch
from .chunk_plan import CallShape, Plan, plan_call
from .grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps, token_grad_inputs


class RowPasses(NamedTuple):
    """A backend's row passes: the Triton kernels or their torch twins (linear_grpo_torch)."""

    stage_statistics: Callable
    grad_logits: Callable
    scale_into: Callable
    scale_in_place: Callable


def row_passes(backend: str) -> RowPasses:
    """The row passes of `backend` ("triton", or "torch")."""
    if backend == "triton":
        from . import linear_grpo_triton as kernels

        return RowPasses(kernels.stage_statistics_triton, kernels.grad_logits_triton, kernels.scale_into_triton,
                         kernels.scale_in_place_triton)
    t = linear_grpo_torch
    return RowPasses(t.stage_statistics_torch, t.grad_logits_torch, t.scale_into_torch, t.scale_in_place_torch)


class Count(NamedTuple):
    """What validation counted in its one host transfer: the scored tokens, and those among them whose loss gradient
    is exactly 0 (the (B, T) bool tensor grpo_loss_math.zero_gradient_tokens made, or None, and their number)."""

    scored: int
    zero_gradient_tokens: torch.Tensor | None = None
    zero_gradient: int = 0


class LossInputs(NamedTuple):
    """The loss's per-token inputs besides the log-probabilities, as grpo_loss_from_logps takes them (fp32, on
    hidden's device)."""

    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    vllm_is_ratio: torch.Tensor | None
    num_items_in_batch: torch.Tensor | None


class WeightGradient(enum.Enum):
    """How the weight gradient is made: not asked; written by the one chunk's GEMM in the weight's dtype (allocated
    once the staging buffer is freed); summed over several chunks in an fp32 accumulator."""

    NONE = 0
    DIRECT = 1
    ACCUMULATE = 2


class Gradients(NamedTuple):
    """What the forward hands to backward: the flat positions of the rows with gradients, and the gradients (None
    where not asked) of those rows' hidden states, of the weight and of the bias, not yet scaled by the incoming
    gradient."""

    rows: torch.Tensor
    grad_h: torch.Tensor | None
    grad_w: torch.Tensor | None
    grad_b: torch.Tensor | None


class Executor:
    """One fused loss call: its scored rows gathered once, its plan, its buffers, and its passes (module docstring).
    `operand_dtype`: the GEMMs' dtype (linear_grpo_gemm.operand_dtype); `needs_grad`: the (hidden, weight, bias)
    gradients asked."""

    def __init__(self, hidden, weight, bias, target_ids, mask, inputs: LossInputs, options: GRPOLossOptions,
                 backend: str, count: Count, operand_dtype: torch.dtype, needs_grad: tuple[bool, bool, bool]):
        B, T, H = hidden.shape
        V = weight.shape[0]
        device = hidden.device
        self.mask, self.inputs, self.options = mask, inputs, options
        self.passes = row_passes(backend)
        self.inv_t, self.softcap = 1.0 / options.temperature, options.logit_softcap

        # the scored rows, gathered once: those with gradients first, those whose loss gradient is 0 last. The counts
        # are known on the host (validation read them in one transfer), so nonzero_static needs no second sync.
        live = mask.reshape(-1) != 0
        self.n_grad = count.scored - count.zero_gradient
        if count.zero_gradient:
            zero = count.zero_gradient_tokens.reshape(-1)
            self.rows = torch.cat([torch.nonzero_static(live & ~zero, size=self.n_grad),
                                   torch.nonzero_static(zero, size=count.zero_gradient)]).squeeze(1)
        else:
            self.rows = torch.nonzero_static(live, size=count.scored).squeeze(1)
        self.h, self.w = gemms.gemm_operands(hidden.reshape(-1, H).index_select(0, self.rows), weight,
                                             operand_dtype)
        self.b = None if bias is None else bias.to(operand_dtype).float()
        self.targets = target_ids.reshape(-1).index_select(0, self.rows).long()

        # results: log p(target) and entropy at every position (0 where nothing is scored), the log-partition of
        # each scored row (the grad-logits pass reads it)
        self.logps = torch.zeros(B * T, dtype=torch.float32, device=device)
        self.entropy = torch.zeros(B * T, dtype=torch.float32, device=device)
        self.lse = torch.empty(count.scored, dtype=torch.float32, device=device)

        need_h, need_w, need_b = needs_grad
        operand = self.w.dtype  # the operands' dtype as held: fp32 where cuBLAS cannot write fp32 from half
        self.plan: Plan = plan_call(CallShape(
            n=count.scored, positions=B * T, V=V, H=H, operand_elem_bytes=operand.itemsize,
            hidden_elem_bytes=hidden.dtype.itemsize,
            grad_h_elem_bytes=gemms.written_dtype(hidden.dtype, operand).itemsize,
            weight_elem_bytes=weight.dtype.itemsize,
            weight_direct=gemms.written_dtype(weight.dtype, operand) == weight.dtype,
            weight_copy=self.w.data_ptr() != weight.data_ptr(), need_h=need_h, need_w=need_w,
            n_zero=count.zero_gradient,
            stage_temporaries=linear_grpo_torch.STAGE_TEMPORARIES if backend == "torch" else 0,
        ), device)

        self.staging: torch.Tensor | None = None  # allocated by the first projection, freed before the last GEMMs
        self.wants_gradients = any(needs_grad)
        # the gradients: grad_h of the rows with gradients (each chunk's GEMM writes its rows once, in hidden's dtype
        # where it can); the weight's (WeightGradient); the bias's, fp32, from the fp32 logits gradient. Nothing is
        # zero-filled unless nothing has a gradient.
        alloc = torch.empty if self.n_grad else torch.zeros
        self.grad_h = None
        if need_h:
            self.grad_h = alloc(self.n_grad, H, dtype=gemms.written_dtype(hidden.dtype, operand), device=device)
        self.weight_gradient = WeightGradient.NONE
        self.grad_w = None
        self.weight_dtype = weight.dtype
        if need_w:
            if len(self.plan.chunks) > 1:
                self.weight_gradient = WeightGradient.ACCUMULATE
                self.grad_w = torch.empty(V, H, dtype=torch.float32, device=device)
            else:
                self.weight_gradient = WeightGradient.DIRECT
                if not self.plan.chunks:  # no row with gradients: no GEMM writes it
                    self.grad_w = torch.zeros(V, H, dtype=gemms.written_dtype(weight.dtype, operand), device=device)
        self.grad_b = torch.zeros(V, dtype=torch.float32, device=device) if need_b else None
        # the chunk's logits gradient, the two GEMMs' operand; a bias trained alone sums each stage's logits
        # gradient and needs none
        self.chunk_buffer = None
        if need_h or need_w:
            self.chunk_buffer = torch.empty(self.plan.chunk_rows, V, dtype=operand, device=device)

        # g = d(loss)/d(logp) of the rows with gradients: for a token-local loss the statistics pass computes it in
        # closed form from per-token inputs gathered once (token_gradient_inputs); else autograd sets it at once
        self.closed_form = self.wants_gradients and options.is_token_local(with_old_logps=inputs.old_logps is not None)
        self.token_gradient_inputs = None
        self.g = None
        if self.closed_form:
            self.token_gradient_inputs = token_grad_inputs(mask, self.rows[: self.n_grad], options=options,
                                                           **inputs._asdict())
            self.g = torch.empty(self.n_grad, dtype=torch.float32, device=device)

    # -- the call

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Gradients | None]:
        """The passes in order; returns the loss, the log-probabilities and entropy (B, T), and the gradients (None
        without any)."""
        plan = self.plan
        if not self.wants_gradients:
            self._statistics_sweep(plan.stages)
        elif self.closed_form:
            self._statistics_sweep(plan.statistics_only)
            self._gradient_sweep(with_statistics=True)
        else:
            self._statistics_sweep(plan.stages)
            self.g = self._g_by_autograd()
            self._gradient_sweep(with_statistics=False)
        self.staging = None
        logps, entropy = self.logps.view(self.mask.shape), self.entropy.view(self.mask.shape)
        gradients = None
        if self.wants_gradients:
            gradients = Gradients(self.rows[: self.n_grad], self.grad_h, self.grad_w, self.grad_b)
        return self.loss(logps), logps, entropy, gradients

    def loss(self, logps: torch.Tensor) -> torch.Tensor:
        return grpo_loss_from_logps(logps, self.mask, options=self.options, with_stats=False,
                                    **self.inputs._asdict())[0]

    # -- sweeps over the plan

    def _statistics_sweep(self, stages) -> None:
        """Passes 1-2 of `stages`, without g."""
        for lo, hi in stages:
            self._statistics(lo, hi, self._project(lo, hi), with_g=False)

    def _gradient_sweep(self, *, with_statistics: bool) -> None:
        """Each chunk's stages through passes 1, (2 with g,) 3, then the chunk's GEMMs (4)."""
        for (start, end), stages in zip(self.plan.chunks, self.plan.chunk_stages):
            for lo, hi in stages:
                logits = self._project(lo, hi)
                if with_statistics:
                    self._statistics(lo, hi, logits, with_g=True)
                self._grad_logits(lo, hi, start, logits)
                del logits
            self._gradient_gemms(start, end)

    # -- the passes

    def _project(self, lo: int, hi: int) -> torch.Tensor:
        """Pass 1: rows [lo, hi)'s fp32 logits, in the staging buffer."""
        if self.staging is None:
            self.staging = torch.empty(self.plan.stage_rows, self.w.shape[0], dtype=torch.float32,
                                       device=self.w.device)
        return gemms.project(self.h[lo:hi], self.w, self.b, self.staging[: hi - lo])

    def _statistics(self, lo: int, hi: int, logits: torch.Tensor, *, with_g: bool) -> None:
        """Pass 2: rows [lo, hi)'s log p(target), entropy and log-partition, and (with_g) their closed-form g."""
        g, g_inputs = (self.g[lo:hi], self.token_gradient_inputs.rows(lo, hi)) if with_g else (None, None)
        self.passes.stage_statistics(logits, self.targets[lo:hi], self.inv_t, self.softcap, logps=self.logps,
                                     entropy=self.entropy, lse=self.lse[lo:hi], positions=self.rows[lo:hi], g=g,
                                     g_inputs=g_inputs, options=self.options)

    def _grad_logits(self, lo: int, hi: int, chunk_start: int, logits: torch.Tensor) -> None:
        """Pass 3: rows [lo, hi)'s d(loss)/d(logits) from their g, into the chunk's buffer, rounded once to the
        operand dtype by the row pass itself; a bias gradient first sums the fp32 values (computed in place), then
        they are copied into the buffer."""
        out = None if self.chunk_buffer is None else self.chunk_buffer[lo - chunk_start: hi - chunk_start]
        into_buffer = out is not None and (self.grad_b is None or out.dtype == torch.float32)
        d = self.passes.grad_logits(logits, self.targets[lo:hi], self.lse[lo:hi], self.g[lo:hi], self.inv_t,
                                    out if into_buffer else None, softcap=self.softcap)
        if self.grad_b is not None:
            self.grad_b.add_(d.sum(0))
            if out is not None and not into_buffer:
                out.copy_(d)

    def _gradient_gemms(self, start: int, end: int) -> None:
        """Pass 4: the chunk's two gradient GEMMs from its logits-gradient buffer (the staging buffer freed first
        before the last chunk's)."""
        if end == self.plan.chunks[-1][1]:
            self.staging = None
        if self.chunk_buffer is None:  # a bias alone: summed per stage
            return
        d = self.chunk_buffer[: end - start]
        if self.grad_h is not None:
            gemms.gemm(self.grad_h[start:end], d, self.w)
        if self.weight_gradient is WeightGradient.DIRECT:
            dtype = gemms.written_dtype(self.weight_dtype, self.w.dtype)
            self.grad_w = torch.empty(self.w.shape, dtype=dtype, device=d.device)
            gemms.gemm(self.grad_w, d.t(), self.h[start:end])
        elif self.weight_gradient is WeightGradient.ACCUMULATE:
            gemms.gemm(self.grad_w, d.t(), self.h[start:end], accumulate=start > 0)

    def _g_by_autograd(self) -> torch.Tensor:
        """g of every scored row by autograd through grpo_loss_math (the reference's code), for the losses that are not
        token-local."""
        rows = self.rows
        with torch.enable_grad():
            x = self.logps[rows].requires_grad_()
            logps = self.logps.index_put((rows,), x).view(self.mask.shape)
            return torch.autograd.grad(self.loss(logps), x)[0]
