"""The length study's runs: arms, sizes, one arm's training and evaluation, a seed's runs, the study and its pieces.

Each arm (ARMS) trains from the same warm-up weights with the same prompts, steps and seed as every other arm of its
seed, on a task of gfpo_study/sums_task.py (TASKS), and is evaluated on held-out prompts: accuracy and length of
sampled answers, their form, and the curves during training. `run_study` runs arms x seeds and writes study.json;
a study too long for one sitting runs in pieces (seed ranges) that `merge_studies` joins into one study file. The
statistics are gfpo_study/study_stats.py's, the tables, verdict and plot gfpo_study/study_report.py's; the
one-seed demo is gfpo_study/demo.py.
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
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

__all__ = ["ARMS", "DEMO_ARMS", "STUDY_ARMS", "Arm", "DemoSettings", "merge_studies", "run_arm", "run_seed",
           "run_study"]

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
    from gfpo_trainer.config import GFPOConfig

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

    from gfpo_trainer.trainer import GFPOTrainer

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
def _task_name(task_fields: dict) -> str | None:
    """The name in sums_task.TASKS of the task with these fields (a study.json's settings["task"]); None for a task
    made by hand. The tasks' field sets tell their classes apart."""
    as_json = json.loads(json.dumps(task_fields))
    return next((name for name, task in TASKS.items() if json.loads(json.dumps(dataclasses.asdict(task))) == as_json),
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


def announce_overwrite(output_dir: str, results_file: str) -> None:
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


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))


@contextlib.contextmanager
def future_warnings_hidden(hidden: bool):
    """FutureWarnings ignored inside the block where `hidden` (transformers' deprecation notices about TRL's calls
    would bury the progress bars); the caller's warning filters are restored after it."""
    with warnings.catch_warnings():
        if hidden:
            warnings.simplefilter("ignore", FutureWarning)
        yield




def _check_arms(arms) -> None:
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"arms={tuple(arms)!r}: unknown arms {unknown}; choices: {list(ARMS)}")


def run_study(settings: DemoSettings, seeds, output_dir: str = "gfpo_study_output", arms=STUDY_ARMS,
              use_kernels: bool = True, verbose: bool = False) -> dict:
    """Every arm on every seed (warm-up per seed, arms in turn, so they share the machine's load); study.json is
    written after each seed, so an interrupted study keeps its finished seeds. With 2 seeds or more, then the summary,
    the report and the plot (finish_study); one seed is a piece of a study, for merge_studies.

    Returns:
        {"study": what study.json holds, "summary", "report", "verdict"} (the last three None for a piece).
    """
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds=[]: the study needs at least 1 seed")
    _check_arms(arms)
    announce_overwrite(output_dir, "study.json")
    os.makedirs(output_dir, exist_ok=True)
    environment = run_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    fields = dataclasses.asdict(settings)
    study = {"environment": environment, "settings": fields, "task": _task_name(fields["task"]), "seeds": seeds,
             "arms": list(arms), "seed_results": []}
    for seed in tqdm(seeds, desc="study: seeds", unit="seed"):
        with future_warnings_hidden(not verbose):
            study["seed_results"].append(run_seed(settings, seed, arms, os.path.join(output_dir, f"seed-{seed}"),
                                                  use_kernels, verbose))
        write_json(os.path.join(output_dir, "study.json"), study)
    environment["wall_time_seconds"] = round(time.perf_counter() - start, 1)
    if hasattr(os, "getloadavg"):
        environment["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    write_json(os.path.join(output_dir, "study.json"), study)
    if len(seeds) < 2:
        print(f"\n1 seed: a piece of a study, no intervals. Its runs: {os.path.join(output_dir, 'study.json')}; "
              "join pieces with  python -m gfpo_trainer demo --merge PIECE_DIR ... --output-dir DIR")
        return {"study": study, "summary": None, "report": None, "verdict": None}
    return finish_study(study, output_dir)


# the fields that must agree for pieces to make one study
_PIECE_FIELDS = ("settings", "task", "arms")


def merge_studies(piece_dirs, output_dir: str) -> dict:
    """Joins pieces of one study (run_study's output folders, each a range of seeds) into one study file: their runs
    in seed order, each piece's environment under environment["pieces"]; then finish_study.

    Raises:
        ValueError: a piece without study.json or with unfinished seeds, pieces of different settings, tasks or arms
            (naming the piece and the field), a seed in two pieces, fewer than 2 seeds in all.
    """
    pieces = []
    for piece_dir in piece_dirs:
        piece = _read_piece(piece_dir)
        done = [r["seed"] for r in piece["seed_results"]]
        if done != piece["seeds"]:
            missing = [s for s in piece["seeds"] if s not in done]
            raise ValueError(f"{piece_dir}: seeds {missing} of {piece['seeds']} have no results (the run stopped "
                             "early); run them again as a piece of their own")
        pieces.append((piece_dir, piece))
    if not pieces:
        raise ValueError("no pieces given")
    first_dir, first = pieces[0]
    for piece_dir, piece in pieces[1:]:
        for field in _PIECE_FIELDS:
            if piece.get(field) != first.get(field):
                raise ValueError(f"{piece_dir} and {first_dir} differ in {field}: {piece.get(field)!r} against "
                                 f"{first.get(field)!r}; pieces of one study share their {', '.join(_PIECE_FIELDS)}")
    seen = {}
    for piece_dir, piece in pieces:
        for seed in piece["seeds"]:
            if seed in seen:
                raise ValueError(f"seed {seed} is in two pieces: {seen[seed]} and {piece_dir}")
            seen[seed] = piece_dir
    if len(seen) < 2:
        raise ValueError(f"the pieces hold {len(seen)} seed; the study needs at least 2 for its intervals")
    results = sorted((r for _, piece in pieces for r in piece["seed_results"]), key=lambda r: r["seed"])
    environment = run_environment(torch.device("cpu"))
    environment["pieces"] = [{"dir": d, "seeds": p["seeds"], **p["environment"]} for d, p in pieces]
    study = {"environment": environment, **{field: first.get(field) for field in _PIECE_FIELDS},
             "seeds": [r["seed"] for r in results], "seed_results": results}
    announce_overwrite(output_dir, "study.json")
    os.makedirs(output_dir, exist_ok=True)
    return finish_study(study, output_dir)


def _read_piece(piece_dir: str) -> dict:
    """A piece's study.json, its task named (read off its settings where the piece predates the name)."""
    path = os.path.join(piece_dir, "study.json")
    try:
        with open(path) as f:
            piece = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{piece_dir}: no study.json there; a piece is the --output-dir of a "
                         "`demo --seeds` run") from None
    if piece.get("task") is None:  # written before study.json named its task
        piece["task"] = _task_name(piece["settings"]["task"])
    return piece


