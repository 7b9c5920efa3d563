"""`python -m gfpo_trainer demo`: GRPO against GFPO where RL lengthens answers, from scratch, on CPU, no downloads.

The task (gfpo_trainer/sums_task.py): sums of 2 to 4 small numbers, answered at once (" 17") or step by step with
filler words (" 3+5=8, hmm 8+9=17, so 17"). A tiny Qwen2-style model is warmed up (supervised) on both forms; the
steps make it more accurate on longer sums, so RL rewarding correct answers lengthens its answers, as RL lengthens a
verbose SFT model's reasoning. Each arm (ARMS) then trains from the same warm-up weights with the same prompts,
steps and seed, and is evaluated on held-out prompts: accuracy and length of sampled answers, and the paper's excess
length reduction ELR = (L_GRPO - L_arm) / (L_GRPO - L_warm-up).

One seed (`demo`): GRPO and GFPO Shortest 8/16 (other arms with `--arms`), a table, a plot and a verdict in words.
Several seeds (`demo --seeds N`): the study (STUDY_ARMS, the paper's Tables 1-2 arms), each figure with a 95%
bootstrap interval over the seeds, the paired accuracy difference against GRPO, and the paper's figures beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import subprocess
import time
import warnings

import torch
from tqdm.auto import tqdm

from .sums_task import TASKS, SumsTask, correctness_reward, evaluate, signed_correctness_reward, warm_up
from .tiny import make_tiny_model, make_tokenizer

__all__ = ["ARMS", "DEMO_ARMS", "STUDY_ARMS", "Arm", "DemoSettings", "correctness_reward", "run_demo", "run_study"]

REWARDS = {"correct": correctness_reward, "signed": signed_correctness_reward}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One trained configuration.

    Args:
        name: its label in tables, plots and output folders.
        num_generations: G, completions sampled per prompt.
        num_remains_in_group: k, completions kept per group (None: GRPO).
        group_filter: GFPOConfig.group_filter.
        adaptive_num_remains: k per difficulty quartile, hardest first (adaptive difficulty); None: fixed k.
        reward: "correct" (1 right, 0 wrong) or "signed" (1 right, -1 wrong: the paper's range).
        paper: the arm's key in the paper's tables (docs/demo/gfpo-paper-tables.json), None where it has none.
        loss_includes_rejected: GFPOConfig.loss_includes_rejected (the paper's objective: rejected rows in the loss's
            normaliser with advantage 0).
    """

    name: str
    num_generations: int
    num_remains_in_group: int | None = None
    group_filter: str | None = None
    adaptive_num_remains: tuple[int, ...] | None = None
    reward: str = "correct"
    paper: str | None = None
    loss_includes_rejected: bool = False

    def config_fields(self) -> dict:
        """The GFPOConfig fields this arm sets."""
        fields = dict(num_generations=self.num_generations, num_remains_in_group=self.num_remains_in_group,
                      group_filter=self.group_filter)
        if self.adaptive_num_remains is not None:
            fields.update(adaptive_difficulty=True, adaptive_num_remains=list(self.adaptive_num_remains))
        if self.loss_includes_rejected:
            fields.update(loss_includes_rejected=True)
        return fields


ARMS = {arm.name: arm for arm in (
    Arm("grpo", 8, paper="GRPO"),
    Arm("shortest-8of16", 16, 8, "length", paper="8/16"),
    Arm("shortest-4of16", 16, 4, "length", paper="4/16"),
    Arm("shortest-6of8", 8, 6, "length", paper="6/8"),  # the paper's control: filtering without sampling more
    Arm("token-efficiency-8of16", 16, 8, "token_efficiency", paper="token_efficiency_8/16"),
    Arm("token-efficiency-8of16-signed", 16, 8, "token_efficiency", reward="signed", paper="token_efficiency_8/16"),
    # the paper's k per difficulty, easy to very hard 4, 6, 8, 8 (here hardest first)
    Arm("adaptive-16", 16, 8, "length", adaptive_num_remains=(8, 8, 6, 4), paper="adaptive_16"),
    Arm("shortest-8of16-paper-objective", 16, 8, "length", paper="8/16", loss_includes_rejected=True),
)}
DEMO_ARMS = ("grpo", "shortest-8of16")
STUDY_ARMS = tuple(ARMS)


