"""`python -m gfpo_trainer demo`: GRPO against GFPO on a synthetic task, from scratch, on CPU, without downloads.

The task: "a+b=" -> the sum. A completion is correct when the last number in it is the sum, so an answer can be
short (" 17") or padded with filler reasoning (" ok ok so 17"): room for length inflation. A tiny Qwen2-style
model with a character tokenizer is warmed up by supervised training on both forms, then trained from the same
weights, with the same seed and the same number of steps and prompts, by
- GRPO (8 completions per prompt),
- GFPO with the length filter (16 sampled, the 8 shortest trained on),
- GFPO with the token-efficiency filter (16 sampled, the 8 with the most reward per token trained on).
It prints accuracy (greedy, held-out prompts), mean completion length, length inflation against the warm-up
model, generated tokens per second and wall time, and saves a plot of reward and completion length per step.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import random
import re
import subprocess
import time
import warnings

import torch
from tqdm.auto import tqdm

from .filters import group_filter_spec
from .tiny import make_tiny_model, make_tokenizer

_NUMBER = re.compile(r"\d+")


def correctness_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the last number of the completion is the sum asked for in the prompt ("a+b="), else 0.0."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        a, b = (int(x) for x in _NUMBER.findall(prompt)[:2])
        numbers = _NUMBER.findall(completion)
        rewards.append(1.0 if numbers and int(numbers[-1]) == a + b else 0.0)
    return rewards


@dataclasses.dataclass
class DemoSettings:
    """Sizes of one demo run: the default, `quick()` (a smaller model and task) and `smoke()` (for tests). Run
    times by machine and load: docs/demo.md."""

    max_operand: int = 50
    warmup_steps: int = 2000
    warmup_batch: int = 64
    rl_steps: int = 300
    prompts_per_step: int = 4
    grpo_generations: int = 8
    gfpo_generations: int = 16
    gfpo_keep: int = 8
    max_completion_length: int = 24
    eval_prompts: int = 200
    hidden_size: int = 128
    num_layers: int = 4
    learning_rate: float = 1e-4
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(max_operand=30, warmup_steps=800, rl_steps=200, eval_prompts=100, hidden_size=64, num_layers=2)

    @classmethod
    def smoke(cls) -> DemoSettings:
        """For tests: every stage runs, in seconds."""
        return cls(warmup_steps=5, rl_steps=2, eval_prompts=4, prompts_per_step=1, gfpo_generations=4, gfpo_keep=2,
                   grpo_generations=2, max_completion_length=8, hidden_size=32)


def _split_prompts(settings: DemoSettings):
    pairs = [(a, b) for a in range(settings.max_operand) for b in range(settings.max_operand)]
    random.Random(settings.seed).shuffle(pairs)
    n_eval = min(settings.eval_prompts, len(pairs) // 4)
    return pairs[n_eval:], pairs[:n_eval]


def _warmup_text(a: int, b: int, rng: random.Random) -> tuple[str, str]:
    """Prompt and completion: half short answers, half padded with 1-3 filler words."""
    filler = "" if rng.random() < 0.5 else " ok" * rng.randint(1, 3) + " so"
    return f"{a}+{b}=", f"{filler} {a + b}"


def warm_up(model, tokenizer, train_pairs, settings: DemoSettings, device) -> list[float]:
    """Supervised warm-up on prompt -> completion + <eos> (loss on the completion only)."""
    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in tqdm(range(settings.warmup_steps), desc="warm-up (supervised)"):
        batch = [_warmup_text(*rng.choice(train_pairs), rng) for _ in range(settings.warmup_batch)]
        ids, labels = [], []
        for prompt, completion in batch:
            p = tokenizer(prompt, add_special_tokens=False).input_ids
            c = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            ids.append(p + c)
            labels.append([-100] * len(p) + c)
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids], device=device)
        label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels], device=device)
        attention = (torch.arange(width, device=device)[None, :] < torch.tensor([len(x) for x in ids], device=device)[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def evaluate(model, tokenizer, pairs, settings: DemoSettings, device, desc: str) -> dict:
    """Greedy completions of held-out prompts: accuracy and mean completion length (tokens, <eos> included)."""
    model.eval()
    prompts = [f"{a}+{b}=" for a, b in pairs]
    correct, lengths = [], []
    for start in tqdm(range(0, len(prompts), 32), desc=desc, leave=False):
        chunk = prompts[start : start + 32]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=settings.max_completion_length, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completion_ids = out[:, enc.input_ids.shape[1] :]
        for prompt, ids in zip(chunk, completion_ids.tolist(), strict=True):
            if tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
            lengths.append(len(ids))
            correct.append(correctness_reward([prompt], [tokenizer.decode(ids, skip_special_tokens=True)])[0])
    return {"accuracy": sum(correct) / len(correct), "mean_length": sum(lengths) / len(lengths)}


# The figures the demo's progress bar shows per run: (label, metric logged by the trainer, format). Add a line here
# to show one more; a metric a run does not log is left out of its bar.
PROGRESS_FIGURES = (
    ("reward", "gfpo/kept_reward_mean", "{:.2f}"),
    ("reward", "reward", "{:.2f}"),
    ("kept len", "gfpo/kept_completion_length", "{:.1f}"),
    ("len", "completions/mean_length", "{:.1f}"),
    ("skipped", "gfpo/skipped_zero_gradient_fraction", "{:.0%}"),
)


def sampled_completion_length(log: dict) -> float:
    """The mean length of every completion a step generated (cut short ones as generated). With the length filter
    TRL's completions/mean_length describes the kept rows only; GFPO logs the kept and dropped means."""
    if "gfpo/kept_fraction" not in log:
        return log["completions/mean_length"]
    kept = log["gfpo/kept_fraction"]
    dropped = log.get("gfpo/dropped_completion_length", log.get("gfpo/dropped_completion_length_truncated"))
    return kept * log["gfpo/kept_completion_length"] + (1 - kept) * dropped


