"""The study's statistics over seeds: Student-t intervals, the paper's excess length reduction, the summary.

Everything here is pure (lists of numbers and the per-seed results of gfpo_study/study.py in, numbers out), so it
is tested on synthetic data (tests/test_study_stats.py). The words of the reports follow the t-interval; the
percentile bootstrap (the 200-step study's interval) is kept beside it as "ci95".
"""

from __future__ import annotations

import math
import random
import statistics

__all__ = ["NO_LOSS_HALF_WIDTH", "accuracy_verdict", "bootstrap_interval", "excess_length_reduction", "figure",
           "summarize", "t_interval"]

NO_LOSS_HALF_WIDTH = 0.03  # "no accuracy loss" needs an interval around 0 at most this wide on each side ...
NO_LOSS_MEAN = -0.01  # ... and a mean difference of at least this (the goal: -0.01 or better)
PLATEAU_WINDOW = 5  # curve points per window of the plateau rule (steps 1300-1500 against 1050-1250 at 50 a point)
PLATEAU_LENGTH_TOKENS = 1.0  # levelled: the length's change between the windows within +-1 token ...
PLATEAU_ACCURACY = 0.02  # ... and the accuracy's within +-0.02 (t-intervals over seeds)
CHECKPOINT_STEPS = (200, 500, 1000, 1500)  # "shorter at the end, or slower to lengthen": the curves at these steps
PHASES = ((1, 200), (201, 500), (501, 1000), (1001, 1500))  # training-signal figures per phase of training


def t_interval(values, confidence: float = 0.95) -> tuple[float, float]:
    """The Student-t interval of the mean of `values`: mean +- t(1 - (1 - confidence) / 2, n - 1) * sd / sqrt(n).

    Args:
        values: one number per seed (at least 2; None and NaN are not allowed: leave such seeds out first).
    Returns:
        (low, high); (nan, nan) with fewer than 2 values.
    """
    from scipy.stats import t as student_t

    values = [float(v) for v in values]
    if len(values) < 2:
        return (math.nan, math.nan)
    mean = statistics.fmean(values)
    quantile = float(student_t.ppf(0.5 + confidence / 2, len(values) - 1))
    half = quantile * statistics.stdev(values) / math.sqrt(len(values))
    return (mean - half, mean + half)