@dataclasses.dataclass
class DemoSettings:
    """Sizes of a run: the default, `quick()` (fewer warm-up and RL steps: the study's sizes) and `smoke()` (seconds:
    every stage runs, the figures mean nothing; for tests). Times by machine and load: docs/demo.md."""

    task: SumsTask = SumsTask()
    warmup_steps: int = 1200
    warmup_batch: int = 64
    rl_steps: int = 300
    prompts_per_step: int = 4
    max_completion_length: int = 48
    eval_prompts: int = 40  # held-out prompts per number of terms
    eval_samples: int = 8  # sampled answers per held-out prompt at the end of a run
    eval_temperature: float = 0.8  # the paper's evaluation temperature (training samples at 1.0)
    eval_every: int = 50  # held-out length and accuracy during training, every this many steps (2 samples a prompt)
    hidden_size: int = 64
    num_layers: int = 2
    learning_rate: float = 1e-4
    held_out_seed: int = 1234  # which prompts are held out: the same for every seed and arm

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(warmup_steps=800, rl_steps=200)

    @classmethod
    def smoke(cls) -> DemoSettings:
        return cls(task=SumsTask(max_terms=3, max_term=5), warmup_steps=5, rl_steps=2, prompts_per_step=1,
                   max_completion_length=8, eval_prompts=2, eval_samples=1, eval_every=1, hidden_size=32)


def _arm_config(arm: Arm, settings: DemoSettings, output_dir: str, seed: int, use_kernels: bool, verbose: bool):
    from .config import GFPOConfig

    return GFPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=settings.prompts_per_step * arm.num_generations,
        max_completion_length=settings.max_completion_length,
        max_steps=settings.rl_steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        loss_type="dapo",
        beta=0.0,
        temperature=1.0,
        shuffle_dataset=False,  # every arm sees the same prompts at the same steps
        use_gfpo_kernels=use_kernels,
        disable_tqdm=not verbose,
        **arm.config_fields(),
    )


