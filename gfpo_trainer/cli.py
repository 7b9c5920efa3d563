"""The command line: `python -m gfpo_trainer train --config FILE.yaml` and `python -m gfpo_trainer env` (the
environment report for a bug report). The length study and its demo: `python -m gfpo_study`.

A training config (YAML):

    model: Qwen/Qwen2.5-0.5B-Instruct      # a Hub model (namespace/name) or a local directory
    dataset: data/train.jsonl              # a local .json/.jsonl/.csv/.parquet file, or a datasets hub name
    dataset_split: train                   # optional, default train (a local file has only "train", or "train[:100]")
    reward_funcs:                          # "module.path:function" (or "module.path.function")
      - my_rewards:correctness
    args:                                  # GFPOConfig fields
      output_dir: out
      num_generations: 16
      num_remains_in_group: 8
      group_filter: length

Paths in the file are read from the file's folder, wherever the command runs: `model` and `dataset` when relative,
the args output_dir (default gfpo-output), logging_dir, resume_from_checkpoint and deepspeed, and the reward modules
(imported from that folder first). `model` is a local directory when one exists there; otherwise it must be a Hub
name, `namespace/name`: anything else (`tiny_model`, `./models/x`, `~/x`, `a/b/c`) is a directory that does not
exist, an error naming where it was looked for, before any download.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pkgutil
import re
import sys
import warnings

_LOCAL_DATA = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# a Hub model named as the Hub names models today, "namespace/name" (Qwen/Qwen2.5-0.5B-Instruct; the old unprefixed
# names such as gpt2 redirect from namespaced ones, openai-community/gpt2): one '/', letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# GFPOConfig (TrainingArguments) fields that name files or folders: read from the config file's folder when relative
# (the module docstring names them)
PATH_ARGS = ("output_dir", "logging_dir", "resume_from_checkpoint", "deepspeed")
_TOP_LEVEL_KEYS = ("model", "dataset", "dataset_split", "reward_funcs", "args")


class ConfigError(ValueError):
    """A training config that cannot run, with what to fix."""


def _did_you_mean(name, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to `name`, "" when none is close: the rule of every
    unknown-name error of the package (gfpo_kernels._validation.did_you_mean)."""
    from gfpo_kernels._validation import did_you_mean  # not at the top: gfpo_kernels imports torch, --help needs none

    return did_you_mean(name, choices)


def _unknown_hints(unknown: list, choices) -> str:
    """The did-you-mean hint of the one unknown name, or of each that has a close match, naming it."""
    from gfpo_kernels._validation import closest_name

    if len(unknown) == 1:
        return _did_you_mean(unknown[0], choices)
    pairs = [(name, closest_name(name, choices)) for name in unknown]
    pairs = [f"{close!r} for {name!r}" for name, close in pairs if close is not None]
    return f" (did you mean {', '.join(pairs)}?)" if pairs else ""


def _in_folder(path: str, base_dir: str) -> str:
    """`path` with ~ expanded, and read from `base_dir` when relative."""
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


def resolve_model(model, base_dir: str) -> str:
    """The local directory `model` names (read from `base_dir` when relative), or `model` itself when it is a Hub
    name (namespace/name) and no such directory exists. Anything else is a ConfigError naming the directory looked
    for, raised before transformers would spend a minute retrying the Hub for a name it cannot have."""
    if not isinstance(model, str) or not model:
        raise ConfigError(f"model must be a Hub name (namespace/name) or a local directory, got {model!r}")
    local = _in_folder(model, base_dir)
    if os.path.isdir(local):
        return local
    namespace = model.split("/")[0]
    if _HUB_ID.fullmatch(model) and not os.path.isdir(_in_folder(namespace, base_dir)):
        return model
    if os.path.exists(local):
        raise ConfigError(f"model {model!r}: {local} is a file; model needs the directory holding the model's files")
    parent = os.path.dirname(local)
    siblings = [d for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))] if os.path.isdir(parent) else []
    hint = _did_you_mean(os.path.basename(local), siblings)
    raise ConfigError(f"model {model!r}: no directory {local}{hint} (relative paths are read from the config file's "
                      f"folder {base_dir}; a Hub model is named namespace/name)")


