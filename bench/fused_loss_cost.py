"""Cost model of the fused linear GRPO loss and of TRL 1.16's chunked fused LM head (what
bench/test_bench_linear_grpo.py times as "trl"): per call, the executed GEMM FLOPs, the HBM bytes (trips over the
logits, the fp32 weight-gradient accumulator's reads and writes), the kernel launches and host time per phase (per
stage of the projection loop, per chunk of the gradient GEMMs), the peak extra memory, and a time from stated device
constants. It needs no GPU: it reads a plan (gfpo_kernels.chunk_plan.plan_chunks, the function the loss plans
with), not a device. It measures; nothing in training imports it.

How it works. A builder writes one call as the host issues it, op by op, with the allocations and frees between
them. `simulate` then runs two clocks: the host issues each op after the previous one (its host cost), the device
starts it once it is free and the op has been issued, and a sync makes the host wait for the device. The call
takes until both are done (the benchmark synchronises at the end). Peak memory is the running sum's maximum.

Device time of an op:
- GEMM: the roofline, max(FLOPs / gemm_flops, bytes / stream_bytes), plus for a GEMM that adds into an fp32
  accumulator of M x N the accumulator's read and write, 8*M*N bytes at stream_bytes, exposed in the share
  min(1, accumulate_rows / K) (K: the rows the GEMM sums over). Short-K accumulations cannot hide that traffic
  behind their math; long ones mostly do.
- streaming kernel (row passes over the logits, copies, fills): max(bytes / stream_bytes, small_kernel_s);
  PyTorch's casting multiply (not vectorised) at cast_bytes.
- kernel over O(B*T) elements (the loss math, index writes): small_kernel_s.
Host time of an op: host_gemm_s for a cuBLAS call, host_op_s for any other aten op that launches a kernel,
host_view_s for a view, host_triton_s for a Triton launch, host_autograd_s for a torch.autograd.grad call.

The constants of H100 come from the one GPU run there is (bench/results/2026-11-23-h100-cec7c50*, commit cec7c50);
each says which measurement fixed it. tests/test_fused_loss_cost.py checks the model against that run's
benchmark (a different measurement from the profile most constants come from), and the kernel counts it uses (ours
per stage, per chunk and per call; TRL's outside its tiles) against what the code dispatches on the CPU. Every
later GPU run checks it again: bench/predicted_vs_measured.py prints the model's numbers beside a results JSON's.

    python bench/fused_loss_cost.py          # predictions at the benchmark's goal shape
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # the checkout's gfpo_kernels when run as a script

from gfpo_kernels.chunk_plan import DEFAULT_LIMITS, Budget, CallShape, PlanLimits, plan_chunks  # noqa: E402

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceConstants:
    """What the model knows of a device (see the module docstring for where each enters)."""

    name: str
    gemm_flops: float  # FLOP/s of a large bf16 GEMM with fp32 accumulation
    stream_bytes: float  # bytes/s of a streaming kernel, and the memory side of a GEMM's roofline
    cast_bytes: float  # bytes/s of PyTorch's casting elementwise multiply (torch.mul(fp32, s, out=bf16))
    small_kernel_s: float  # device time of a kernel over O(B*T) elements
    accumulate_rows: float  # K below which a GEMM's fp32 accumulator traffic is fully exposed
    host_op_s: float  # host time of an aten op that launches a kernel
    host_gemm_s: float  # host time of a cuBLAS GEMM call
    host_view_s: float  # host time of a view (slice, reshape)
    host_triton_s: float  # host time of a Triton launch
    host_autograd_s: float  # host overhead of one torch.autograd.grad call (beyond its ops)
    workspace_bytes: int  # cuBLAS workspace, allocated by the process's first GEMM


# NVIDIA H100 80GB HBM3 (SXM), torch 2.11 + cu130, Triton 3.6: the cec7c50 run.
H100 = DeviceConstants(
    name="NVIDIA H100 80GB HBM3",
    # the benchmark's plain cuBLAS GEMM, N16384 x H4096 x V151936 bf16: 693 TFLOP/s (median; its kernels ran at
    # 753-797 in the profile, another moment of the same run: the clock varies by about 10%)
    gemm_flops=693.4e12,
    # profile: the log-prob pass (9.41 ms), the in-place logits-gradient pass (18.90 ms) and the bf16 copy of the
    # gradient (13.15 ms), 3 steps of ~14746 scored tokens x 151936: 121 GB in 41.5 ms
    stream_bytes=2.92e12,
    # profile: elementwise_kernel<128, 4> (torch.mul into bf16), 3 steps x (V*H + n*H) x 6 bytes in 9.07 ms
    cast_bytes=1.35e12,
    # profile: reduce_kernel 246 us / 54 calls, _index_put_impl_ 163 us / 36 calls
    small_kernel_s=4.5e-6,
    # profile: the weight-gradient GEMM of a 4711-row chunk took 8.22 ms, 0.65 ms more than the mean of the two
    # other GEMMs of the same FLOPs (projection 7.78, input gradient 7.36): 0.65 = 1.71 ms (8VH bytes) x 1788/4711.
    # (Check, not fitted: the 613-row chunk's took 1.46 ms more than its two others; predicted 1.71.)
    accumulate_rows=1788.0,
    # profile self CPU per call: aten::mul 10.0 us (117 calls); aten::mm 36 us, aten::addmm 38 us (the profiler
    # adds its own overhead: upper bounds)
    host_op_s=10e-6,
    host_gemm_s=37e-6,
    # not in the files (stated; the profile of the next GPU run checks them): a view 3 us, a Triton 3.x launch from
    # Python 25 us, the autograd engine's overhead per torch.autograd.grad call 50 us
    host_view_s=3e-6,
    host_triton_s=25e-6,
    host_autograd_s=50e-6,
    # PyTorch's default cuBLAS workspace on Hopper (CUBLAS_WORKSPACE_CONFIG unset): 32 MiB, taken from the caching
    # allocator by the first GEMM. The run's first case (gfpo forward, ragged ends) holds 32 MiB more than its
    # buffers; no later case does.
    workspace_bytes=32 << 20,
)


@dataclasses.dataclass
class _Op:
    phase: str
    name: str
    kind: str  # gemm, stream, cast, small, triton, view, sync, autograd
    device_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    logits_bytes: float = 0.0  # bytes of row passes over (rows, V) logits or their gradient
    accumulator_bytes: float = 0.0  # fp32 weight-gradient accumulator read + write
    count: int = 1


class Trace:
    """One call as the host issues it: ops (with device time from `device`) and allocations."""

    def __init__(self, device: DeviceConstants):
        self.device = device
        self.events: list = []  # _Op, or ("alloc", name, bytes) / ("free", name)
        self.phase = "setup"

    # -- memory
    def alloc(self, name: str, nbytes: float) -> None:
        self.events.append(("alloc", name, float(nbytes)))

    def free(self, *names: str) -> None:
        for name in names:
            self.events.append(("free", name))

    # -- ops
    def _op(self, **kw) -> None:
        self.events.append(_Op(phase=self.phase, **kw))

    def gemm(self, name: str, m: int, n: int, k: int, *, operand_bytes: int = 2, out_bytes: int = 4,
             accumulate: bool = False) -> None:
        """out (m, n) = a (m, k) @ b (k, n) (+ out when `accumulate`, an fp32 accumulator)."""
        d = self.device
        flops = 2.0 * m * n * k
        nbytes = (m * k + k * n) * operand_bytes + m * n * out_bytes
        t = max(flops / d.gemm_flops, nbytes / d.stream_bytes)
        acc = 0.0
        if accumulate:
            acc = 2.0 * m * n * out_bytes
            t += acc / d.stream_bytes * min(1.0, d.accumulate_rows / max(k, 1))
            nbytes += m * n * out_bytes
        self._op(name=name, kind="gemm", device_s=t, flops=flops, bytes=nbytes, accumulator_bytes=acc)

    def stream(self, name: str, nbytes: float, *, logits: bool = False, triton: bool = False) -> None:
        d = self.device
        self._op(name=name, kind="triton" if triton else "stream",
                 device_s=max(nbytes / d.stream_bytes, d.small_kernel_s), bytes=nbytes,
                 logits_bytes=nbytes if logits else 0.0)

    def cast(self, name: str, nbytes: float) -> None:
        self._op(name=name, kind="cast", device_s=nbytes / self.device.cast_bytes, bytes=nbytes)

    def small(self, name: str, count: int = 1, *, triton: bool = False) -> None:
        if count:
            self._op(name=name, kind="triton" if triton else "small", device_s=self.device.small_kernel_s,
                     count=count)

    def views(self, count: int) -> None:
        if count:
            self._op(name="views", kind="view", count=count)

    def autograd(self) -> None:
        self._op(name="autograd.grad", kind="autograd")

    def sync(self, name: str = "host sync") -> None:
        self._op(name=name, kind="sync")


@dataclasses.dataclass
class Cost:
    """What one call costs (seconds, bytes, FLOPs); per-phase launch counts and host time."""

    time_s: float
    device_s: float
    host_s: float
    flops: float
    hbm_bytes: float
    logits_bytes: float
    accumulator_bytes: float
    peak_bytes: float
    launches: dict  # phase -> {"aten": kernels launched by aten ops, "triton": Triton launches, "views": views}
    host_by_phase: dict  # phase -> host seconds
    device_by_phase: dict  # phase -> device seconds
    phase_count: dict  # phase -> how many times it ran (stages, chunks)

    def per(self, phase: str) -> dict:
        """Launches, host and device time of one instance of `phase` (a stage, a chunk), averaged."""
        k = max(self.phase_count.get(phase, 1), 1)
        launches = self.launches.get(phase, {})
        return {"aten": launches.get("aten", 0) / k, "triton": launches.get("triton", 0) / k,
                "views": launches.get("views", 0) / k,
                "host_s": self.host_by_phase.get(phase, 0.0) / k, "device_s": self.device_by_phase.get(phase, 0.0) / k}


def executed_flops(impl: str, backward: bool, n_scored: int, n_all: int, H: int, V: int) -> int:
    """GEMM FLOPs over the vocabulary that `impl` executes (2*rows*H*V per GEMM), token-level IS as benchmarked:
    - gfpo projects the scored tokens only: 1 GEMM forward-only, 3 with gradients (projection and the two gradient
      GEMMs, all in the forward; sequence-level IS would add a second projection sweep: 4).
    - trl (its chunked fused head) projects the scored tokens: 1 GEMM forward, and its backward recomputes the
      projection before the two gradient GEMMs: 4.
    - liger runs every token, padding included; its forward always takes the input gradient through a recomputing
      log-prob backward (3 GEMMs even when nothing requires grad), and the weight gradient adds one: 4.
    - eager: full logits of every token: 1 GEMM forward, 2 more backward."""
    gemms, rows = {
        "gfpo": ((1, 3), n_scored),
        "trl": ((1, 4), n_scored),
        "liger": ((3, 4), n_all),
        "eager": ((1, 3), n_all),
    }[impl]
    return gemms[backward] * 2 * rows * H * V


def simulate(trace: Trace, phase_count: dict | None = None) -> Cost:
    d = trace.device
    host = dev = 0.0
    live: dict[str, float] = {}
    current = peak = 0.0
    flops = hbm = logits = acc = 0.0
    launches: dict = defaultdict(lambda: {"aten": 0, "triton": 0, "views": 0})
    host_by, dev_by = defaultdict(float), defaultdict(float)
    host_cost = {"gemm": d.host_gemm_s, "stream": d.host_op_s, "cast": d.host_op_s, "small": d.host_op_s,
                 "triton": d.host_triton_s, "view": d.host_view_s, "autograd": d.host_autograd_s, "sync": 0.0}
    for event in trace.events:
        if isinstance(event, tuple):
            if event[0] == "alloc":
                _, name, nbytes = event
                assert name not in live, name
                live[name] = nbytes
                current += nbytes
                peak = max(peak, current)
            else:
                current -= live.pop(event[1])
            continue
        op = event
        if op.kind == "sync":
            host = max(host, dev)
            continue
        for _ in range(op.count):
            host += host_cost[op.kind]
            if op.device_s:
                dev = max(dev, host) + op.device_s
        host_by[op.phase] += host_cost[op.kind] * op.count
        dev_by[op.phase] += op.device_s * op.count
        if op.kind == "triton":
            launches[op.phase]["triton"] += op.count
        elif op.kind == "view":
            launches[op.phase]["views"] += op.count
        elif op.kind in ("gemm", "stream", "cast", "small"):
            launches[op.phase]["aten"] += op.count
        flops += op.flops * op.count
        hbm += op.bytes * op.count
        logits += op.logits_bytes * op.count
        acc += op.accumulator_bytes * op.count
    return Cost(time_s=max(host, dev), device_s=sum(dev_by.values()), host_s=sum(host_by.values()), flops=flops,
                hbm_bytes=hbm, logits_bytes=logits, accumulator_bytes=acc, peak_bytes=peak,
                launches={k: dict(v) for k, v in launches.items()}, host_by_phase=dict(host_by),
                device_by_phase=dict(dev_by), phase_count=dict(phase_count or {}))


def _ranges(n: int, step: int):
    return [(lo, min(lo + step, n)) for lo in range(0, n, max(step, 1))]


# ---------------------------------------------------------------------------------------------------- TRL 1.16
# The aten kernels of the benchmark's "trl" path outside its tiles (each tile: its GEMMs and one fold kernel), as
# tests/test_fused_loss_cost.py::test_trl_kernel_counts_are_measured counts them on the CPU (bench/
# test_bench_linear_grpo.py's _trl under a dispatch mode, TRL's fold kernels counted as one launch each): in the
# forward (mask.bool(), the two boolean-mask gathers, the statistics vectors, log-sum-exp finishing, the
# masked_scatter of the log-probs, the loss math) and in the backward. trl_chunked_head streams the ones it names
# and counts the rest as small kernels. On CUDA the backward casts its two fp32 accumulators to bf16 besides (no-ops
# for the CPU's fp32 parameters). Host syncs: the two boolean-mask gathers and, in backward, masked_scatter's
# masked_select.
TRL_FIXED_KERNELS = {"forward": 32, "backward": 30}


def trl_chunked_head(n: int, positions: int, H: int, V: int, *, backward: bool, device: DeviceConstants = H100,
                     operand_bytes: int = 2, token_chunk: int = 4096, vocab_chunk: int = 32768,
                     first_gemm: bool = False) -> Cost:
    """TRL 1.16's ChunkedLogProbFunction on the n scored of `positions` tokens (the benchmark's "trl"): tiles of
    token_chunk tokens x vocab_chunk vocabulary entries, the projection written in the operand dtype into one
    (token_chunk, vocab_chunk) buffer; its backward projects every tile again, overwrites it with the logits
    gradient and adds the two gradient GEMMs into fp32 accumulators (zero-filled), cast to bf16 at the end."""
    t = Trace(device)
    tiles = [(tl, vl) for tl in _ranges(n, token_chunk) for vl in _ranges(V, vocab_chunk)]
    if first_gemm:
        t.alloc("cublas workspace", device.workspace_bytes)
    t.sync("hidden[live]")
    t.stream("gather hidden rows", 2 * n * H * operand_bytes)
    t.alloc("hidden rows", n * H * operand_bytes)
    t.sync("target_ids[live]")
    t.alloc("targets", 8 * n)
    t.alloc("statistics", 7 * 4 * n)
    t.small("forward small ops", TRL_FIXED_KERNELS["forward"] - 1)  # all but the gather
    buf = min(n, token_chunk) * min(V, vocab_chunk) * operand_bytes
    t.alloc("tile", buf)
    t.phase = "tile"
    for (t0, t1), (v0, v1) in tiles:
        rows, cols = t1 - t0, v1 - v0
        t.gemm("projection", rows, cols, H, operand_bytes=operand_bytes, out_bytes=operand_bytes)
        t.stream("fold tile", rows * cols * operand_bytes, logits=True, triton=True)
        t.views(5)
    t.phase = "loss"
    t.free("tile", "statistics")
    t.alloc("per-token", 6 * 4 * n + 3 * 4 * positions)
    count = {"tile": len(tiles)}
    if not backward:
        return simulate(t, count)
    t.phase = "backward"
    t.sync("masked_scatter backward")
    # all but the 4 streaming kernels below that the CPU runs too: the accumulators' and hidden.grad's zero fills,
    # and hidden.grad's index_put (the two casts to bf16 are CUDA's only)
    t.small("backward small ops", TRL_FIXED_KERNELS["backward"] - 4)
    t.alloc("grad_hidden fp32", 4 * n * H)
    t.stream("zero grad_hidden", 4 * n * H)
    t.alloc("grad_weight fp32", 4 * V * H)
    t.stream("zero grad_weight", 4 * V * H)
    t.alloc("tile", buf)
    t.phase = "backward tile"
    for (t0, t1), (v0, v1) in tiles:
        rows, cols = t1 - t0, v1 - v0
        t.gemm("projection again", rows, cols, H, operand_bytes=operand_bytes, out_bytes=operand_bytes)
        t.stream("logits gradient in place", 2 * rows * cols * operand_bytes, logits=True, triton=True)
        t.gemm("grad_hidden +=", rows, H, cols, operand_bytes=operand_bytes, accumulate=True)
        t.gemm("grad_weight +=", cols, H, rows, operand_bytes=operand_bytes, accumulate=True)
        t.views(10)
    t.phase = "backward"
    t.alloc("grad_hidden", n * H * operand_bytes)
    t.stream("cast grad_hidden", 6 * n * H)
    t.alloc("grad_weight", V * H * operand_bytes)
    t.stream("cast grad_weight", 6 * V * H)
    t.free("tile", "grad_hidden fp32", "grad_weight fp32")
    t.alloc("hidden.grad", positions * H * operand_bytes)
    t.stream("zero hidden.grad", positions * H * operand_bytes)
    t.stream("index_put hidden.grad", 3 * n * H * operand_bytes)
    t.free("grad_hidden", "hidden rows")
    count["backward tile"] = len(tiles)
    return simulate(t, count)


# ---------------------------------------------------------------------------------------------------- ours
@dataclasses.dataclass(frozen=True)
class LossPlan:
    """Our fused loss's plan as the model needs it: how the n scored tokens are projected (stages) and how their
    gradient GEMMs are grouped (chunks), what each stage launches and where the gradients are kept.

    Without an LM head bias: a bias adds per stage 1 aten op (its add to the staged logits) and with gradients 2
    more (the column sum of the logits gradient, added into grad_b) and with half-precision operands a 4th (that
    fp32 gradient's copy into the chunk's buffer), 20 bytes a logit of fp32 passes in all
    (tests/test_fused_loss_cost.py counts them on the code).

    stage_rows / chunk_rows: rows per projection stage / per chunk of the two gradient GEMMs.
    logprob_launches: Triton launches of the log-prob pass per stage (a split pass: 2).
    loss_grad_ops, loss_grad_views, loss_grad_autograd: aten kernels, views and autograd.grad calls that give one
        stage its loss gradient g = d(loss)/d(logp).
    stage_ops: other small aten kernels per stage (writing logps / entropy / lse).
    fixed_small_forward / fixed_small_backward: small aten kernels outside the loop (validation, loss, statistics;
        with gradients, the per-token inputs of the closed-form g and backward's own).
    fixed_autograd_backward: autograd.grad calls outside the loop with gradients (the per-token weights of the
        loss's reduction, grpo_loss_math.token_grad_inputs).
    cast_in_place: the chunk's logits gradient is written rounded to bf16 by the row kernel (False: an fp32 pass in
        place, then a copy to bf16, as at cec7c50).
    zero_fill: the fp32 accumulators are zero-filled (cec7c50) instead of written by the first chunk's GEMMs.
    grad_h_fp32: the input gradient is held in an fp32 (n, H) accumulator and cast in backward (False: each chunk's
        GEMM writes it in the parameter dtype).
    grad_w_direct: one chunk, whose weight-gradient GEMM writes the parameter dtype: no fp32 (V, H) accumulator.
    weight_grad: the LM head weight is trained (False: a frozen head, no weight-gradient GEMM, sum or gradient).
    backward_cast: how backward finishes an fp32 accumulator: "triton" (one vectorised pass) or "torch" (PyTorch's
        casting multiply); a gradient written in the parameter dtype is scaled in place only when the incoming
        gradient is not 1 (a device-side test: one small launch).
    free_stage_early: the staging buffer is freed before the last chunk's gradient GEMMs (where a directly written
        weight gradient is allocated).
    sweeps: projection sweeps (sequence-level importance sampling: 2).
    planned_peak_bytes: the peak the fused loss's budget counted for this plan (current_plan; None: not made there).
    The kernel counts are the code's as tests/test_fused_loss_cost.py::test_launches_per_stage_and_chunk_are_the_codes
    counts them on the CPU under a dispatch mode (it fails when they drift).
    """

    stage_rows: int
    chunk_rows: int
    # the counts of the current code, counted on CPU under a dispatch mode (tests/test_fused_loss_cost.py checks
    # them): a stage launches its projection and the Triton passes only, g in closed form inside the log-prob pass
    logprob_launches: int = 2
    loss_grad_ops: int = 0
    loss_grad_views: int = 0
    loss_grad_autograd: int = 0
    stage_ops: int = 0
    stage_views: int = 6
    grad_views: int = 7  # more per stage with gradients
    fixed_small_forward: int = 69
    fixed_small_backward: int = 17
    fixed_autograd_backward: int = 1
    cast_in_place: bool = True
    zero_fill: bool = False
    grad_h_fp32: bool = True
    grad_w_direct: bool = False
    weight_grad: bool = True
    backward_cast: str = "triton"
    free_stage_early: bool = False
    sweeps: int = 1
    layout: tuple | None = None  # per chunk, its stages' rows (None: chunks of chunk_rows cut into stage_rows)
    statistics_only: tuple = ()  # the stages' rows of tokens whose loss gradient is 0 (log-probs only)
    planned_peak_bytes: int | None = None

    def chunk_layout(self, n: int) -> list[list[tuple[int, int]]]:
        """Per chunk, its stages as (lo, hi) row ranges."""
        if self.layout is None:
            return [_ranges(c1 - c0, self.stage_rows) for c0, c1 in _ranges(n, self.chunk_rows)]
        chunks = []
        for stage_rows in self.layout:
            bounds = [0]
            for rows in stage_rows:
                bounds.append(bounds[-1] + rows)
            chunks.append(list(zip(bounds[:-1], bounds[1:])))
        return chunks


def cec7c50_plan(n: int, V: int, operand_bytes: int = 2, budget: int = 4 << 30) -> LossPlan:
    """The plan of commit cec7c50 (the measured one) on an 80 GB H100: one level, chunks of budget // (6 V) rows
    (fp32 logits plus their bf16 copy), the loss gradient by autograd per chunk, one-program-per-row log-prob pass,
    zero-filled accumulators, PyTorch's casting multiply in backward. Kernel counts on CPU under a dispatch mode at
    cec7c50 (git archive cec7c50 gfpo_kernels): 43 kernel ops per chunk (projection, two gradient GEMMs, lse copy,
    two index writes, 37 for g), 60 outside the loop on CUDA (62 on CPU less the two fp32 operand copies)."""
    rows = max(1, min(n, budget // (V * (4 + operand_bytes))))
    return LossPlan(stage_rows=rows, chunk_rows=rows, logprob_launches=1, loss_grad_ops=37, loss_grad_views=19,
                    loss_grad_autograd=1, stage_ops=3, stage_views=4, grad_views=0, fixed_small_forward=59,
                    fixed_small_backward=3, fixed_autograd_backward=0, cast_in_place=False, zero_fill=True,
                    backward_cast="torch")


def call_shape(n: int, positions: int, H: int, V: int, *, operand_bytes: int = 2, zero_rows: int = 0,
               weight_grad: bool = True) -> CallShape:
    """The planner's view of a call with parameters in the operand dtype, gradients for hidden and, unless not
    `weight_grad` (a frozen head), weight; `zero_rows` of the n scored tokens have a loss gradient of exactly 0."""
    return CallShape(n=n, positions=positions, V=V, H=H, operand_elem_bytes=operand_bytes,
                     hidden_elem_bytes=operand_bytes, grad_h_elem_bytes=operand_bytes, weight_elem_bytes=operand_bytes,
                     weight_direct=True, weight_copy=False, need_h=True, need_w=weight_grad, n_zero=zero_rows)


def current_plan(n: int, positions: int, H: int, V: int, *, free_bytes: float = 75 * GiB,
                 operand_bytes: int = 2, zero_rows: int = 0, weight_grad: bool = True,
                 limits: PlanLimits = DEFAULT_LIMITS) -> LossPlan:
    """The plan the fused loss makes for these shapes (call_shape; token-level importance sampling) on a CUDA device
    with `free_bytes` free: gfpo_kernels.chunk_plan.plan_chunks within that device's budget, with `limits`."""
    shape = call_shape(n, positions, H, V, operand_bytes=operand_bytes, zero_rows=zero_rows, weight_grad=weight_grad)
    budget = Budget(int(free_bytes * limits.cuda_budget_share), follows_free_memory=True)
    plan = plan_chunks(shape, budget, limits)
    layout = tuple(tuple(hi - lo for lo, hi in stages) for stages in plan.chunk_stages)
    return LossPlan(stage_rows=plan.stage_rows, chunk_rows=plan.chunk_rows, layout=layout, grad_h_fp32=False,
                    grad_w_direct=weight_grad and len(plan.chunks) == 1, weight_grad=weight_grad,
                    free_stage_early=True, statistics_only=tuple(hi - lo for lo, hi in plan.statistics_only),
                    planned_peak_bytes=plan.peak_bytes)