def _training_prompts(task: SumsTask, train, settings: DemoSettings, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [task.prompt(task.draw(train, rng)) for _ in range(settings.rl_steps * settings.prompts_per_step)]


def _callbacks(name: str, settings: DemoSettings, evaluate_held_out, verbose: bool):
    """A compact progress bar for the run, and the held-out evaluation every settings.eval_every steps."""
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        def __init__(self):
            self.curve = []  # (step, held-out accuracy, held-out length)
            self.curve_figures = []  # the whole held-out figures (evaluate's dict) at the same steps

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = None if verbose else tqdm(total=settings.rl_steps, desc=name, unit="step", dynamic_ncols=True)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % settings.eval_every == 0 or state.global_step == settings.rl_steps:
                figures = evaluate_held_out(model, samples=2)
                model.train()
                self.curve.append((state.global_step, figures["accuracy"], figures["mean_length"]))
                self.curve_figures.append({"step": state.global_step, **figures})
                if self.bar is not None:
                    self.bar.set_postfix({"held-out acc": f"{figures['accuracy']:.2f}",
                                          "len": f"{figures['mean_length']:.1f}"}, refresh=False)
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return DemoProgress()


def _generated_tokens(log: dict, rows: int) -> float:
    """The completion tokens a step generated, every sampled completion as far as it ran (GFPO logs it; GRPO's
    completions/mean_length covers every completion)."""
    return log["gfpo/generated_tokens"] if "gfpo/generated_tokens" in log else log["completions/mean_length"] * rows


def _trained_tokens(log: dict, rows: int) -> float:
    """The completion tokens a step trained on: the kept rows' (GFPO), every row's (GRPO)."""
    if "gfpo/kept_completion_length" in log:
        return log["gfpo/kept_completion_length"] * log["gfpo/kept_fraction"] * rows
    return log["completions/mean_length"] * rows


def _step_signal(log: dict) -> dict:
    """The learning signal of a step's trained rows: their mean reward, their reward spread (std over the batch's
    trained rows) and the share of trained rows in groups whose trained rewards are all equal (advantage 0)."""
    kept = "gfpo/kept_reward_mean" in log  # GFPO: over the kept rows; GRPO: TRL's, over every row
    return {"reward": log["gfpo/kept_reward_mean" if kept else "reward"],
            "reward_std": log["gfpo/kept_reward_std" if kept else "reward_std"],
            "frac_reward_zero_std": log["gfpo/kept_frac_reward_zero_std" if kept else "frac_reward_zero_std"]}


def run_arm(arm: Arm, start_dir: str, tokenizer, task: SumsTask, train, held_out, settings: DemoSettings,
            output_dir: str, seed: int, use_kernels: bool = True, verbose: bool = False) -> dict:
    """Trains `arm` from the warm-up model in `start_dir` and evaluates it on the held-out prompts. Saves the final
    model (with the tokenizer) into `output_dir`. Returns the held-out figures ("final"), the held-out curve during
    training, and per step the generated tokens and the step's time."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .trainer import GFPOTrainer

    args = _arm_config(arm, settings, output_dir, seed, use_kernels, verbose)
    dataset = Dataset.from_list([{"prompt": p} for p in _training_prompts(task, train, settings, seed)])

    def evaluate_held_out(model, samples):
        return evaluate(model, tokenizer, task, held_out, settings.max_completion_length, model.device,
                        samples=samples, temperature=settings.eval_temperature, seed=seed, desc=f"evaluate {arm.name}")

    progress = _callbacks(arm.name, settings, evaluate_held_out, verbose)
    trainer = GFPOTrainer(model=start_dir, reward_funcs=REWARDS[arm.reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[progress])
    if not verbose:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    trainer.train()
    trainer.save_model()  # save_strategy="no": this is the run's one model on disk
    history = [h for h in trainer.state.log_history if "reward" in h]
    final = evaluate_held_out(trainer.model, settings.eval_samples)
    rows = args.per_device_train_batch_size
    signal = [_step_signal(h) for h in history]
    return {"final": final, "curve": progress.curve, "curve_figures": progress.curve_figures,
            "generated_tokens": [_generated_tokens(h, rows) for h in history],
            "trained_tokens": [_trained_tokens(h, rows) for h in history],
            "step_time": [h["step_time"] for h in history],
            "train_reward": [s["reward"] for s in signal],
            "train_reward_std": [s["reward_std"] for s in signal],
            "train_frac_reward_zero_std": [s["frac_reward_zero_std"] for s in signal]}


def run_seed(settings: DemoSettings, seed: int, arms, output_dir: str, use_kernels: bool = True,
             verbose: bool = False) -> dict:
    """Warm-up with `seed`, then every arm from its weights. Writes `output_dir/warmup_model` and
    `output_dir/<arm>`; returns {"seed", "warm-up": figures, "warmup_time", "arms": {name: run_arm's result, with
    the 1-minute load average when the arm started}}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = settings.task
    tokenizer = make_tokenizer()
    train, held_out = task.split(settings.eval_prompts, settings.held_out_seed)
    model = make_tiny_model(tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                            seed=seed).to(device)
    start = time.perf_counter()
    warm_up(model, tokenizer, task, train, settings.warmup_steps, settings.warmup_batch, seed, device,
            desc=f"warm-up, seed {seed}")
    warmup_time = time.perf_counter() - start
    start_dir = os.path.join(output_dir, "warmup_model")
    model.save_pretrained(start_dir)
    tokenizer.save_pretrained(start_dir)
    warm = evaluate(model, tokenizer, task, held_out, settings.max_completion_length, device,
                    samples=settings.eval_samples, temperature=settings.eval_temperature, seed=seed,
                    desc="evaluate warm-up")
    result = {"seed": seed, "warm-up": warm, "warmup_time": warmup_time, "arms": {}}
    for name in arms:
        torch.manual_seed(seed)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        run = run_arm(ARMS[name], start_dir, tokenizer, task, train, held_out, settings,
                      os.path.join(output_dir, name), seed, use_kernels, verbose)
        run["load_average_1min_at_start"] = load
        result["arms"][name] = run
    return result


# ------------------------------------------------------------------ statistics over seeds

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


def _mean(values):
    return sum(values) / len(values)


def excess_length_reduction(grpo_length: float, arm_length: float, warmup_length: float) -> float | None:
    """The paper's Eq. 4: (L_GRPO - L_arm) / (L_GRPO - L_warm-up); None where GRPO did not lengthen answers."""
    excess = grpo_length - warmup_length
    return None if excess <= 0 else (grpo_length - arm_length) / excess


def summarize(seed_results: list[dict], arms) -> dict:
    """Per arm, over the seeds: mean and 95% bootstrap interval of held-out accuracy and length, ELR, the paired
    accuracy difference against GRPO, generated tokens and time per step (each also as a paired ratio to GRPO's)."""
    per_seed = []  # one dict per seed: the figures every statistic reads
    for result in seed_results:
        row = {"warm-up": result["warm-up"]}
        for name in arms:
            run = result["arms"][name]
            row[name] = {"accuracy": run["final"]["accuracy"], "mean_length": run["final"]["mean_length"],
                         "tokens_per_step": _mean(run["generated_tokens"]), "seconds_per_step": _mean(run["step_time"])}
        per_seed.append(row)

    def interval(extract):
        values = [extract(s) for s in per_seed]
        return {"mean": _mean(values), "ci95": bootstrap_interval(values, _mean), "per_seed": values}

    summary = {"warm-up": {key: interval(lambda s, key=key: s["warm-up"][key]) for key in ("accuracy", "mean_length")},
               "arms": {}}
    for name in arms:
        figures = {key: interval(lambda s, key=key: s[name][key])
                   for key in ("accuracy", "mean_length", "tokens_per_step", "seconds_per_step")}
        if "grpo" in arms:
            def elr(sample, name=name):
                return excess_length_reduction(_mean([s["grpo"]["mean_length"] for s in sample]),
                                               _mean([s[name]["mean_length"] for s in sample]),
                                               _mean([s["warm-up"]["mean_length"] for s in sample]))

            figures["elr"] = {"mean": elr(per_seed), "ci95": bootstrap_interval(per_seed, elr)}
            figures["accuracy_minus_grpo"] = interval(lambda s, name=name: s[name]["accuracy"] - s["grpo"]["accuracy"])
            for key in ("tokens_per_step", "seconds_per_step"):
                figures[f"{key}_over_grpo"] = interval(lambda s, name=name, key=key: s[name][key] / s["grpo"][key])
        summary["arms"][name] = figures
    return summary


# ------------------------------------------------------------------ output

def _fmt_interval(figure: dict, fmt: str) -> str:
    low, high = figure["ci95"]
    if figure["mean"] is None:
        return "-"
    return f"{fmt.format(figure['mean'])} [{fmt.format(low)}, {fmt.format(high)}]"


def study_table(summary: dict) -> str:
    """The study as a markdown table: every figure a mean over seeds with its 95% bootstrap interval."""
    header = ["arm", "held-out accuracy", "accuracy - GRPO (paired)", "held-out length (tokens)", "ELR",
              "tokens generated / step vs GRPO", "time / step vs GRPO"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    warm = summary["warm-up"]
    lines.append(" | ".join(["warm-up", _fmt_interval(warm["accuracy"], "{:.3f}"), "-",
                             _fmt_interval(warm["mean_length"], "{:.1f}"), "-", "-", "-"]))
    for name, f in summary["arms"].items():
        lines.append(" | ".join([
            name, _fmt_interval(f["accuracy"], "{:.3f}"),
            "-" if name == "grpo" else _fmt_interval(f["accuracy_minus_grpo"], "{:+.3f}"),
            _fmt_interval(f["mean_length"], "{:.1f}"),
            "-" if name == "grpo" or f["elr"]["mean"] is None else _fmt_interval(f["elr"], "{:.0%}"),
            "-" if name == "grpo" else _fmt_interval(f["tokens_per_step_over_grpo"], "{:.2f}x"),
            "-" if name == "grpo" else _fmt_interval(f["seconds_per_step_over_grpo"], "{:.2f}x"),
        ]))
    return "\n".join(lines)


def paper_comparison_table(summary: dict, paper_tables: dict) -> str:
    """The study beside the paper's Table 1-2 averages (`paper_tables`: docs/demo/gfpo-paper-tables.json): per arm the
    paper's accuracy difference to GRPO (points) and ELR, and this study's, with their 95% intervals."""
    average = paper_tables["benchmarks"]["Average"]
    header = ["arm", "paper: accuracy - GRPO", "paper: ELR", "here: accuracy - GRPO", "here: ELR"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, f in summary["arms"].items():
        key = ARMS[name].paper
        if name == "grpo" or key not in average:
            continue
        accuracy, _, elr = average[key]
        lines.append(" | ".join([
            name, f"{(accuracy - average['GRPO'][0]) / 100:+.3f}", f"{elr / 100:.0%}",
            _fmt_interval(f["accuracy_minus_grpo"], "{:+.3f}"),
            "-" if f["elr"]["mean"] is None else _fmt_interval(f["elr"], "{:.0%}"),
        ]))
    return "\n".join(lines)


def demo_table(result: dict) -> str:
    """One seed's runs as a markdown table (held-out figures; generated tokens and time depend on the machine)."""
    header = ["run", "held-out accuracy", "held-out length (tokens)", "length vs warm-up", "ELR",
              "tokens generated / step", "time / step (s)"]
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
            f"{_mean(run['generated_tokens']):.0f}", f"{_mean(run['step_time']):.2f}",
        ]))
    return "\n".join(lines)


