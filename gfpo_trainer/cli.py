"""The command line: `python -m gfpo_trainer train --config FILE.yaml` and `python -m gfpo_trainer env` (the
environment report for a bug report). The length study and its demo: `python -m gfpo_study`.

A training config (YAML):

    model: Qwen/Qwen2.5-0.5B-Instruct      # a Hub model (namespace/name) or a local directory
    dataset: data/train.jsonl              # a local .json/.jsonl/.csv/.parquet file, or a datasets hub name
    dataset_split: train                   # optional, default train (a local file has only "train", or "train[:100]")
    dataset_config: main                   # optional: a hub data set's configuration (openai/gsm8k has main, socratic)
    prompt: {user: "{question}"}           # optional: chat prompts from a data set without a "prompt" column
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

from ._names import closest_name, did_you_mean

CHECKPOINT_PREFIX = "checkpoint-"  # transformers' checkpoint folders, checkpoint-<step>
_LOCAL_DATA = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# a Hub model named as the Hub names models today, "namespace/name" (Qwen/Qwen2.5-0.5B-Instruct; the old unprefixed
# names such as gpt2 redirect from namespaced ones, openai-community/gpt2): one '/', letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# GFPOConfig (TrainingArguments) fields that name files or folders: read from the config file's folder when relative
# (the module docstring names them)
PATH_ARGS = ("output_dir", "logging_dir", "resume_from_checkpoint", "deepspeed")
_TOP_LEVEL_KEYS = ("model", "dataset", "dataset_split", "dataset_config", "prompt", "reward_funcs", "args")
# the `prompt:` key's fields: the chat messages built from a data set's own columns
PROMPT_KEYS = ("system", "user")
# the column a data set without "prompt" most likely holds its prompts in (GSM8K's "question" first): the error's
# suggested `prompt:` line names the first of these it has
_PROMPT_LIKE_COLUMNS = ("question", "problem", "instruction", "query", "input", "text")


class ConfigError(ValueError):
    """A training config that cannot run, with what to fix."""


def _did_you_mean(name, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to `name`, "" when none is close: the rule of every
    unknown-name error of the package, in its torch-free copy (a config is checked before torch is imported)."""
    return did_you_mean(name, choices)


def _unknown_hints(unknown: list, choices) -> str:
    """The did-you-mean hint of the one unknown name, or of each that has a close match, naming it."""
    if len(unknown) == 1:
        return _did_you_mean(unknown[0], choices)
    pairs = [(name, closest_name(name, choices)) for name in unknown]
    pairs = [f"{close!r} for {name!r}" for name, close in pairs if close is not None]
    return f" (did you mean {', '.join(pairs)}?)" if pairs else ""


def _close_file(name: str, files) -> str:
    """" (did you mean 'x'?)" for the file of `files` whose name without its extension is closest to `name`'s: a
    shared extension (.yaml, .jsonl) would make every file look close."""
    stems = {os.path.splitext(f)[0]: f for f in sorted(files, reverse=True)}  # sorted: the same choice every time
    close = closest_name(os.path.splitext(name)[0], stems)
    return f" (did you mean {stems[close]!r}?)" if close is not None else ""


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


def check_prompt_key(prompt) -> dict:
    """The config's `prompt:` key, checked: a mapping with `user` (a str.format template over a row's columns,
    "{question}") and optionally `system` (a system message, as it is). Returns it; ConfigError naming what is
    wrong."""
    import string

    form = "prompt: {system: \"optional system message\", user: \"{question}\"}"
    if not isinstance(prompt, dict):
        raise ConfigError(f"prompt must be a mapping of the chat messages to build, {form}; got {prompt!r}")
    unknown = sorted((key for key in prompt if key not in PROMPT_KEYS), key=str)
    if unknown:
        raise ConfigError(f"unknown prompt keys {unknown}{_unknown_hints(unknown, PROMPT_KEYS)}; expected "
                          f"{list(PROMPT_KEYS)}: {form}")
    if not isinstance(prompt.get("user"), str) or not prompt["user"].strip():
        raise ConfigError(f"prompt needs user, the user message made from each row's columns, e.g. {form}; got "
                          f"user={prompt.get('user')!r}")
    if prompt.get("system") is not None and not isinstance(prompt["system"], str):
        raise ConfigError(f"prompt: system must be a string (the system message), got {prompt['system']!r}")
    try:
        list(string.Formatter().parse(prompt["user"]))
    except ValueError as error:  # "Single '}' encountered in format string" and the like
        raise ConfigError(f"prompt: user={prompt['user']!r} is not a format string ({error}); columns are named "
                          "in braces, {question}, and a literal brace is doubled, {{") from None
    return prompt


