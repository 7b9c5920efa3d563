"""The length study's report: markdown tables, the verdict in words and the plot, from study_stats.summarize's summary.

Every figure is a mean over seeds with its Student-t 95% interval ("t95"); the words follow the interval
(study_stats.accuracy_verdict). Nothing here trains or evaluates: it reads the summary and the per-seed results.
"""

from __future__ import annotations

import math
import re

from .study_stats import (
    CHECKPOINT_STEPS, NO_LOSS_HALF_WIDTH, NO_LOSS_MEAN, PLATEAU_ACCURACY, PLATEAU_LENGTH_TOKENS, accuracy_verdict,
)

__all__ = ["ELR_IN_WORDS", "checkpoint_table", "elr_in_words", "markdown_table", "paper_comparison_table", "plot_study",
           "signal_table", "study_report", "study_table", "study_verdict"]



def elr_in_words(start: str = "warm-up") -> str:
    """ELR spelt out, its starting model named `start` ("warm-up" where a start function warmed the model up, as the
    sums study's; "start" for a config's own model)."""
    return (f"ELR, the paper's excess length reduction (its Eq. 4): (L_GRPO - L_arm) / (L_GRPO - L_{start}), the "
            f"share of GRPO's extra length over the {start} model that the arm avoided")


ELR_IN_WORDS = elr_in_words()


def fmt(figure: dict | None, spec: str, interval: str = "t95") -> str:
    """`mean [low, high]` of a study_stats.figure, "-" where it is undefined. A bound that is not 0 but prints as 0
    at `spec`'s precision gets one more digit (two if that still prints 0): which side of zero it lies on decides
    verdicts. A figure defined on fewer seeds than the study's says so: "(7 of 8 seeds)"."""
    if figure is None or figure.get("mean") is None:
        return "-"
    per_seed = figure.get("per_seed")
    fewer = (f" ({figure['n']} of {len(per_seed)} seeds)" if per_seed is not None and "n" in figure
             and figure["n"] < len(per_seed) else "")
    low, high = figure[interval]
    if math.isnan(low):
        return spec.format(figure["mean"]) + fewer
    return f"{spec.format(figure['mean'])} [{_bound(spec, low)}, {_bound(spec, high)}]{fewer}"


