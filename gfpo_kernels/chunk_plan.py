"""The fused linear GRPO loss's plan: how a call works through its n scored tokens, as a pure function of its shapes,
dtypes and a byte budget (plan_chunks), plus the one impure step, the device's budget (device_budget).

A plan cuts the rows into stages, projected one at a time into an fp32 staging buffer, grouped into chunks, whose
logits gradients share one buffer and whose two gradient GEMMs run together (docs/fused-loss.md). The budget counts
everything a call holds at its peak (CallShape.phase_bytes), and the plan records the peak it counted.

Stages depend on the shapes only (where the budget follows free memory) so that log-probabilities, entropy and the
loss are the same bits whatever memory is free. Chunks depend on the budget only where it is short: plan_chunks
returns the same plan for every budget from roomy_budget_bytes up; below it the chunks shrink, and the gradients,
summed over other chunks, may differ in their last bits (docs/fused-loss.md, "Same inputs, same bits").

The fused loss asks plan_call, which reads the planning() context: tests and bench/tune.py pass a budget, limits or
a whole planner there; bench/fused_loss_cost.py calls plan_chunks itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class PlanLimits:
    """The planner's constants (bench/tune.py sweeps stage_rows and buffer_share_of_weight; docs/performance.md says
    where each value comes from).

    stage_rows: rows per projection stage: enough to keep the projection compute-bound (a stage of r rows does r
        FLOP per byte of the bf16 weight it streams), few enough that each stage's fp32 logits stay small.
    max_stage_bytes: the fp32 staging buffer (rows, V) stays within this, so that vocabularies past 256k take
        shorter stages.
    buffer_share_of_weight: with several chunks, the staging and chunk buffers together take at most this share of
        the LM head weight in the operand dtype (for a half-precision head, 1 is the weight gradient's converted copy,
        which backward holds beside the fp32 accumulator anyway, so the buffers add no peak memory).
    min_buffer_bytes: ... and at least this: each chunk reads and writes the fp32 (V, H) accumulator once, so small
        heads keep chunks of thousands of rows.
    min_chunk_bytes: where the budget follows free memory and is short, the chunk's logits-gradient buffer still
        takes this much.
    stage_share_of_constant_budget: where the budget is a constant (off CUDA), the staging buffer and the row passes'
        temporaries take at most this share of it, with or without gradients (so the stages stay a function of the
        shapes); the rest is for a call with gradients.
    cuda_budget_share: on CUDA the budget is this share of the memory free for new tensors (the device's free memory
        plus what PyTorch's caching allocator holds unused); it counts the accumulators and returned gradients too.
    constant_budget_bytes: the budget on the CPU and on any device without a free-memory query.
    """

    stage_rows: int = 512
    max_stage_bytes: int = 512 << 20
    buffer_share_of_weight: float = 1.0
    min_buffer_bytes: int = 1 << 30
    min_chunk_bytes: int = 256 << 20
    stage_share_of_constant_budget: float = 0.5
    cuda_budget_share: float = 0.5
    constant_budget_bytes: int = 64 << 20


DEFAULT_LIMITS = PlanLimits()


@dataclasses.dataclass(frozen=True)
class Budget:
    """The bytes a call may hold at its peak, and whether they follow the device's free memory (CUDA: the stages must
    then not depend on them) or are a constant (the stages stay within a share of them)."""

    total_bytes: int
    follows_free_memory: bool


@dataclasses.dataclass(frozen=True)
class CallShape:
    """What the budget needs to know of a call: n scored rows (n_zero of them with a loss gradient of exactly 0:
    projected, no gradient work) of `positions` (B*T), the head (V, H), the bytes per element of the GEMM operands
    (and the chunk's logits-gradient buffer), of hidden, of the scored rows' input gradient as the forward keeps it
    and of the weight; whether one chunk's GEMM can write the weight gradient in the weight's dtype (weight_direct),
    whether the call holds a converted copy of the weight (an fp32 head under bf16 autocast, or fp32 operands where
    cuBLAS cannot write fp32 from half), which gradients it computes, and the (rows, V) fp32 temporaries the
    backend's row passes hold beside the staging buffer."""

    n: int
    positions: int
    V: int
    H: int
    operand_elem_bytes: int
    hidden_elem_bytes: int
    grad_h_elem_bytes: int
    weight_elem_bytes: int
    weight_direct: bool
    weight_copy: bool
    need_h: bool
    need_w: bool
    n_zero: int = 0
    stage_temporaries: int = 0

    @property
    def n_grad(self) -> int:
        return self.n - self.n_zero

    @property
    def wants_gradients(self) -> bool:
        return self.need_h or self.need_w

    def staging_bytes(self, stage_rows: int) -> int:
        """A stage of `stage_rows`: the fp32 staging buffer and the row passes' temporaries."""
        return 4 * stage_rows * self.V * (1 + self.stage_temporaries)

    def phase_bytes(self, stage_rows: int, chunk_rows: int, chunks: int) -> tuple[int, int, int]:
        """Bytes held during the stage loop, during the last chunk's GEMMs (the staging buffer freed, a weight
        gradient written directly allocated) and during backward."""
        n, V, H = self.n, self.V, self.H
        rows = (n * H * self.operand_elem_bytes + 20 * n + 8 * self.positions
                + self.n_grad * H * self.grad_h_elem_bytes * self.need_h)
        copy = V * H * self.operand_elem_bytes if self.weight_copy else 0
        staging = self.staging_bytes(stage_rows)
        if not self.wants_gradients:
            return rows + copy + staging, 0, 0
        buffer = self.operand_elem_bytes * chunk_rows * V
        sums = self.need_w and (chunks > 1 or not self.weight_direct)
        accumulator = 4 * V * H if sums else 0
        # the weight gradient returned: written directly (one chunk), cast from the accumulator in backward, or the
        # accumulator itself (an fp32 weight)
        returned = V * H * self.weight_elem_bytes if self.need_w and not (sums and self.weight_elem_bytes == 4) else 0
        stage_loop = rows + copy + staging + buffer + accumulator
        last_gemms = rows + copy + buffer + accumulator + (0 if sums else returned)
        cast_h = self.n_grad * H * self.hidden_elem_bytes if self.grad_h_elem_bytes != self.hidden_elem_bytes else 0
        hidden_grad = (self.n_grad * self.grad_h_elem_bytes + self.positions * self.hidden_elem_bytes) * H + cast_h
        backward = accumulator + returned + hidden_grad * self.need_h
        return stage_loop, last_gemms, backward

    def peak_bytes(self, stage_rows: int, chunk_rows: int, chunks: int) -> int:
        return max(self.phase_bytes(stage_rows, chunk_rows, chunks))


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a call works through its n scored rows: chunks (start, end), whose two gradient GEMMs run together, each
    made of stages (lo, hi) projected one at a time. With one chunk the weight gradient is written by one GEMM, in
    the weight's dtype; with several it is summed over the chunks in an fp32 accumulator. The rows whose loss
    gradient is exactly 0 come last, in stages of their own (statistics_only), in no chunk."""

    chunks: tuple[tuple[int, int], ...]
    stages: tuple[tuple[int, int], ...]  # every stage in order; those of the gradient rows each inside one chunk
    statistics_only: tuple[tuple[int, int], ...] = ()
    # the peak the budget counted for this plan (CallShape.peak_bytes of its buffers; None: a plan a test forces)
    peak_bytes: int | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def balanced(cls, n: int, n_stages: int, n_chunks: int, zero: tuple[int, int] = (0, 0)) -> Plan:
        """n rows in n_stages stages of as equal sizes as can be, grouped into n_chunks chunks of whole stages; then
        zero = (rows, stages): rows n..n+rows whose loss gradient is 0, in their own stages."""
        bounds = [i * n // n_stages for i in range(n_stages + 1)] if n_stages else [0]
        groups = [j * n_stages // n_chunks for j in range(n_chunks + 1)] if n_chunks else [0]
        chunks = tuple((bounds[groups[j]], bounds[groups[j + 1]]) for j in range(n_chunks))
        rows, stages = zero
        after = tuple((n + i * rows // stages, n + (i + 1) * rows // stages) for i in range(stages))
        return cls(chunks=chunks, stages=tuple((bounds[i], bounds[i + 1]) for i in range(n_stages)) + after,
                   statistics_only=after)

    @classmethod
    def fixed(cls, n: int, stage_rows: int, chunk_rows: int, zero_rows: int = 0) -> Plan:
        """Chunks of chunk_rows rows (the last one shorter), each cut into stages of stage_rows, then zero_rows rows
        without gradients in stages of stage_rows."""
        chunks = tuple((a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows))
        stages = tuple((lo, min(lo + stage_rows, b)) for a, b in chunks for lo in range(a, b, stage_rows))
        after = tuple((lo, min(lo + stage_rows, n + zero_rows)) for lo in range(n, n + zero_rows, stage_rows))
        return cls(chunks=chunks, stages=stages + after, statistics_only=after)

    def stages_of(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The stages of the chunk [start, end)."""
        return self.chunk_stages[self.chunks.index((start, end))]

    @functools.cached_property
    def chunk_stages(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per chunk, its stages in order."""
        gradient_stages = self.stages[: len(self.stages) - len(self.statistics_only)]
        return tuple(tuple(s for s in gradient_stages if start <= s[0] < end) for start, end in self.chunks)

    @property
    def stage_rows(self) -> int:
        """Rows of the largest stage: the staging buffer's."""
        return max((hi - lo for lo, hi in self.stages), default=0)

    @property
    def chunk_rows(self) -> int:
        """Rows of the largest chunk: the logits-gradient buffer's."""
        return max((end - start for start, end in self.chunks), default=0)

    def counted(self, shape: CallShape) -> Plan:
        """This plan with the peak `shape` holds under it (peak_bytes): the staging buffer of its largest stage (those
        of the rows without gradients included) and the chunk buffer of its largest chunk."""
        return dataclasses.replace(self, peak_bytes=shape.peak_bytes(self.stage_rows, self.chunk_rows,
                                                                     len(self.chunks)))


def plan_chunks(shape: CallShape, budget: Budget, limits: PlanLimits = DEFAULT_LIMITS) -> Plan:
    """The plan for a call of `shape` within `budget` (everything counted), with its peak (Plan.peak_bytes).

    Stages: limits.stage_rows rows (fewer past limits.max_stage_bytes of fp32 logits; where the budget is a constant,
    fewer past limits.stage_share_of_constant_budget of it, the backend's temporaries counted), cut evenly: they
    depend on the shapes only, so the log-probabilities are the same bits with and without gradients and whatever
    memory is free. Without gradients that is all. With them:
    - several chunks of whole stages, cut evenly, as few as fit in buffers of the LM head weight's size
      (limits.buffer_share_of_weight; limits.min_buffer_bytes at least), or in what the budget leaves beside
      everything else when that is less (where the budget follows free memory not under limits.min_chunk_bytes for
      the chunk, elsewhere not under one stage): their weight gradient is summed in an fp32 accumulator;
    - or one chunk, when its peak is no higher than that (budget or not): every stage's logits gradient in one
      buffer, and the weight gradient written once by one GEMM in the weight's dtype, no fp32 accumulator. (Few
      scored rows: GRPO batches of short completions.)
    When every one of the B*T positions is scored, no stage or chunk holds more than half of them, so that no
    buffer is the (B*T, V) logits (then always two chunks or more)."""
    s = shape
    n_grad = s.n_grad  # the rows with gradients come first; those without get stages of their own
    rows_max = -(-s.n // 2) if s.n >= s.positions > 1 else s.n  # never every position in one buffer
    stage_max = max(1, min(limits.stage_rows, limits.max_stage_bytes // (4 * s.V), rows_max))
    if not budget.follows_free_memory:  # a constant budget: the stages within their share of it
        stage_share = int(budget.total_bytes * limits.stage_share_of_constant_budget)
        stage_max = max(1, min(stage_max, stage_share // s.staging_bytes(1)))
    zero = (s.n_zero, -(-s.n_zero // stage_max))
    n_stages = -(-n_grad // stage_max)
    one_chunk = Plan.balanced(n_grad, n_stages, min(n_stages, 1), zero).counted(s)
    if not s.wants_gradients or n_stages <= 1 and rows_max >= n_grad:
        return one_chunk
    # every count below from the buffers as allocated: the staging buffer holds the largest stage, which may be one
    # of the rows without gradients, the chunk buffer only rows with gradients
    staging = s.staging_bytes(one_chunk.stage_rows)
    grad_stage_rows = -(-n_grad // n_stages)
    held_without_chunk_buffer = s.phase_bytes(one_chunk.stage_rows, 0, chunks=2)[0]
    buffer_cap = max(int(limits.buffer_share_of_weight * s.V * s.H * s.operand_elem_bytes), limits.min_buffer_bytes)
    buffers = min(buffer_cap, budget.total_bytes - held_without_chunk_buffer + staging)
    chunk_floor = limits.min_chunk_bytes if budget.follows_free_memory else 0
    chunk_bytes = max(buffers - staging, chunk_floor)
    stages_per_chunk = max(1, min(chunk_bytes // (s.operand_elem_bytes * s.V * grad_stage_rows),
                                  rows_max // grad_stage_rows))
    several_chunks = Plan.balanced(n_grad, n_stages, max(2, -(-n_stages // stages_per_chunk)), zero).counted(s)
    # one chunk when it peaks no higher than several would, whatever the budget: a budget one chunk exceeds is
    # exceeded further by several chunks then (the fp32 accumulator beside the weight gradient cast from it)
    if rows_max >= n_grad and one_chunk.peak_bytes <= several_chunks.peak_bytes:
        return one_chunk
    return several_chunks


def roomy_budget_bytes(shape: CallShape, limits: PlanLimits = DEFAULT_LIMITS) -> int:
    """A budget (one that follows free memory) from which on plan_chunks makes one and the same plan for `shape`:
    its chunks' buffers then take their cap (limits.buffer_share_of_weight of the weight, at least
    limits.min_buffer_bytes), not what the budget leaves. For a plan of several chunks it is the least such budget;
    one chunk may hold at smaller budgets too."""
    # the stages do not depend on such a budget: those of an unbounded one
    stage_rows = plan_chunks(shape, Budget(1 << 62, follows_free_memory=True), limits).stage_rows
    buffer_cap = max(int(limits.buffer_share_of_weight * shape.V * shape.H * shape.operand_elem_bytes),
                     limits.min_buffer_bytes)
    return shape.phase_bytes(stage_rows, 0, chunks=2)[0] - shape.staging_bytes(stage_rows) + buffer_cap


def device_budget(device: torch.device, limits: PlanLimits = DEFAULT_LIMITS) -> Budget:
    """The budget of a call on `device`: on CUDA limits.cuda_budget_share of the memory free for new tensors (the
    device's free memory plus what PyTorch's caching allocator holds unused), elsewhere limits.constant_budget_bytes."""
    if device.type != "cuda":
        return Budget(limits.constant_budget_bytes, follows_free_memory=False)
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return Budget(int(free * limits.cuda_budget_share), follows_free_memory=True)


# A planner: (shape, budget, limits) -> Plan. plan_chunks is the fused loss's.
Planner = Callable[[CallShape, Budget, PlanLimits], Plan]


@dataclasses.dataclass(frozen=True)
class _Planning:
    planner: Planner = plan_chunks
    budget_bytes: int | None = None
    limits: PlanLimits = DEFAULT_LIMITS


_planning: contextvars.ContextVar[_Planning] = contextvars.ContextVar("gfpo_planning", default=_Planning())


@contextlib.contextmanager
def planning(planner: Planner | None = None, *, budget_bytes: int | None = None, limits: PlanLimits | None = None):
    """Within the block (this thread or task), fused loss calls plan with `planner` (None: the one in force,
    plan_chunks by default), a budget of `budget_bytes` instead of the device's (None: the device's), and `limits`
    (None: those in force). For tests, which force plans and budgets, and bench/tune.py, which sweeps limits."""
    current = _planning.get()
    token = _planning.set(_Planning(
        planner=current.planner if planner is None else planner,
        budget_bytes=current.budget_bytes if budget_bytes is None else budget_bytes,
        limits=current.limits if limits is None else limits,
    ))
    try:
        yield
    finally:
        _planning.reset(token)


def fixed_planner(stage_rows: int, chunk_rows: int) -> Planner:
    """A planner that ignores the budget: chunks of chunk_rows rows cut into stages of stage_rows (Plan.fixed)."""
    return lambda shape, budget, limits: Plan.fixed(shape.n_grad, stage_rows, chunk_rows, shape.n_zero)


def plan_call(shape: CallShape, device: torch.device) -> Plan:
    """The plan of a fused loss call of `shape` on `device`, as planning() says (by default plan_chunks within
    device_budget)."""
    p = _planning.get()
    if p.budget_bytes is None:
        budget = device_budget(device, p.limits)
    else:
        budget = Budget(p.budget_bytes, follows_free_memory=device.type == "cuda")
    return p.planner(shape, budget, p.limits)