def _prompt_columns(user: str) -> list[str]:
    """The columns a `prompt: user` template reads ("{question} ({source})" -> ["question", "source"])."""
    import string

    names = [field for _, field, _, _ in string.Formatter().parse(user) if field is not None]
    return list(dict.fromkeys(re.split(r"[.\[]", name, maxsplit=1)[0] for name in names))


def build_prompts(dataset, prompt: dict, name: str):
    """`dataset` with a conversational "prompt" column built by the `prompt:` key: a system message where `system`
    is given, then the user message `user.format(**row)`. The other columns stay (TRL passes them to the reward
    functions as keyword arguments: GSM8K's `answer`)."""
    columns = dataset.column_names
    if "prompt" in columns:
        raise ConfigError(f"dataset {name!r} has a 'prompt' column already, and the config's prompt key would build "
                          "another: remove the prompt key to train on the column, or rename the column")
    missing = [column for column in _prompt_columns(prompt["user"]) if column not in columns]
    if missing or not _prompt_columns(prompt["user"]):
        what = (f"names no column {missing}{_unknown_hints(missing, columns)}" if missing
                else "names no column, so every prompt would be the same")
        raise ConfigError(f"prompt: user={prompt['user']!r} {what}; the dataset's columns: {columns}")
    system = prompt.get("system")

    def messages(row):
        try:
            user = prompt["user"].format(**row)
        except (KeyError, IndexError, ValueError, AttributeError) as error:
            raise ConfigError(f"prompt: user={prompt['user']!r} cannot be filled from the row {row!r} "
                              f"({type(error).__name__}: {error})") from None
        return {"prompt": ([{"role": "system", "content": system}] if system is not None else [])
                + [{"role": "user", "content": user}]}

    return dataset.map(messages, desc="building the prompts")


def check_local_dataset(dataset: str, base_dir: str) -> None:
    """A `dataset` that is a local path must be a folder or a file datasets reads (.json, .jsonl, .csv, .parquet)
    that exists; anything else a path names (a missing file, a .txt file, `./x`, `~/x`, `/abs/x`, `a/b/c`, `a/b` whose
    `a/` exists in the config file's folder) is a ConfigError naming where it looked, with a close name there, before
    datasets would spend half a minute retrying the Hub for a name it cannot have."""
    local = _in_folder(dataset, base_dir)
    extension = os.path.splitext(dataset)[1].lower()
    if os.path.isdir(local) or (extension in _LOCAL_DATA and os.path.isfile(local)):
        return
    kinds = ", ".join(sorted(_LOCAL_DATA))
    if os.path.isfile(local):
        raise ConfigError(f"dataset {dataset!r}: {local} is a {extension or 'extensionless'} file; a local data set "
                          f"is a {kinds} file (or a folder of them)")
    namespace = dataset.split("/")[0]
    is_path = (extension in _LOCAL_DATA or dataset.startswith((".", "/", "~")) or dataset.count("/") > 1
               or ("/" in dataset and os.path.isdir(_in_folder(namespace, base_dir))))
    if not is_path:
        return  # a datasets hub name
    parent = os.path.dirname(local)
    siblings = os.listdir(parent) if os.path.isdir(parent) else []
    hint = _close_file(os.path.basename(local), siblings)
    raise ConfigError(f"dataset file {dataset!r} does not exist (looked for {local}){hint}; relative paths are read "
                      "from the config file's folder, and a hub data set is named namespace/name")