def fused_loss(plan: LossPlan, n: int, positions: int, H: int, V: int, *, backward: bool,
               device: DeviceConstants = H100, operand_bytes: int = 2, first_gemm: bool = False) -> Cost:
    """Our fused loss on n scored of `positions` tokens under `plan` (token-level importance sampling, no bias;
    parameters in the operand dtype; a weight gradient where plan.weight_grad)."""
    t = Trace(device)
    p = plan
    ob = operand_bytes
    if first_gemm:
        t.alloc("cublas workspace", device.workspace_bytes)
    t.sync("validation")
    t.alloc("per-token", 4 * 2 * positions + (8 + 8 + 4) * n)  # logps, entropy; rows, targets, lse
    t.stream("gather hidden rows", 2 * n * H * ob)
    t.alloc("hidden rows", n * H * ob)
    t.small("setup and loss small ops", p.fixed_small_forward)
    n_zero = sum(p.statistics_only)
    n_grad = n - n_zero
    layout = p.chunk_layout(n_grad)
    chunks, start = [], 0
    for stages in layout:
        chunks.append((start, start + stages[-1][1]))
        start += stages[-1][1]
    assert not (p.grad_w_direct and len(chunks) > 1), "a weight gradient written directly needs one chunk"
    count = {"stage": sum(len(stages) for stages in layout) * p.sweeps + len(p.statistics_only)}
    chunk_rows = max((c1 - c0 for c0, c1 in chunks), default=0)
    stage_rows = max([hi - lo for stages in layout for lo, hi in stages] + list(p.statistics_only), default=0)
    if backward:
        count["chunk"] = len(chunks)
        t.alloc("grad_h", (4 if p.grad_h_fp32 else ob) * n_grad * H)
        sums_w = p.weight_grad and not p.grad_w_direct
        if sums_w:
            t.alloc("grad_W fp32", 4 * V * H)
        if p.zero_fill:
            t.stream("zero grad_h", 4 * n * H)
            if sums_w:
                t.stream("zero grad_W", 4 * V * H)
    t.alloc("stage logits fp32", 4 * stage_rows * V)
    if backward and p.cast_in_place:
        t.alloc("chunk logits gradient", ob * chunk_rows * V)
    for rows in p.statistics_only:  # tokens whose loss gradient is 0: log-probs and entropy only
        t.phase = "stage"
        t.views(p.stage_views)
        t.gemm("projection", rows, V, H, operand_bytes=ob, out_bytes=4)
        t.stream("log-prob pass", 4 * rows * V, logits=True, triton=True)
        t.small("log-prob combine", p.logprob_launches - 1, triton=True)
    for (c0, c1), stages in zip(chunks, layout):
        for lo, hi in stages:
            rows = hi - lo
            t.phase = "stage"
            t.views(p.stage_views)
            t.gemm("projection", rows, V, H, operand_bytes=ob, out_bytes=4)
            t.stream("log-prob pass", 4 * rows * V, logits=True, triton=True)
            t.small("log-prob combine", p.logprob_launches - 1, triton=True)
            t.small("write logps / entropy / lse", p.stage_ops)
            if not backward:
                continue
            t.small("loss gradient g", p.loss_grad_ops)
            t.views(p.loss_grad_views + p.grad_views)
            if p.loss_grad_autograd:
                t.autograd()
            if p.cast_in_place:
                t.stream("logits gradient -> bf16", (4 + ob) * rows * V, logits=True, triton=True)
            else:
                t.stream("logits gradient in place", 8 * rows * V, logits=True, triton=True)
        if not backward:
            continue
        t.phase = "chunk"
        rows = c1 - c0
        if not p.cast_in_place:
            t.alloc("chunk logits gradient", ob * rows * V)
            t.stream("logits gradient -> bf16 copy", (4 + ob) * rows * V, logits=True)
        if c1 == n_grad and p.free_stage_early:
            t.free("stage logits fp32")
        t.gemm("grad_h = dlogits @ W", rows, H, V, operand_bytes=ob, out_bytes=4 if p.grad_h_fp32 else ob,
               accumulate=p.zero_fill)
        if p.grad_w_direct:
            t.alloc("weight.grad", V * H * ob)
        if p.weight_grad:
            t.gemm("grad_W += dlogits^T @ h", V, H, rows, operand_bytes=ob, out_bytes=ob if p.grad_w_direct else 4,
                   accumulate=p.zero_fill or c0 > 0)
        if not p.cast_in_place:
            t.free("chunk logits gradient")
    t.phase = "loss"
    if not (backward and chunks and p.free_stage_early):
        t.free("stage logits fp32")
    t.free("hidden rows")
    if backward and p.cast_in_place:
        t.free("chunk logits gradient")
    if not backward:
        return simulate(t, count)
    t.phase = "backward"
    t.small("backward small ops", p.fixed_small_backward)
    for _ in range(p.fixed_autograd_backward):
        t.autograd()
    t.alloc("hidden.grad", positions * H * ob)
    t.stream("zero hidden.grad", positions * H * ob)
    cast = t.cast if p.backward_cast == "torch" else (lambda name, b: t.stream(name, b, triton=True))
    if p.grad_h_fp32:
        t.alloc("grad_h scaled", n_grad * H * ob)
        cast("scale grad_h into bf16", 6 * n_grad * H)
        t.stream("index_copy grad_h", 2 * n_grad * H * ob)
        t.free("grad_h scaled")
    else:
        t.small("scale grad_h if the incoming gradient is not 1", triton=True)
        t.stream("index_copy grad_h", 2 * n_grad * H * ob)
    if not p.weight_grad:
        t.free("grad_h")
    elif p.grad_w_direct:
        t.small("scale weight.grad if the incoming gradient is not 1", triton=True)
        t.free("grad_h")
    else:
        t.alloc("weight.grad", V * H * ob)
        cast("scale grad_W into bf16", 6 * V * H)
        t.free("grad_h", "grad_W fp32")
    return simulate(t, count)