def bootstrap_interval(values_per_seed, statistic, resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of `statistic(sample)` over resamples of the seeds (a sample is a list of
    per-seed values, drawn with replacement). A resample where the statistic is undefined (None) is left out."""
    rng = random.Random(seed)
    n = len(values_per_seed)
    stats = []
    for _ in range(resamples):
        value = statistic([values_per_seed[rng.randrange(n)] for _ in range(n)])
        if value is not None and math.isfinite(value):
            stats.append(value)
    stats.sort()
    if not stats:
        return (math.nan, math.nan)
    return stats[int(0.025 * (len(stats) - 1))], stats[int(math.ceil(0.975 * (len(stats) - 1)))]


def excess_length_reduction(grpo_length: float, arm_length: float, warmup_length: float) -> float | None:
    """The paper's Eq. 4: (L_GRPO - L_arm) / (L_GRPO - L_warm-up); None where GRPO did not lengthen answers."""
    excess = grpo_length - warmup_length
    return None if excess <= 0 else (grpo_length - arm_length) / excess


def figure(values, bootstrap: bool = True) -> dict:
    """A mean over seeds with its intervals: {"mean", "t95", "ci95" (bootstrap), "per_seed", "n"}. Seeds whose value
    is None (undefined there) are left out of the mean and the intervals, and counted in "n" only when defined."""
    defined = [v for v in values if v is not None and math.isfinite(v)]
    mean = statistics.fmean(defined) if defined else None
    return {"mean": mean, "t95": t_interval(defined),
            "ci95": bootstrap_interval(defined, statistics.fmean) if bootstrap and defined else (math.nan, math.nan),
            "per_seed": list(values), "n": len(defined)}


def accuracy_verdict(difference: dict) -> str:
    """The words for a paired accuracy difference (arm minus GRPO), from its t-interval: "no accuracy loss" only
    where the interval contains 0, is at most NO_LOSS_HALF_WIDTH wide on each side and the mean is NO_LOSS_MEAN or
    better; an interval that contains 0 otherwise does not resolve the difference."""
    low, high = difference["t95"]
    if math.isnan(low):
        return "not resolved (fewer than 2 seeds)"
    if low > 0:
        return "higher accuracy"
    if high < 0:
        return "lower accuracy"
    if high - difference["mean"] > NO_LOSS_HALF_WIDTH or difference["mean"] - low > NO_LOSS_HALF_WIDTH:
        return f"not resolved (the interval contains 0 but is wider than +-{NO_LOSS_HALF_WIDTH})"
    if difference["mean"] < NO_LOSS_MEAN:
        return f"not resolved (the interval contains 0, but the mean is below {NO_LOSS_MEAN:+})"
    return "no accuracy loss"


def _mean(values):
    return statistics.fmean(values)


def _curve_at(run: dict, step: int):
    """(accuracy, length) of a run's curve at `step`, None where the curve has no point there."""
    return next(((acc, length) for s, acc, length in run["curve"] if s == step), None)


def _window_change(run: dict, key: int) -> float | None:
    """The mean of a curve column over its last PLATEAU_WINDOW points minus that over the PLATEAU_WINDOW before."""
    points = [c[key] for c in run["curve"]]
    if len(points) < 2 * PLATEAU_WINDOW:
        return None
    return _mean(points[-PLATEAU_WINDOW:]) - _mean(points[-2 * PLATEAU_WINDOW:-PLATEAU_WINDOW])


def _phase_mean(values, low: int, high: int) -> float | None:
    """The mean of per-step values (step 1 first) over steps low..high; None where the run has no such step."""
    window = [v for v in values[low - 1:high] if v is not None and math.isfinite(v)]
    return _mean(window) if window else None


def summarize(seed_results: list[dict], arms, kept_shares: dict | None = None) -> dict:
    """Per arm, over the seeds (each figure a `figure`: mean, t-interval, bootstrap interval, per-seed values):

    - held-out accuracy, length, stepwise share, filler words and accuracy within each form (the final evaluation),
      also per number of terms ("by_terms");
    - against GRPO (where "grpo" is an arm): the paired accuracy and length differences (also per number of terms:
      "by_terms_against_grpo"), ELR per seed ("elr_per_seed")
      and as the paper computes it, from the means ("elr": the ratio of means with its bootstrap interval), tokens
      generated and trained per step and their paired ratios to GRPO's, and the same at CHECKPOINT_STEPS from the
      curves ("checkpoints");
    - training signal per phase of training (PHASES): the share of trained rows with advantage 0, the trained rows'
      reward spread and mean;
    - the plateau rule ("plateau": the change in length and accuracy between the curve's last two windows);
    - for the arms in `kept_shares` ({name: k / G} of the arms whose dropped completions stop early), the early stop's
      floor against GRPO's tokens ("early_stop_floor_over_grpo"): a dropped completion runs until it is as long as
      the k-th shortest of its group, at least the kept ones' mean, so a step generates at least G / k times the
      tokens it trains.
    """
    per_seed = []
    for result in seed_results:
        row = {"warm-up": result["warm-up"]}
        for name in arms:
            row[name] = result["arms"][name]
        per_seed.append(row)
    final = lambda s, name, key: s[name]["final"][key]  # noqa: E731

    # the answers' form and the figures per number of terms: where the study's eval.details records them (the sums
    # task's); a study of another task has accuracy and length
    def has(key):
        return all(key in s["warm-up"] and all(key in s[n]["final"] for n in arms) for s in per_seed)

    summary = {"warm-up": {key: figure([s["warm-up"][key] for s in per_seed])
                           for key in ("accuracy", "mean_length", "stepwise_fraction", "filler_per_answer")
                           if has(key)},
               "arms": {}}
    by_terms = has("by_terms")
    summary["warm-up"]["by_terms"] = {
        n: {key: figure([s["warm-up"]["by_terms"][n][key] for s in per_seed]) for key in ("accuracy", "mean_length")}
        for n in per_seed[0]["warm-up"]["by_terms"]} if by_terms else {}
    for name in arms:
        f = {key: figure([final(s, name, key) for s in per_seed])
             for key in ("accuracy", "mean_length", "stepwise_fraction", "filler_per_answer", "accuracy_stepwise",
                         "accuracy_at_once") if has(key)}
        f["tokens_per_step"] = figure([_mean(s[name]["generated_tokens"]) for s in per_seed])
        f["seconds_per_step"] = figure([_mean(s[name]["step_time"]) for s in per_seed])
        if all("trained_tokens" in s[name] for s in per_seed):
            f["trained_tokens_per_step"] = figure([_mean(s[name]["trained_tokens"]) for s in per_seed])
            steps = len(per_seed[0][name]["trained_tokens"])
            f["signal"] = {  # a phase the run ends inside is named by the steps it has: 201-250, not 201-500
                f"{low}-{min(high, steps)}": {
                    key: figure([_phase_mean(s[name][key], low, high) for s in per_seed], bootstrap=False)
                    for key in ("train_frac_reward_zero_std", "train_reward_std", "train_reward")}
                for low, high in PHASES if steps >= low}
        f["by_terms"] = {n: {key: figure([s[name]["final"]["by_terms"][n][key] for s in per_seed])
                             for key in ("accuracy", "mean_length", "stepwise_fraction")}
                         for n in per_seed[0][name]["final"]["by_terms"]} if by_terms else {}
        changes = [(_window_change(s[name], 2), _window_change(s[name], 1)) for s in per_seed]
        if all(c[0] is not None for c in changes):
            length, accuracy = figure([c[0] for c in changes], False), figure([c[1] for c in changes], False)
            levelled = (-PLATEAU_LENGTH_TOKENS <= length["t95"][0] and length["t95"][1] <= PLATEAU_LENGTH_TOKENS
                        and -PLATEAU_ACCURACY <= accuracy["t95"][0] and accuracy["t95"][1] <= PLATEAU_ACCURACY)
            f["plateau"] = {"length_change": length, "accuracy_change": accuracy, "levelled": levelled}
        if "grpo" in arms:
            f.update(_against_grpo(per_seed, name))
            if name in (kept_shares or {}) and "trained_tokens" in per_seed[0][name]:
                f["early_stop_floor_over_grpo"] = figure(
                    [_mean(s[name]["trained_tokens"]) / kept_shares[name] / _mean(s["grpo"]["generated_tokens"])
                     for s in per_seed])
        summary["arms"][name] = f
    return summary


def _against_grpo(per_seed: list[dict], name: str) -> dict:
    """The paired figures of arm `name` against GRPO on the same seeds."""
    elr = excess_length_reduction
    def elr_of_means(sample):
        return excess_length_reduction(_mean([s["grpo"]["final"]["mean_length"] for s in sample]),
                                       _mean([s[name]["final"]["mean_length"] for s in sample]),
                                       _mean([s["warm-up"]["mean_length"] for s in sample]))

    out = {
        "elr": {"mean": elr_of_means(per_seed), "ci95": bootstrap_interval(per_seed, elr_of_means)},
        "elr_per_seed": figure([elr(s["grpo"]["final"]["mean_length"], s[name]["final"]["mean_length"],
                                    s["warm-up"]["mean_length"]) for s in per_seed]),
        "accuracy_minus_grpo": figure([s[name]["final"]["accuracy"] - s["grpo"]["final"]["accuracy"]
                                       for s in per_seed]),
        "length_minus_grpo": figure([s[name]["final"]["mean_length"] - s["grpo"]["final"]["mean_length"]
                                     for s in per_seed]),
        "tokens_per_step_over_grpo": figure([_mean(s[name]["generated_tokens"]) / _mean(s["grpo"]["generated_tokens"])
                                             for s in per_seed]),
        "seconds_per_step_over_grpo": figure([_mean(s[name]["step_time"]) / _mean(s["grpo"]["step_time"])
                                              for s in per_seed]),
        "by_terms_against_grpo": {},
        "checkpoints": {},
    }
    if all("trained_tokens" in s[name] for s in per_seed):
        out["trained_tokens_per_step_over_grpo"] = figure(
            [_mean(s[name]["trained_tokens"]) / _mean(s["grpo"]["trained_tokens"]) for s in per_seed])
    for n in per_seed[0]["warm-up"].get("by_terms", {}):
        terms = lambda s, who: s[who]["final"]["by_terms"][n] if who != "warm-up" else s["warm-up"]["by_terms"][n]  # noqa: E731
        out["by_terms_against_grpo"][n] = {
            "elr_per_seed": figure([elr(terms(s, "grpo")["mean_length"], terms(s, name)["mean_length"],
                                        terms(s, "warm-up")["mean_length"]) for s in per_seed]),
            "accuracy_minus_grpo": figure([terms(s, name)["accuracy"] - terms(s, "grpo")["accuracy"]
                                           for s in per_seed]),
        }
    for step in CHECKPOINT_STEPS:
        points = [(_curve_at(s[name], step), _curve_at(s["grpo"], step), s["warm-up"]) for s in per_seed]
        if any(arm is None or grpo is None for arm, grpo, _ in points):
            continue
        out["checkpoints"][str(step)] = {
            "mean_length": figure([arm[1] for arm, _, _ in points], False),
            "accuracy": figure([arm[0] for arm, _, _ in points], False),
            "elr_per_seed": figure([elr(grpo[1], arm[1], warm["mean_length"]) for arm, grpo, warm in points],
                                   False),
            "accuracy_minus_grpo": figure([arm[0] - grpo[0] for arm, grpo, _ in points], False),
        }
        forms = [_curve_figures_at(s[name], step) for s in per_seed]
        if all(f is not None and all(key in f for key in FORM_KEYS) for f in forms):  # the form, where recorded
            out["checkpoints"][str(step)].update({key: figure([f[key] for f in forms], False) for key in FORM_KEYS})
    return out


FORM_KEYS = ("stepwise_fraction", "filler_per_answer", "accuracy_stepwise")


def _curve_figures_at(run: dict, step: int) -> dict | None:
    """The held-out figures a run's curve recorded at `step` ("curve_figures"), None where it has none."""
    return next((f for f in run.get("curve_figures", ()) if f["step"] == step), None)