def load_reward_func(spec: str, base_dir: str | None = None):
    """"package.module:function" or "package.module.function" -> the function; modules are looked for in `base_dir`
    (the config file's folder) first, when given. A module or function that is not there is a ConfigError naming
    what is there, and the close name if there is one."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"reward function {spec!r} must look like 'package.module:function'")
    if base_dir is not None:
        _look_in_first(base_dir, module_name.split(".")[0])
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as error:  # a SyntaxError's message names the file and line
        missing = getattr(error, "name", None)
        if isinstance(error, ModuleNotFoundError) and base_dir is not None and missing == module_name.split(".")[0]:
            # the module itself is missing (not one that it imports): say where it was looked for and what is there
            modules = sorted(found.name for found in pkgutil.iter_modules([base_dir]))
            raise ConfigError(f"reward function {spec!r}: no module {missing!r}{_did_you_mean(missing, modules)} in "
                              f"the config file's folder {base_dir} (modules there: {modules}) or elsewhere on the "
                              "Python path") from None
        raise ConfigError(
            f"reward function {spec!r}: cannot import module {module_name!r} ({type(error).__name__}: {error})"
        ) from None
    func = getattr(module, attr, None)
    if not callable(func):
        functions = sorted(name for name, value in vars(module).items()
                           if callable(value) and not isinstance(value, type) and not name.startswith("_"))
        found = (f"has no function {attr!r}" if func is None
                 else f"has {attr!r} of type {type(func).__name__}, not a function")
        raise ConfigError(f"reward function {spec!r}: module {module_name!r} {found}{_did_you_mean(attr, functions)}; "
                          f"its functions: {functions}")
    return func


def _look_in_first(base_dir: str, top: str) -> None:
    """Puts `base_dir` first on the Python path and, where it holds module `top` while this process imported another
    module of that name (another config's, from its own folder), forgets that one: each config gets its own folder's
    module."""
    base_dir = os.path.abspath(base_dir)
    if base_dir in sys.path:
        sys.path.remove(base_dir)
    sys.path.insert(0, base_dir)
    cached = sys.modules.get(top)
    here = os.path.exists(os.path.join(base_dir, f"{top}.py")) or os.path.isdir(os.path.join(base_dir, top))
    if cached is not None and here and not os.path.abspath(getattr(cached, "__file__", None) or "").startswith(
            base_dir + os.sep):
        for name in [name for name in sys.modules if name == top or name.startswith(top + ".")]:
            del sys.modules[name]


def load_train_dataset(name: str, split: str = "train", base_dir: str | None = None):
    """The data set `name` names: a local file (read from `base_dir` when relative), a local folder, or a datasets
    hub name; `split` of it."""
    import datasets

    if not isinstance(name, str):
        raise ConfigError(f"dataset must be a file path or a datasets hub name, got {name!r}")
    if not isinstance(split, str):
        raise ConfigError(f"dataset_split must be a split name such as 'train', got {split!r}")
    local = _in_folder(name, base_dir or os.getcwd())
    extension = os.path.splitext(name)[1].lower()
    if extension in _LOCAL_DATA:
        if not os.path.exists(local):
            raise ConfigError(f"dataset file {name!r} does not exist (looked for {local})")
        name = local
        try:  # one file loads as the one split "train"; the split still selects from it ("train[:100]")
            dataset = datasets.load_dataset(_LOCAL_DATA[extension], data_files=name, split=split)
        except ValueError as error:  # e.g. 'Unknown split "test". Should be one of ['train'].'
            raise ConfigError(f"cannot load dataset file {name!r} with dataset_split={split!r}: {error}") from None
    else:
        name = local if os.path.isdir(local) else name
        try:
            dataset = datasets.load_dataset(name, split=split)
        except Exception as error:  # network, missing dataset, bad split: say which
            raise ConfigError(f"cannot load dataset {name!r} (split {split!r}): {error}") from None
    if "prompt" not in dataset.column_names:
        raise ConfigError(f"dataset {name!r} has no 'prompt' column (columns: {dataset.column_names})")
    return dataset


def build_trainer(config: dict, base_dir: str | None = None):
    """A GFPOTrainer from a parsed training config; relative paths in it are read from `base_dir` (the config file's
    folder; default: the working directory)."""
    from transformers import AutoTokenizer

    from .config import GFPOConfig
    from .trainer import GFPOTrainer

    base_dir = os.path.abspath(base_dir or os.getcwd())
    unknown = sorted(set(config) - set(_TOP_LEVEL_KEYS), key=str)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}{_unknown_hints(unknown, _TOP_LEVEL_KEYS)}; expected some of "
                          f"{sorted(_TOP_LEVEL_KEYS)}")
    for key in ("model", "dataset", "reward_funcs"):
        if key not in config:
            raise ConfigError(f"the config needs {key!r}")
    model = resolve_model(config["model"], base_dir)
    fields = {f.name for f in dataclasses.fields(GFPOConfig) if f.init}
    args = config.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"args must be a mapping of GFPOConfig fields (field: value), got {args!r}")
    bad = sorted((name for name in args if name not in fields), key=str)
    if bad:
        raise ConfigError(f"unknown GFPOConfig fields {bad} under 'args'{_unknown_hints(bad, sorted(fields))}")
    args = _convert_args(args)
    args.setdefault("output_dir", "gfpo-output")
    for name in PATH_ARGS:  # a deepspeed config may also be given inline, as a mapping: left as it is
        if isinstance(args.get(name), str) and not (name == "deepspeed" and args[name].lstrip().startswith("{")):
            args[name] = _in_folder(args[name], base_dir)
    reward_specs = config["reward_funcs"]
    reward_specs = [reward_specs] if isinstance(reward_specs, str) else reward_specs
    if not isinstance(reward_specs, list) or not reward_specs or not all(isinstance(s, str) for s in reward_specs):
        raise ConfigError(f"reward_funcs must be one or more 'package.module:function' strings, got {reward_specs!r}")
    reward_funcs = [load_reward_func(s, base_dir) for s in reward_specs]
    try:
        args = GFPOConfig(**args)
    except (ValueError, TypeError) as error:  # GFPOConfig's and GRPOConfig's own checks name the field and value
        raise ConfigError(f"args: {_one_line(error)}") from None
    dataset = load_train_dataset(config["dataset"], config.get("dataset_split", "train"), base_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except OSError as error:
        raise ConfigError(f"cannot load model {model!r}: {error}") from None
    try:
        return GFPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                           processing_class=tokenizer)
    except (ValueError, TypeError) as error:  # e.g. a filter without num_remains_in_group
        raise ConfigError(_one_line(error)) from None


def _convert_args(args: dict) -> dict:
    """YAML strings -> the GFPOConfig field types, as TRL's CLI converts them: PyYAML reads `1e-6` as a string, a
    quoted '4' or 'false' stays one, and GFPOConfig converts nothing. The types are those of HfArgumentParser's
    actions (what `trl grpo --learning_rate 1e-6` goes through). Values that are not strings must already be of the
    field's type (an int field takes no 2.5 nor 4.0, a float field no list), or the run would fail steps later
    inside transformers or TRL, naming neither the key nor the value."""
    from enum import Enum

    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool

    from .config import GFPOConfig

    actions = HfArgumentParser(GFPOConfig)._option_string_actions  # "--name" -> its argparse action
    converted = dict(args)
    for name, value in args.items():
        action = actions.get(f"--{name}")
        kind = getattr(action, "type", None)
        # only the types that parse text: str needs nothing, and dict or config-object fields (liger_kernel_config,
        # parallelism_config) keep their string, which TrainingArguments reads as JSON itself
        if not (kind in (int, float, string_to_bool) or getattr(action, "choices", None) is not None
                or (isinstance(kind, type) and issubclass(kind, Enum))):
            continue
        if isinstance(value, str):
            converted[name] = _convert_value(name, value, action)
        elif action.nargs == "+" and isinstance(value, list):  # list[int] and the like: item by item
            converted[name] = [_convert_value(name, v, action) if isinstance(v, str) else _checked(name, v, action)
                               for v in value]
        elif value is not None:  # None: an optional field left unset
            converted[name] = _checked(name, value, action)
    return converted


def _checked(name: str, value, action):
    """A value YAML gave as a number, bool or list, checked against the field's type (a bool field also takes 0/1)."""
    kind = action.type
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(kind)
    what = {int: "an int", float: "a number"}.get(kind)
    if getattr(kind, "__name__", None) == "string_to_bool":
        if type(value) is int and value in (0, 1):
            return bool(value)
        ok, what = (lambda v: isinstance(v, bool)), "a bool (true/false, 1/0)"
    if ok is not None and not ok(value):
        raise ConfigError(f"args: {name}={value!r} is not {what}")
    if ok is None and action.choices is not None and value not in action.choices:
        raise ConfigError(f"args: {name}={value!r} is not one of {list(action.choices)}"
                          f"{_did_you_mean(value, action.choices)}")
    return value


def _convert_value(name: str, value: str, action):
    import argparse

    try:
        converted = action.type(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        what = getattr(action.type, "__name__", "its type")
        what = "a bool (true/false, yes/no, 1/0)" if what == "string_to_bool" else what
        raise ConfigError(f"args: {name}={value!r} cannot be read as {what}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"args: {name}={value!r} is not one of {list(action.choices)}"
                          f"{_did_you_mean(value, action.choices)}")
    return converted


def saved_line(output_dir: str) -> str:
    """`train`'s last line: where the trained model was saved, and what that folder holds (its files, its folders
    marked with a /, then its checkpoints, first to last)."""
    entries = sorted(os.listdir(output_dir))
    checkpoints = sorted((e for e in entries if re.fullmatch(r"checkpoint-\d+", e)), key=lambda e: int(e[11:]))
    held = ", ".join(e + "/" * os.path.isdir(os.path.join(output_dir, e)) for e in entries if e not in checkpoints)
    if checkpoints:
        held += f"; checkpoints: {checkpoints[0]}" + (f" to {checkpoints[-1]} ({len(checkpoints)})"
                                                      if len(checkpoints) > 1 else "")
    return f"saved the trained model to {output_dir}: {held}"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def parse_seeds(text: str) -> list[int]:
    """The length study's seeds (gfpo_study: `seeds:`, `--seeds`): a range ("0-3": seeds 0, 1, 2, 3), a list ("0,2,5") or both ("0-3,8"). A bare number is
    refused: it read as a count of seeds once, and as one seed it would run a different study without a word."""
    if text.strip().isdigit():
        n = int(text)
        example = (f": --seeds 0-{n - 1} for the {n} seeds 0..{n - 1}, or --seeds {n}-{n} for seed {n} alone" if n > 0
                   else ", e.g. --seeds 0-3")
        raise ValueError(f"--seeds={text!r}: a bare number is ambiguous; give a range or a list{example}")
    seeds = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not (low.isdigit() and (high.isdigit() if dash else True)):
            raise ValueError(f"--seeds={text!r}: {part.strip()!r} is neither a seed nor a range; give seeds as a range "
                             "or a list, e.g. --seeds 0-3 or --seeds 0,2,5")
        if dash and int(high) < int(low):
            raise ValueError(f"--seeds={text!r}: the range {part.strip()!r} is empty (its end is below its start)")
        seeds.extend(range(int(low), int(high) + 1) if dash else [int(low)])
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ValueError(f"--seeds={text!r}: seeds {repeated} appear more than once")
    return seeds


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatting, with a description or epilog filled paragraph by paragraph, and an indented paragraph
    (the example config) kept as it is written."""

    def _fill_text(self, text, width, indent):
        return "\n\n".join(paragraph if paragraph.startswith(" ") else super(_HelpFormatter, self)._fill_text(
            paragraph, width, indent) for paragraph in text.split("\n\n"))


def _doc_paragraphs() -> list[str]:
    """This module's docstring, paragraph by paragraph (none under python -OO): the help's description and the
    train command's example config."""
    return (__doc__ or "").strip("\n").split("\n\n")


def _sentence(summary: str) -> str:
    """A command's one-line summary (`help=`, lower case, no full stop) as the first sentence of its own --help."""
    return summary[:1].upper() + summary[1:] + ("" if summary.endswith(".") else ".")


TRAIN_DESCRIPTION = (
    "Train with GFPO from a YAML config: a model, a data set with a \"prompt\" column, reward functions and GFPOConfig "
    "fields (docs/cli.md). At the end the command says where it saved the trained model and what is there: "
    "args.output_dir (default gfpo-output, beside the config file)."
)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo is the length study's (gfpo_study), which the trainer does not import
        print(f"error: the demo is the length study's command: python -m gfpo_study {' '.join(argv)}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m gfpo_trainer", description=" ".join(_doc_paragraphs()[0].split()),
                                     epilog="Each command's --help says what it does and what it takes.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train with GFPO from a YAML config", description=TRAIN_DESCRIPTION,
                                epilog="\n\n".join(_doc_paragraphs()[1:]), formatter_class=_HelpFormatter)
    train.add_argument("--config", required=True,
                       help="YAML file: model, dataset, reward_funcs, args (GFPOConfig fields), "
                       "and optionally dataset_split (default train)")
    commands.add_parser("env", help="print the environment report for a bug report: versions, devices, the "
                        "extension, backends, and whether the installed TRL and vLLM are supported")
    for command in commands._choices_actions:  # a command's --help opens with its summary from the list above
        if commands.choices[command.dest].description is None:
            commands.choices[command.dest].description = _sentence(command.help)
    options = parser.parse_args(argv)
    if options.command == "env":  # needs no TRL: a bug report must be possible from a broken install
        from .env_report import environment_report

        print(environment_report())
        return 0
    try:  # the commands need the trainer extra, which `pip install --no-build-isolation .` alone does not bring
        from .trainer import GFPOTrainer  # noqa: F401 (TRL, transformers, ...: build_trainer imports it again)
    except ModuleNotFoundError as error:
        missing = error.name.partition(".")[0] if error.name else str(error)  # the package, not its submodule
        print(f"error: {missing!r} is not installed: gfpo's trainer needs its dependencies; from the checkout, "
              'pip install --no-build-isolation ".[trainer]" (docs/install.md)', file=sys.stderr)
        return 2

    import yaml

    # a mistake in the file is one line: what the libraries warn while the config is built (transformers' deprecation
    # FutureWarnings among them) is held back, and shown only when the config turns out to be good
    with warnings.catch_warnings(record=True) as held:
        try:
            with open(options.config) as f:
                config = yaml.safe_load(f) or {}
            if not isinstance(config, dict):
                raise ConfigError(f"{options.config} must hold a mapping, got {type(config).__name__}")
            trainer = build_trainer(config, base_dir=os.path.dirname(os.path.abspath(options.config)))
        except (ConfigError, OSError, yaml.YAMLError) as error:
            print(f"error: {_one_line(error)}", file=sys.stderr)
            return 2
    for warning in held:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    # TrainingArguments.resume_from_checkpoint is read by the caller of train(), not by the Trainer (TRL's scripts
    # pass it too): without this, a config asking to resume would start again from the model and overwrite
    # the checkpoints
    from transformers.trainer_utils import get_last_checkpoint

    resume, output_dir = trainer.args.resume_from_checkpoint, trainer.args.output_dir
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if resume is None and last is not None:
        print(f"warning: {output_dir} already holds {last}; this run starts from the model and writes its checkpoints "
              "over those (set args.resume_from_checkpoint to continue it)", file=sys.stderr)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    if trainer.is_world_process_zero():  # the process that saved it
        print(saved_line(output_dir))
    return 0