def reevaluate_final_models(piece_dir: str) -> list[dict]:
    """The held-out evaluation of a piece's saved models (the warm-up model and each arm's final model, per seed)
    again, as the run evaluated them (same prompts, samples, temperature and seed), for the figures its runs did not
    record (the stepwise answers apart: every step written or some skipped, with filler or without).

    Returns:
        one {"seed", "warm-up": evaluate's figures, "arms": {name: {"final": figures}}} per seed.
    Raises:
        ValueError: where a model's accuracy or length differs from what the run recorded (not the same answers).
    """
    from transformers import AutoModelForCausalLM

    piece = _read_piece(piece_dir)
    task = TASKS[piece["task"]] if piece["task"] else SumsTask(**{  # a task made by hand (tests' smoke sizes)
        key: tuple(value) if isinstance(value, list) else value for key, value in piece["settings"]["task"].items()})
    settings = DemoSettings(**{**piece["settings"], "task": task})
    tokenizer = make_tokenizer()
    _, held_out = settings.task.split(settings.eval_prompts, settings.held_out_seed)
    results = []
    for recorded in piece["seed_results"]:
        seed, result = recorded["seed"], {"seed": recorded["seed"], "arms": {}}
        for name in ["warm-up", *piece["arms"]]:
            model_dir = os.path.join(piece_dir, f"seed-{seed}", "warmup_model" if name == "warm-up" else name)
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            figures = evaluate(model, tokenizer, settings.task, held_out, settings.max_completion_length, "cpu",
                               samples=settings.eval_samples, temperature=settings.eval_temperature, seed=seed,
                               desc=f"evaluate {name}, seed {seed}")
            before = recorded["warm-up"] if name == "warm-up" else recorded["arms"][name]["final"]
            if (figures["accuracy"], figures["mean_length"]) != (before["accuracy"], before["mean_length"]):
                raise ValueError(f"{model_dir}: accuracy {figures['accuracy']} and length {figures['mean_length']} "
                                 f"now, {before['accuracy']} and {before['mean_length']} when it ran: not the same "
                                 "answers (another torch, thread count or device?)")
            if name == "warm-up":
                result["warm-up"] = figures
            else:
                result["arms"][name] = {"final": figures}
        results.append(result)
    return results


def _paper_tables() -> dict | None:
    """docs/demo/gfpo-paper-tables.json where this runs from a checkout, else None."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "demo",
                        "gfpo-paper-tables.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def finish_study(study: dict, output_dir: str) -> dict:
    """The summary over seeds (study_stats.summarize), the report and verdict (study_report), the plot; writes
    study.json (the runs and the summary), study.md and study.png into `output_dir` and says so."""
    from .study_report import plot_study, study_report, study_verdict
    from .study_stats import summarize

    arms, seeds = study["arms"], study["seeds"]
    summary = summarize(study["seed_results"], arms, kept_shares={
        name: ARMS[name].num_remains_in_group / ARMS[name].num_generations for name in arms
        if ARMS[name].num_remains_in_group is not None and ARMS[name].adaptive_num_remains is None
        and not ARMS[name].loss_includes_rejected and ARMS[name].group_filter == "length"})
    study = {**study, "summary": summary}
    report = study_report(summary, len(seeds), _paper_tables(), ARMS)
    verdict = study_verdict(summary, len(seeds))
    paths = {name: os.path.join(output_dir, name) for name in ("study.json", "study.md", "study.png")}
    write_json(paths["study.json"], study)
    with open(paths["study.md"], "w") as f:
        f.write(report + "\n")
    plot_study(study["seed_results"], summary, paths["study.png"])
    print("\n" + report)
    models = "each piece's seed-*/" if "pieces" in study["environment"] else f"{output_dir}/seed-*/"
    print(f"\nwritten: {paths['study.md']} (the tables and the verdict), {paths['study.json']} (every run per seed, "
          f"and the summary), {paths['study.png']} (the plot); the models under {models}")
    return {"study": study, "summary": summary, "report": report, "verdict": verdict}
