"""The study config: what `python -m gfpo_trainer train --config` takes, plus the study's own keys.

    model: Qwen/Qwen2.5-0.5B-Instruct   # as `train`: a Hub name or a local folder; or {function: module:fn, ...}
    dataset: data/train.jsonl           # as `train`; or {function: module:fn, ...}: fn(seed, rows, **kw) -> rows
    reward_funcs: [my_rewards:correctness]
    args: {learning_rate: 1e-6, max_completion_length: 512}   # GFPOConfig fields every arm shares
    eval:
      dataset: data/test.jsonl          # held-out rows, a "prompt" column (or the `prompt:` key); or {function: ...}
      correct: my_rewards:correctness   # one bool or number per completion (accuracy: their mean) ...
      threshold: 0.5                    # ... or, given a threshold, correct where the value is >= it
      samples: 8                        # answers sampled per held-out prompt at the end of a run
      temperature: 0.8
      max_tokens: 512
    arms: [grpo, shortest-8of16, {name: mine, num_generations: 16, num_remains_in_group: 4, group_filter: length}]
    seeds: 0-4                          # a range, a list or both ("0-3,8"), or a YAML list
    steps: 200                          # RL steps per run
    eval_every: 50                      # a curve point (held-out, eval.curve_samples answers a prompt) every N steps
    prompts_per_step: 4                 # prompts per optimizer step, the same for every arm
    output_dir: study-out               # read from the config file's folder, as every relative path in the file;
                                        # without it, gfpo_study_output in the working folder
    checkpoint_every: 50                # a checkpoint of each run every N steps, which a rerun resumes (default: none)

The parsing reuses gfpo_trainer.cli's (paths, models, reward functions, GFPOConfig fields and their conversion):
the same key gives the same error as in `train`. A function is named "module:function" (or "module.function"), or
as a mapping {function: "module:function", other keys: its keyword arguments}; modules are looked for in the config
file's folder first.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from gfpo_trainer import cli as train_cli
from gfpo_trainer.cli import ConfigError

__all__ = ["ARMS", "Arm", "ConfigError", "EvalSpec", "StudyConfig", "load_study_config", "parse_study_config"]

# the keys the study adds to `train`'s; `train`'s own are gfpo_trainer.cli's
STUDY_KEYS = ("eval", "arms", "seeds", "steps", "eval_every", "prompts_per_step", "output_dir", "checkpoint_every")
# the GFPOConfig fields of checkpointing, which checkpoint_every sets for every run
CHECKPOINT_ARGS = ("save_strategy", "save_steps", "save_total_limit", "save_only_model")
EVAL_KEYS = ("dataset", "dataset_split", "dataset_config", "correct", "threshold", "details", "samples",
             "temperature", "max_tokens", "curve_samples", "batch_size")
# GFPOConfig fields the study sets itself, per run (what to set instead)
OWNED_ARGS = {"max_steps": "steps", "seed": "seeds", "output_dir": "output_dir (top level)",
              "per_device_train_batch_size": "prompts_per_step (per_device_train_batch_size = prompts_per_step x "
              "num_generations / (processes x gradient_accumulation_steps))",
              "shuffle_dataset": "nothing: every arm of a seed sees the same prompts in the same order",
              "logging_steps": "nothing: the study logs every step",
              "disable_tqdm": "nothing: the study shows one progress bar (run --verbose prints TRL's metrics at every "
              "step instead)",
              # the study passes each run's checkpoint to trainer.train itself: this field would go unread
              "resume_from_checkpoint": "checkpoint_every (a rerun resumes each run from its latest checkpoint)"}
ARM_KEYS = ("name", "reward", "paper")  # an arm's own keys besides GFPOConfig fields
# GFPOConfig fields that decide how the start model is loaded and where it runs: one value for every arm (args)
MODEL_LOADING_ARGS = ("model_init_kwargs", "trust_remote_code", "use_cpu")
DEFAULT_OUTPUT_DIR = "gfpo_study_output"  # in the working folder, where the config names none


@dataclasses.dataclass(frozen=True)
class Arm:
    """One trained configuration of the study.

    Args:
        name: its label in tables, plots and output folders.
        num_generations: G, completions sampled per prompt.
        num_remains_in_group: k, completions kept per group (None: GRPO).
        group_filter: GFPOConfig.group_filter.
        adaptive_num_remains: k per difficulty quartile, hardest first (adaptive difficulty); None: fixed k.
        reward: "correct" (the reward functions as given) or "signed" (each reward r as 2r - 1: 0/1 rewards become
            the paper's -1/1 range).
        paper: the arm's key in the paper's tables (gfpo_study/paper_tables.json), None where it has none.
        loss_includes_rejected: GFPOConfig.loss_includes_rejected (the paper's objective: rejected rows in the loss's
            normaliser with advantage 0).
        extra: further GFPOConfig fields the arm sets, (field, value) pairs.
    """

    name: str
    num_generations: int
    num_remains_in_group: int | None = None
    group_filter: str | None = None
    adaptive_num_remains: tuple[int, ...] | None = None
    reward: str = "correct"
    paper: str | None = None
    loss_includes_rejected: bool = False
    extra: tuple = ()

    def config_fields(self) -> dict:
        """The GFPOConfig fields this arm sets."""
        fields = dict(num_generations=self.num_generations, num_remains_in_group=self.num_remains_in_group,
                      group_filter=self.group_filter)
        if self.adaptive_num_remains is not None:
            fields.update(adaptive_difficulty=True, adaptive_num_remains=list(self.adaptive_num_remains))
        if self.loss_includes_rejected:
            fields.update(loss_includes_rejected=True)
        fields.update(dict(self.extra))
        return fields

    def definition(self) -> dict:
        """What makes this arm: its GFPOConfig fields and its reward (recorded with each of its runs)."""
        return {"fields": self.config_fields(), "reward": self.reward}

    def kept_share(self) -> float | None:
        """k / G where the arm keeps a fixed share by length (its dropped completions can stop early), else None."""
        if (self.num_remains_in_group is None or self.adaptive_num_remains is not None or self.loss_includes_rejected
                or self.group_filter != "length"):
            return None
        return self.num_remains_in_group / self.num_generations


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
REWARD_FORMS = ("correct", "signed")


@dataclasses.dataclass
class EvalSpec:
    """The held-out evaluation: the data, what counts as correct, how answers are sampled."""

    dataset: object  # a file or hub name (str) or a function spec
    correct: object  # a function spec
    dataset_split: str = "train"
    dataset_config: str | None = None  # a hub data set's configuration (openai/gsm8k: main)
    threshold: float | None = None
    details: object = None  # a function spec or None
    samples: int = 8
    temperature: float = 0.8
    max_tokens: int | None = None  # None: args.max_completion_length (study.eval_max_tokens)
    curve_samples: int = 2
    batch_size: int = 64  # answers a generate call on HF; vLLM takes every request of an evaluation at once


@dataclasses.dataclass
class StudyConfig:
    """A parsed study config. `identity` is the JSON-able config that makes a study (without seeds, arms,
    output_dir and checkpoint_every, which a piece or a later run may change: checkpoints change no figure): the runs
    of an output folder all belong to one."""

    train: dict  # `train`'s keys (model, dataset, dataset_split, reward_funcs, args, and prompt where given)
    eval: EvalSpec
    arms: dict  # name -> Arm, in the config's order
    seeds: list
    steps: int
    eval_every: int
    prompts_per_step: int
    output_dir: str
    base_dir: str
    identity: dict
    checkpoint_every: int | None = None  # steps between a run's checkpoints; None: no checkpoints

    @functools.cached_property
    def reward_funcs(self) -> list:
        return [train_cli.load_reward_func(s, self.base_dir) for s in _as_list(self.train["reward_funcs"])]


def _as_list(value):
    return [value] if isinstance(value, str) else list(value)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1")
    return value


def function_spec(key: str, spec, base_dir: str):
    """The function a spec names: "module:function", or {function: "module:function", **keyword arguments} (the
    function with those bound). Errors name the config key."""
    kwargs = {}
    if isinstance(spec, dict):
        if "function" not in spec:
            raise ConfigError(f"{key}: a mapping names its function with a 'function' key (function: "
                              f"module:function), got keys {sorted(spec)}")
        kwargs = {k: v for k, v in spec.items() if k != "function"}
        spec = spec["function"]
    if not isinstance(spec, str):
        raise ConfigError(f"{key}: give a function as 'module:function', got {spec!r}")
    try:
        func = train_cli.load_reward_func(spec, base_dir)
    except ConfigError as error:
        raise ConfigError(f"{key}: {error}".replace("reward function ", "function ", 1)) from None
    return functools.partial(func, **kwargs) if kwargs else func


def is_function_spec(spec) -> bool:
    """Whether a `model`/`dataset` value names a function (a mapping with a 'function' key) rather than data."""
    return isinstance(spec, dict) and "function" in spec


def parse_arms(items, default_generations: int) -> dict:
    """The config's `arms` -> {name: Arm}. A string is a built-in arm (ARMS); a mapping is a user arm: `name`, an
    optional `reward` (correct, signed) and `paper` key, and GFPOConfig fields. Unknown names and fields, reused
    names and two arms of the same config are ConfigErrors."""
    from gfpo_trainer import config_fields

    if isinstance(items, str):
        items = [a.strip() for a in items.split(",") if a.strip()]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"arms: give a list of arm names ({', '.join(ARMS)}) or mappings, got {items!r}")
    fields = config_fields.field_specs()  # GFPOConfig's fields without importing TRL: a mistake is told at once
    arms = {}
    for item in items:
        if isinstance(item, str):
            if item not in ARMS:
                raise ConfigError(f"arms: unknown arm {item!r}{train_cli._did_you_mean(item, ARMS)}; the built-in "
                                  f"arms: {', '.join(ARMS)} (or a mapping: name and GFPOConfig fields)")
            arm = ARMS[item]
        elif isinstance(item, dict):
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"arms: a user arm needs a name (name: my-arm), got {item!r}")
            if name in ARMS:
                raise ConfigError(f"arms: {name!r} is a built-in arm's name; list it as '{name}' or give your arm "
                                  "another name")
            overrides = {k: v for k, v in item.items() if k not in ARM_KEYS}
            bad = sorted(k for k in overrides if k not in fields or k in OWNED_ARGS)
            path = sorted(k for k in overrides if k == "use_vllm" or k.startswith("vllm_"))
            if path:
                raise ConfigError(f"arms: arm {name!r} sets {path[0]!r}: every arm generates on the same path (the "
                                  "same sampling for the same weights); set it under args")
            loading = sorted(k for k in overrides if k in MODEL_LOADING_ARGS)
            if loading:
                raise ConfigError(f"arms: arm {name!r} sets {loading[0]!r}: every arm loads the start model alike "
                                  "(the seed's starting model is evaluated once, as every arm's start); set it under "
                                  "args")
            if bad:
                owned = [k for k in bad if k in OWNED_ARGS]
                if owned:
                    raise ConfigError(f"arms: arm {name!r} sets {owned[0]!r}, which the study sets for every run; "
                                      f"set {OWNED_ARGS[owned[0]]}")
                raise ConfigError(f"arms: arm {name!r} has unknown GFPOConfig fields {bad}"
                                  f"{train_cli._unknown_hints(bad, sorted(fields))}")
            reward = item.get("reward", "correct")
            if reward not in REWARD_FORMS:
                raise ConfigError(f"arms: arm {name!r} reward={reward!r}: one of {list(REWARD_FORMS)}")
            overrides = train_cli._convert_args(overrides)
            adaptive = overrides.pop("adaptive_num_remains", None)
            if overrides.pop("adaptive_difficulty", adaptive is not None) is not (adaptive is not None):
                raise ConfigError(f"arms: arm {name!r}: adaptive_difficulty goes with adaptive_num_remains (k per "
                                  "difficulty quartile, hardest first)")
            _check_filter(name, overrides.get("num_remains_in_group"), overrides.get("group_filter"))
            arm = Arm(name, overrides.pop("num_generations", default_generations),
                      overrides.pop("num_remains_in_group", None), overrides.pop("group_filter", None),
                      tuple(adaptive) if adaptive is not None else None, reward, item.get("paper"),
                      bool(overrides.pop("loss_includes_rejected", False)), tuple(sorted(overrides.items())))
        else:
            raise ConfigError(f"arms: each arm is a built-in name or a mapping, got {item!r}")
        if arm.name in arms:
            raise ConfigError(f"arms: {arm.name!r} is listed twice")
        arms[arm.name] = arm
    _refuse_identical_arms(arms)
    return arms


def _check_filter(name: str, k, group_filter) -> None:
    """A user arm's filter, as GFPOTrainer will check it (the study passes no group_filter_func): a built-in
    group_filter name (filters.group_filter_spec, torch-free), given exactly where num_remains_in_group is."""
    from gfpo_trainer.filters import GROUP_FILTERS, group_filter_spec

    try:
        group_filter_spec(group_filter)
    except ValueError as error:
        raise ConfigError(f"arms: arm {name!r}: {error}") from None
    if (k is None) != (group_filter is None):
        given, missing = ((f"num_remains_in_group={k}", f"group_filter (one of {', '.join(GROUP_FILTERS)})")
                          if group_filter is None else (f"group_filter={group_filter!r}", "num_remains_in_group (k)"))
        raise ConfigError(f"arms: arm {name!r} sets {given} without {missing}: a GFPO arm keeps k completions of "
                          "each group by a filter; set both, or neither for GRPO")


def _refuse_identical_arms(arms: dict) -> None:
    """Two arms that train the same config (each field any arm sets, the default where an arm leaves it) would be
    one arm counted twice."""
    from gfpo_trainer.config import GFPOConfig  # the defaults (TRL's): only here, after the fast checks

    fields = {f.name: f for f in dataclasses.fields(GFPOConfig) if f.init}
    keys = sorted({k for arm in arms.values() for k in arm.config_fields()})

    def default(name):
        f = fields[name]
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    seen = {}
    for arm in arms.values():
        own = arm.config_fields()
        key = json.dumps([arm.reward] + [own.get(k, default(k)) for k in keys], default=str)
        if key in seen:
            raise ConfigError(f"arms: {seen[key]!r} and {arm.name!r} are the same config ({arm.definition()}); "
                              "drop one or change a field")
        seen[key] = arm.name


def _checkpoint_every(value, steps: int, args: dict, arms: dict) -> int | None:
    """`checkpoint_every`: None (no checkpoints) or a number of steps below `steps` (the last step saves none: the
    final model is saved right after it), without args or arm fields of their own for checkpointing."""
    if value is None:
        return None
    value = _positive_int("checkpoint_every", value)
    if value >= steps:
        raise ConfigError(f"checkpoint_every={value} with steps={steps}: no checkpoint would be saved before the run "
                          "ends (the last step saves none, the final model is saved right after it); give a "
                          f"checkpoint_every below {steps}, or leave checkpoint_every out")
    why = ("checkpoint_every sets each run's checkpoints (one every N steps, the older removed, the optimizer's "
           "state in each)")
    key = _own_checkpoint_field(args)
    if key:
        raise ConfigError(f"args.{key}={args[key]!r} with checkpoint_every={value}: {why}; leave args.{key} out")
    for arm in arms.values():
        fields = dict(arm.extra)
        key = _own_checkpoint_field(fields)
        if key:
            raise ConfigError(f"arms: arm {arm.name!r} sets {key}={fields[key]!r} with checkpoint_every={value}: "
                              f"{why}; leave {key} out of the arm")
    return value


def _own_checkpoint_field(fields: dict) -> str | None:
    """The first GFPOConfig field of checkpointing that `fields` set (save_strategy "no" is none), None where none."""
    return next((k for k in CHECKPOINT_ARGS
                 if k in fields and not (k == "save_strategy" and fields[k] in ("no", False))), None)


def parse_seeds(value) -> list:
    """`seeds`: a YAML list of seeds, or gfpo_trainer.cli.parse_seeds's text (a range "0-4", a list "0,2,5")."""
    if isinstance(value, list):
        if not value or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
            raise ConfigError(f"seeds={value!r}: give whole numbers >= 0")
        if len(set(value)) != len(value):
            raise ConfigError(f"seeds={value!r}: a seed appears more than once")
        return list(value)
    try:
        return train_cli.parse_seeds(str(value))
    except ValueError as error:
        raise ConfigError(str(error).replace("--seeds=", "seeds=")) from None


def parse_eval(spec, base_dir: str) -> EvalSpec:
    if not isinstance(spec, dict):
        raise ConfigError(f"eval: a mapping (dataset, correct, samples, temperature, max_tokens), got {spec!r}")
    unknown = sorted(set(spec) - set(EVAL_KEYS), key=str)
    if unknown:
        raise ConfigError(f"eval: unknown keys {unknown}{train_cli._unknown_hints(unknown, EVAL_KEYS)}; expected "
                          f"some of {list(EVAL_KEYS)}")
    for key in ("dataset", "correct"):
        if key not in spec:
            raise ConfigError(f"eval needs {key!r}" + (" (a function: one bool or number per completion)"
                                                       if key == "correct" else " (the held-out data)"))
    out = EvalSpec(dataset=spec["dataset"], correct=spec["correct"])
    for key in ("samples", "curve_samples", "batch_size", "max_tokens"):
        if spec.get(key) is not None:
            setattr(out, key, _positive_int(f"eval.{key}", spec[key]))
    if "temperature" in spec:
        t = spec["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"eval.temperature={t!r}: a number > 0 (sampled answers; the paper evaluates at 0.8)")
        out.temperature = float(t)
    if spec.get("threshold") is not None:
        if isinstance(spec["threshold"], bool) or not isinstance(spec["threshold"], (int, float)):
            raise ConfigError(f"eval.threshold={spec['threshold']!r}: a number")
        out.threshold = float(spec["threshold"])
    out.dataset_split = spec.get("dataset_split", "train")
    out.dataset_config = spec.get("dataset_config")
    out.details = spec.get("details")
    # loaded now: a missing module or function is an error before anything trains
    function_spec("eval.correct", out.correct, base_dir)
    if out.details is not None:
        function_spec("eval.details", out.details, base_dir)
    if is_function_spec(out.dataset):
        function_spec("eval.dataset", out.dataset, base_dir)
    elif isinstance(out.dataset, str):  # a missing file is told now, not after the imports and the output folder
        try:
            train_cli.check_local_dataset(out.dataset, base_dir)
        except ConfigError as error:
            raise ConfigError(f"eval.{error}") from None
    return out


def parse_study_config(config: dict, base_dir: str, flags: dict | None = None) -> StudyConfig:
    """A StudyConfig from a parsed YAML mapping; relative paths read from `base_dir`. Checks everything that can be
    checked without loading a model: keys, arms, seeds, sizes, the functions named, GFPOConfig fields. `flags`: the
    command-line overrides' flags by dotted path (gfpo_trainer.cli.override_flags), which an error names."""
    import os

    if not isinstance(config, dict):
        raise ConfigError(f"the study config must hold a mapping, got {type(config).__name__}")
    train_keys = train_cli._TOP_LEVEL_KEYS
    known = train_keys + STUDY_KEYS
    unknown = sorted(set(config) - set(known), key=str)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}{train_cli._unknown_hints(unknown, known)}; expected some of "
                          f"{sorted(known)}")
    for key in ("model", "dataset", "reward_funcs", "eval", "arms", "seeds", "steps"):
        if key not in config:
            hint = ("; this looks like a training config (no eval, no arms): train with python -m gfpo_trainer train "
                    "--config FILE, or add the study's keys (docs/study.md)"
                    if key == "eval" and "arms" not in config else "")
            raise ConfigError(f"the study config needs {key!r}{hint}")
    args = config.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"args must be a mapping of GFPOConfig fields (field: value), got {args!r}")
    owned = [k for k in args if k in OWNED_ARGS]
    if owned:
        raise ConfigError(f"args.{owned[0]}: the study sets it for every run; set {OWNED_ARGS[owned[0]]}")
    if args.get("use_vllm"):
        mode = args.get("vllm_mode", "colocate")  # GFPOConfig's default, as TRL's
        if mode != "colocate":
            raise ConfigError(f"args.use_vllm=true with vllm_mode={mode!r}: the study evaluates held-out answers "
                              "through the trainer's own vLLM engine, which only colocate mode holds; set vllm_mode: "
                              "colocate, or use_vllm: false (docs/study.md)")
        if args.get("vllm_enable_sleep_mode"):
            raise ConfigError("args.vllm_enable_sleep_mode=true: the study's held-out evaluation generates on the "
                              "trainer's engine between training steps, which it does not put to sleep and wake; set "
                              "vllm_enable_sleep_mode: false (docs/study.md)")
    # `train`'s own checks (keys, model folder, args names, types and choices, filter, prompt key, data file), on the
    # training part; a model or data set given by a function is checked as a function instead
    train_part = {k: config[k] for k in train_keys if k in config}
    if is_function_spec(config["model"]):
        function_spec("model", config["model"], base_dir)
        train_part["model"] = base_dir  # a folder that exists: the function's model is checked when it is built
    if is_function_spec(config["dataset"]):
        function_spec("dataset", config["dataset"], base_dir)
        train_part["dataset"] = "function/rows"  # no file to look for
    named = {"flags": flags, "top_level_keys": known} if flags else {}
    converted = train_cli.check_config(train_part, base_dir, **named)["args"]
    for spec in _as_list(config["reward_funcs"]):
        train_cli.load_reward_func(spec, base_dir)
    evaluation = parse_eval(config["eval"], base_dir)
    arms = parse_arms(config["arms"], converted.get("num_generations", 8))
    seeds = parse_seeds(config["seeds"])
    steps = _positive_int("steps", config["steps"])
    eval_every = _positive_int("eval_every", config.get("eval_every", steps))
    prompts_per_step = _positive_int("prompts_per_step", config.get("prompts_per_step", 4))
    output_dir = config.get("output_dir")
    if output_dir is not None and not isinstance(output_dir, str):
        raise ConfigError(f"output_dir={output_dir!r}: a folder path")
    checkpoint_every = _checkpoint_every(config.get("checkpoint_every"), steps, args, arms)
    identity = {k: v for k, v in config.items() if k not in ("seeds", "arms", "output_dir", "checkpoint_every")}
    identity = json.loads(json.dumps({**identity, "steps": steps, "eval_every": eval_every,
                                      "prompts_per_step": prompts_per_step, "eval": dataclasses.asdict(evaluation)},
                                     default=str))
    return StudyConfig(train={k: config[k] for k in train_keys if k in config}, eval=evaluation, arms=arms,
                       seeds=seeds, steps=steps, eval_every=eval_every, prompts_per_step=prompts_per_step,
                       output_dir=os.path.abspath(DEFAULT_OUTPUT_DIR) if output_dir is None
                       else train_cli._in_folder(output_dir, base_dir), base_dir=os.path.abspath(base_dir),
                       identity=identity, checkpoint_every=checkpoint_every)


def load_study_config(path: str, overrides: list | None = None) -> StudyConfig:
    """The study config in the YAML file `path`, with command-line `overrides` (`--key value`, `--eval.samples 4`,
    `--learning_rate 1e-6`: gfpo_trainer.cli.apply_overrides) applied first."""
    import os

    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except OSError as error:
        raise ConfigError(f"cannot read the study config {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not YAML: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a mapping, got {type(config).__name__}")
    flags = None
    if overrides:
        keys = train_cli._TOP_LEVEL_KEYS + STUDY_KEYS
        config = train_cli.apply_overrides(config, list(overrides), keys)
        flags = train_cli.override_flags(list(overrides), keys)
    return parse_study_config(config, os.path.dirname(os.path.abspath(path)), flags=flags)