def load_train_dataset(name: str, split: str = "train", base_dir: str | None = None, prompt: dict | None = None,
                       config_name: str | None = None):
    """The data set `name` names: a local file (read from `base_dir` when relative), a local folder, or a datasets
    hub name; `split` of it. `prompt`: the config's `prompt:` key, which builds the "prompt" column from the other
    columns (build_prompts); without it the data set must have one. `config_name`: the config's `dataset_config`,
    the configuration of a hub data set that has several (datasets.load_dataset's `name`)."""
    import datasets

    if not isinstance(name, str):
        raise ConfigError(f"dataset must be a file path or a datasets hub name, got {name!r}")
    if not isinstance(split, str):
        raise ConfigError(f"dataset_split must be a split name such as 'train', got {split!r}")
    local = _in_folder(name, base_dir or os.getcwd())
    extension = os.path.splitext(name)[1].lower()
    check_local_dataset(name, base_dir or os.getcwd())
    _check_dataset_config(name, config_name)
    if extension in _LOCAL_DATA:
        name = local
        # a local file is read in a moment: its "Generating train split" bar would only stand on stderr before
        # the one error line a data set without a prompt column gives
        bars_were_on = not datasets.utils.are_progress_bars_disabled()
        datasets.utils.disable_progress_bars()
        try:  # one file loads as the one split "train"; the split still selects from it ("train[:100]")
            dataset = datasets.load_dataset(_LOCAL_DATA[extension], data_files=name, split=split)
        except ValueError as error:  # e.g. 'Unknown split "test". Should be one of ['train'].'
            raise ConfigError(f"cannot load dataset file {name!r} with dataset_split={split!r}: {error}") from None
        finally:
            if bars_were_on:
                datasets.utils.enable_progress_bars()
    else:
        name = local if os.path.isdir(local) else name
        try:
            dataset = datasets.load_dataset(name, config_name, split=split)
        except Exception as error:  # network, missing dataset, bad split: say which
            which = f"configuration {config_name!r}, " if config_name is not None else ""
            hint = ("; a data set of several configurations needs one named: dataset_config: NAME"
                    if config_name is None and "config" in str(error).lower() else "")
            raise ConfigError(f"cannot load dataset {name!r} ({which}split {split!r}): {_one_line(error)}{hint}"
                              ) from None
    if prompt is not None:
        return build_prompts(dataset, check_prompt_key(prompt), name)
    if "prompt" not in dataset.column_names:
        raise _no_prompt_column(name, dataset.column_names)
    return dataset


def _no_prompt_column(name: str, columns: list) -> ConfigError:
    """The error of a data set without a "prompt" column and no `prompt:` key: its columns and the line to add."""
    source = next((c for c in _PROMPT_LIKE_COLUMNS if c in columns), columns[0] if columns else "question")
    return ConfigError(f"dataset {name!r} has no 'prompt' column (columns: {columns}); to build chat prompts from "
                       f"its {source!r} column, add to the config: prompt: {{user: \"{{{source}}}\"}} (and "
                       "optionally system: \"...\"; docs/cli.md)")


def _first_jsonl_columns(path: str) -> list | None:
    """The keys of a .jsonl file's first record, read without the datasets library; None where it is not one JSON
    object per line (datasets then reads the file, and says what is wrong)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            line = next((line for line in f if line.strip()), "")
        record = json.loads(line)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return list(record) if isinstance(record, dict) else None


def _check_dataset_config(dataset: str, config_name) -> None:
    """`dataset_config`: None, or the name of a configuration of a hub data set (a local file has none)."""
    if config_name is not None and not isinstance(config_name, str):
        raise ConfigError(f"dataset_config must be the name of a configuration of the data set, got {config_name!r}")
    if config_name is not None and os.path.splitext(dataset)[1].lower() in _LOCAL_DATA:
        raise ConfigError(f"dataset_config={config_name!r} names a configuration of a hub data set; the file "
                          f"{dataset!r} has none: remove dataset_config")


def checkpoint_folders(folder: str) -> list:
    """(step, path) of the checkpoint folders transformers saves in `folder` (checkpoint-<step>), by step; [] where
    `folder` is none."""
    found = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            step = name[len(CHECKPOINT_PREFIX):]
            if name.startswith(CHECKPOINT_PREFIX) and step.isdigit() and os.path.isdir(os.path.join(folder, name)):
                found.append((int(step), os.path.join(folder, name)))
    return sorted(found)


def _check_resume(checkpoint, base_dir: str) -> None:
    """args.resume_from_checkpoint, when a path, names a checkpoint folder that exists: told before the model loads,
    with the checkpoints beside it, not as transformers' traceback when training starts."""
    if not isinstance(checkpoint, str) or os.path.isdir(_in_folder(checkpoint, base_dir)):
        return
    local = _in_folder(checkpoint, base_dir)
    parent = os.path.dirname(local)
    found = [os.path.basename(path) for _, path in checkpoint_folders(parent)]
    there = f"; {parent} holds {', '.join(found)}" if found else f"; {parent} holds no checkpoint-N folder"
    raise ConfigError(f"args.resume_from_checkpoint={checkpoint!r}: no checkpoint folder {local}{there} (relative "
                      "paths are read from the config file's folder)")