def demo_verdict(result: dict) -> str:
    """One line in words: did GRPO lengthen answers, and how much of that did each GFPO arm avoid, at what accuracy."""
    warm, arms = result["warm-up"], result["arms"]
    grpo = arms["grpo"]["final"]
    grew = grpo["mean_length"] / warm["mean_length"] - 1
    words = [f"GRPO took held-out accuracy from {warm['accuracy']:.2f} to {grpo['accuracy']:.2f} and answers "
             f"{'longer' if grew > 0 else 'shorter'} by {abs(grew):.0%}"]
    for name, run in arms.items():
        if name == "grpo":
            continue
        final = run["final"]
        elr = excess_length_reduction(grpo["mean_length"], final["mean_length"], warm["mean_length"])
        change = final["mean_length"] / warm["mean_length"] - 1
        versus = final["accuracy"] - grpo["accuracy"]
        words.append(f"{name} {'+' if change >= 0 else '-'}{abs(change):.0%} at accuracy {final['accuracy']:.2f}, "
                     f"{abs(versus):.2f} {'above' if versus > 0 else 'below'} GRPO's"
                     + ("" if elr is None else f" ({elr:.0%} of GRPO's extra length avoided)"))
    return "; ".join(words) + "."


def _plot_demo(result: dict, path: str) -> None:
    """Held-out answer length and accuracy over training, per arm (the warm-up model at step 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_length, ax_accuracy) = plt.subplots(1, 2, figsize=(11, 4.4))
    warm = result["warm-up"]
    for name, run in result["arms"].items():
        steps = [0] + [c[0] for c in run["curve"]]
        line = ax_length.plot(steps, [warm["mean_length"]] + [c[2] for c in run["curve"]], marker="o", label=name)[0]
        ax_accuracy.plot(steps, [warm["accuracy"]] + [c[1] for c in run["curve"]], marker="o", color=line.get_color())
    ax_length.set(title="held-out answer length (sampled, tokens)", xlabel="RL step", ylabel="tokens")
    ax_accuracy.set(title="held-out accuracy (sampled)", xlabel="RL step", ylabel="accuracy")
    for ax in (ax_length, ax_accuracy):
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=len(result["arms"]), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_study(seed_results: list[dict], summary: dict, path: str) -> None:
    """Left: held-out length against accuracy per arm (means over seeds, 95% intervals); right: held-out length over
    training per arm (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_final, ax_curve) = plt.subplots(1, 2, figsize=(12, 4.8))
    warm = summary["warm-up"]
    ax_final.errorbar(warm["mean_length"]["mean"], warm["accuracy"]["mean"], fmt="s", color="gray", label="warm-up",
                      xerr=[[warm["mean_length"]["mean"] - warm["mean_length"]["ci95"][0]],
                            [warm["mean_length"]["ci95"][1] - warm["mean_length"]["mean"]]],
                      yerr=[[warm["accuracy"]["mean"] - warm["accuracy"]["ci95"][0]],
                            [warm["accuracy"]["ci95"][1] - warm["accuracy"]["mean"]]])
    for name, f in summary["arms"].items():
        length, accuracy = f["mean_length"], f["accuracy"]
        bar = ax_final.errorbar(length["mean"], accuracy["mean"], fmt="o", label=name, capsize=3,
                                xerr=[[length["mean"] - length["ci95"][0]], [length["ci95"][1] - length["mean"]]],
                                yerr=[[accuracy["mean"] - accuracy["ci95"][0]],
                                      [accuracy["ci95"][1] - accuracy["mean"]]])
        curves = [r["arms"][name]["curve"] for r in seed_results]
        steps = [0] + [c[0] for c in curves[0]]
        warm_length = _mean([r["warm-up"]["mean_length"] for r in seed_results])
        mean_curve = [warm_length] + [_mean([c[i][2] for c in curves]) for i in range(len(curves[0]))]
        ax_curve.plot(steps, mean_curve, marker="o", color=bar[0].get_color())
    ax_final.set(title="held-out: length and accuracy after RL (95% intervals over seeds)",
                 xlabel="mean answer length (tokens)", ylabel="accuracy")
    ax_curve.set(title="held-out answer length over training (mean over seeds)", xlabel="RL step", ylabel="tokens")
    for ax in (ax_final, ax_curve):
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _task_name(settings: DemoSettings) -> str | None:
    """The name of settings.task in sums_task.TASKS (None for a task made by hand)."""
    return next((name for name, task in TASKS.items() if task == settings.task and type(task) is type(settings.task)),
                None)


