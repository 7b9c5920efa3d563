"""The oracle itself: gfpo_kernels.reference against hand-computed cases and against TRL's own formulas."""

import math

import pytest
import torch

from gfpo_kernels import reference as ref

NAN = float("nan")


@pytest.mark.parametrize(
    "scores, k, largest, expected",
    [
        ([3.0, 1.0, 2.0, 2.0], 2, True, [1, 0, 1, 0]),  # the tie 2.0/2.0 goes to the lower index
        ([3.0, 1.0, 2.0, 2.0], 2, False, [0, 1, 1, 0]),
        ([3.0, 1.0, 2.0, 2.0], 3, True, [1, 0, 1, 1]),
        ([NAN, 1.0, NAN, 0.0], 3, True, [1, 1, 0, 1]),  # NaN last, the first NaN before the second
        ([NAN, 1.0, NAN, 0.0], 3, False, [1, 1, 0, 1]),
        ([NAN, 1.0, NAN, 0.0], 1, False, [0, 0, 0, 1]),
        ([-0.0, 0.0, -1.0, float("inf")], 2, True, [1, 0, 0, 1]),  # -0.0 == 0.0: a tie
        ([-0.0, 0.0, -1.0, float("-inf")], 2, False, [0, 0, 1, 1]),
        ([5.0, 5.0, 5.0, 5.0], 2, True, [1, 1, 0, 0]),
        ([5.0, 5.0, 5.0, 5.0], 2, False, [1, 1, 0, 0]),
    ],
)
def test_topk_hand_cases(scores, k, largest, expected):
    keep = ref.group_topk_mask(torch.tensor(scores), 4, k, largest=largest)
    assert keep.tolist() == [bool(e) for e in expected]


def test_topk_integer_and_adaptive_k():
    scores = torch.tensor([[7, 9, 7, 1], [2, 2, 2, 2], [0, 1, 2, 3]], dtype=torch.int64)
    keep = ref.group_topk_mask(scores, 4, torch.tensor([2, 0, 4]))
    assert keep.tolist() == [[True, True, False, False], [False] * 4, [True] * 4]
    # int64 values beyond float64's 53-bit mantissa still order exactly
    big = torch.tensor([2**62 + 1, 2**62, 2**62 + 3, 2**62 + 2], dtype=torch.int64)
    assert ref.group_topk_mask(big, 4, 2).tolist() == [False, False, True, True]


def test_advantages_hand_cases():
    eps = 1e-4
    # kept rewards 1, 2, 3: mean 2, unbiased std 1
    adv = ref.group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), 4, keep=torch.tensor([1, 1, 1, 0]).bool())
    torch.testing.assert_close(adv, torch.tensor([-1 / (1 + eps), 0.0, 1 / (1 + eps), 0.0]))
    # NaN reward: left out of mean/std (mean 2, std sqrt(2)), advantage 0
    adv = ref.group_advantages(torch.tensor([1.0, NAN, 3.0]), 3)
    s = math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([-1 / (s + eps), 0.0, 1 / (s + eps)]))
    # scale none: r - mean
    adv = ref.group_advantages(torch.tensor([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]]), 3, scale="none")
    torch.testing.assert_close(adv, torch.tensor([[-2.0, -1.0, 3.0], [-1.0, -1.0, 2.0]]))
    # scale batch: group means 1 and 6; std of all rewards [0, 2, 4, 8] = sqrt(35 / 3)
    adv = ref.group_advantages(torch.tensor([0.0, 2.0, 4.0, 8.0]), 2, scale="batch")
    sb = math.sqrt(35 / 3)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (sb + eps))
    # scale batch counts only kept rows: kept [0, 2, 8] -> std sqrt(((0-10/3)^2+(2-10/3)^2+(8-10/3)^2)/2)
    keep = torch.tensor([True, True, False, True])
    adv = ref.group_advantages(torch.tensor([0.0, 2.0, 4.0, 8.0]), 2, keep=keep, scale="batch")
    m = 10 / 3
    sb = math.sqrt(((0 - m) ** 2 + (2 - m) ** 2 + (8 - m) ** 2) / 2)
    torch.testing.assert_close(adv, torch.tensor([-1.0 / (sb + eps), 1.0 / (sb + eps), 0.0, 0.0]))


def test_zero_variance_and_single_kept_give_exact_zero():
    for value in (0.1, 1.0, -3.7, 1e6):
        rewards = torch.full((3, 5), value, dtype=torch.float64)
        for scale in ("group", "batch", "none"):
            assert torch.equal(ref.group_advantages(rewards, 5, scale=scale), torch.zeros(3, 5))
    keep = torch.tensor([False, True, False, False])
    adv = ref.group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), 4, keep=keep)
    assert torch.equal(adv, torch.zeros(4))


def test_filter_advantages_is_mask_then_advantages():
    g = torch.Generator().manual_seed(1)
    rewards, scores = torch.randn(64, generator=g), torch.randn(64, generator=g)
    keep, adv = ref.gfpo_filter_advantages(rewards, scores, 8, 3, largest=False, scale="batch")
    assert torch.equal(keep, ref.group_topk_mask(scores, 8, 3, largest=False))
    assert torch.equal(adv, ref.group_advantages(rewards, 8, keep=keep, scale="batch"))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reference_matches_trl_grpo_formula(scale):
    """keep=None is TRL's GRPO advantage (GRPOTrainer._generate_and_score_completions, sum_then_normalize),
    written here with TRL's own nanstd."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    G = 8
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6 * G, generator=g)
    rewards[3] = NAN  # an unscorable completion
    rewards[G : 2 * G] = 1.0  # a zero-variance group
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = trl_utils.nanstd(rewards).expand_as(rewards)
    else:
        std = trl_utils.nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    trl_adv = rewards - mean
    if scale != "none":
        trl_adv = trl_adv / (std + 1e-4)
    trl_adv = torch.nan_to_num(trl_adv, nan=0.0)
    torch.testing.assert_close(ref.group_advantages(rewards, G, scale=scale), trl_adv, rtol=1e-5, atol=1e-5)
