"""Fused linear GRPO loss, forward and forward+backward: ours, TRL's own GRPO path (its chunked fused LM head
log-probs + TRL's loss math), Liger-Kernel's LigerFusedLinearGRPOLoss, and eager torch with full logits, on
identical inputs. One pytest-benchmark group per (size, pass, mask): the mask is either ragged ends or GRPO-like
completion lengths (long-tailed, about a third of the positions scored, see _completion_mask).

    pytest bench/test_bench_linear_grpo.py --benchmark-json=out.json

Logits are realistic, i.e. peaked: each hidden state leans towards its target's weight row, so the softmax
is concentrated as in a trained LM rather than flat as with N(0, 1) inputs. On CUDA every case records its
peak extra memory (torch.cuda.max_memory_allocated above the inputs); every case records the GEMM FLOPs its
implementation executes (`fused_loss_cost.executed_flops`, checked against the GEMMs actually run by
test_executed_flops_match_the_gemms_run) and the TFLOP/s achieved on them, and a plain cuBLAS GEMM of the same
shape is timed in the same run.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gfpo_kernels
from gfpo_kernels.grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps

from bench_utils import DEVICE, ON_GPU, record_tflops, sync
from fused_loss_cost import executed_flops

# (B sequences, T tokens, H, V): N = B*T scored tokens
SIZES = [(16, 256, 2048, 32768), (32, 512, 4096, 151936)] if ON_GPU else [(4, 32, 64, 1000)]
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
IMPLS = ["gfpo", "trl", "liger", "eager"]
LOSS = dict(loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=0.28)


MASKS = ["ragged-ends", "grpo-lengths"]


def _completion_mask(kind, B, T, g):
    """ragged-ends: every sequence scored but for a random half of its last quarter. grpo-lengths: completion
    lengths as in GRPO batches padded to the longest, long-tailed: 15% run to the maximum length T (truncated), the
    rest are exponential with mean T/4, so about a third of the (B, T) positions are scored."""
    if kind == "ragged-ends":
        mask = torch.ones(B, T, device=DEVICE)
        mask[:, T - T // 4 :] = (torch.rand(B, T // 4, generator=g, device=DEVICE) < 0.5).float()
        return mask
    exponential = -torch.log1p(-torch.rand(B, generator=g, device=DEVICE))
    lengths = torch.where(torch.rand(B, generator=g, device=DEVICE) < 0.15, float(T), (T / 4) * exponential)
    lengths = lengths.ceil().clamp(1, T)
    return (torch.arange(T, device=DEVICE)[None, :] < lengths[:, None]).float()


def _inputs(B, T, H, V, mask_kind="ragged-ends"):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    weight = torch.randn(V, H, generator=g, device=DEVICE, dtype=torch.float32) / H**0.5
    target = torch.randint(0, V, (B, T), generator=g, device=DEVICE)
    # peaked logits: h = 3 * w[target] + noise puts the target ~3 sqrt(H) standard deviations up
    hidden = 3.0 * weight[target] + torch.randn(B, T, H, generator=g, device=DEVICE) / H**0.5
    mask = _completion_mask(mask_kind, B, T, g)
    adv = torch.randn(B, generator=g, device=DEVICE)
    old = None  # on-policy: old = this policy (TRL's num_iterations=1)
    return hidden.to(DTYPE), weight.to(DTYPE), target, mask, adv, old


def _gfpo(hidden, weight, target, mask, adv):
    return gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, adv, **LOSS)[0]


def _trl(hidden, weight, target, mask, adv):
    """TRL 1.16's GRPO path: the chunked fused LM head gives per-token log-probs (and entropy, which the
    trainer logs) of the scored tokens, then TRL's loss math (grpo_loss_math is checked equal to it)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    live = mask.bool()
    logps_live, *_ = ChunkedLogProbFunction.apply(
        hidden[live], weight, None, target[live], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
    )
    logps = logps_live.new_zeros(mask.shape).masked_scatter(live, logps_live)
    return grpo_loss_from_logps(logps, mask, adv, GRPOLossOptions(**LOSS), with_stats=False)[0]


_liger_module = None