def _bound(spec: str, value: float) -> str:
    text = spec.format(value)
    for _ in range(2):
        if value == 0 or re.search(r"[1-9]", text):
            break
        spec = re.sub(r"\.(\d+)", lambda m: f".{int(m.group(1)) + 1}", spec, count=1)
        text = spec.format(value)
    return text


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, its rule, one line a row."""
    return "\n".join([" | ".join(header), " | ".join("---" for _ in header)] + [" | ".join(r) for r in rows])


def study_table(summary: dict, start: str = "warm-up") -> str:
    """The main table: held-out accuracy and length, the paired accuracy difference to GRPO, ELR per seed and of the
    means, tokens generated per step against GRPO's with the early stop's floor (the least a step of the length filter
    can generate: every completion as long as the kept ones' mean) and tokens trained per step against GRPO's."""
    warm = summary["warm-up"]
    rows = [[start, fmt(warm["accuracy"], "{:.3f}"), "-", fmt(warm["mean_length"], "{:.1f}")] + ["-"] * 5]
    for name, f in summary["arms"].items():
        paired = name != "grpo" and "accuracy_minus_grpo" in f
        rows.append([
            name, fmt(f["accuracy"], "{:.3f}"), fmt(f["accuracy_minus_grpo"], "{:+.3f}") if paired else "-",
            fmt(f["mean_length"], "{:.1f}"), fmt(f["elr_per_seed"], "{:.0%}") if paired else "-",
            "-" if not paired or f["elr"]["mean"] is None else f"{f['elr']['mean']:.0%}",
            fmt(f["tokens_per_step_over_grpo"], "{:.2f}x") if paired else "-",
            fmt(f.get("early_stop_floor_over_grpo"), "{:.2f}x") if paired else "-",
            fmt(f.get("trained_tokens_per_step_over_grpo"), "{:.2f}x") if paired else "-",
        ])
    return markdown_table(["arm", "held-out accuracy", "accuracy - GRPO (paired)", "held-out length (tokens)",
                   "ELR (per seed)", "ELR (of the means)", "tokens generated / step vs GRPO",
                   "early stop's floor vs GRPO", "tokens trained / step vs GRPO"], rows)


def signal_table(summary: dict) -> str:
    """Why an arm learns slower or faster: per phase of training, the share of trained rows with advantage 0 (groups
    whose trained rewards are all equal) and the trained rows' reward spread; the final answers' form and accuracy
    within each form."""
    phases = next((list(f["signal"]) for f in summary["arms"].values() if "signal" in f), [])
    forms = all("stepwise_fraction" in f for f in summary["arms"].values())
    rows = []
    for name, f in summary["arms"].items():
        signal = f.get("signal", {})
        rows.append([name]
                    + [fmt(signal[p]["train_frac_reward_zero_std"], "{:.2f}") if p in signal else "-" for p in phases]
                    + [fmt(signal[p]["train_reward_std"], "{:.2f}") if p in signal else "-" for p in phases]
                    + ([fmt(f["stepwise_fraction"], "{:.2f}"), fmt(f["accuracy_stepwise"], "{:.3f}"),
                        fmt(f["accuracy_at_once"], "{:.3f}")] if forms else []))
    forms_header = ["stepwise share (end)", "accuracy stepwise (end)", "accuracy at once (end)"] if forms else []
    return markdown_table(["arm"] + [f"advantage-0 share, steps {p}" for p in phases]
                  + [f"reward spread, steps {p}" for p in phases] + forms_header, rows)


def checkpoint_table(summary: dict) -> str:
    """Shorter at the end, or slower to lengthen: each arm's held-out length, ELR and accuracy difference to GRPO on
    the curves (2 samples a prompt) at CHECKPOINT_STEPS, and the plateau rule's changes over the last windows."""
    steps = [s for s in map(str, CHECKPOINT_STEPS)
             if any(s in f.get("checkpoints", {}) for f in summary["arms"].values())]
    rows = []
    for name, f in summary["arms"].items():
        points = f.get("checkpoints", {})
        cells = [name]
        for s in steps:
            p = points.get(s)
            if p is None:
                cells.append("-")
            elif name == "grpo":
                cells.append(fmt(p["mean_length"], "{:.1f}"))
            else:
                cells.append(f"{fmt(p['mean_length'], '{:.1f}')}; ELR {fmt(p['elr_per_seed'], '{:.0%}')}; acc "
                             f"{fmt(p['accuracy_minus_grpo'], '{:+.3f}')}")
        plateau = f.get("plateau")
        cells.append("-" if plateau is None else
                     f"length {fmt(plateau['length_change'], '{:+.2f}')}, accuracy "
                     f"{fmt(plateau['accuracy_change'], '{:+.3f}')}: {'levelled' if plateau['levelled'] else 'moving'}")
        rows.append(cells)
    return markdown_table(["arm"] + [f"step {s}: length; ELR; accuracy - GRPO" for s in steps]
                  + [f"plateau (last two windows; levelled within +-{PLATEAU_LENGTH_TOKENS:g} token, "
                     f"+-{PLATEAU_ACCURACY:g})"], rows)


def form_table(summary: dict) -> str:
    """The answers' form on the curves at CHECKPOINT_STEPS (2 samples a prompt): the share written step by step,
    the filler words per answer and the accuracy of the stepwise answers, per arm."""
    steps = [s for s in map(str, CHECKPOINT_STEPS)
             if any("stepwise_fraction" in f.get("checkpoints", {}).get(s, {}) for f in summary["arms"].values())]
    rows = []
    for name, f in summary["arms"].items():
        cells = [name]
        for s in steps:
            p = f.get("checkpoints", {}).get(s, {})
            cells.append("-" if "stepwise_fraction" not in p else
                         f"{fmt(p['stepwise_fraction'], '{:.2f}')}; {fmt(p['filler_per_answer'], '{:.2f}')}; "
                         f"{fmt(p['accuracy_stepwise'], '{:.3f}')}")
        rows.append(cells)
    header = [f"step {s}: stepwise share; filler words; accuracy of stepwise answers" for s in steps]
    return markdown_table(["arm"] + header, rows)


def by_terms_table(summary: dict) -> str:
    """ELR and the accuracy difference to GRPO per number of terms (per kind of prompt)."""
    terms = list(summary["warm-up"]["by_terms"])
    rows = []
    for name, f in summary["arms"].items():
        paired = f.get("by_terms_against_grpo")
        if name == "grpo" or not paired:
            continue
        rows.append([name] + [f"ELR {fmt(paired[n]['elr_per_seed'], '{:.0%}')}; acc "
                              f"{fmt(paired[n]['accuracy_minus_grpo'], '{:+.3f}')}" for n in terms])
    return markdown_table(["arm"] + [f"{n} terms" for n in terms], rows)


def paper_comparison_table(summary: dict, paper_tables: dict, arms: dict) -> str:
    """The study beside the paper's Table 1-2 averages (`paper_tables`: gfpo_study/paper_tables.json): per arm the
    paper's accuracy difference to GRPO (points) and ELR, and this study's with their t-intervals. `arms`: study.ARMS
    (each arm's key in the paper's tables)."""
    average = paper_tables["benchmarks"]["Average"]
    rows = []
    for name, f in summary["arms"].items():
        key = arms[name].paper
        if name == "grpo" or key not in average:
            continue
        accuracy, _, elr = average[key]
        rows.append([name, f"{(accuracy - average['GRPO'][0]) / 100:+.3f}", f"{elr / 100:.0%}",
                     fmt(f["accuracy_minus_grpo"], "{:+.3f}"), fmt(f.get("elr_per_seed"), "{:.0%}")])
    return markdown_table(["arm", "paper: accuracy - GRPO", "paper: ELR", "here: accuracy - GRPO", "here: ELR"], rows)


def study_verdict(summary: dict, seeds: int, start: str = "warm-up") -> str:
    """The study in words: per GFPO arm, how much of GRPO's extra length it avoided and at what accuracy, as the
    t-intervals say; a warning where few seeds make the intervals wide."""
    warm, arms = summary["warm-up"], summary["arms"]
    if "grpo" not in arms:
        return "No GRPO arm: no ELR and no accuracy difference to GRPO."
    grpo = arms["grpo"]
    lines = [f"Over {seeds} seeds GRPO took held-out accuracy from {fmt(warm['accuracy'], '{:.3f}')} to "
             f"{fmt(grpo['accuracy'], '{:.3f}')} and answers from {fmt(warm['mean_length'], '{:.1f}')} to "
             f"{fmt(grpo['mean_length'], '{:.1f}')} tokens (means, 95% t-intervals over seeds)."]
    for name, f in arms.items():
        if name == "grpo":
            continue
        elr, difference = f["elr_per_seed"], f["accuracy_minus_grpo"]
        low, high = elr["t95"]
        if elr["mean"] is None:
            shorter = "GRPO did not lengthen answers: no ELR"
        elif not math.isnan(low) and low > 0:
            shorter = f"avoided {fmt(elr, '{:.0%}')} of GRPO's extra length"
        else:
            shorter = f"ELR {fmt(elr, '{:.0%}')}: not shown shorter than GRPO"
        length = f" (length {fmt(f['length_minus_grpo'], '{:+.1f}')} tokens)" if "length_minus_grpo" in f else ""
        lines.append(f"- {name}: {shorter}{length}; accuracy {fmt(difference, '{:+.3f}')} against GRPO: "
                     f"{accuracy_verdict(difference)}.")
    lines.append(f"{elr_in_words(start)}. \"No accuracy loss\" is said only where the accuracy difference's interval "
                 f"contains 0 and is at most +-{NO_LOSS_HALF_WIDTH} wide, and its mean is {NO_LOSS_MEAN:+} or better "
                 "(the mean's condition was added after the first study's results were seen: stricter, it only takes "
                 "claims away). Shorter than GRPO is said only where the ELR's interval lies above 0.")
    if seeds < 5:
        lines.append(f"Only {seeds} seeds (fewer than 5): the t-intervals are wide (t = {_t_quantile(seeds):.2f} "
                     "standard errors on each side) and the verdicts above weak; the protocols run 8.")
    return "\n".join(lines)


def _t_quantile(seeds: int) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.975, seeds - 1)) if seeds > 1 else math.inf