def _git_commit() -> str | None:
    """The commit of the checkout this package runs from, "+dirty" when tracked files differ; None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_environment(device: torch.device) -> dict:
    """What a demo run's figures depend on, recorded beside them in results.json: the package versions, the commit,
    the machine (CPU model, cores this process may use, the device trained on) and the load when the run started
    (wall times on a machine shared with other jobs are longer)."""
    from gfpo_kernels.env_report import package_versions  # the versions the env report prints, read alike

    machine = {"cpu": _cpu_model(), "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if hasattr(os, "getloadavg"):
        machine["load_average_1min_at_start"] = round(os.getloadavg()[0], 2)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _git_commit(), "python": platform.python_version(),
            "versions": package_versions(), "machine": machine}


def _announce_overwrite(output_dir: str, results_file: str) -> None:
    """Says, before anything is written, that an earlier run's results in `output_dir` (its `results_file`,
    results.json or study.json) will be replaced."""
    previous = os.path.join(output_dir, results_file)
    if not os.path.exists(previous):
        return
    try:
        with open(previous) as f:
            environment = json.load(f).get("environment", {})
        what = f"of {environment.get('date', 'an unknown date')}, commit {environment.get('commit')}"
    except (OSError, ValueError):
        what = "that could not be read"
    print(f"gfpo demo: replacing the earlier run in {output_dir}/ (its {results_file} {what}); --output-dir keeps "
          "both")


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))


@contextlib.contextmanager
def _future_warnings_hidden(hidden: bool):
    """FutureWarnings ignored inside the block where `hidden` (transformers' deprecation notices about TRL's calls
    would bury the progress bars); the caller's warning filters are restored after it."""
    with warnings.catch_warnings():
        if hidden:
            warnings.simplefilter("ignore", FutureWarning)
        yield


