"""The study's statistics (gfpo_study/study_stats.py) on synthetic data, against known values."""

import math
import statistics

import pytest

pytest.importorskip("scipy")

from gfpo_study import study_stats  # noqa: E402
from gfpo_study.study_stats import (  # noqa: E402
    accuracy_verdict, bootstrap_interval, excess_length_reduction, figure, summarize, t_interval
)


def test_t_interval_against_known_quantiles():
    # t(0.975, 4) = 2.776445 (printed tables); [1..5]: mean 3, sd sqrt(2.5), se sqrt(0.5)
    low, high = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (low, high) == pytest.approx((3 - 2.776445 * math.sqrt(0.5), 3 + 2.776445 * math.sqrt(0.5)), abs=1e-5)
    # two seeds: t(0.975, 1) = 12.706205, se of [0, 1] = 0.5
    assert t_interval([0.0, 1.0]) == pytest.approx((0.5 - 6.3531025, 0.5 + 6.3531025), abs=1e-5)
    # 8 seeds: t(0.975, 7) = 2.364624
    values = [0.1, -0.2, 0.3, 0.0, 0.05, -0.1, 0.2, 0.15]
    half = 2.364624 * statistics.stdev(values) / math.sqrt(8)
    assert t_interval(values) == pytest.approx((statistics.fmean(values) - half, statistics.fmean(values) + half),
                                               abs=1e-6)
    assert t_interval([3.0, 3.0, 3.0]) == (3.0, 3.0)
    assert all(math.isnan(x) for x in t_interval([1.0])) and all(math.isnan(x) for x in t_interval([]))


def test_excess_length_reduction_is_the_papers_eq_4():
    # the paper's average row (Table 1): GRPO 13000, SFT 9500, Shortest 8/16 12000 -> 28.6%
    assert excess_length_reduction(13000, 12000, 9500) == pytest.approx(1000 / 3500)
    assert excess_length_reduction(20.0, 25.0, 10.0) == pytest.approx(-0.5)  # longer than GRPO: negative
    assert excess_length_reduction(10.0, 8.0, 12.0) is None  # GRPO did not lengthen: undefined


def test_bootstrap_interval_of_two_values():
    # resamples of [0, 1]: means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5% points are 0 and 1
    assert bootstrap_interval([0.0, 1.0], statistics.fmean) == (0.0, 1.0)
    assert bootstrap_interval([3.0, 3.0, 3.0], statistics.fmean) == (3.0, 3.0)
    low, high = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0], statistics.fmean)
    assert 1.0 <= low < 3.0 < high <= 5.0


def test_figure_leaves_undefined_seeds_out():
    f = figure([1.0, None, 3.0, float("nan")])
    assert f["mean"] == 2.0 and f["n"] == 2 and f["per_seed"][:3] == [1.0, None, 3.0]
    assert f["t95"] == pytest.approx((2 - 12.706205, 2 + 12.706205), abs=1e-5)
    assert figure([None])["mean"] is None


@pytest.mark.parametrize("per_seed, words", [
    ([0.01, -0.01, 0.0, 0.005, -0.005, 0.0, 0.01, -0.01], "no accuracy loss"),
    ([0.05, -0.06, 0.04, -0.05, 0.06, -0.04, 0.05, -0.05], "not resolved (the interval contains 0 but is wider than "
                                                            "+-0.03)"),
    ([-0.04, -0.05, -0.03, -0.04, -0.05, -0.03, -0.04, -0.04], "lower accuracy"),
    ([0.04, 0.05, 0.03, 0.04, 0.05, 0.03, 0.04, 0.04], "higher accuracy"),
    ([0.01], "not resolved (fewer than 2 seeds)"),
    ([-0.05, 0.01, -0.03, 0.0, -0.04, 0.01, -0.02, 0.0], "not resolved (the interval contains 0, but the mean is "
                                                         "below -0.01)"),
])
def test_accuracy_verdict_follows_the_t_interval(per_seed, words):
    assert accuracy_verdict(figure(per_seed)) == words


def _final(accuracy, length, stepwise=0.5):
    terms = {"2": {"accuracy": accuracy, "mean_length": length - 5, "stepwise_fraction": stepwise},
             "4": {"accuracy": accuracy - 0.1, "mean_length": length + 5, "stepwise_fraction": stepwise}}
    return {"accuracy": accuracy, "mean_length": length, "stepwise_fraction": stepwise, "filler_per_answer": 0.5,
            "accuracy_stepwise": accuracy, "accuracy_at_once": None, "by_terms": terms}


def _run(accuracy, length, curve_lengths, generated, trained, zero_std):
    steps = len(generated)
    curve = [(50 * (i + 1), accuracy, value) for i, value in enumerate(curve_lengths)]
    return {"final": _final(accuracy, length), "curve": curve, "generated_tokens": generated,
            "trained_tokens": trained, "step_time": [1.0] * steps, "train_reward": [0.5] * steps,
            "train_reward_std": [0.4] * steps, "train_frac_reward_zero_std": zero_std}


def _seed(warm_length, grpo, arm):
    return {"warm-up": {**_final(0.5, warm_length), "accuracy": 0.5}, "arms": {"grpo": grpo, "gfpo": arm}}