def _samples(n: int) -> str:
    return f"{n} sample{'' if n == 1 else 's'} a prompt"


def study_report(summary: dict, seeds: int, paper_tables: dict | None, arms: dict, samples: int = 8,
                 curve_samples: int = 2, start: str = "warm-up") -> str:
    """study.md: the tables and the verdict. `samples`, `curve_samples`: the config's eval.samples and
    eval.curve_samples (answers a held-out prompt at the end and on the curves), which the headings say; `start`:
    the starting model's name in the tables and words (start_label)."""
    parts = [f"## Held-out figures at the end ({_samples(samples)})\n\n" + study_table(summary, start)]
    if summary["warm-up"].get("by_terms"):
        parts.append("## Per number of terms\n\n" + by_terms_table(summary))
    if any(f.get("checkpoints") for f in summary["arms"].values()):
        parts.append(f"## Over training (curves: {_samples(curve_samples)})\n\n" + checkpoint_table(summary))
    if any("stepwise_fraction" in p for f in summary["arms"].values() for p in f.get("checkpoints", {}).values()):
        parts.append(f"## The answers' form over training (curves: {_samples(curve_samples)})\n\n"
                     + form_table(summary))
    if any("signal" in f for f in summary["arms"].values()):
        parts.append("## Learning signal and form\n\n" + signal_table(summary))
    if paper_tables is not None and "grpo" in summary["arms"] and any(
            getattr(arms.get(name), "paper", None) in paper_tables["benchmarks"]["Average"]
            for name in summary["arms"] if name != "grpo"):
        parts.append("## Beside the paper (Tables 1-2, average)\n\n" + paper_comparison_table(summary, paper_tables,
                                                                                               arms))
    parts.append("## Verdict\n\n" + study_verdict(summary, seeds, start))
    return "\n\n".join(parts)