def check_config(config: dict, base_dir: str | None = None, flags: dict | None = None,
                 top_level_keys: tuple[str, ...] = _TOP_LEVEL_KEYS) -> dict:
    """Everything about a training config that can be checked without TRL, transformers or torch (which take
    seconds to import): the keys, the model directory, the `args` field names, their values' types and choices (by
    config_fields.field_specs), the group_filter name, the prompt key, the reward function names' form and a local
    data file's existence. Returns {"model": the resolved model, "args": the args converted to the field types,
    "reward_specs": the reward functions' names}; ConfigError naming what is wrong. `flags`: {"args.name": "--flag"}
    for the fields set on the command line (override_flags), which an unknown-field error names as the user typed
    them; a bare flag closer to one of `top_level_keys` than to any field (the study's `--stepz`) is pointed to that
    key's flag."""
    from . import config_fields
    from .filters import group_filter_spec

    base_dir = os.path.abspath(base_dir or os.getcwd())
    unknown = sorted(set(config) - set(_TOP_LEVEL_KEYS), key=str)
    if {"eval", "arms"} <= set(unknown):  # the length study's own keys: the config was given to the wrong command
        raise ConfigError(f"unknown config keys {unknown}: this is a length-study config (eval, arms); run it with "
                          "python -m gfpo_study run --config FILE (docs/study.md)")
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}{_unknown_hints(unknown, _TOP_LEVEL_KEYS)}; expected some of "
                          f"{sorted(_TOP_LEVEL_KEYS)}")
    for key in ("model", "dataset", "reward_funcs"):
        if key not in config:
            raise ConfigError(f"the config needs {key!r}")
    model = resolve_model(config["model"], base_dir)
    args = config.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"args must be a mapping of GFPOConfig fields (field: value), got {args!r}")
    specs = config_fields.field_specs()
    bad = sorted((name for name in args if name not in specs), key=str)
    if bad:
        typed = [flags[f"args.{name}"] for name in bad if f"args.{name}" in (flags or {})]
        where = f", given on the command line as {', '.join(typed)}" if typed else ""
        hint = _unknown_hints(bad, sorted(specs))
        if len(bad) == 1 and "." not in (flags or {}).get(f"args.{bad[0]}", "."):
            # a bare flag lands under args whatever was meant: it may be a misspelt top-level key
            keys = [k for k in top_level_keys if k != "args"]
            key = closest_name(bad[0], [*keys, *sorted(specs)])
            if key in keys:
                hint = f" (did you mean --{key}, the config's own key?)"
        raise ConfigError(f"unknown GFPOConfig fields {bad} under 'args'{hint}{where}")
    args = _convert_args(args, specs)
    try:
        group_filter_spec(args.get("group_filter"))
    except ValueError as error:
        raise ConfigError(f"args: {error}") from None
    _check_resume(args.get("resume_from_checkpoint"), base_dir)
    if config.get("prompt") is not None:
        check_prompt_key(config["prompt"])
    reward_specs = config["reward_funcs"]
    reward_specs = [reward_specs] if isinstance(reward_specs, str) else reward_specs
    if not isinstance(reward_specs, list) or not reward_specs or not all(isinstance(s, str) for s in reward_specs):
        raise ConfigError(f"reward_funcs must be one or more 'package.module:function' strings, got {reward_specs!r}")
    dataset, split = config["dataset"], config.get("dataset_split", "train")
    if not isinstance(dataset, str):
        raise ConfigError(f"dataset must be a file path or a datasets hub name, got {dataset!r}")
    if not isinstance(split, str):
        raise ConfigError(f"dataset_split must be a split name such as 'train', got {split!r}")
    local = _in_folder(dataset, base_dir)
    check_local_dataset(dataset, base_dir)
    _check_dataset_config(dataset, config.get("dataset_config"))
    if config.get("prompt") is None and os.path.splitext(dataset)[1].lower() == ".jsonl":
        columns = _first_jsonl_columns(local)  # GSM8K's question/answer: told now, not after the imports
        if columns is not None and "prompt" not in columns:
            raise _no_prompt_column(local, columns)
    return {"model": model, "args": args, "reward_specs": reward_specs}