def _liger(hidden, weight, target, mask, adv):
    global _liger_module
    if _liger_module is None:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        _liger_module = LigerFusedLinearGRPOLoss(use_ref_model=False, compiled=ON_GPU, **LOSS)
    return _liger_module(hidden, weight, target, mask, adv)[0]


def _eager(hidden, weight, target, mask, adv):
    """Full (B, T, V) logits in fp32, log_softmax, gather, TRL's loss math."""
    logits = (hidden @ weight.t()).float()
    logps = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return grpo_loss_from_logps(logps, mask, adv, GRPOLossOptions(**LOSS), with_stats=False)[0]


FNS = {"gfpo": _gfpo, "trl": _trl, "liger": _liger, "eager": _eager}


def _ids(sizes):
    return [f"N{b * t}-H{h}-V{v}" for b, t, h, v in sizes]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("passes", ["forward", "forward+backward"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("B, T, H, V", SIZES, ids=_ids(SIZES))
def test_linear_grpo_loss(benchmark, impl, passes, mask_kind, B, T, H, V):
    if impl == "liger":
        pytest.importorskip("liger_kernel")
    if impl == "trl":
        pytest.importorskip("trl")
    benchmark.group = f"linear_grpo {passes} {mask_kind} N{B * T}-H{H}-V{V} {str(DTYPE).removeprefix('torch.')}"
    hidden, weight, target, mask, adv, _ = _inputs(B, T, H, V, mask_kind)
    benchmark.extra_info["scored_fraction"] = float(mask.mean())
    fn = FNS[impl]
    backward = passes == "forward+backward"
    hidden.requires_grad_(backward)
    weight.requires_grad_(backward)

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, target, mask, adv)
        if backward:
            loss.backward()
        sync()
        return loss

    if ON_GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            loss = step()
        except torch.OutOfMemoryError:
            pytest.skip(f"{impl} runs out of GPU memory at this size")
        benchmark.extra_info["peak_extra_memory_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    loss = benchmark.pedantic(step, rounds=5 if ON_GPU else 3, warmup_rounds=1)
    flops = executed_flops(impl, backward, int(mask.sum()), B * T, H, V)
    benchmark.extra_info["executed_tflop"] = flops / 1e12
    record_tflops(benchmark, flops)
    benchmark.extra_info["loss"] = float(loss.detach())
    with torch.no_grad():
        want = _gfpo(hidden.detach(), weight.detach(), target, mask, adv)
    torch.testing.assert_close(loss.detach().float(), want.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("B, T, H, V", SIZES, ids=_ids(SIZES))
def test_cublas_gemm(benchmark, B, T, H, V):
    """The matmul throughput the fused loss is measured against: one (N, H) x (H, V) GEMM in DTYPE."""
    benchmark.group = f"cublas gemm N{B * T}-H{H}-V{V}"
    hidden, weight, *_ = _inputs(B, T, H, V)
    h2 = hidden.reshape(-1, H)
    benchmark.pedantic(lambda: (h2 @ weight.t(), sync()), rounds=5 if ON_GPU else 3, warmup_rounds=1)
    record_tflops(benchmark, 2 * B * T * H * V)


class _GemmFlops(TorchDispatchMode):
    """Sums 2*M*K*N over every matrix product an op runs."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[-2:] if name.startswith("addmm") else args[:2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backward", [False, True])
def test_executed_flops_match_the_gemms_run(impl, backward):
    """executed_flops equals the FLOPs of the matrix products each implementation really dispatches (tiny shapes)."""
    if impl == "liger":
        pytest.importorskip("liger_kernel")
    if impl == "trl":
        pytest.importorskip("trl")
    B, T, H, V = 4, 32, 64, 1000
    hidden, weight, target, mask, adv, _ = _inputs(B, T, H, V)
    hidden.requires_grad_(backward)
    weight.requires_grad_(backward)
    with _GemmFlops() as counted:
        loss = FNS[impl](hidden, weight, target, mask, adv)
        if backward:
            loss.backward()
    n_scored = int(mask.sum())
    assert n_scored < B * T  # the ragged ends leave padding, so scored-only and all-token counts differ
    assert counted.flops == executed_flops(impl, backward, n_scored, B * T, H, V)
