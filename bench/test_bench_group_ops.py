"""Group filter + advantages: every implementation on identical inputs, one pytest-benchmark group per size.

    pytest bench/test_bench_group_ops.py --benchmark-json=out.json

Rewards are 0/1 correctness plus a little noise; scores are completion lengths (integer-valued, many ties),
kept by `largest=False` as GFPO's length filter does."""

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import _dispatch, reference

from bench_utils import DEVICE, ON_GPU

SIZES = [(64, 8), (4096, 16), (8192, 64)] if ON_GPU else [(64, 8), (4096, 16)]
IMPLS = ["reference"] + [b for b in ("cpp", "triton") if b in _dispatch.available_backends("group", DEVICE)]
if not ON_GPU:
    IMPLS = [i for i in IMPLS if i != "triton"]  # the interpreter measures Python, not the kernel


def _inputs(num_groups, G):
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(num_groups * G, generator=g) < 0.4).float() + 0.01 * torch.randn(num_groups * G, generator=g)
    lengths = torch.randint(16, 4096, (num_groups * G,), generator=g).float()
    return rewards.to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_groups, G", SIZES, ids=[f"{n}x{g}" for n, g in SIZES])
def test_filter_advantages(run, benchmark, impl, num_groups, G):
    benchmark.group = f"filter_advantages {num_groups}x{G}"
    rewards, lengths = _inputs(num_groups, G)
    k = G // 2
    if impl == "reference":
        keep, adv = run(reference.gfpo_filter_advantages, rewards, lengths, G, k, largest=False)
    else:
        with gfpo_kernels.use_backend(impl):
            keep, adv = run(gfpo_kernels.gfpo_filter_advantages, rewards, lengths, G, k, largest=False)
    want_keep, want_adv = reference.gfpo_filter_advantages(rewards, lengths, G, k, largest=False)
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(adv, want_adv, rtol=1e-4, atol=1e-4)


if ON_GPU and _dispatch.HAS_TRITON:
    import triton

    @triton.jit
    def _empty_kernel(x_ptr):
        pass

    @pytest.mark.parametrize("num_groups, G", SIZES, ids=[f"{n}x{g}" for n, g in SIZES])
    def test_empty_launch(run, benchmark, num_groups, G):
        """The floor: one empty Triton launch, in the same group as the fused kernel."""
        benchmark.group = f"filter_advantages {num_groups}x{G}"
        x = torch.empty(1, device=DEVICE)
        run(lambda: _empty_kernel[(1,)](x))