def bf16_hint(args: dict, error: Exception) -> str:
    """What to change when GFPOConfig refused `args` for their bf16: true on a machine without bf16 (transformers'
    words name neither the field nor its value); "" for any other error."""
    if args.get("bf16") and "bf16" in str(error):
        return (" (the config sets bf16: true, which needs a GPU with bf16: on this machine set bf16: false, or "
                "--bf16 false on the command line)")
    return ""


def check_vllm_installed(args) -> None:
    """With use_vllm, the trainer's own check that vLLM is installed and in TRL's range (its one line, which names
    the install command), as a ConfigError before the model and data load, not an ImportError's traceback."""
    if not getattr(args, "use_vllm", False):
        return
    from ._compat import check_vllm_version

    try:
        check_vllm_version()
    except ImportError as error:
        raise ConfigError(f"args: {_one_line(error)}") from None


def build_trainer(config: dict, base_dir: str | None = None):
    """A GFPOTrainer from a parsed training config (checked first by check_config); relative paths in it are read
    from `base_dir` (the config file's folder; default: the working directory)."""
    from transformers import AutoTokenizer

    from .config import GFPOConfig
    from .trainer import GFPOTrainer

    base_dir = os.path.abspath(base_dir or os.getcwd())
    checked = check_config(config, base_dir)
    model, args = checked["model"], checked["args"]
    args.setdefault("output_dir", "gfpo-output")
    for name in PATH_ARGS:  # a deepspeed config may also be given inline, as a mapping: left as it is
        if isinstance(args.get(name), str) and not (name == "deepspeed" and args[name].lstrip().startswith("{")):
            args[name] = _in_folder(args[name], base_dir)
    reward_funcs = [load_reward_func(s, base_dir) for s in checked["reward_specs"]]
    try:
        args = GFPOConfig(**args)
    except (ValueError, TypeError) as error:  # GFPOConfig's and GRPOConfig's own checks name the field and value
        raise ConfigError(f"args: {_one_line(error)}{bf16_hint(args, error)}") from None
    check_vllm_installed(args)
    dataset = load_train_dataset(config["dataset"], config.get("dataset_split", "train"), base_dir,
                                 prompt=config.get("prompt"), config_name=config.get("dataset_config"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except OSError as error:
        raise ConfigError(f"cannot load model {model!r}: {error}") from None
    if config.get("prompt") is not None and not getattr(tokenizer, "chat_template", None):
        # TRL would fail at the first step, inside apply_chat_template
        raise ConfigError(f"the prompt key builds chat messages, and the tokenizer of model {model!r} has no chat "
                          "template: use an instruct (chat) model, or give the tokenizer a chat_template")
    try:
        return GFPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                           processing_class=tokenizer)
    except (ValueError, TypeError) as error:  # e.g. a filter without num_remains_in_group
        raise ConfigError(_one_line(error)) from None


def _convert_args(args: dict, specs: dict | None = None) -> dict:
    """YAML strings -> the GFPOConfig field types, as TRL's CLI converts them: PyYAML reads `1e-6` as a string, a
    quoted '4' or 'false' stays one, and GFPOConfig converts nothing. The types are those of HfArgumentParser's
    actions (what `trl grpo --learning_rate 1e-6` goes through), as config_fields.field_specs gives them. Values that
    are not strings must already be of the field's type (an int field takes no 2.5 nor 4.0, a float field no list),
    or the run would fail steps later inside transformers or TRL, naming neither the key nor the value. `specs`:
    config_fields.field_specs() when not given."""
    if specs is None:
        from .config_fields import field_specs

        specs = field_specs()
    converted = dict(args)
    for name, value in args.items():
        kind, choices, is_list = specs[name]
        # only the types that parse text: str needs nothing, and dict or config-object fields (liger_kernel_config,
        # parallelism_config) keep their string, which TrainingArguments reads as JSON itself
        if kind is None:
            continue
        if isinstance(value, str):
            converted[name] = _convert_value(name, value, kind, choices)
        elif is_list and isinstance(value, list):  # list[int] and the like: item by item
            converted[name] = [_convert_value(name, v, kind, choices) if isinstance(v, str)
                               else _checked(name, v, kind, choices) for v in value]
        elif value is not None:  # None: an optional field left unset
            converted[name] = _checked(name, value, kind, choices)
    return converted


def _checked(name: str, value, kind: str, choices):
    """A value YAML gave as a number, bool or list, checked against the field's type (a bool field also takes 0/1)."""
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(kind)
    what = {"int": "an int", "float": "a number"}.get(kind)
    if kind == "bool":
        if type(value) is int and value in (0, 1):
            return bool(value)
        ok, what = (lambda v: isinstance(v, bool)), "a bool (true/false, 1/0)"
    if ok is not None and not ok(value):
        raise ConfigError(f"args: {name}={value!r} is not {what}")
    if ok is None and choices is not None and isinstance(value, bool):
        # YAML 1.1 reads an unquoted no/off/false as False: `save_strategy: no` means the choice "no"
        if value is False and "no" in [str(choice) for choice in choices]:
            return _convert_value(name, "no", kind, choices)
        raise ConfigError(f"args: {name}={value!r} is not one of {list(choices)} (YAML reads an unquoted "
                          "yes/no/on/off as a bool: quote the choice)")
    if ok is None and choices is not None and value not in choices:
        raise ConfigError(f"args: {name}={value!r} is not one of {list(choices)}{_did_you_mean(value, choices)}")
    return value


# the words a bool field's string takes, as transformers' string_to_bool reads them (any case)
_BOOL_WORDS = {"true": True, "yes": True, "t": True, "y": True, "1": True,
               "false": False, "no": False, "f": False, "n": False, "0": False}


def _convert_value(name: str, value: str, kind: str, choices):
    """A string -> the field's kind, as HfArgumentParser's action for it converts `--name value`."""
    try:
        if kind == "bool":
            converted = _BOOL_WORDS[value.lower()]
        elif kind in ("int", "float"):
            converted = {"int": int, "float": float}[kind](value)
        else:  # a choice: the value whose text it is
            converted = {str(choice): choice for choice in choices}.get(value, value)
    except (ValueError, KeyError):
        what = "a bool (true/false, yes/no, 1/0)" if kind == "bool" else kind
        raise ConfigError(f"args: {name}={value!r} cannot be read as {what}") from None
    if choices is not None and converted not in choices:
        raise ConfigError(f"args: {name}={value!r} is not one of {list(choices)}{_did_you_mean(value, choices)}")
    return converted


def apply_overrides(config: dict, overrides: list[str], top_level_keys: tuple[str, ...],
                    section: str = "args") -> dict:
    """The config with command-line overrides applied, as `trl grpo --config F --max_steps 3` applies its flags.

    Each override is `--name value` or `--name=value`. `name` is a top-level key (`--model path`), a dotted path from
    one (`--args.max_steps 3`, `--eval.samples 4`: sections that do not exist yet are made), or a bare name that is no
    top-level key, which goes into `section` (`--max_steps 3` sets args.max_steps). Dashes in a name read as
    underscores (`--max-steps`), as in TRL's flags. A value is read as one YAML value: `3` is 3, `true` True,
    `[a, b]` a list, `null` None, and `1e-6` stays the string that the config's own conversion reads as a float. A
    mapping given for a mapping is merged into it (`--args '{max_steps: 3}'` keeps the file's other args). Names are
    not checked here: the config's validation reports an unknown one, with the close name.

    Args:
        config: the parsed YAML config (left unchanged).
        overrides: the command-line words after the command's own options, e.g. ["--max_steps", "3", "--bf16=true"].
        top_level_keys: the config's top-level keys (the first part of a dotted path must be one).
        section: where a bare name that is no top-level key goes.

    Returns:
        A new dict: `config` with every override applied, later ones over earlier ones.

    Raises:
        ConfigError naming the flag: a word that is no `--name`, a flag without a value, a value that is not YAML,
        a dotted path from no top-level key or through a value that is not a mapping.
    """
    import copy

    import yaml

    config = copy.deepcopy(config)
    words = list(overrides)
    while words:
        flag = words.pop(0)
        name, equals, value = flag.partition("=")
        if not name.startswith("--") or len(name) == 2:
            raise ConfigError(f"{flag!r}: overrides are --name value (or --name=value), e.g. --max_steps 3 or "
                              f"--{section}.max_steps 3")
        name = name[2:].replace("-", "_")
        if not equals:
            if not words or words[0].startswith("--"):
                raise ConfigError(f"{flag}: no value given; write {flag} VALUE or {flag}=VALUE (a switch takes true "
                                  f"or false: {flag} true)")
            value = words.pop(0)
        if value.strip() == "":
            raise ConfigError(f"--{name}: the value is empty; give one (null unsets an optional field: --{name} null)")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise ConfigError(f"--{name}={value!r} is not a YAML value ({_one_line(error)}); quote it for the "
                              "shell, e.g. --name '[1, 2]'") from None
        path = name.split(".")
        if len(path) == 1 and name not in top_level_keys:
            path = [section, name]
        if path[0] not in top_level_keys or not all(path):
            raise ConfigError(f"--{name}: the config has no section {path[0]!r}"
                              f"{_did_you_mean(path[0], top_level_keys)}; its keys: {list(top_level_keys)}")
        place = config
        for depth, key in enumerate(path[:-1]):
            if place.get(key) is None:
                place[key] = {}
            elif not isinstance(place[key], dict):
                where = ".".join(path[:depth + 1])
                raise ConfigError(f"--{name}: {where} is {place[key]!r}, not a mapping of fields; set it whole with "
                                  f"--{where} VALUE")
            place = place[key]
        place[path[-1]] = _merged(place.get(path[-1]), value)
    return config


def override_flags(overrides: list[str], top_level_keys: tuple[str, ...], section: str = "args") -> dict:
    """{dotted path: the flag as typed} for the overrides apply_overrides applies (`--max-step 3` gives
    {"args.max_step": "--max-step"}), so that an error about a field can name the flag that set it."""
    flags, words = {}, list(overrides)
    while words:
        flag = words.pop(0)
        name, equals, _ = flag.partition("=")
        if not name.startswith("--"):
            continue
        if not equals and words and not words[0].startswith("--"):
            words.pop(0)  # the flag's value
        path = name[2:].replace("-", "_")
        flags[path if "." in path or path in top_level_keys else f"{section}.{path}"] = name
    return flags


def _merged(old, new):
    """`new` over `old`: two mappings key by key (what `new` leaves out is kept), anything else replaced by `new`."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{key: _merged(old.get(key), value) for key, value in new.items()}}
    return new


def saved_line(output_dir: str) -> str:
    """`train`'s last line: where the trained model was saved, and what that folder holds (its files, its folders
    marked with a /, then its checkpoints, first to last)."""
    entries = sorted(os.listdir(output_dir))
    checkpoints = [os.path.basename(path) for _, path in checkpoint_folders(output_dir)]
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


# the packages of the trainer extra that `train` imports (pyproject.toml's `trainer` extra lists them with versions)
TRAIN_MODULES = ("yaml", "trl", "transformers", "datasets", "accelerate", "torch")


def _not_installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except (ValueError, ImportError):  # a module set to None in sys.modules, or a broken package
        return True


def _missing_dependency(name: str) -> int:
    """The one line for a package of the trainer extra that is not installed; the exit status 2."""
    missing = name.partition(".")[0]  # the package, not its submodule
    print(f"error: {missing!r} is not installed: gfpo's trainer needs its dependencies; from the checkout, "
          'pip install --no-build-isolation ".[trainer]" (docs/install.md)', file=sys.stderr)
    return 2


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


def read_config_file(path: str) -> dict:
    """The mapping in the YAML file `path` (`--config`). A file that is not there (with the close name of a file
    beside it), a folder, a file that is not YAML or holds no mapping is a ConfigError naming `--config` and the
    path."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        files = [f for f in os.listdir(folder) if f.endswith((".yaml", ".yml"))] if os.path.isdir(folder) else []
        raise ConfigError(f"--config {path!r}: no such file {os.path.abspath(path)}"
                          f"{_close_file(os.path.basename(path), files)}; give the path of the YAML config file"
                          ) from None
    except IsADirectoryError:
        found = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
        raise ConfigError(f"--config {path!r} is a folder; give the YAML config file itself"
                          + (f" (there: {', '.join(found)})" if found else "")) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path!r} is not valid YAML: {_one_line(error)}") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path!r} must hold a mapping (model: ..., dataset: ...), got "
                          f"{type(config).__name__}")
    return config