# ---------------------------------------------------------------------------------------------------- the bench
# bench/test_bench_linear_grpo.py at the goal shape: B=32, T=512, H=4096, V=151936, bf16; the scored tokens of its
# two masks (cec7c50 JSON: scored_fraction 0.87335205078125 and 0.26458740234375 of 16384).
GOAL_SHAPE = dict(positions=32 * 512, H=4096, V=151936)
BENCH_MASKS = {"ragged-ends": 14309, "grpo-lengths": 4335}


def describe(cost: Cost) -> str:
    """One line: time, peak, FLOPs, bytes, and launches / host / device time per stage and per chunk."""
    parts = [f"{cost.time_s * 1e3:6.1f} ms (device {cost.device_s * 1e3:.1f}, host {cost.host_s * 1e3:.1f})",
             f"peak {cost.peak_bytes / GiB:.2f} GiB", f"{cost.flops / 1e12:.1f} TFLOP",
             f"HBM {cost.hbm_bytes / 1e9:.0f} GB (logits {cost.logits_bytes / 1e9:.1f}, "
             f"fp32 accumulators {cost.accumulator_bytes / 1e9:.1f})"]
    for phase in ("stage", "chunk"):
        if phase in cost.phase_count:
            p = cost.per(phase)
            parts.append(f"{cost.phase_count[phase]} {phase}s x ({p['aten']:g} aten + {p['triton']:g} Triton launches, "
                         f"host {p['host_s'] * 1e3:.2f} ms, device {p['device_s'] * 1e3:.2f} ms)")
    return "; ".join(parts)