def run_demo(settings: DemoSettings, output_dir: str = "gfpo_demo_output", use_kernels: bool = True,
             verbose: bool = False, seed: int = 0, arms=DEMO_ARMS) -> dict:
    """One seed: warm-up, then `arms` from its weights; prints the table and a verdict, writes demo.png,
    results.json, the warm-up model (`warmup_model/`) and each arm's final model (`<arm>/`)."""
    _announce_overwrite(output_dir, "results.json")
    os.makedirs(output_dir, exist_ok=True)
    environment = run_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    with _future_warnings_hidden(not verbose):
        result = run_seed(settings, seed, arms, output_dir, use_kernels, verbose)
    environment["wall_time_seconds"] = round(time.perf_counter() - start, 1)  # warm-up, arms, evaluations
    if hasattr(os, "getloadavg"):
        environment["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    table, verdict = demo_table(result), demo_verdict(result) if "grpo" in arms else ""
    print("\n" + table + "\n\n" + verdict)
    plot_path = os.path.join(output_dir, "demo.png")
    _plot_demo(result, plot_path)
    _write_json(os.path.join(output_dir, "results.json"),
                {"environment": environment, "settings": dataclasses.asdict(settings), "result": result})
    versions = environment["versions"]
    print(f"\nplot: {plot_path}\nresults: {os.path.join(output_dir, 'results.json')} (commit {environment['commit']}, "
          f"torch {versions['torch']}, trl {versions['trl']}, {environment['machine']['device']} on "
          f"{environment['machine']['cpu_cores']} cores of {environment['machine']['cpu']}; tokens and times "
          "depend on the machine and its load)")
    return {"result": result, "table": table, "verdict": verdict, "plot": plot_path}


def run_study(settings: DemoSettings, seeds, output_dir: str = "gfpo_study_output", arms=STUDY_ARMS,
              use_kernels: bool = True, verbose: bool = False) -> dict:
    """Every arm on every seed (warm-up per seed, arms in turn, so they share the machine's load), then the summary
    over seeds; writes study.json, study.md (the table) and study.png into `output_dir`."""
    seeds = list(seeds)
    if not seeds:
        raise ValueError("the study needs at least 1 seed, got seeds=[]")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"arms={tuple(arms)!r}: unknown arms {unknown}; choices: {list(ARMS)}")
    _announce_overwrite(output_dir, "study.json")
    os.makedirs(output_dir, exist_ok=True)
    environment = run_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    seed_results = []
    for seed in tqdm(seeds, desc="study: seeds", unit="seed"):
        with _future_warnings_hidden(not verbose):
            seed_results.append(run_seed(settings, seed, arms, os.path.join(output_dir, f"seed-{seed}"),
                                         use_kernels, verbose))
        _write_json(os.path.join(output_dir, "study.json"),  # after every seed: an interrupted study keeps its runs
                    {"environment": environment, "settings": dataclasses.asdict(settings), "task": _task_name(settings),
                     "seeds": seeds, "arms": list(arms), "seed_results": seed_results})
    if len(seeds) < 2:  # a piece of a study: its runs are kept, the statistics wait for the merge
        print(f"\none seed: no intervals; {os.path.join(output_dir, 'study.json')} holds its runs")
        return {"summary": None, "table": "", "seed_results": seed_results}
    summary = summarize(seed_results, arms)
    environment["wall_time_seconds"] = round(time.perf_counter() - start, 1)
    if hasattr(os, "getloadavg"):
        environment["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    table = study_table(summary)
    paper_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "demo",
                              "gfpo-paper-tables.json")
    if "grpo" in arms and os.path.exists(paper_path):  # a checkout: the paper's figures beside the study's
        with open(paper_path) as f:
            table += "\n\n" + paper_comparison_table(summary, json.load(f))
    print("\n" + table)
    _write_json(os.path.join(output_dir, "study.json"),
                {"environment": environment, "settings": dataclasses.asdict(settings), "task": _task_name(settings),
                 "seeds": seeds, "arms": list(arms), "summary": summary, "seed_results": seed_results})
    with open(os.path.join(output_dir, "study.md"), "w") as f:
        f.write(table + "\n")
    _plot_study(seed_results, summary, os.path.join(output_dir, "study.png"))
    return {"summary": summary, "table": table, "seed_results": seed_results}