TRAIN_DESCRIPTION = (
    "Train with GFPO from a YAML config: a model, a data set with a \"prompt\" column (or a prompt key that builds "
    "one from its columns), reward functions and GFPOConfig fields (docs/cli.md). At the end the command says where it saved the trained model and what is there: "
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
                                epilog="\n\n".join(_doc_paragraphs()[1:]), formatter_class=_HelpFormatter,
                                usage="%(prog)s --config FILE.yaml [--field value ...]", allow_abbrev=False)
    train.add_argument("--config", required=True,
                       help="YAML file: model, dataset, reward_funcs, args (GFPOConfig fields), "
                       "and optionally dataset_split (default train), dataset_config and prompt. Any further --field value (or --field=value) "
                       "overrides the file: a GFPOConfig field (--max_steps 3, or --args.max_steps 3) or a top-level "
                       "key (--model DIR)")
    commands.add_parser("env", help="print the environment report for a bug report: versions, devices, the "
                        "extension, backends, and whether the installed TRL and vLLM are supported")
    for command in commands._choices_actions:  # a command's --help opens with its summary from the list above
        if commands.choices[command.dest].description is None:
            commands.choices[command.dest].description = _sentence(command.help)
    # the train command's further words are config overrides (apply_overrides); the other commands take none
    options, overrides = parser.parse_known_args(argv)
    if overrides and options.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if options.command == "env":  # needs no TRL: a bug report must be possible from a broken install
        from .env_report import environment_report

        print(environment_report())
        return 0
    # the training stack takes seconds to import: a missing package is found by name (find_spec imports nothing),
    # and the config is checked (check_config) before the stack is imported, so a mistake is reported at once
    missing = next((name for name in TRAIN_MODULES if _not_installed(name)), None)
    if missing is not None:
        return _missing_dependency(missing)
    # a mistake in the file is one line: what the libraries warn while the config is built (transformers' deprecation
    # FutureWarnings among them) is held back, and shown only when the config turns out to be good
    with warnings.catch_warnings(record=True) as held:
        try:
            config = read_config_file(options.config)
            config = apply_overrides(config, overrides, _TOP_LEVEL_KEYS)
            base_dir = os.path.dirname(os.path.abspath(options.config))
            check_config(config, base_dir, flags=override_flags(overrides, _TOP_LEVEL_KEYS))
            try:
                from .trainer import GFPOTrainer  # noqa: F401 (TRL, transformers, ...: build_trainer imports it again)
            except ModuleNotFoundError as error:  # a dependency of theirs
                return _missing_dependency(error.name or str(error))
            trainer = build_trainer(config, base_dir=base_dir)
        except (ConfigError, OSError) as error:
            print(f"error: {_one_line(error)}", file=sys.stderr)
            return 2
    for warning in held:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    from ._compat import quiet_known_noise

    quiet_known_noise()  # again: the trainer set these filters inside the block above, which undid them on leaving
    from transformers.trainer_callback import ProgressCallback

    from .progress import progress_callback

    if trainer.pop_callback(ProgressCallback) is not None:  # none with disable_tqdm or in a notebook
        trainer.add_callback(progress_callback())  # a bar that stays small in a log file
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