def predictions(n: int, *, backward: bool, plan: LossPlan | None = None, device: DeviceConstants = H100,
                shape: dict = GOAL_SHAPE) -> dict[str, Cost]:
    """{"trl", "cec7c50", "now"}: the model's cost of each at n scored tokens of `shape` (now: `plan`, default the
    plan the fused loss makes on an H100 with 75 GiB free)."""
    plan = plan or current_plan(n, **shape)
    return {
        "trl": trl_chunked_head(n, backward=backward, device=device, **shape),
        "cec7c50": fused_loss(cec7c50_plan(n, shape["V"]), n, backward=backward, device=device, **shape),
        "now": fused_loss(plan, n, backward=backward, device=device, **shape),
    }


def main() -> None:
    print(f"cost model, {H100.name} constants; the benchmark's goal shape N16384 H4096 V151936 bf16, token-level IS")
    for mask, n in BENCH_MASKS.items():
        for backward in (False, True):
            print(f"\n{mask} (n={n}) {'forward+backward' if backward else 'forward'}")
            costs = predictions(n, backward=backward)
            for name, c in costs.items():
                print(f"  {name:8s} {describe(c)}")
            now, trl = costs["now"], costs["trl"]
            print(f"  now vs trl: {trl.time_s / now.time_s:.2f}x faster, {now.peak_bytes / trl.peak_bytes:.2f}x its "
                  f"peak memory")
            if backward:  # what skipping the gradient work of zero-advantage tokens buys (not in the benchmark)
                for share in (0.3, 0.6):
                    zero = round(share * n)
                    skip = fused_loss(current_plan(n, **GOAL_SHAPE, zero_rows=zero), n, backward=True, **GOAL_SHAPE)
                    print(f"  now, {share:.0%} of the tokens with advantage 0: {describe(skip)}")


if __name__ == "__main__":
    main()