def plot_study(seed_results: list[dict], summary: dict, path: str, samples: int = 8, curve_samples: int = 2,
               start: str = "warm-up") -> None:
    """Left: held-out length against accuracy per arm at the end (means, 95% t-intervals over seeds); middle and right:
    held-out length and accuracy over training (means over seeds; the curves sample `curve_samples` answers a prompt,
    the end `samples`: the config's eval.curve_samples and eval.samples)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_final, ax_length, ax_accuracy) = plt.subplots(1, 3, figsize=(16, 4.8))
    warm = summary["warm-up"]

    def errors(figure):
        low, high = figure["t95"]
        return [[figure["mean"] - low], [high - figure["mean"]]]

    ax_final.errorbar(warm["mean_length"]["mean"], warm["accuracy"]["mean"], fmt="s", color="gray", label=start,
                      xerr=errors(warm["mean_length"]), yerr=errors(warm["accuracy"]), capsize=3)
    warm_length = sum(r["warm-up"]["mean_length"] for r in seed_results) / len(seed_results)
    warm_accuracy = sum(r["warm-up"]["accuracy"] for r in seed_results) / len(seed_results)
    for name, f in summary["arms"].items():
        bar = ax_final.errorbar(f["mean_length"]["mean"], f["accuracy"]["mean"], fmt="o", label=name, capsize=3,
                                xerr=errors(f["mean_length"]), yerr=errors(f["accuracy"]))
        curves = [r["arms"][name]["curve"] for r in seed_results]
        steps = [0] + [c[0] for c in curves[0]]
        for ax, column, at_start in ((ax_length, 2, warm_length), (ax_accuracy, 1, warm_accuracy)):
            mean = [at_start] + [sum(c[i][column] for c in curves) / len(curves) for i in range(len(curves[0]))]
            ax.plot(steps, mean, color=bar[0].get_color(), linewidth=1.2)
    ax_final.set(title=f"held-out at the end ({_samples(samples)}; 95% t-intervals)",
                 xlabel="mean answer length (tokens)", ylabel="accuracy")
    ax_length.set(title=f"held-out length over training ({_samples(curve_samples)})", xlabel="RL step",
                  ylabel="tokens")
    ax_accuracy.set(title=f"held-out accuracy over training ({_samples(curve_samples)})", xlabel="RL step",
                    ylabel="accuracy")
    for ax in (ax_final, ax_length, ax_accuracy):
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=7, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
