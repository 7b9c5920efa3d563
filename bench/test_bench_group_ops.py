"""Group filter + advantages: every implementation on identical inputs, one pytest-benchmark group per size.

    pytest bench/test_bench_group_ops.py --benchmark-json=out.json

Implementations: our fused kernel (Triton, on CUDA), our C++ op, gfpo_kernels.reference, and "trl-gfpo": the
path TRL's last GFPOTrainer took, written fresh here as a baseline (a Python filter callback over the grouped
completion lists, torch.topk, index arithmetic, then mean/std of the kept rewards). Rewards are 0/1
correctness plus a little noise; scores are completion lengths (distinct within a group, so every
implementation keeps the same rows), kept shortest-first as GFPO's length filter does."""

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import _dispatch, reference

from bench_utils import DEVICE, ON_GPU, group_inputs

SIZES = [(64, 8), (1024, 16), (4096, 16), (8192, 64)]
IMPLS = ["reference", "trl-gfpo"] + [b for b in ("cpp", "triton") if b in _dispatch.available_backends("group", DEVICE)]
if not ON_GPU:
    IMPLS = [i for i in IMPLS if i != "triton"]  # the interpreter measures Python, not the kernel


def _shortest_first(group_completions, group_rewards, **kwargs):
    """A TRL-style group_filter_func: higher score kept, so minus the completion length."""
    return [[-len(c) for c in group] for group in group_completions]


def trl_gfpo_filter_advantages(rewards, completions, G, k, group_filter_func=_shortest_first):
    """Baseline: what TRL's last GFPOTrainer did per step (re-implemented): call the filter on Python lists of
    grouped completions, torch.topk per group, global row indices by arithmetic, GRPO advantages of the kept
    rewards. Returns (kept row indices, their advantages)."""
    num_groups = len(completions) // G
    scores = group_filter_func(
        group_completions=[completions[i * G : (i + 1) * G] for i in range(num_groups)],
        group_rewards=rewards.view(-1, G).tolist(),
    )
    scores = torch.tensor(scores, device=rewards.device)
    _, local = torch.topk(scores, k, dim=-1)
    rows = (torch.arange(0, num_groups * G, G, device=rewards.device).unsqueeze(1) + local).flatten()
    kept = rewards[rows].view(-1, k)
    advantages = (kept - kept.mean(dim=1, keepdim=True)) / (kept.std(dim=1, keepdim=True) + 1e-4)
    return rows, advantages.flatten()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_groups, G", SIZES, ids=[f"{n}x{g}" for n, g in SIZES])
def test_filter_advantages(run, benchmark, impl, num_groups, G):
    benchmark.group = f"filter_advantages {num_groups}x{G}"
    rewards, lengths = group_inputs(num_groups, G)
    k = G // 2
    if impl == "trl-gfpo":
        completions = [range(int(n)) for n in lengths.tolist()]  # stand-ins for token id lists: len() is all it reads
        rows, kept_adv = run(trl_gfpo_filter_advantages, rewards, completions, G, k)
        keep = torch.zeros_like(rewards, dtype=torch.bool)
        keep[rows] = True
        adv = torch.zeros_like(rewards)
        adv[rows] = kept_adv
    elif impl == "reference":
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