def test_summarize_on_synthetic_seeds():
    """Three seeds, every figure computed by hand: ELR per seed and of the means, paired differences, token ratios,
    the curves at a checkpoint, the plateau rule and the training signal per phase."""
    steps = 250
    flat = [20.0] * 10  # 10 curve points (steps 50..500), levelled
    rising = [10.0] * 5 + [14.0] * 5  # the last window 4 tokens above the one before
    seeds = [
        _seed(10.0, _run(0.90, 20.0, flat, [100.0] * steps, [100.0] * steps, [0.2] * steps),
              _run(0.88, 15.0, rising, [150.0] * steps, [60.0] * steps, [0.4] * 200 + [0.6] * 50)),
        _seed(12.0, _run(0.80, 22.0, flat, [100.0] * steps, [100.0] * steps, [0.2] * steps),
              _run(0.82, 22.0, rising, [130.0] * steps, [50.0] * steps, [0.4] * 200 + [0.6] * 50)),
        _seed(11.0, _run(0.85, 21.0, flat, [100.0] * steps, [100.0] * steps, [0.2] * steps),
              _run(0.85, 16.0, rising, [140.0] * steps, [55.0] * steps, [0.4] * 200 + [0.6] * 50)),
    ]
    summary = summarize(seeds, ("grpo", "gfpo"), kept_shares={"gfpo": 0.5})
    arm = summary["arms"]["gfpo"]
    # the early stop's floor: k of G rows trained 60, 50, 55 tokens, so the G rows ran at least twice that
    assert arm["early_stop_floor_over_grpo"]["per_seed"] == pytest.approx([1.2, 1.0, 1.1])
    assert "early_stop_floor_over_grpo" not in summary["arms"]["grpo"]
    # ELR per seed: (20-15)/(20-10) = 0.5, (22-22)/(22-12) = 0, (21-16)/(21-11) = 0.5
    assert arm["elr_per_seed"]["per_seed"] == pytest.approx([0.5, 0.0, 0.5])
    assert arm["elr_per_seed"]["mean"] == pytest.approx(1 / 3)
    assert arm["elr_per_seed"]["t95"] == pytest.approx(t_interval([0.5, 0.0, 0.5]))
    assert arm["elr"]["mean"] == pytest.approx((21 - 53 / 3) / (21 - 11))  # the paper's: of the means
    assert arm["accuracy_minus_grpo"]["per_seed"] == pytest.approx([-0.02, 0.02, 0.0])
    assert arm["length_minus_grpo"]["per_seed"] == pytest.approx([-5.0, 0.0, -5.0])
    assert arm["tokens_per_step_over_grpo"]["per_seed"] == pytest.approx([1.5, 1.3, 1.4])
    assert arm["trained_tokens_per_step_over_grpo"]["per_seed"] == pytest.approx([0.6, 0.5, 0.55])
    # per number of terms: "2" lengths are 5 shorter, so ELR (15-10)/(15-5) = 0.5 on seed 0
    assert arm["by_terms_against_grpo"]["2"]["elr_per_seed"]["per_seed"][0] == pytest.approx(0.5)
    assert arm["by_terms"]["4"]["mean_length"]["per_seed"] == pytest.approx([20.0, 27.0, 21.0])  # the arm's own
    # the curves at step 200 (the 4th point): arm 10 tokens, GRPO 20, warm-up 10/12/11 -> ELR 10/10, 10/8, 10/9
    point = arm["checkpoints"]["200"]
    assert point["mean_length"]["mean"] == 10.0
    assert point["elr_per_seed"]["per_seed"] == pytest.approx([1.0, 1.25, 10 / 9])
    assert "1000" not in arm["checkpoints"]  # the curves end at step 500
    # plateau: GRPO's curve is flat (levelled), the arm's last window is 4 tokens up (moving)
    assert summary["arms"]["grpo"]["plateau"]["levelled"] is True
    assert arm["plateau"]["length_change"]["per_seed"] == pytest.approx([4.0] * 3)
    assert arm["plateau"]["levelled"] is False
    # the training signal per phase: steps 1-200 and 201-250 (the run is 250 steps: no later phase)
    assert list(arm["signal"]) == ["1-200", "201-250"]
    assert arm["signal"]["1-200"]["train_frac_reward_zero_std"]["mean"] == pytest.approx(0.4)
    assert arm["signal"]["201-250"]["train_frac_reward_zero_std"]["mean"] == pytest.approx(0.6)
    assert summary["warm-up"]["mean_length"]["mean"] == 11.0


def test_plateau_and_checkpoint_constants_match_the_protocol():
    """docs/demo/convergence-protocol.md: steps 1300-1500 against 1050-1250 at 50 a point, +-1 token, +-0.02."""
    assert study_stats.PLATEAU_WINDOW * 50 == 250
    assert (study_stats.PLATEAU_LENGTH_TOKENS, study_stats.PLATEAU_ACCURACY) == (1.0, 0.02)
    assert study_stats.CHECKPOINT_STEPS == (200, 500, 1000, 1500)
    assert (study_stats.NO_LOSS_HALF_WIDTH, study_stats.NO_LOSS_MEAN) == (0.03, -0.01)
