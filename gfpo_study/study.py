"""The length study's runs: one (arm, seed) run, the study over arms x seeds, its pieces and their merge.

Every arm of a seed trains from the same start weights (the config's model, or what its start function builds for
the seed), on the same prompts in the same order for the same steps, with the seed's generator, and is evaluated on
the same held-out prompts with the same sampling seed; the starting model is evaluated once per seed (the length
ELR measures from). Each run is written when it finishes, `<output_dir>/seed-<s>/<arm>.json` (the starting model's
figures: `start.json`), so a rerun skips finished runs and trains again those killed part-way, from their latest
complete checkpoint where the config asked for checkpoints (`checkpoint_every`, now or before); pieces (a selection
of seeds and arms) run on different machines and `merge_studies` joins their folders. With every run of the config
done and 2 seeds or more: study.json (the runs and the summary), study.md and study.png. The statistics are
gfpo_study/study_stats.py's, the tables, verdict and plot gfpo_study/study_report.py's; the config
gfpo_study/config.py's; the one-seed demo is gfpo_study/demo.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
import warnings

import torch

from gfpo_trainer.cli import CHECKPOINT_PREFIX, checkpoint_folders

from .config import ARMS, Arm, ConfigError, StudyConfig, function_spec, is_function_spec, parse_study_config
from .sums_task import SumsTask, TASKS

__all__ = ["ARMS", "DEMO_ARMS", "STUDY_ARMS", "Arm", "DemoSettings", "StudyConfig", "finish_study", "merge_studies",
           "run_study", "study_config", "sums_config"]

DEMO_ARMS = ("grpo", "shortest-8of16")
STUDY_ARMS = tuple(a for a in ARMS if a != "shortest-8of16-paper-objective")
CONFIG_FILE = "study-config.json"  # the config an output folder's runs belong to
START_FILE = "start.json"
# the study's own state of a run, in each of its checkpoints, written last: a checkpoint folder without it is one
# killed while it was being saved
CHECKPOINT_STATE = "study_state.json"


@dataclasses.dataclass
class DemoSettings:
    """Sizes of the sums study (configs/sums.yaml is `quick()`): the default, `quick()` (fewer warm-up and RL steps:
    the study's sizes) and `smoke()` (seconds: every stage runs, the figures mean nothing; for tests). `sums_config`
    turns them into a study config. Times by machine and load: docs/demo.md."""

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


def _task_spec(task: SumsTask):
    """A task's name in TASKS, or its fields where it is none of them (the smoke sizes)."""
    if type(task) is not SumsTask and task not in TASKS.values():
        raise ValueError(f"task={task!r}: a task of its own must be a SumsTask (its fields go into the config)")
    return next((name for name, t in TASKS.items() if t == task), None) or dataclasses.asdict(task)


def sums_config(settings: DemoSettings, seeds="0-4", arms=STUDY_ARMS, output_dir: str | None = None,
                use_kernels: bool = True) -> dict:
    """The sums study at `settings` as a study config (a dict as the YAML file holds it): the tiny model warmed up
    per seed, the sums task's prompts, its correctness reward. configs/sums.yaml is sums_config(quick()) with the
    seeds 0-4 and every arm but the paper's objective."""
    task = _task_spec(settings.task)
    split = dict(task=task, eval_prompts=settings.eval_prompts, held_out_seed=settings.held_out_seed)
    return {
        "model": {"function": "gfpo_study.sums_task:start_model", "warmup_steps": settings.warmup_steps,
                  "warmup_batch": settings.warmup_batch, "hidden_size": settings.hidden_size,
                  "num_layers": settings.num_layers, **split},
        "dataset": {"function": "gfpo_study.sums_task:training_prompts", **split},
        "reward_funcs": ["gfpo_study.sums_task:correctness_reward"],
        "args": {"max_completion_length": settings.max_completion_length, "learning_rate": settings.learning_rate,
                 "lr_scheduler_type": "constant", "save_strategy": "no", "report_to": "none",
                 "bf16": False, "loss_type": "dapo", "beta": 0.0,
                 "temperature": 1.0, "use_gfpo_kernels": use_kernels},
        "eval": {"dataset": {"function": "gfpo_study.sums_task:held_out_prompts", **split},
                 "correct": "gfpo_study.sums_task:correctness_reward",
                 "details": {"function": "gfpo_study.sums_task:answer_figures", "task": task},
                 "samples": settings.eval_samples, "temperature": settings.eval_temperature,
                 "max_tokens": settings.max_completion_length, "curve_samples": 2},
        "arms": list(arms), "seeds": seeds, "steps": settings.rl_steps, "eval_every": settings.eval_every,
        "prompts_per_step": settings.prompts_per_step, **({} if output_dir is None else {"output_dir": output_dir}),
    }


def study_config(config: dict, base_dir: str | None = None) -> StudyConfig:
    """gfpo_study.config.parse_study_config, relative paths read from `base_dir` (default: the working folder)."""
    return parse_study_config(config, base_dir or os.getcwd())


# ------------------------------------------------------------------ files
def write_json(path: str, data: dict) -> None:
    """`data` as JSON into `path`, whole or not at all (written beside it, then renamed): a run killed while writing
    leaves no half file that a rerun would take for a finished run."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _first_difference(a, b, path: str = "") -> tuple[str, object, object] | None:
    """The first (dotted key, value in a, value in b) where two JSON values differ, None where they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    return None if a == b else (path or "(the whole config)", a, b)


def claim_output_dir(output_dir: str, identity: dict, main_process: bool = True, base_dir: str | None = None,
                     plan: dict | None = None) -> None:
    """Makes `output_dir` this config's, or checks that it is: a folder holding another config's runs is a
    ConfigError naming the first differing field and both values; nothing there is touched. The file also records
    the config file's folder (`base_dir`), from which its relative paths are read, and `plan`, the config's
    {"seeds", "arms"} (merged with those recorded before: a later session may list more), so that a merge can say
    which of them no piece holds."""
    path = os.path.join(output_dir, CONFIG_FILE)
    held = _read_json(path)
    if held is None:
        if main_process:
            os.makedirs(output_dir, exist_ok=True)
            write_json(path, {"config": identity, "base_dir": base_dir, **({"plan": plan} if plan else {})})
        return
    found = _first_difference(identity, held.get("config"))
    if found:
        key, ours, theirs = found
        raise ConfigError(f"output_dir {output_dir} holds the runs of another study config: {key} is {theirs!r} "
                          f"there and {ours!r} here; give another output_dir (its runs stay as they are)")
    if main_process and plan:
        joined = _joined_plans([held.get("plan"), plan])
        if joined != held.get("plan"):
            write_json(path, {**held, "plan": joined})


def _joined_plans(plans) -> dict | None:
    """The union of recorded plans ({"seeds", "arms"}; None for a folder written before plans were recorded): seeds
    sorted, arms in first-seen order; None where no plan is recorded."""
    plans = [p for p in plans if p]
    if not plans:
        return None
    return {"seeds": sorted({s for p in plans for s in p["seeds"]}),
            "arms": list(dict.fromkeys(a for p in plans for a in p["arms"]))}


def read_output_dir(output_dir: str) -> dict:
    """An output folder's study-config.json: {"config": the identity, "base_dir", "plan": the config's seeds and
    arms (absent in folders of older versions)}; a ConfigError where there is none."""
    held = _read_json(os.path.join(output_dir, CONFIG_FILE))
    if held is None:
        raise ConfigError(f"{output_dir}: no {CONFIG_FILE} there; a piece is the output folder of a `python -m "
                          "gfpo_study run` (its --output-dir)")
    return held


def _seed_files(output_dir: str):
    """(seed, file name, path) of each JSON file in an output folder's `seed-<s>/` folders (the run files and
    start.json; a write's leftover `.tmp-` skipped), in folder and name order. A `seed-` folder whose suffix is no
    number is a ConfigError naming it."""
    for entry in sorted(os.listdir(output_dir)):
        folder = os.path.join(output_dir, entry)
        if not entry.startswith("seed-") or not os.path.isdir(folder):
            continue
        if not entry[len("seed-"):].isdigit():
            raise ConfigError(f"{folder}: a study's seed folders are seed-<number>, as run writes them; move this "
                              f"one out of {output_dir}")
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json") and ".tmp-" not in name:
                yield int(entry[len("seed-"):]), name, os.path.join(folder, name)


def _run_file(output_dir: str, seed: int, arm: str) -> str:
    return os.path.join(output_dir, f"seed-{seed}", f"{arm}.json")


def _check_run_definition(path: str, record: dict, arm: Arm) -> None:
    found = _first_difference(arm.definition(), record.get("definition"))
    if found:
        key, ours, theirs = found
        raise ConfigError(f"{path}: arm {arm.name!r} ran with {key}={theirs!r}, the config now says {ours!r}; give "
                          "the changed arm another name (the finished run stays)")


# ------------------------------------------------------------------ a run's checkpoints
@dataclasses.dataclass
class Resume:
    """A run's latest complete checkpoint: its step, its folder and the study's state of the run there (the curve
    points so far, the time spent up to it)."""

    step: int
    folder: str
    state: dict


def run_key(config: StudyConfig, arm: Arm, seed: int, num_processes: int) -> dict:
    """What a checkpoint must have been made with to be resumed by this run: the study config, the arm's definition,
    the seed and the number of processes (each process's generator state is in the checkpoint)."""
    return json.loads(json.dumps({"identity": config.identity, "definition": arm.definition(), "seed": seed,
                                  "num_processes": num_processes}, default=str))


def find_resume(run_dir: str, key: dict, arm: str, seed: int) -> Resume | None:
    """The latest complete checkpoint of the run whose folder is `run_dir` (one holding the study's state, written
    after everything else of it), None where it has none. Folders killed while being saved are passed over.

    Raises:
        ConfigError: that checkpoint was made with another config, arm definition, seed or number of processes
            (naming the field and both values): resuming it would mix two runs.
    """
    for step, folder in reversed(checkpoint_folders(run_dir)):
        state = _read_json(os.path.join(folder, CHECKPOINT_STATE))
        if state is None:
            continue
        found = _first_difference(key, state.get("run"))
        if found:
            field, ours, theirs = found
            raise ConfigError(f"{folder}: a checkpoint of {arm} seed {seed} made with {field}={theirs!r}; this run "
                              f"has {ours!r}, and resuming it would mix the two; remove {run_dir} to train the run "
                              "from its start, or give a changed arm another name")
        return Resume(step, folder, state)
    return None


def remove_checkpoints(run_dir: str, before: int | None = None, incomplete: bool = True) -> None:
    """Removes the checkpoint folders of a run (those of steps below `before`, where given); with `incomplete` False,
    only the study's own (those holding its state): without checkpoint_every, checkpoints that args.save_strategy
    asked for are the user's."""
    for step, folder in checkpoint_folders(run_dir):
        if (before is None or step < before) and (incomplete or os.path.exists(os.path.join(folder,
                                                                                          CHECKPOINT_STATE))):
            shutil.rmtree(folder, ignore_errors=True)


def remove_incomplete_checkpoints(run_dir: str) -> list:
    """Removes the checkpoint folders without the study's state (killed while being saved; the resumed run saves
    those steps again); returns their steps."""
    removed = []
    for step, folder in checkpoint_folders(run_dir):
        if not os.path.exists(os.path.join(folder, CHECKPOINT_STATE)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(step)
    return removed


# ------------------------------------------------------------------ one seed's data
def _start_model(config: StudyConfig, seed: int, seed_dir: str, state) -> str:
    """The model folder every arm of `seed` starts from: the config's model, or the start function's folder for the
    seed (built once, by the main process, while the others wait)."""
    from gfpo_trainer.cli import resolve_model

    spec = config.train["model"]
    if not is_function_spec(spec):
        return resolve_model(spec, config.base_dir)
    folder = os.path.join(seed_dir, "start_model")
    done = os.path.join(folder, ".complete")
    with state.main_process_first():
        if state.is_main_process and not os.path.exists(done):
            # built beside it, then renamed into place: a build killed part-way, or another piece building the same
            # seed's start into a shared folder, never leaves a half model that a run would start from
            building = f"{folder}.tmp-{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            built = function_spec("model", spec, config.base_dir)(seed=seed, output_dir=building)
            if os.path.abspath(built) != os.path.abspath(building):
                raise ConfigError(f"model: the start function returned {built!r}; it must save the model into the "
                                  f"output_dir it is given ({building}) and return it")
            open(os.path.join(building, ".complete"), "w").close()
            if not os.path.exists(done):
                shutil.rmtree(folder, ignore_errors=True)  # a build killed before its rename
                try:
                    os.rename(building, folder)
                except OSError:  # another piece's build got there first: the same seed, the same model
                    if not os.path.exists(done):
                        raise
            shutil.rmtree(building, ignore_errors=True)
    return folder


def _rows(spec, split: str, config: StudyConfig, dataset_config: str | None = None, **call) -> list:
    """The rows (dicts with a "prompt") of a data spec: a file or hub name (read as `train` reads its data set, its
    `prompt:` key building the prompts), or a function called with `call` as keyword arguments."""
    if is_function_spec(spec):
        rows = function_spec("dataset", spec, config.base_dir)(**call)
        rows = rows.to_list() if hasattr(rows, "to_list") else list(rows)
    else:
        from gfpo_trainer import cli as train_cli

        kwargs = {"prompt": config.train["prompt"]} if config.train.get("prompt") is not None else {}
        if dataset_config is not None:
            kwargs["config_name"] = dataset_config
        dataset = train_cli.load_train_dataset(spec, split, config.base_dir, **kwargs)
        rows = dataset.to_list()
    if not rows or not all(isinstance(r, dict) and "prompt" in r for r in rows):
        raise ConfigError(f"dataset {spec!r}: no rows with a 'prompt' column")
    return rows


def training_rows(config: StudyConfig, seed: int) -> list:
    """The prompts of `seed`'s runs, steps x prompts_per_step rows in training order: the start function's rows, or
    the data set's rows in an order drawn with `seed` (one pass after another, each shuffled, as many as needed)."""
    needed = config.steps * config.prompts_per_step
    spec = config.train["dataset"]
    if is_function_spec(spec):
        rows = _rows(spec, "train", config, seed=seed, rows=needed)
        if len(rows) != needed:
            raise ConfigError(f"dataset: the function returned {len(rows)} rows for seed {seed}; the study asked for "
                              f"{needed} (steps x prompts_per_step)")
        return rows
    rows = _rows(spec, config.train.get("dataset_split", "train"), config, config.train.get("dataset_config"))
    rng, order = random.Random(seed), []
    while len(order) < needed:
        one_pass = list(range(len(rows)))
        rng.shuffle(one_pass)
        order.extend(one_pass)
    return [rows[i] for i in order[:needed]]


def eval_rows(config: StudyConfig) -> list:
    """The held-out rows (eval.dataset, its split and configuration; the config's `prompt:` key builds their
    prompts as it builds the training prompts); an error names eval, whose split or file it is."""
    try:
        return _rows(config.eval.dataset, config.eval.dataset_split, config, config.eval.dataset_config)
    except ConfigError as error:
        raise ConfigError(f"eval: {error}") from None


def warn_overlap(train: list, held_out: list, seed: int | None = None) -> int:
    """Warns where held-out prompts are also training prompts (the held-out figures would then measure recall),
    naming `seed` where given (whose prompts `train` are); returns how many held-out prompts are."""
    seen = {json.dumps(r["prompt"], sort_keys=True) for r in train}
    shared = [r for r in held_out if json.dumps(r["prompt"], sort_keys=True) in seen]
    if shared:
        whose = f"seed {seed}: " if seed is not None else ""
        warnings.warn(f"{whose}{len(shared)} of the {len(held_out)} held-out prompts are also training prompts (the "
                      f"first: {shared[0]['prompt']!r}): held-out accuracy there measures what training saw",
                      stacklevel=2)
    return len(shared)


# ------------------------------------------------------------------ evaluation
def eval_max_tokens(config: StudyConfig) -> int | None:
    """The held-out answers' token limit: eval.max_tokens, else the max_completion_length of the config's args
    (GFPOConfig's default where they set none). One limit for every arm, the starting model and every piece: an arm
    that sets its own max_completion_length trains with it, and is evaluated as the others are."""
    if config.eval.max_tokens is not None:
        return config.eval.max_tokens
    from gfpo_trainer import cli as train_cli
    from gfpo_trainer.config import GFPOConfig

    args = train_cli._convert_args(dict(config.train.get("args") or {}))
    if "max_completion_length" in args:
        return args["max_completion_length"]
    return next(f.default for f in dataclasses.fields(GFPOConfig) if f.name == "max_completion_length")


class Evaluator:
    """The held-out evaluation of the config: sampled answers, the correctness function, the details function."""

    def __init__(self, config: StudyConfig, rows: list, max_tokens: int):
        self.config, self.rows, self.max_tokens = config, rows, max_tokens
        spec = config.eval
        self.correct = function_spec("eval.correct", spec.correct, config.base_dir)
        self.details = None if spec.details is None else function_spec("eval.details", spec.details, config.base_dir)
        self.seconds = 0.0

    def __call__(self, model, tokenizer, seed: int, samples: int) -> dict:
        """The evaluation with `model`'s own generate (HF)."""
        from .evaluation import sample_answers

        start = time.perf_counter()
        answers, lengths = sample_answers(model, tokenizer, [r["prompt"] for r in self.rows], samples=samples,
                                          temperature=self.config.eval.temperature, max_tokens=self.max_tokens,
                                          seed=seed, batch_size=self.config.eval.batch_size)
        return self._figures(answers, lengths, samples, start)

    def on_engine(self, trainer, tokenizer, seed: int, samples: int) -> dict:
        """The evaluation through `trainer`'s colocated vLLM engine, its weights first synced from the trained
        model as TRL syncs them before it generates (engine_with_trained_weights), every prompt's answers seeded from
        `seed` (sample_answers_vllm). On one process: run_study refuses several with vLLM."""
        from .evaluation import _eos_ids, sample_answers_vllm

        start = time.perf_counter()
        llm = engine_with_trained_weights(trainer)
        answers, lengths = sample_answers_vllm(
            llm, tokenizer, [r["prompt"] for r in self.rows], samples=samples,
            temperature=self.config.eval.temperature, max_tokens=self.max_tokens, seed=seed,
            eos_token_ids=_eos_ids(trainer.model, tokenizer), device=trainer.accelerator.device)
        return self._figures(answers, lengths, samples, start)

    def _figures(self, answers: list, lengths: list, samples: int, start: float) -> dict:
        from .evaluation import figures, score_answers

        correct = score_answers(self.correct, self.rows, answers, samples, self.config.eval.threshold)
        result = figures(correct, lengths)
        if self.details is not None:
            prompts = [r["prompt"] for r in self.rows for _ in range(samples)]
            result = {**result, **self.details(prompts, answers, lengths, correct)}
        self.seconds += time.perf_counter() - start
        return result


def engine_with_trained_weights(trainer):
    """`trainer`'s colocated `vllm.LLM`, holding the trained model's weights: where the engine has not been loaded at
    this step, TRL's own sync (`vllm_generation.sync_weights`, which also resets the prefix cache), marked done for
    the step as TRL marks it, so training's next generation at this step finds it done (the same weights) and loads
    none again."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or not hasattr(trainer, "_last_loaded_step") or getattr(generation, "llm", None) is None:
        from gfpo_trainer._compat import TRLSurfaceError

        raise TRLSurfaceError("this TRL's colocated vLLM generation has no vllm_generation.llm, sync_weights and "
                              "_last_loaded_step (TRL 1.16's): the study cannot evaluate on its engine")
    if trainer.state.global_step != trainer._last_loaded_step:
        generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step
    return generation.llm


def _load_for_eval(model_dir: str, args):
    """The model as the trainer loads it (TRL's own loader with args.model_init_kwargs: float32 unless a dtype is
    given), on the device training uses."""
    from accelerate import PartialState

    kwargs = dict(args.model_init_kwargs or {})
    kwargs["device_map"] = None  # placed below, as the trainer places its model
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    try:
        from trl.trainer.utils import create_model_from_path
    except ImportError:  # a TRL without it: transformers' loader at TRL's default dtype
        from transformers import AutoModelForCausalLM

        kwargs.setdefault("dtype", torch.float32)
        load = functools.partial(AutoModelForCausalLM.from_pretrained, model_dir, **kwargs)
    else:
        load = functools.partial(create_model_from_path, model_dir, **kwargs)
    try:
        model = load()
    except OSError as error:
        raise _model_error(model_dir, error) from None
    device = torch.device("cpu") if args.use_cpu else PartialState().device
    return model.to(device)


# ------------------------------------------------------------------ one run
def arm_args(config: StudyConfig, arm: Arm, seed: int, output_dir: str, verbose: bool = False,
             num_processes: int = 1):
    """The GFPOConfig of `arm`'s run on `seed`: the config's args, the arm's fields over them, and what the study
    sets: the steps, the seed, prompts_per_step prompts per optimizer step, no shuffling, a log every step."""
    from gfpo_trainer import cli as train_cli
    from gfpo_trainer.config import GFPOConfig

    args = train_cli._convert_args(dict(config.train.get("args") or {}))
    for name in train_cli.PATH_ARGS:
        if isinstance(args.get(name), str) and not (name == "deepspeed" and args[name].lstrip().startswith("{")):
            args[name] = train_cli._in_folder(args[name], config.base_dir)
    fields = {"save_strategy": "no", "report_to": "none", **args, **arm.config_fields()}
    if config.checkpoint_every is not None:  # the checkpoints a rerun resumes (StudyProgress.on_save completes each)
        fields.update(save_strategy="steps", save_steps=config.checkpoint_every)
    accumulation = fields.get("gradient_accumulation_steps", 1)
    rows = config.prompts_per_step * fields["num_generations"]
    per_device, left = divmod(rows, num_processes * accumulation)
    if left:
        raise ConfigError(f"prompts_per_step={config.prompts_per_step}: arm {arm.name!r} trains {rows} completions a "
                          f"step (x num_generations={fields['num_generations']}), which {num_processes} processes x "
                          f"gradient_accumulation_steps={accumulation} do not divide; choose a prompts_per_step "
                          "they do")
    try:
        args = GFPOConfig(**fields, output_dir=output_dir, per_device_train_batch_size=per_device,
                          max_steps=config.steps, seed=seed, shuffle_dataset=False, logging_steps=1,
                          disable_tqdm=not verbose)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"arm {arm.name!r}: {' '.join(str(error).split())}"
                          f"{train_cli.bf16_hint(fields, error)}") from None
    # a run's records (tokens generated and trained, time, learning signal) are read per optimizer step from the
    # generation it trains on: TRL generates every steps_per_generation x num_iterations micro-batches, so a step
    # must generate its own batch, once, or the records of a GFPO arm and GRPO's would count different spans
    if args.steps_per_generation != args.gradient_accumulation_steps or args.num_iterations != 1:
        raise ConfigError(
            f"arm {arm.name!r}: steps_per_generation={args.steps_per_generation} (generation_batch_size="
            f"{args.generation_batch_size}), num_iterations={args.num_iterations} with gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}: the study records every optimizer step from its own generation, "
            "so each step must generate once; leave steps_per_generation, generation_batch_size and num_iterations "
            "unset (docs/study.md)")
    return args


def _model_error(model: str, error: OSError) -> ConfigError:
    """`train`'s line for a model that cannot be loaded: a Hub name without network or cache, a folder without the
    model's files."""
    return ConfigError(f"cannot load model {model!r}: {' '.join(str(error).split())}")


def _signed(func):
    """A reward function giving 2r - 1 for its r: 0/1 rewards in the paper's -1/1 range."""

    def signed(*args, **kwargs):
        return [None if r is None else 2.0 * r - 1.0 for r in func(*args, **kwargs)]

    signed.__name__ = f"signed_{getattr(func, '__name__', 'reward')}"
    return signed


class _RunClock:
    """Where a run's time goes while it trains: building the trainer, the curve's evaluations, saving checkpoints,
    and the rest (training) since `train_start`; `earlier`: the sessions before a resume, up to its checkpoint (what
    they spent after it, until they stopped, is not counted)."""

    def __init__(self, evaluate, earlier: dict | None):
        self.evaluate, self.earlier = evaluate, earlier
        self.eval_before = evaluate.seconds
        self.setup = self.train_start = self.step_end = None
        self.checkpoint = 0.0

    def so_far(self, now: float) -> dict:
        """This session's split up to `now`."""
        curve = self.evaluate.seconds - self.eval_before
        return {"setup": self.setup, "train": now - self.train_start - curve - self.checkpoint, "curve_eval": curve,
                "checkpoint": self.checkpoint}

    def total(self, now: float) -> dict:
        """The run's split up to `now`, the earlier sessions' included."""
        mine = self.so_far(now)
        return {k: mine[k] + (self.earlier or {}).get(k, 0.0) for k in mine}


def _callback(config: StudyConfig, seed: int, evaluate, tokenizer, progress, key: dict, clock: _RunClock,
              resume: Resume | None = None):
    """The held-out curve (every eval_every steps and at the last), the progress bar's steps, and the study's state
    of the run in each checkpoint (the curve so far, the time so far), written when the checkpoint is whole."""
    from transformers import TrainerCallback

    class StudyProgress(TrainerCallback):
        def __init__(self):
            self.trainer = None
            # (step, held-out accuracy, held-out length), the points before a resume from its checkpoint
            self.curve = [] if resume is None else [tuple(point) for point in resume.state["curve"]]
            # the whole held-out figures at the same steps
            self.curve_figures = [] if resume is None else list(resume.state["curve_figures"])

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if step % config.eval_every == 0 or step == config.steps:
                from trl.models.utils import unwrap_model_for_generation

                trainer = self.trainer
                if trainer.use_vllm:
                    figures = evaluate.on_engine(trainer, tokenizer, seed, config.eval.curve_samples)
                else:
                    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
                        figures = evaluate(unwrapped, tokenizer, seed, config.eval.curve_samples)
                model.train()
                self.curve.append((step, figures["accuracy"], figures["mean_length"]))
                self.curve_figures.append({"step": step, **figures})
                progress.postfix(figures)
            if step >= config.steps and config.checkpoint_every is not None:
                control.should_save = False  # the final model is saved right after the last step: no checkpoint
            progress.step(step)
            clock.step_end = time.perf_counter()
            return control

        def on_save(self, args, state, control, **kwargs):
            if config.checkpoint_every is None:  # checkpoints of args.save_strategy: the user's, left as they are
                return
            # every process's part of the checkpoint (its generator state) is on disk before the state marks it whole
            self.trainer.accelerator.wait_for_everyone()
            clock.checkpoint += time.perf_counter() - clock.step_end
            if state.is_world_process_zero:
                written = time.perf_counter()
                folder = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{state.global_step}")
                write_json(os.path.join(folder, CHECKPOINT_STATE), {
                    "run": key, "step": state.global_step, "curve": self.curve, "curve_figures": self.curve_figures,
                    "seconds": clock.total(written)})
                remove_checkpoints(args.output_dir, before=state.global_step)  # the newer one is whole now
                clock.checkpoint += time.perf_counter() - written

    return StudyProgress()


class Progress:
    """One bar over the steps of every run left to do: the run, the step, the time left (tqdm's estimate from the
    steps done, evaluations included). Only the main process shows it."""

    def __init__(self, total_steps: int, show: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, disable=not show, desc="study")
        self.base = 0

    def start(self, label: str, base: int):
        self.base = base
        self.bar.set_description(label, refresh=True)

    def step(self, step: int):
        self.bar.update(self.base + step - self.bar.n)

    def postfix(self, figures: dict):
        self.bar.set_postfix({"held-out acc": f"{figures['accuracy']:.2f}", "len": f"{figures['mean_length']:.1f}"},
                             refresh=False)

    def close(self):
        self.bar.close()


def build_run_trainer(config: StudyConfig, arm: Arm, seed: int, start_dir: str, rows: list, output_dir: str,
                      tokenizer=None, callbacks=(), verbose: bool = False, num_processes: int = 1):
    """The GFPOTrainer of `arm`'s run on `seed`: the model in `start_dir`, the config's reward functions (as 2r - 1
    for a signed arm), arm_args, `rows` in order; the torch generator seeded first, as for every arm of the seed."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from gfpo_trainer.trainer import GFPOTrainer

    torch.manual_seed(seed)
    args = arm_args(config, arm, seed, output_dir, verbose, num_processes)
    try:
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(start_dir)
    except OSError as error:
        raise _model_error(start_dir, error) from None
    reward_funcs = config.reward_funcs if arm.reward == "correct" else [_signed(f) for f in config.reward_funcs]
    try:
        return GFPOTrainer(model=start_dir, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(rows),
                           processing_class=tokenizer, callbacks=list(callbacks))
    except (ValueError, TypeError) as error:  # e.g. a filter without num_remains_in_group
        raise ConfigError(f"arm {arm.name!r}: {' '.join(str(error).split())}") from None


def run_one(config: StudyConfig, arm: Arm, seed: int, start_dir: str, rows: list, evaluate, output_dir: str,
            progress: Progress, verbose: bool = False, num_processes: int = 1, resume: Resume | None = None) -> dict:
    """Trains `arm` on `seed` from `start_dir` (or from `resume`'s checkpoint, the curve points before it from its
    state), evaluates it on the held-out prompts, saves the final model (with the tokenizer) into `output_dir`.
    Returns the held-out figures ("final"), the held-out curve, per step the tokens generated and trained, the step's
    time and learning signal, and the run's time split ("seconds"; a resumed run's: this session's, and the sessions'
    before the resume up to its checkpoint under "before_resume")."""
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    start = time.perf_counter()
    clock = _RunClock(evaluate, None if resume is None else resume.state["seconds"])
    tokenizer = AutoTokenizer.from_pretrained(start_dir)
    callback = _callback(config, seed, evaluate, tokenizer, progress, run_key(config, arm, seed, num_processes),
                         clock, resume)
    trainer = build_run_trainer(config, arm, seed, start_dir, rows, output_dir, tokenizer, [callback], verbose,
                                num_processes)
    args = trainer.args
    callback.trainer = trainer
    if not verbose:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    clock.setup = time.perf_counter() - start
    clock.train_start = time.perf_counter()
    trainer.train(resume_from_checkpoint=None if resume is None else resume.folder)
    trained = clock.so_far(time.perf_counter())  # training's split: the curve's evaluations and checkpoints apart
    save_start = time.perf_counter()
    trainer.save_model()  # the run's one model on disk
    save = time.perf_counter() - save_start
    # every step's, a resumed run's too: its checkpoint's trainer state holds the log of the steps before it
    history = [h for h in trainer.state.log_history if "reward" in h]
    from trl.models.utils import unwrap_model_for_generation

    if trainer.use_vllm:
        final = evaluate.on_engine(trainer, tokenizer, seed, config.eval.samples)
    else:
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
            final = evaluate(unwrapped, tokenizer, seed, config.eval.samples)
    rows_per_step = config.prompts_per_step * args.num_generations
    # TRL's frac_reward_zero_std tests each group's reward std only with scale_rewards "group" or "none" and
    # sum_then_normalize; otherwise it tests the batch's (0 or 1): not the per-group share GFPO's kept rows give
    per_group = args.scale_rewards != "batch" and args.multi_objective_aggregation == "sum_then_normalize"
    signal = [_step_signal(h, per_group) for h in history]
    # where the run's time went: building the trainer, training (the curve's evaluations and the checkpoints inside
    # it), the curve's and the final evaluations, saving the model, saving checkpoints
    seconds = {"setup": trained["setup"], "train": trained["train"], "curve_eval": trained["curve_eval"],
               "final_eval": evaluate.seconds - clock.eval_before - trained["curve_eval"], "save": save}
    if config.checkpoint_every is not None:
        seconds["checkpoint"] = trained["checkpoint"]
    if resume is not None:
        seconds.update(resumed_from_step=resume.step, before_resume=resume.state["seconds"])
    return {"final": final, "curve": callback.curve, "curve_figures": callback.curve_figures,
            "generated_tokens": [_generated_tokens(h, rows_per_step) for h in history],
            "trained_tokens": [_trained_tokens(h, rows_per_step) for h in history],
            "step_time": [h["step_time"] for h in history],
            "train_reward": [s["reward"] for s in signal],
            "train_reward_std": [s["reward_std"] for s in signal],
            "train_frac_reward_zero_std": [s["frac_reward_zero_std"] for s in signal],
            "seconds": seconds}


def _evaluate_start_on_engine(config: StudyConfig, arm: Arm, seed: int, start_dir: str, rows: list, evaluate,
                              seed_dir: str, verbose: bool, num_processes: int) -> dict:
    """The starting model's held-out figures on vLLM: `arm`'s trainer is built on it (its engine, as every run's),
    its weights synced at step 0 and evaluated; it trains nothing and writes nothing."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(start_dir)
    with tempfile.TemporaryDirectory(dir=seed_dir) as scratch:
        trainer = build_run_trainer(config, arm, seed, start_dir, rows, scratch, tokenizer, (), verbose,
                                    num_processes)
        figures = evaluate.on_engine(trainer, tokenizer, seed, config.eval.samples)
    del trainer
    gc.collect()  # its engine goes when nothing holds it (not shut down here: vLLM's shutdown ends the process group)
    return figures


# ------------------------------------------------------------------ the study
def run_study(config: StudyConfig, seeds=None, arms=None, verbose: bool = False) -> dict:
    """The runs of `seeds` x `arms` (default: the config's) not finished yet in config.output_dir, seed after seed,
    the arms of a seed in turn (so they share the machine's load); each run written when it finishes. Then, where
    every run of the config is done and there are 2 seeds or more, the study (finish_study).

    Returns:
        {"ran": [(seed, arm) trained now], "skipped": [(seed, arm) found finished], "study": finish_study's result
        or None while runs are missing, "missing": [(seed, arm) not done yet]}.
    Raises:
        ConfigError: an output folder of another config, an arm that ran with another definition, a selection
            outside the config, an arm whose GFPOConfig is refused (before any run), bad data or functions.
    """
    from accelerate import PartialState

    seeds = list(config.seeds if seeds is None else seeds)
    arms = list(config.arms if arms is None else arms)
    outside = [s for s in seeds if s not in config.seeds]
    if outside:
        raise ConfigError(f"--seeds: {outside} are not among the config's seeds {config.seeds}")
    unknown = [a for a in arms if a not in config.arms]
    if unknown:
        from gfpo_trainer.cli import _did_you_mean

        raise ConfigError(f"--arms: {unknown[0]!r} is not an arm of the config{_did_you_mean(unknown[0], config.arms)}"
                          f"; its arms: {', '.join(config.arms)}")
    if not seeds or not arms:
        which, given = ("--seeds", config.seeds) if not seeds else ("--arms", config.arms)
        raise ConfigError(f"{which}: the selection is empty; give some of the config's "
                          f"({', '.join(map(str, given))}), or leave it out to run them all")
    # processes on CPUs (torchrun, gloo) are one group only where the first PartialState says cpu, as the trainer's
    state = PartialState(cpu=bool(arm_args(config, config.arms[arms[0]], seeds[0], config.output_dir).use_cpu))
    main = state.is_main_process
    # every selected arm's GFPOConfig built now, as its run will build it: an arm the trainer refuses (k >= G, an
    # unknown filter, sizes the processes do not divide) is one error before anything trains, not when its turn comes
    run_args = {name: arm_args(config, config.arms[name], seeds[0], config.output_dir,
                               num_processes=state.num_processes) for name in arms}
    on_vllm = bool(run_args[arms[0]].use_vllm)
    if on_vllm:  # vLLM missing or out of TRL's range: the trainer's one line, before the output folder is claimed
        from gfpo_trainer import cli as train_cli

        train_cli.check_vllm_installed(run_args[arms[0]])
    if on_vllm and state.num_processes > 1:
        raise ConfigError(f"args.use_vllm=true with {state.num_processes} processes: each run's trainer builds its "
                          "own colocated vLLM engine, and vLLM ends the processes' torch process group when an "
                          "engine is released, so they could not synchronise after the first engine; run each "
                          "piece on one process (--seeds/--arms pieces on several GPUs, then merge), or use_vllm: "
                          "false (docs/study.md)")
    claim_output_dir(config.output_dir, config.identity, main, config.base_dir,
                     plan={"seeds": list(config.seeds), "arms": list(config.arms)})
    state.wait_for_everyone()
    held_out = eval_rows(config)
    # every selected seed's prompts (each seed draws its own), checked against the held-out ones before anything trains
    rows_of = {seed: training_rows(config, seed) for seed in seeds}
    if main:
        for seed in seeds:
            warn_overlap(rows_of[seed], held_out, seed)
    evaluate = Evaluator(config, held_out, eval_max_tokens(config))
    todo, skipped, resumes = [], [], {}
    # every checkpoint folder of a run is the study's unless its GFPOConfig asks for checkpoints of its own, which
    # checkpoint_every refuses (parse_study_config) and args keep in every session of the folder: so a session without
    # checkpoint_every clears what an earlier one with it left
    own_checkpoints = {name: config.checkpoint_every is not None or run_args[name].save_strategy == "no"
                       for name in arms}
    for seed in seeds:
        for name in arms:
            path = _run_file(config.output_dir, seed, name)
            record = _read_json(path)
            run_dir = os.path.join(config.output_dir, f"seed-{seed}", name)
            if record is None:
                todo.append((seed, name))
                resume = find_resume(run_dir, run_key(config, config.arms[name], seed, state.num_processes), name,
                                     seed)
                if resume is not None:
                    resumes[(seed, name)] = resume
            else:
                _check_run_definition(path, record, config.arms[name])
                skipped.append((seed, name))
    state.wait_for_everyone()  # every process has looked before the main one removes anything
    if main and skipped:
        print(f"gfpo study: {len(skipped)} run(s) already finished in {config.output_dir}, not run again: "
              + ", ".join(f"{a} seed {s}" for s, a in skipped))
        for seed, name in skipped:  # a run killed after its file was written, before its checkpoints went
            remove_checkpoints(os.path.join(config.output_dir, f"seed-{seed}", name),
                               incomplete=own_checkpoints[name])
    if main:
        for seed, name in (k for k in todo if own_checkpoints[k[1]]):
            removed = remove_incomplete_checkpoints(os.path.join(config.output_dir, f"seed-{seed}", name))
            if removed:
                print(f"gfpo study: {name} seed {seed}: checkpoint(s) at step {', '.join(map(str, removed))} "
                      "were not saved whole (killed while saving): not used, removed")
    if main:
        for (seed, name), resume in resumes.items():
            print(f"gfpo study: resuming {name} seed {seed} from step {resume.step} of {config.steps} "
                  f"({resume.folder})")
    state.wait_for_everyone()
    progress = Progress(sum(config.steps - (resumes[k].step if k in resumes else 0) for k in todo),
                        show=main and not verbose and bool(todo))
    ran = []
    # the bar is closed on an error too, so that the error's line starts a line of its own
    with future_warnings_hidden(not verbose), contextlib.closing(progress):
        for seed in seeds:
            pending = [a for s, a in todo if s == seed]
            start_path = os.path.join(config.output_dir, f"seed-{seed}", START_FILE)
            start_done = os.path.exists(start_path)
            state.wait_for_everyone()  # every process has looked before the main one writes: they decide alike
            if not pending and start_done:
                continue
            seed_dir = os.path.join(config.output_dir, f"seed-{seed}")
            os.makedirs(seed_dir, exist_ok=True)
            start_build = time.perf_counter()
            start_dir = _start_model(config, seed, seed_dir, state)
            start_seconds = time.perf_counter() - start_build
            rows = rows_of[seed]
            if not start_done and on_vllm:  # on the engine of a trainer that never trains
                progress.start(f"seed {seed}: the starting model", progress.bar.n)
                eval_start = evaluate.seconds
                figures = _evaluate_start_on_engine(config, config.arms[arms[0]], seed, start_dir, rows, evaluate,
                                                    seed_dir, verbose, state.num_processes)
                if main:
                    write_json(start_path, {"seed": seed, "model": start_dir, "figures": figures,
                                            "seconds": {"build": start_seconds, "eval": evaluate.seconds - eval_start}})
                state.wait_for_everyone()
            elif not start_done:
                if main:  # no collective here: the main process alone evaluates the starting model
                    progress.start(f"seed {seed}: the starting model", progress.bar.n)
                    from transformers import AutoTokenizer

                    model = _load_for_eval(start_dir, run_args[arms[0]])  # the model-loading args: every arm's
                    eval_start = evaluate.seconds
                    figures = evaluate(model, AutoTokenizer.from_pretrained(start_dir), seed, config.eval.samples)
                    del model
                    write_json(start_path, {"seed": seed, "model": start_dir, "figures": figures,
                                            "seconds": {"build": start_seconds, "eval": evaluate.seconds - eval_start}})
                state.wait_for_everyone()
            for name in pending:
                resume = resumes.get((seed, name))
                done = 0 if resume is None else resume.step  # the bar counts the steps left
                progress.start(f"seed {seed}, {name}" + ("" if resume is None else f" (from step {done})"),
                               progress.bar.n - done)
                load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                run = run_one(config, config.arms[name], seed, start_dir, rows, evaluate,
                              os.path.join(seed_dir, name), progress, verbose, state.num_processes, resume)
                run["load_average_1min_at_start"] = load
                if main:
                    write_json(_run_file(config.output_dir, seed, name),
                               {"seed": seed, "arm": name, "definition": config.arms[name].definition(),
                                "paper": config.arms[name].paper,
                                "environment": run_environment(torch.device("cuda" if torch.cuda.is_available()
                                                                            else "cpu")), "run": run})
                    # the run is in its file now
                    remove_checkpoints(os.path.join(seed_dir, name), incomplete=own_checkpoints[name])
                state.wait_for_everyone()
                ran.append((seed, name))
    missing = missing_runs(config.output_dir, config.seeds, list(config.arms))
    result = {"ran": ran, "skipped": skipped, "missing": missing, "study": None}
    if missing:
        if main:
            print(f"\ngfpo study: {len(ran)} run(s) done now; {len(missing)} of the config's "
                  f"{len(config.seeds) * len(config.arms)} runs are not in {config.output_dir} yet "
                  f"({', '.join(f'{a} seed {s}' for s, a in missing[:6])}{', ...' if len(missing) > 6 else ''}). "
                  "Run the other pieces, then  python -m gfpo_study merge PIECE_DIR ... --output-dir DIR  (or run "
                  "them into this folder: the report comes when every run is there)")
        return result
    if len(config.seeds) < 2:
        if main:
            print(f"\n1 seed: no intervals. Its runs: {config.output_dir}/seed-{config.seeds[0]}/")
        return result
    if main:
        result["study"] = finish_study(assemble_study(config.output_dir, config), config.output_dir, config.arms)
    return result


def missing_runs(output_dir: str, seeds, arms) -> list:
    """The (seed, arm) of `seeds` x `arms` without a finished run (or without its starting model's figures) in
    `output_dir`."""
    return [(s, a) for s in seeds for a in arms if not os.path.exists(_run_file(output_dir, s, a))
            or not os.path.exists(os.path.join(output_dir, f"seed-{s}", START_FILE))]


def assemble_study(output_dir: str, config: StudyConfig | None = None, identity: dict | None = None,
                   seeds=None, arms=None, environment: dict | None = None) -> dict:
    """study.json's runs part (environment, settings, task, arms, seeds, seed_results) from an output folder's
    run files."""
    identity = identity if identity is not None else config.identity
    seeds = list(config.seeds if seeds is None else seeds)
    arms = list(config.arms if arms is None else arms)
    seed_results = []
    for seed in seeds:
        start = _read_json(os.path.join(output_dir, f"seed-{seed}", START_FILE))
        result = {"seed": seed, "warm-up": start["figures"], "warmup_time": start["seconds"]["build"], "arms": {}}
        for name in arms:
            result["arms"][name] = _read_json(_run_file(output_dir, seed, name))["run"]
        seed_results.append(result)
    if environment is None:
        environment = run_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model = identity.get("model")
    task = model.get("task") if isinstance(model, dict) and isinstance(model.get("task"), str) else None
    return {"environment": environment, "settings": identity, "task": task, "arms": arms, "seeds": seeds,
            "seed_results": seed_results}


def merge_studies(piece_dirs, output_dir: str) -> dict:
    """Joins pieces of one study (the output folders of `run` with --seeds / --arms, on other machines) into
    `output_dir`: their run files copied there (the models stay in the pieces), then the study (finish_study).

    Raises:
        ConfigError: a folder that is no study's output, pieces of different configs (naming the piece, the field and
            both values), an arm that ran with two definitions, one run, or one seed's starting model, found with
            different figures in two pieces,
            runs missing for the study's seeds x arms (naming them), an output folder of another config.
    """
    pieces = [(str(piece_dir), read_output_dir(piece_dir)) for piece_dir in piece_dirs]  # each study-config.json
    if not pieces:
        raise ConfigError("no pieces given")
    first_dir, first_held = pieces[0]
    first = first_held["config"]
    for piece_dir, held in pieces[1:]:
        found = _first_difference(held["config"], first)
        if found:
            key, theirs, ours = found
            raise ConfigError(f"{piece_dir} and {first_dir} are pieces of different configs: {key} is {theirs!r} in "
                              f"{piece_dir} and {ours!r} in {first_dir}")
    runs, starts = {}, {}
    for piece_dir, _ in pieces:
        for seed, name, path in _seed_files(piece_dir):
            record = _read_json(path)
            if name == START_FILE:
                if seed in starts and starts[seed][1]["figures"] != record["figures"]:
                    raise ConfigError(
                        f"seed {seed}'s starting model has other figures in {path} than in {starts[seed][0]}: the "
                        "pieces' arms of that seed did not start from one model, or it was evaluated otherwise "
                        "(figures reproduce on one machine and thread count), and ELR would measure one piece's "
                        "arms from another's start; run a seed's arms on one machine, or in one piece")
                starts.setdefault(seed, (path, record))
                continue
            arm = name[: -len(".json")]
            if (seed, arm) in runs:
                other_path, other = runs[(seed, arm)]
                if other["definition"] != record["definition"]:
                    raise ConfigError(f"arm {arm!r} ran with two definitions: {other_path} and {path}")
                if other["run"]["final"] != record["run"]["final"]:
                    raise ConfigError(f"{arm} seed {seed} is in two pieces with different figures: {other_path} "
                                      f"and {path}; keep one (remove the other piece's file)")
                continue
            runs[(seed, arm)] = (path, record)
    seeds = sorted({s for s, _ in runs})
    arms = list(dict.fromkeys(a for _, a in sorted(runs, key=lambda k: (k[0], _arm_order(k[1])))))
    missing = [(s, a) for s in seeds for a in arms if (s, a) not in runs or s not in starts]
    if missing:
        raise ConfigError(f"the pieces lack {len(missing)} run(s) of their seeds x arms: "
                          + ", ".join(f"{a} seed {s}" for s, a in missing) + "; run them (python -m gfpo_study run "
                          "--config ... --seeds S --arms A) and merge again")
    if len(seeds) < 2:
        raise ConfigError(f"the pieces hold {len(seeds)} seed; the study needs at least 2 for its intervals")
    # the config's seeds and arms that no piece holds: the study is of the runs found, said aloud and recorded
    plan = _joined_plans([held.get("plan") for _, held in pieces])
    not_merged = None if plan is None else {"seeds": [x for x in plan["seeds"] if x not in seeds],
                                            "arms": [x for x in plan["arms"] if x not in arms]}
    if not_merged and (not_merged["seeds"] or not_merged["arms"]):
        absent = [f"seed(s) {', '.join(map(str, not_merged['seeds']))}"] if not_merged["seeds"] else []
        absent += [f"arm(s) {', '.join(not_merged['arms'])}"] if not_merged["arms"] else []
        print(f"gfpo study: merge: no piece holds {' or '.join(absent)} of the config; the study is of the "
              f"{len(seeds)} seeds x {len(arms)} arms the pieces hold (merge again with their pieces to add them)")
    claim_output_dir(output_dir, first, base_dir=first_held.get("base_dir"), plan=plan)
    for (seed, arm), (path, record) in runs.items():
        target = _run_file(output_dir, seed, arm)
        if os.path.abspath(target) != os.path.abspath(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write_json(target, record)
    for seed, (path, record) in starts.items():
        target = os.path.join(output_dir, f"seed-{seed}", START_FILE)
        if os.path.abspath(target) != os.path.abspath(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write_json(target, record)
    environment = run_environment(torch.device("cpu"))
    environment["pieces"] = [{"dir": d, "seeds": sorted({s for (s, _), (p, _) in runs.items()
                                                         if p.startswith(os.path.join(d, ""))})} for d, _ in pieces]
    if not_merged and (not_merged["seeds"] or not_merged["arms"]):
        environment["not_merged"] = not_merged  # the config's seeds and arms that no piece held
    study = assemble_study(output_dir, identity=first, seeds=seeds, arms=arms, environment=environment)
    records = {a: runs[(seeds[0], a)][1] for a in arms}
    return finish_study(study, output_dir, {a: _arm_from_definition(a, r["definition"], r.get("paper"))
                                            for a, r in records.items()})


def config_of_output_dir(output_dir: str) -> StudyConfig:
    """The StudyConfig an output folder's runs belong to: its config, with the seeds and arms of its run files."""
    held = read_output_dir(output_dir)
    runs = {(seed, name[: -len(".json")]): _read_json(path) for seed, name, path in _seed_files(output_dir)
            if name != START_FILE}
    arms = {}
    for (_, name), record in sorted(runs.items(), key=lambda k: (k[0][0], _arm_order(k[0][1]))):
        arm = _arm_from_definition(name, record["definition"], record.get("paper"))
        arms.setdefault(name, arm.name if ARMS.get(name) == arm else {
            "name": name, "reward": arm.reward, **({"paper": arm.paper} if arm.paper is not None else {}),
            **{k: v for k, v in arm.config_fields().items() if v is not None and k != "adaptive_difficulty"}})
    config = {**held["config"], "seeds": sorted({s for s, _ in runs}), "arms": list(arms.values()),
              "output_dir": os.path.abspath(output_dir)}
    return parse_study_config(config, held.get("base_dir") or os.getcwd())


def reevaluate_final_models(output_dir: str) -> list[dict]:
    """The held-out evaluation of an output folder's saved models (each seed's starting model and each arm's final
    model) again, as the runs evaluated them (same prompts, samples, temperature and seed): the figures the runs did
    not record, from the config's eval.details function as it is now.

    Returns:
        one {"seed", "warm-up": figures, "arms": {name: {"final": figures}}} per seed.
    Raises:
        ValueError: where a model's accuracy or length differs from what the run recorded (not the same answers).
        ConfigError: a study that generated on vLLM (its answers came from the trainer's engine, not from generate).
    """
    from transformers import AutoTokenizer

    config = config_of_output_dir(output_dir)
    if arm_args(config, next(iter(config.arms.values())), 0, output_dir).use_vllm:
        raise ConfigError(f"{output_dir}: its runs were evaluated on the trainer's vLLM engine (use_vllm); evaluating "
                          "the saved models again with generate would give other answers, not theirs")
    evaluate = Evaluator(config, eval_rows(config), eval_max_tokens(config))
    results = []
    for seed in config.seeds:
        seed_dir = os.path.join(output_dir, f"seed-{seed}")
        start = _read_json(os.path.join(seed_dir, START_FILE))
        result = {"seed": seed, "arms": {}}
        for name in ["warm-up", *config.arms]:
            model_dir = start["model"] if name == "warm-up" else os.path.join(seed_dir, name)
            args = arm_args(config, next(iter(config.arms.values())), seed, seed_dir)
            figures = evaluate(_load_for_eval(model_dir, args), AutoTokenizer.from_pretrained(model_dir), seed,
                               config.eval.samples)
            before = (start["figures"] if name == "warm-up"
                      else _read_json(_run_file(output_dir, seed, name))["run"]["final"])
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


def _arm_order(name: str) -> int:
    return list(ARMS).index(name) if name in ARMS else len(ARMS)


def _arm_from_definition(name: str, definition: dict, paper: str | None = None) -> Arm:
    """The Arm a run file records (its GFPOConfig fields and reward; `paper`: its key in the paper's tables, which
    the file records beside them); a built-in arm keeps its own paper key."""
    if name in ARMS and ARMS[name].definition() == definition:
        return ARMS[name]
    fields = dict(definition["fields"])
    adaptive = fields.pop("adaptive_num_remains", None)
    fields.pop("adaptive_difficulty", None)
    return Arm(name, fields.pop("num_generations"), fields.pop("num_remains_in_group", None),
               fields.pop("group_filter", None), tuple(adaptive) if adaptive else None, definition["reward"], paper,
               bool(fields.pop("loss_includes_rejected", False)), tuple(sorted(fields.items())))


# ------------------------------------------------------------------ records
def _generated_tokens(log: dict, rows: int) -> float:
    """The completion tokens a step generated, every sampled completion as far as it ran (GFPO logs it; GRPO's
    completions/mean_length covers every completion)."""
    return log["gfpo/generated_tokens"] if "gfpo/generated_tokens" in log else log["completions/mean_length"] * rows


def _trained_tokens(log: dict, rows: int) -> float:
    """The completion tokens a step trained on: the kept rows' (GFPO), every row's (GRPO)."""
    if "gfpo/kept_completion_length" in log:
        return log["gfpo/kept_completion_length"] * log["gfpo/kept_fraction"] * rows
    return log["completions/mean_length"] * rows


def _step_signal(log: dict, trl_zero_std_per_group: bool = True) -> dict:
    """The learning signal of a step's trained rows: their mean reward, their reward spread (std over the batch's
    trained rows) and the share of trained rows in groups whose trained rewards are all equal (advantage 0). That
    share comes from TRL's frac_reward_zero_std for a run without a filter, and is None (undefined) where
    `trl_zero_std_per_group` is False: TRL's then tests the batch's std, not each group's."""
    kept = "gfpo/kept_reward_mean" in log  # GFPO: over the kept rows; GRPO: TRL's, over every row
    zero_std = (log["gfpo/kept_frac_reward_zero_std"] if kept
                else log["frac_reward_zero_std"] if trl_zero_std_per_group else None)
    return {"reward": log["gfpo/kept_reward_mean" if kept else "reward"],
            "reward_std": log["gfpo/kept_reward_std" if kept else "reward_std"], "frac_reward_zero_std": zero_std}


def _git_commit() -> str | None:
    """The commit of the checkout this package runs from, "+dirty" when tracked files differ; outside git (an
    installed copy) the commit its build recorded (gfpo_kernels._build_info, as the environment report says); None
    without either."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        try:
            build_info = importlib.import_module("gfpo_kernels._build_info")
        except ImportError:
            return None
        return getattr(build_info, "COMMIT", None)
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


@contextlib.contextmanager
def future_warnings_hidden(hidden: bool):
    """FutureWarnings ignored inside the block where `hidden` (transformers' deprecation notices about TRL's calls
    would bury the progress bars); the caller's warning filters are restored after it."""
    with warnings.catch_warnings():
        if hidden:
            warnings.simplefilter("ignore", FutureWarning)
        yield


def paper_tables() -> dict:
    """The paper's Tables 1-2 and setup (gfpo_study/paper_tables.json, shipped with the package, so that an
    installed copy reports beside the paper as a checkout does)."""
    from importlib import resources

    return json.loads(resources.files(__package__).joinpath("paper_tables.json").read_text())


def start_label(study: dict) -> str:
    """The report's name for a study's starting model: "warm-up" where a start function built it (the sums study
    warms the tiny model up), "start" where it is the config's own model."""
    return "warm-up" if is_function_spec(study.get("settings", {}).get("model")) else "start"


def sample_counts(study: dict) -> dict:
    """A study's own answers a prompt at the end and on the curves ({"samples", "curve_samples"}, those its settings
    give), for the report's headings and the plot's titles."""
    evaluation = study.get("settings", {}).get("eval") or {}
    return {key: evaluation[key] for key in ("samples", "curve_samples") if evaluation.get(key) is not None}


def finish_study(study: dict, output_dir: str, arms: dict | None = None) -> dict:
    """The summary over seeds (study_stats.summarize), the report and verdict (study_report), the plot; writes
    study.json (the runs and the summary), study.md and study.png into `output_dir` and says so. `arms`: {name: Arm}
    of the study's arms (default: the built-in ARMS)."""
    from .study_report import plot_study, study_report, study_verdict
    from .study_stats import summarize

    definitions = ARMS if arms is None else arms
    arms, seeds = study["arms"], study["seeds"]
    summary = summarize(study["seed_results"], arms, kept_shares={
        name: definitions[name].kept_share() for name in arms if definitions[name].kept_share() is not None})
    study = {**study, "summary": summary}
    counts = sample_counts(study)
    label = start_label(study)
    report = study_report(summary, len(seeds), paper_tables(), definitions, **counts, start=label)
    verdict = study_verdict(summary, len(seeds), label)
    paths = {name: os.path.join(output_dir, name) for name in ("study.json", "study.md", "study.png")}
    write_json(paths["study.json"], study)
    with open(paths["study.md"], "w") as f:
        f.write(report + "\n")
    plot_study(study["seed_results"], summary, paths["study.png"], **counts, start=label)
    print("\n" + report)
    models = "each piece's seed-*/" if "pieces" in study["environment"] else f"{output_dir}/seed-*/"
    print(f"\nwritten: {paths['study.md']} (the tables and the verdict), {paths['study.json']} (every run per seed, "
          f"and the summary), {paths['study.png']} (the plot); the models under {models}")
    return {"study": study, "summary": summary, "report": report, "verdict": verdict}