def _progress_callback(name: str, total_steps: int, tokens_per_step: int):
    """A TrainerCallback drawing one compact tqdm bar for a run, in place of TRL's metrics dict at every step."""
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total_steps, desc=name, unit="step", dynamic_ncols=True)
            self.start = time.perf_counter()
            self.tokens = 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "reward" not in logs:  # the end-of-training summary: keep the last step's figures
                return
            self.tokens += sampled_completion_length(logs) * tokens_per_step
            figures, shown = {}, set()
            for label, key, fmt in PROGRESS_FIGURES:
                if key in logs and label not in shown:  # the first metric of a label that the run logs
                    figures[label] = fmt.format(logs[key])
                    shown.add(label)
            figures["tok/s"] = f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):.0f}"
            self.bar.set_postfix(figures, refresh=False)
            self.bar.update(state.global_step - self.bar.n)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return DemoProgress()


def run_rl(name, start_dir, tokenizer, train_pairs, settings: DemoSettings, output_dir, use_kernels, verbose=False,
           **gfpo) -> dict:
    """One RL run from the warm-up weights; returns its per-step history and wall time and saves the final model
    (with the tokenizer) into `output_dir/name`. Shows one progress bar with the key figures, or with `verbose` TRL's
    metrics dict at every step."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .config import GFPOConfig
    from .trainer import GFPOTrainer

    G = gfpo.pop("num_generations")
    args = GFPOConfig(
        output_dir=os.path.join(output_dir, name),
        per_device_train_batch_size=settings.prompts_per_step * G,
        num_generations=G,
        max_completion_length=settings.max_completion_length,
        max_steps=settings.rl_steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=settings.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        loss_type="dapo",
        beta=0.0,
        temperature=1.0,
        use_gfpo_kernels=use_kernels,
        disable_tqdm=not verbose,
        **gfpo,
    )
    rng = random.Random(settings.seed)
    prompts = [f"{a}+{b}=" for a, b in rng.sample(train_pairs, len(train_pairs))]
    trainer = GFPOTrainer(model=start_dir, reward_funcs=correctness_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=tokenizer)
    if not verbose:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(_progress_callback(name, settings.rl_steps, args.per_device_train_batch_size))
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.save_model()  # the runs train with save_strategy="no": this is each run's one model on disk
    history = [h for h in trainer.state.log_history if "reward" in h]
    generated = sum(sampled_completion_length(h) * args.per_device_train_batch_size for h in history)
    return {"trainer": trainer, "history": history, "wall_time": wall, "tokens_per_second": generated / wall}


def _moving_average(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _plot(runs: dict, path: str) -> None:
    """Reward and length per step of the completions each run trained on (moving averages over 10 steps): GRPO's
    are all it sampled, GFPO's the kept ones. GFPO's dropped completions are left out: with the early-stop rule
    they are cut short before they answer, so their length and reward say nothing about the policy. Where TRL's
    metrics cover every sampled completion (filters other than length, whose metrics describe the kept rows), GFPO's
    mean over them is drawn faint and dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_length) = plt.subplots(1, 2, figsize=(11, 4.6))
    for name, run in runs.items():
        history = run["history"]
        steps = [h["step"] for h in history]
        gfpo = "gfpo/kept_reward_mean" in history[0]
        reward_key, length_key = ("gfpo/kept_reward_mean", "gfpo/kept_completion_length") if gfpo else (
            "reward", "completions/mean_length")
        line = ax_reward.plot(steps, _moving_average([h[reward_key] for h in history]), label=name)[0]
        ax_length.plot(steps, _moving_average([h[length_key] for h in history]), color=line.get_color())
        if gfpo and not group_filter_spec(run["trainer"].args.group_filter).trl_metrics_over_kept_rows:  # all rows
            label = f"{name}, all sampled"
            for ax, key in ((ax_reward, "reward"), (ax_length, "completions/mean_length")):
                ax.plot(steps, _moving_average([h[key] for h in history]), color=line.get_color(), linestyle=":",
                        alpha=0.5, label=label if ax is ax_reward else None)
    ax_reward.set(title="reward of the trained completions (10-step mean)", xlabel="step", ylabel="reward")
    ax_length.set(title="length of the trained completions (10-step mean)", xlabel="step", ylabel="tokens")
    for ax in (ax_reward, ax_length):
        ax.grid(alpha=0.3)
    handles, labels = ax_reward.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)  # below the axes, off the data
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: list[dict]) -> str:
    header = ["run", "accuracy", "mean length", "length inflation", "tokens/s", "wall time (s)",
              "zero-gradient rows skipped"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:
        lines.append(" | ".join([
            r["run"], f"{r['accuracy']:.3f}", f"{r['mean_length']:.2f}", f"{r['inflation']:+.1%}",
            "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.0f}",
            "-" if r["wall_time"] is None else f"{r['wall_time']:.1f}",
            "-" if r.get("skipped_fraction") is None else f"{r['skipped_fraction']:.0%}",
        ]))
    return "\n".join(lines)


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
    from gfpo_kernels.env_report import _PACKAGES, _version  # the versions the env report prints, read alike

    machine = {"cpu": _cpu_model(), "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if hasattr(os, "getloadavg"):
        machine["load_average_1min_at_start"] = round(os.getloadavg()[0], 2)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _git_commit(), "python": platform.python_version(),
            "versions": {name: _version(name) for name in _PACKAGES}, "machine": machine}


def run_demo(settings: DemoSettings, output_dir: str = "gfpo_demo_output", use_kernels: bool = True,
             verbose: bool = False) -> dict:
    """Warm-up, then GRPO and the two GFPO filters; prints the table, writes demo.png, results.json, the warm-up
    model (`warmup_model/`) and each run's final model (`grpo/`, `gfpo-length/`, `gfpo-token-efficiency/`)."""
    os.makedirs(output_dir, exist_ok=True)
    if not verbose:  # transformers' deprecation notices about TRL's calls would bury the progress bars
        warnings.filterwarnings("ignore", category=FutureWarning)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    environment = run_environment(device)
    torch.manual_seed(settings.seed)
    tokenizer = make_tokenizer()
    train_pairs, eval_pairs = _split_prompts(settings)
    model = make_tiny_model(tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                            seed=settings.seed).to(device)
    t0 = time.perf_counter()
    warm_up(model, tokenizer, train_pairs, settings, device)
    warmup_time = time.perf_counter() - t0
    start_dir = os.path.join(output_dir, "warmup_model")
    model.save_pretrained(start_dir)
    tokenizer.save_pretrained(start_dir)
    base = evaluate(model, tokenizer, eval_pairs, settings, device, "evaluate warm-up model")

    s = settings
    configs = {
        "grpo": dict(num_generations=s.grpo_generations),
        "gfpo-length": dict(num_generations=s.gfpo_generations, num_remains_in_group=s.gfpo_keep, group_filter="length"),
        "gfpo-token-efficiency": dict(num_generations=s.gfpo_generations, num_remains_in_group=s.gfpo_keep,
                                      group_filter="token_efficiency"),
    }
    runs, rows = {}, [dict(run="warm-up", **base, inflation=0.0, tokens_per_second=None, wall_time=warmup_time)]
    for name, gfpo in configs.items():
        if verbose:
            print(f"\n== {name}: {gfpo}")
        torch.manual_seed(settings.seed)
        run = run_rl(name, start_dir, tokenizer, train_pairs, settings, output_dir, use_kernels, verbose, **dict(gfpo))
        result = evaluate(run["trainer"].model, tokenizer, eval_pairs, settings, device, f"evaluate {name}")
        runs[name] = run
        skipped = [h["gfpo/skipped_zero_gradient_fraction"] for h in run["history"]
                   if "gfpo/skipped_zero_gradient_fraction" in h]
        rows.append(dict(run=name, **result, inflation=result["mean_length"] / base["mean_length"] - 1,
                         tokens_per_second=run["tokens_per_second"], wall_time=run["wall_time"],
                         skipped_fraction=sum(skipped) / len(skipped) if skipped else None))
    table = format_table(rows)
    print("\n" + table)
    plot_path = os.path.join(output_dir, "demo.png")
    _plot(runs, plot_path)
    results = {"environment": environment, "settings": dataclasses.asdict(settings), "rows": rows,
               "history": {name: run["history"] for name, run in runs.items()}}
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    versions = environment["versions"]
    print(f"\nplot: {plot_path}\nresults: {os.path.join(output_dir, 'results.json')} (commit {environment['commit']}, "
          f"torch {versions['torch']}, trl {versions['trl']}, {environment['machine']['device']} on "
          f"{environment['machine']['cpu_cores']} cores of {environment['machine']['cpu']})")
    return {"rows": rows, "table": table, "plot": plot_path}
