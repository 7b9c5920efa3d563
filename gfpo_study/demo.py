"""`python -m gfpo_study demo`: GRPO against GFPO on one seed, from scratch, on CPU, no downloads.

A tiny Qwen2-style model is warmed up (supervised) on a task of gfpo_study/sums_task.py whose answers come at once
(" 17") or step by step with filler words (" 3+5=8, hmm 8+9=17, so 17"); RL rewarding correct answers lengthens
them. GRPO and GFPO Shortest 8/16 (other arms with `--arms`) then train from the same warm-up weights with the same
prompts, steps and seed, and are evaluated on held-out prompts; the demo prints a table and a verdict that sets the
seed's figures beside what the study over 8 seeds found (STUDY_FINDINGS), and writes a plot.

The demo is the sums study (configs/sums.yaml) on one seed, through the study's own path (gfpo_study/study.py);
the study itself (many seeds, every arm, intervals) is `python -m gfpo_study run --config` or `demo --seeds`, its
statistics gfpo_study/study_stats.py and its report gfpo_study/study_report.py.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from .study import (  # noqa: F401 (ARMS, Arm, STUDY_ARMS, DemoSettings, run_study: the demo's names, kept here)
    ARMS, DEMO_ARMS, STUDY_ARMS, Arm, DemoSettings, assemble_study, run_environment, run_study, study_config,
    sums_config, write_json,
)
from .study_report import ELR_IN_WORDS, fmt
from .study_stats import excess_length_reduction
from .sums_task import correctness_reward  # noqa: F401 (the demo's reward, imported from here by tests and configs)

__all__ = ["ARMS", "DEMO_ARMS", "STUDY_ARMS", "STUDY_FINDINGS", "Arm", "DemoSettings", "correctness_reward",
           "demo_table", "demo_verdict", "run_demo", "run_study"]

# What the study at convergence found, which the demo's verdict ends with: per arm, ELR and the paired accuracy
# difference to GRPO, each (mean, low, high) of its 95% t-interval over seeds. tests/test_demo.py checks every figure
# against STUDY_FILE's summary.
STUDY_FILE = "docs/demo/study-sums-1500-8seeds.json"
STUDY_RUN = "8 seeds, 1500 RL steps"
STUDY_FIGURES: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "shortest-8of16": ((0.221, -0.004, 0.446), (-0.0223, -0.0448, 0.0003)),
    "shortest-6of8": ((0.214, 0.011, 0.417), (-0.0132, -0.0262, -0.0001)),
}


def _figure(triple) -> dict:
    return {"mean": triple[0], "t95": triple[1:]}


def study_findings() -> str:
    """STUDY_FIGURES in words, "" where there are none."""
    if not STUDY_FIGURES:
        return ""
    parts = [f"{name} ELR {fmt(_figure(elr), '{:.0%}')}, accuracy {fmt(_figure(acc), '{:+.3f}')}"
             for name, (elr, acc) in STUDY_FIGURES.items()]
    return (f"The study ({STUDY_RUN}, docs/demo.md; means and 95% t-intervals over seeds, against GRPO): "
            + "; ".join(parts) + ".")


STUDY_FINDINGS = study_findings()


def demo_table(result: dict) -> str:
    """One seed's runs as a markdown table: the held-out figures at the end (8 samples a prompt), ELR, and the tokens
    generated and trained per step (time per step depends on the machine and its load: in results.json only)."""
    header = ["run", "held-out accuracy", "held-out length (tokens)", "length vs warm-up", "ELR",
              "tokens generated / step", "tokens trained / step"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    warm = result["warm-up"]
    lines.append(" | ".join(["warm-up", f"{warm['accuracy']:.3f}", f"{warm['mean_length']:.1f}", "-", "-", "-", "-"]))
    grpo = result["arms"].get("grpo")
    for name, run in result["arms"].items():
        final = run["final"]
        elr = None if grpo is None or name == "grpo" else excess_length_reduction(
            grpo["final"]["mean_length"], final["mean_length"], warm["mean_length"])
        lines.append(" | ".join([
            name, f"{final['accuracy']:.3f}", f"{final['mean_length']:.1f}",
            f"{final['mean_length'] / warm['mean_length'] - 1:+.0%}", "-" if elr is None else f"{elr:.0%}",
            f"{statistics.fmean(run['generated_tokens']):.0f}", f"{statistics.fmean(run['trained_tokens']):.0f}",
        ]))
    return "\n".join(lines)


def demo_verdict(result: dict) -> str:
    """In words: did GRPO lengthen answers, and how much of that did each GFPO arm avoid, at what accuracy, on this
    seed; then what ELR is, and what the study over many seeds found (one seed's figures vary by seed)."""
    warm, arms = result["warm-up"], result["arms"]
    grpo = arms["grpo"]["final"]
    grew = grpo["mean_length"] / warm["mean_length"] - 1
    words = [f"On this seed GRPO took held-out accuracy from {warm['accuracy']:.2f} to {grpo['accuracy']:.2f} and "
             f"answers {'longer' if grew > 0 else 'shorter'} by {abs(grew):.0%}"]
    for name, run in arms.items():
        if name == "grpo":
            continue
        final = run["final"]
        elr = excess_length_reduction(grpo["mean_length"], final["mean_length"], warm["mean_length"])
        change = final["mean_length"] / warm["mean_length"] - 1
        versus = final["accuracy"] - grpo["accuracy"]
        words.append(f"{name} {'+' if change >= 0 else '-'}{abs(change):.0%} at accuracy {final['accuracy']:.2f}, "
                     f"{abs(versus):.2f} {'above' if versus > 0 else 'below'} GRPO's"
                     + ("" if elr is None else f" (ELR {elr:.0%})"))
    text = "; ".join(words) + f".\n{ELR_IN_WORDS}."
    return text + ("\n" + STUDY_FINDINGS if STUDY_FINDINGS else "")


def _plot_demo(result: dict, path: str) -> None:
    """Held-out answer length and accuracy over training per arm (the warm-up model at step 0; 2 samples a prompt),
    and the end of each run as the table has it (8 samples a prompt), a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_length, ax_accuracy) = plt.subplots(1, 2, figsize=(11, 4.4))
    warm = result["warm-up"]
    for name, run in result["arms"].items():
        steps = [0] + [c[0] for c in run["curve"]]
        line = ax_length.plot(steps, [warm["mean_length"]] + [c[2] for c in run["curve"]], marker="o",
                              markersize=3, label=name)[0]
        ax_accuracy.plot(steps, [warm["accuracy"]] + [c[1] for c in run["curve"]], marker="o", markersize=3,
                         color=line.get_color())
        ax_length.plot(steps[-1], run["final"]["mean_length"], marker="*", markersize=12, color=line.get_color())
        ax_accuracy.plot(steps[-1], run["final"]["accuracy"], marker="*", markersize=12, color=line.get_color())
    ax_length.set(title="held-out answer length (tokens)", xlabel="RL step", ylabel="tokens")
    ax_accuracy.set(title="held-out accuracy", xlabel="RL step", ylabel="accuracy")
    for ax in (ax_length, ax_accuracy):
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=len(result["arms"]), fontsize=8, frameon=False,
               title="dots: during training, 2 samples a prompt; star: the end, 8 samples a prompt (the table's)",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(settings: DemoSettings, output_dir: str = "gfpo_demo_output", use_kernels: bool = True,
             verbose: bool = False, seed: int = 0, arms=DEMO_ARMS) -> dict:
    """One seed of the sums study at `settings` (sums_config, through run_study: a rerun into the same folder keeps
    its finished runs): the warm-up, then `arms` from its weights; prints the table and a verdict, writes demo.png,
    results.json, the warm-up model (`seed-<seed>/start_model/`) and each arm's final model (`seed-<seed>/<arm>/`)."""
    config = study_config(sums_config(settings, seeds=[seed], arms=arms, output_dir=os.path.abspath(output_dir),
                                      use_kernels=use_kernels))
    environment = run_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    run_study(config, verbose=verbose)
    environment["wall_time_seconds"] = round(time.perf_counter() - start, 1)  # warm-up, arms, evaluations
    if hasattr(os, "getloadavg"):
        environment["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    result = assemble_study(config.output_dir, config, environment=environment)["seed_results"][0]
    table, verdict = demo_table(result), demo_verdict(result) if "grpo" in arms else ""
    print("\n" + table + "\n\n" + verdict)
    plot_path = os.path.join(output_dir, "demo.png")
    _plot_demo(result, plot_path)
    write_json(os.path.join(output_dir, "results.json"),
               {"environment": environment, "settings": dataclasses.asdict(settings), "result": result})
    versions, machine = environment["versions"], environment["machine"]
    print(f"\nwritten: {plot_path} (the plot), {os.path.join(output_dir, 'results.json')} (every figure; commit "
          f"{environment['commit']}, torch {versions['torch']}, trl {versions['trl']}, {machine['device']}"
          f" on {machine['cpu_cores']} cores of {machine['cpu']}; tokens and times "
          f"depend on the machine and its load), the models under {output_dir}/seed-{seed}/")
    return {"result": result, "table": table, "verdict": verdict, "plot": plot_path}
