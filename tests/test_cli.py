"""The command line: `train --config` with its errors, the commands' help and missing dependencies (the study's
command line: tests/test_study_command.py)."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
yaml = pytest.importorskip("yaml")

from gfpo_trainer import GROUP_FILTERS  # noqa: E402
from gfpo_trainer.cli import (  # noqa: E402
    _TOP_LEVEL_KEYS, ConfigError, apply_overrides, build_trainer, load_reward_func, main, saved_line)
from gfpo_study.sums_task import correctness_reward  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402

REPO = Path(__file__).parents[1]


def test_correctness_reward():
    prompts = ["12+7=", "3+4=", "3+4=", "3+4=", "3+4="]
    completions = [" 19", " hmm hmm so 7", " 8", "", " 7 or 17"]
    assert correctness_reward(prompts, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gfpo_test_utils import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("cli-model"))


@pytest.fixture
def dataset_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(8)))
    return str(path)


def _config(model_dir, dataset_file, tmp_path, **changes):
    config = {
        "model": model_dir,
        "dataset": dataset_file,
        "reward_funcs": ["gfpo_study.demo:correctness_reward"],
        "args": dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=8,
                     num_remains_in_group=4, group_filter="length", max_completion_length=6, max_steps=1,
                     use_cpu=True, bf16=False, report_to="none", save_strategy="no"),
    }
    config.update(changes)
    return config


def test_train_command(model_dir, dataset_file, tmp_path, capsys):
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path)))
    assert main(["train", "--config", str(config_file)]) == 0
    out = tmp_path / "out"
    assert (out / "config.json").exists()  # the trained model was saved
    # and the command's last line says where, and what is there: every file of the folder, the model's among them
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"saved the trained model to {out}: ")
    listed = last.split(": ", 1)[1].split(", ")
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(listed)
    assert sorted(listed) == sorted(path.name for path in out.iterdir())


def test_apply_overrides_sets_fields_sections_and_top_level_keys():
    """`--name value` and `--name=value`: a bare name goes into args (as `trl grpo --max_steps 3`), a dotted path
    into its section (made when missing), a top-level key replaces its value; values are YAML values."""
    config = {"model": "tiny", "args": {"max_steps": 1, "learning_rate": "1e-5"}}
    keys = ("model", "dataset", "args", "eval")
    got = apply_overrides(config, ["--max_steps", "3", "--args.learning_rate=1e-6", "--model", "other/dir",
                                   "--eval.samples", "4", "--report-to", "[tensorboard, wandb]", "--bf16", "true",
                                   "--epsilon", "-0.1", "--group_filter", "null", "--max_steps=5"], keys)
    assert got == {"model": "other/dir",
                   "args": {"max_steps": 5, "learning_rate": "1e-6", "report_to": ["tensorboard", "wandb"],
                            "bf16": True, "epsilon": -0.1, "group_filter": None},
                   "eval": {"samples": 4}}
    assert config == {"model": "tiny", "args": {"max_steps": 1, "learning_rate": "1e-5"}}  # not changed
    assert apply_overrides({}, ["--deep.a.b", "x"], ("deep",)) == {"deep": {"a": {"b": "x"}}}
    assert apply_overrides({"args": None}, ["--seed", "7"], ("args",)) == {"args": {"seed": 7}}
    assert apply_overrides({}, ["--max_steps", "3"], ("model", "eval"), section="eval") == {"eval": {"max_steps": 3}}
    # a mapping merges into a mapping, key by key; any other value replaces
    assert apply_overrides(config, ["--args", "{max_steps: 3, model_init_kwargs: {dtype: float32}}"], keys)["args"] == {
        "max_steps": 3, "learning_rate": "1e-5", "model_init_kwargs": {"dtype": "float32"}}
    assert apply_overrides({"prompt": {"system": "s", "user": "{q}"}}, ["--prompt", "{user: '{question}'}"],
                           ("prompt",)) == {"prompt": {"system": "s", "user": "{question}"}}
    assert apply_overrides({"reward_funcs": ["a:f", "b:g"]}, ["--reward_funcs", "[c:h]"], ("reward_funcs",)) == {
        "reward_funcs": ["c:h"]}


@pytest.mark.parametrize("overrides, message", [
    (["--max_steps"], "--max_steps: no value given; write --max_steps VALUE or --max_steps=VALUE (a switch takes "
     "true or false: --max_steps true)"),
    (["--bf16", "--max_steps", "3"], "--bf16: no value given; write --bf16 VALUE or --bf16=VALUE (a switch takes "
     "true or false: --bf16 true)"),
    (["--max_steps="], "--max_steps: the value is empty; give one (null unsets an optional field: --max_steps null)"),
    (["--argz.max_steps", "3"], "--argz.max_steps: the config has no section 'argz' (did you mean 'args'?); its "
     "keys: ['model', 'dataset', 'dataset_split', 'dataset_config', 'prompt', 'reward_funcs', 'args']"),
    (["--model.revision", "main"], "--model.revision: model is 'tiny', not a mapping of fields; set it whole with "
     "--model VALUE"),
    (["max_steps", "3"], "'max_steps': overrides are --name value (or --name=value), e.g. --max_steps 3 or "
     "--args.max_steps 3"),
    (["--report_to", "[a, b"], "--report_to='[a, b' is not a YAML value"),
])
def test_apply_overrides_errors_name_the_flag(overrides, message):
    with pytest.raises(ConfigError) as error:
        apply_overrides({"model": "tiny", "args": {}}, overrides, _TOP_LEVEL_KEYS)
    assert str(error.value).startswith(message), str(error.value)


def test_train_command_takes_field_overrides(model_dir, dataset_file, tmp_path, capsys):
    """`train --config F --field value`: the overrides reach GFPOConfig (converted like the file's values) and the
    run; an unknown field is the config's own error, with the close name."""
    config = _config(model_dir, dataset_file, tmp_path)
    overridden = apply_overrides(config, ["--num_remains_in_group", "2", "--args.group_filter=token_efficiency",
                                          "--learning_rate", "1e-6", "--use_gfpo_kernels", "false"], _TOP_LEVEL_KEYS)
    args = build_trainer(overridden).args
    assert (args.num_remains_in_group, args.group_filter, args.learning_rate, args.use_gfpo_kernels) == (
        2, "token_efficiency", 1e-6, False)
    assert config["args"]["num_remains_in_group"] == 4 and args.num_generations == 8  # the file's other values
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    shutil.rmtree(tmp_path / "out", ignore_errors=True)  # the trainer built above made it
    assert main(["train", "--config", str(config_file), "--max_steps", "2", "--save_strategy=steps",
                 "--save-steps", "2", "--output_dir", str(tmp_path / "other")]) == 0
    state = json.loads((tmp_path / "other" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and not (tmp_path / "out").exists()
    capsys.readouterr()
    assert main(["train", "--config", str(config_file), "--max_stepz", "3"]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['max_stepz'] under 'args' (did you mean "
                                       "'max_steps'?), given on the command line as --max_stepz\n")
    # the flag as typed, in any form; a misspelt name in the file is not said to come from the command line
    assert main(["train", "--config", str(config_file), "--max-step=3", "--args.bogus", "1"]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['bogus', 'max_step'] under 'args' (did you "
                                       "mean 'max_steps' for 'max_step'?), given on the command line as --args.bogus, "
                                       "--max-step\n")
    config_file.write_text(yaml.safe_dump({**config, "args": {**config["args"], "max_stepz": 3}}))
    assert main(["train", "--config", str(config_file), "--max_steps", "2"]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['max_stepz'] under 'args' (did you mean "
                                       "'max_steps'?)\n")
    config_file.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(config_file), "--max_steps"]) == 2
    assert capsys.readouterr().err.startswith("error: --max_steps: no value given; ")
    with pytest.raises(SystemExit):  # the other commands take no overrides
        main(["env", "--max_steps", "3"])
    assert "unrecognized arguments: --max_steps 3" in capsys.readouterr().err


def test_saved_line_lists_files_folders_and_checkpoints_in_step_order(tmp_path):
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_text("")
    for name in ("runs", "checkpoint-10", "checkpoint-9", "checkpoint-100"):
        (tmp_path / name).mkdir()
    assert saved_line(str(tmp_path)) == (f"saved the trained model to {tmp_path}: config.json, model.safetensors, "
                                         "runs/; checkpoints: checkpoint-9 to checkpoint-100 (3)")
    for name in ("checkpoint-10", "checkpoint-100"):
        (tmp_path / name).rmdir()
    assert saved_line(str(tmp_path)).endswith("runs/; checkpoints: checkpoint-9")


def test_train_command_resumes_from_a_checkpoint(model_dir, dataset_file, tmp_path, capsys):
    """args.resume_from_checkpoint continues the run (the Trainer does not read it itself: the CLI passes it to
    train(), as TRL's scripts do); a run into an output_dir holding checkpoints without it warns that it starts
    again."""
    args = dict(_config(model_dir, dataset_file, tmp_path)["args"], save_strategy="steps", save_steps=1, max_steps=2,
                logging_steps=1)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path, args=args)))
    assert main(["train", "--config", str(config_file)]) == 0
    checkpoint = tmp_path / "out" / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    printed = capsys.readouterr()
    assert state["global_step"] == 2 and "warning:" not in printed.err
    assert printed.out.endswith("; checkpoints: checkpoint-1 to checkpoint-2 (2)\n")

    resumed = dict(args, max_steps=3, resume_from_checkpoint=str(checkpoint))
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path, args=resumed)))
    shutil.rmtree(tmp_path / "out" / "checkpoint-1")  # a run restarted from the model would write it again
    assert main(["train", "--config", str(config_file)]) == 0
    assert not (tmp_path / "out" / "checkpoint-1").exists()
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    steps = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert state["global_step"] == 3 and steps == [1, 2, 3]  # steps 1-2 from the first run's history, then 3
    assert "warning:" not in capsys.readouterr().err

    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path, args=dict(args, max_steps=1))))
    assert main(["train", "--config", str(config_file)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'out'} already holds" in err and "set args.resume_from_checkpoint" in err


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model="/nonexistent/model"), r"^model '/nonexistent/model': no directory /nonexistent/model \(relative"),
        (dict(model="./models/tiny"), r"^model './models/tiny': no directory .*/models/tiny \(relative paths are read"),
        (dict(model="Qwen/../x"), r"^model 'Qwen/../x': no directory .*/x \(relative paths"),
        (dict(model=["a"]), r"^model must be a Hub name \(namespace/name\) or a local directory, got \['a'\]$"),
        (dict(reward_funcs=[]), r"reward_funcs must be one or more 'package.module:function' strings, got \[\]"),
        (dict(args={"num_remains_in_group": 9, "num_generations": 8}),
         r"args: num_remains_in_group must be an int with 2 <= k < num_generations=8 .*got num_remains_in_group=9"),
        (dict(args={"group_filter": "shortest", "num_remains_in_group": 4}),
         re.escape(f"args: group_filter must be None or one of {GROUP_FILTERS}, got group_filter='shortest' (did you "
                   "mean 'length'? the filter the paper calls 'shortest', which keeps the k completions with the "
                   "fewest tokens)")),
        (dict(args={"per_device_train_batch_size": 8, "num_generations": 16}),
         r"^args: per_device_train_batch_size=8 x 1 process x gradient_accumulation_steps=1 = 8 completions per "
         r"generation batch, which must hold whole groups of num_generations=16: .* per_device_train_batch_size=16"),
        (dict(args={"num_remains_in_group": 4, "num_generations": 8, "per_device_train_batch_size": 8}),
         re.escape(f"num_remains_in_group is set: give exactly one of GFPOConfig.group_filter (one of "
                   f"{GROUP_FILTERS}; got None) and group_filter_func (got None)")),
        (dict(dataset="/nonexistent/train.jsonl"),
         r"dataset file '/nonexistent/train.jsonl' does not exist \(looked for /nonexistent/train.jsonl\)"),
        (dict(reward_funcs=["gfpo_study.demo:nope"]), r"module 'gfpo_study.demo' has no function 'nope'; its "
         r"functions: \[.*'correctness_reward', .*\]$"),
        (dict(reward_funcs=["gfpo_study.demo:correctnes_reward"]),
         r"^reward function 'gfpo_study.demo:correctnes_reward': module 'gfpo_study.demo' has no function "
         r"'correctnes_reward' \(did you mean 'correctness_reward'\?\); its functions: \[.*'correctness_reward'"),
        (dict(reward_funcs=["gfpo_trainer.filters:GROUP_FILTERS"]),
         r"module 'gfpo_trainer.filters' has 'GROUP_FILTERS' of type tuple, not a function; its functions: \[.*"
         r"'group_filter_spec'"),
        (dict(reward_funcs=["no_such_module:f"]), r"^reward function 'no_such_module:f': no module 'no_such_module' in "
         r"the config file's folder .* \(modules there: \[.*\]\) or elsewhere on the Python path$"),
        (dict(args={"num_generationz": 8}),
         r"^unknown GFPOConfig fields \['num_generationz'\] under 'args' \(did you mean 'num_generations'\?\)$"),
        (dict(args={"lerning_rate": 1.0, "xyzzy": 1, "num_generationz": 8}),
         r"^unknown GFPOConfig fields \['lerning_rate', 'num_generationz', 'xyzzy'\] under 'args' \(did you mean "
         r"'learning_rate' for 'lerning_rate', 'num_generations' for 'num_generationz'\?\)$"),
        (dict(optimiser="adam"), r"^unknown config keys \['optimiser'\]; expected some of"),
        (dict(reward_func=["m:f"]), r"^unknown config keys \['reward_func'\] \(did you mean 'reward_funcs'\?\); "),
        (dict(args=["output_dir", "out"]),
         r"args must be a mapping of GFPOConfig fields \(field: value\), got \['output_dir', 'out'\]"),
        (dict(args={"num_generations": "four"}), r"^args: num_generations='four' cannot be read as int$"),
        (dict(args={"learning_rate": "1e-6x"}), r"^args: learning_rate='1e-6x' cannot be read as float$"),
        (dict(args={"use_gfpo_kernels": "maybe"}), r"^args: use_gfpo_kernels='maybe' cannot be read as a bool"),
        (dict(args={"lr_scheduler_type": "cosin"}),
         r"^args: lr_scheduler_type='cosin' is not one of \['linear', .*\] \(did you mean 'cosine'\?\)$"),
        (dict(args={"group_filter": "lenght", "num_remains_in_group": 4}),
         re.escape(f"args: group_filter must be None or one of {GROUP_FILTERS}, got group_filter='lenght' (did you "
                   "mean 'length'?)")),
        (dict(args={"scale_rewards": "grup"}), r"got scale_rewards='grup' \(did you mean 'group'\?\)$"),
        (dict(args={"adaptive_difficulty": True, "adaptive_num_remains": ["8", "x", 4, 2]}),
         r"^args: adaptive_num_remains='x' cannot be read as int$"),
        (dict(dataset_split="test"),
         r"cannot load dataset file '.*train.jsonl' with dataset_split='test': Unknown split \"test\"\. Should be "
         r"one of \['train'\]"),
        (dict(dataset_split=3), r"dataset_split must be a split name such as 'train', got 3"),
        # values YAML gives as numbers or lists, of the wrong type: transformers or TRL would fail steps later
        (dict(args={"max_steps": 2.5}), r"^args: max_steps=2.5 is not an int$"),
        (dict(args={"num_generations": 8.0}), r"^args: num_generations=8.0 is not an int$"),
        (dict(args={"learning_rate": [1]}), r"^args: learning_rate=\[1\] is not a number$"),
        (dict(args={"use_cpu": 2}), r"^args: use_cpu=2 is not a bool \(true/false, 1/0\)$"),
        (dict(args={"adaptive_difficulty": True, "adaptive_num_remains": [8, 2.5, 4, 2]}),
         r"^args: adaptive_num_remains=2.5 is not an int$"),
        (dict(dataset=["a.jsonl", "b.jsonl"]), r"^dataset must be a file path or a datasets hub name, got \['a.jsonl'"),
        # GRPOConfig takes these and TRL fails only at the first training step
        (dict(args={"loss_type": "foo"}), r"^args: loss_type must be one of \('grpo', .*'vespo'\), got loss_type='foo'$"),
        (dict(args={"loss_type": "dapoo"}), r"^args: loss_type must be one of .*, got loss_type='dapoo' \(did you mean "
         r"'dapo'\?\)$"),
        (dict(args={"importance_sampling_level": "tok"}),
         r"^args: importance_sampling_level must be one of \('token', 'sequence'\), got "
         r"importance_sampling_level='tok' \(did you mean 'token'\?\)$"),
    ],
)
def test_train_config_errors(model_dir, dataset_file, tmp_path, change, match):
    with pytest.raises(ConfigError, match=match):
        build_trainer(_config(model_dir, dataset_file, tmp_path, **change))


def test_yaml_strings_take_the_field_types(model_dir, dataset_file, tmp_path):
    """PyYAML reads 1e-6 as a string, and quoted numbers and booleans stay strings: the CLI converts them by the
    field types, as TRL's CLI does (unconverted, Adam failed on lr '1e-6', '8' on '%', and 'false' was True)."""
    config = _config(model_dir, dataset_file, tmp_path)
    args = config.pop("args")
    args.pop("num_generations")
    text = yaml.safe_dump(config) + "args:\n" + "".join(f"  {line}\n" for line in yaml.safe_dump(args).splitlines())
    text += "  learning_rate: 1e-6\n  max_grad_norm: '0.5'\n  num_generations: '8'\n  use_gfpo_kernels: 'false'\n"
    text += "  skip_zero_gradient_rows: 'no'\n"
    config = yaml.safe_load(text)
    assert config["args"]["learning_rate"] == "1e-6" and config["args"]["num_generations"] == "8"  # what YAML gives
    args = build_trainer(config).args
    assert (args.learning_rate, args.max_grad_norm, args.num_generations) == (1e-6, 0.5, 8)
    assert args.use_gfpo_kernels is False and args.skip_zero_gradient_rows is False
    assert args.bf16 is False and args.max_steps == 1  # values already of the field's type pass unchanged
    config_file = tmp_path / "config.yaml"
    config_file.write_text(text)
    assert main(["train", "--config", str(config_file)]) == 0  # trains: the optimizer got a float learning rate


def test_an_unquoted_yaml_no_is_the_choice_no(model_dir, dataset_file, tmp_path):
    """YAML 1.1 reads `save_strategy: no` as False: the CLI takes it as the choice "no", in the file and as a flag;
    a bool where no choice "no" exists says to quote the value."""
    config = _config(model_dir, dataset_file, tmp_path)
    config["args"].pop("save_strategy", None)
    text = yaml.safe_dump(config) + ""
    config = yaml.safe_load(text.replace("args:\n", "args:\n  save_strategy: no\n", 1))
    assert config["args"]["save_strategy"] is False  # what YAML gives
    assert build_trainer(config).args.save_strategy == "no"
    config["args"]["lr_scheduler_type"] = False
    with pytest.raises(ConfigError, match=r"^args: lr_scheduler_type=False is not one of \['linear', .*\] \(YAML "
                       r"reads an unquoted yes/no/on/off as a bool: quote the choice\)$"):
        build_trainer(config)


def test_a_reward_module_that_is_not_there_names_the_folder_and_its_modules(model_dir, dataset_file, tmp_path,
                                                                           monkeypatch, capsys):
    """A misspelt reward module: one line naming where it was looked for, the modules there and the close one."""
    (tmp_path / "gfpo_cli_typo_rewards.py").write_text("def digits(completions, **kwargs):\n    return [0.0]\n")
    (tmp_path / "notes.txt").write_text("not a module\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the config's folder is put first on it
    config = _config(model_dir, dataset_file, tmp_path, reward_funcs=["gfpo_cli_typo_reward:digits"])
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(config_file)]) == 2
    assert capsys.readouterr().err == (
        "error: reward function 'gfpo_cli_typo_reward:digits': no module 'gfpo_cli_typo_reward' (did you mean "
        f"'gfpo_cli_typo_rewards'?) in the config file's folder {tmp_path} (modules there: ['gfpo_cli_typo_rewards']) "
        "or elsewhere on the Python path\n")
    # a module that imports a missing one is not itself missing: the import error says which
    (tmp_path / "gfpo_cli_rewards_needing_more.py").write_text("import gfpo_no_such_dependency\n")
    with pytest.raises(ConfigError, match=r"^reward function 'gfpo_cli_rewards_needing_more:f': cannot import module "
                                          r"'gfpo_cli_rewards_needing_more' \(ModuleNotFoundError: No module named "
                                          r"'gfpo_no_such_dependency'\)$"):
        load_reward_func("gfpo_cli_rewards_needing_more:f", str(tmp_path))


def test_reward_module_with_a_syntax_error(tmp_path, monkeypatch):
    (tmp_path / "gfpo_test_broken_rewards.py").write_text("def correctness(prompts, completions:\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"reward function 'gfpo_test_broken_rewards:correctness': cannot import "
                                          r"module 'gfpo_test_broken_rewards' \(SyntaxError: .*"
                                          r"gfpo_test_broken_rewards.py, line 1\)"):
        load_reward_func("gfpo_test_broken_rewards:correctness")


def test_dataset_split_slices_a_local_file(model_dir, dataset_file, tmp_path):
    trainer = build_trainer(_config(model_dir, dataset_file, tmp_path, dataset_split="train[:3]"))
    assert trainer.train_dataset["prompt"] == ["0+0=", "1+1=", "2+2="]


def test_missing_prompt_column(model_dir, tmp_path):
    """A data set without "prompt" (GSM8K's question/answer): the error names the columns and the line to add."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "#### 2"}) + "\n")
    with pytest.raises(ConfigError) as error:
        build_trainer(_config(model_dir, str(path), tmp_path))
    assert str(error.value) == (
        f"dataset '{path}' has no 'prompt' column (columns: ['question', 'answer']); to build chat prompts from its "
        "'question' column, add to the config: prompt: {user: \"{question}\"} (and optionally system: \"...\"; "
        "docs/cli.md)")
    line = str(error.value).split("add to the config: ")[1].split(" (and")[0]
    assert yaml.safe_load(line) == {"prompt": {"user": "{question}"}}  # the line to add is YAML as printed
    path.write_text(json.dumps({"problem": "1+1=", "solution": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"from its 'problem' column, add to the config: prompt: \{user: "
                                          r"\"\{problem\}\"\}"):
        build_trainer(_config(model_dir, str(path), tmp_path))


# a template of the form chat models have (role, then content), in the tiny tokenizer's characters
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} ; {% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(model_dir, tmp_path_factory):
    """The tiny model with a chat template on its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("cli-chat-model") / "tiny-chat"
    shutil.copytree(model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


QUESTIONS = [(f"what is {a} plus {a + 1}?", f"{a} + {a + 1} = {2 * a + 1}\n#### {2 * a + 1}") for a in range(8)]


@pytest.fixture
def question_file(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    return str(path)


def test_prompt_key_builds_chat_prompts_from_the_columns(chat_model_dir, question_file, tmp_path):
    config = _config(chat_model_dir, question_file, tmp_path,
                     prompt={"system": "answer with a number", "user": "q: {question}"})
    dataset = build_trainer(config).train_dataset
    assert dataset.column_names == ["question", "answer", "prompt"]
    assert dataset[3]["prompt"] == [{"role": "system", "content": "answer with a number"},
                                    {"role": "user", "content": "q: what is 3 plus 4?"}]
    assert [row["answer"] for row in dataset] == [a for _, a in QUESTIONS]  # the other columns stay
    config["prompt"] = {"user": "{question}"}  # no system message: the user message alone
    assert build_trainer(config).train_dataset[0]["prompt"] == [{"role": "user", "content": "what is 0 plus 1?"}]


def test_prompt_key_answer_column_reaches_the_reward_function(chat_model_dir, question_file, tmp_path, monkeypatch):
    """A real run: every reward call gets the `answer` of the very row whose question its prompt holds."""
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "gfpo_cli_answer_rewards.py").write_text(
        "import json\n"
        "def final_number(completions, prompts, answer, **kwargs):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(json.dumps({'prompts': prompts, 'answer': answer}) + '\\n')\n"
        "    return [float(a.split('####')[1].strip() in c[0]['content']) for c, a in zip(completions, answer)]\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = _config(chat_model_dir, question_file, tmp_path, prompt={"system": "be brief", "user": "{question}"},
                     reward_funcs=["gfpo_cli_answer_rewards:final_number"])
    config["args"].update(max_steps=2, logging_steps=1)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(config_file)]) == 0
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(logged) == 2  # one call per generation batch, 8 rows (1 prompt x 8 generations) each
    answer_of = dict(QUESTIONS)
    for call in logged:
        assert len(call["answer"]) == 8
        for prompt, answer in zip(call["prompts"], call["answer"]):
            assert prompt[0] == {"role": "system", "content": "be brief"}
            assert answer == answer_of[prompt[1]["content"]]


@pytest.mark.parametrize("prompt, message", [
    ("{question}", "prompt must be a mapping of the chat messages to build, prompt: {system: \"optional system "
     "message\", user: \"{question}\"}; got '{question}'"),
    ({"usr": "{question}"}, "unknown prompt keys ['usr'] (did you mean 'user'?); expected ['system', 'user']: "),
    ({"system": "be brief"}, "prompt needs user, the user message made from each row's columns, e.g. prompt: "),
    ({"user": "{question}", "system": ["a"]}, "prompt: system must be a string (the system message), got ['a']"),
    ({"user": "{question"}, "prompt: user='{question' is not a format string (expected '}' before end of string); "),
    ({"user": "{questoin}"}, "prompt: user='{questoin}' names no column ['questoin'] (did you mean 'question'?); "
     "the dataset's columns: ['question', 'answer']"),
    ({"user": "solve it"}, "prompt: user='solve it' names no column, so every prompt would be the same; "),
])
def test_prompt_key_errors(chat_model_dir, question_file, tmp_path, prompt, message):
    with pytest.raises(ConfigError) as error:
        build_trainer(_config(chat_model_dir, question_file, tmp_path, prompt=prompt))
    assert str(error.value).startswith(message), str(error.value)


def test_prompt_key_needs_a_chat_template_and_no_prompt_column(chat_model_dir, dataset_file, question_file, tmp_path):
    no_template = tmp_path / "no-template"  # the tiny tokenizer has a chat template: this one has none
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    make_tiny_model(tokenizer).save_pretrained(no_template)
    tokenizer.save_pretrained(no_template)
    with pytest.raises(ConfigError, match=r"^the prompt key builds chat messages, and the tokenizer of model .* has "
                                          r"no chat template: use an instruct \(chat\) model, or give"):
        build_trainer(_config(str(no_template), question_file, tmp_path, prompt={"user": "{question}"}))
    with pytest.raises(ConfigError, match=r"has a 'prompt' column already, and the config's prompt key would build "
                                          r"another: remove the prompt key"):
        build_trainer(_config(chat_model_dir, dataset_file, tmp_path, prompt={"user": "{prompt}"}))


def test_train_command_reports_errors(tmp_path, capsys):
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({"dataset": "x.jsonl", "reward_funcs": []}))
    assert main(["train", "--config", str(config_file)]) == 2
    assert "error: the config needs 'model'" in capsys.readouterr().err


def test_a_config_file_that_cannot_be_read_is_one_line_naming_config(tmp_path, capsys, monkeypatch):
    """--config naming no file (a typo of a file beside it), a folder, a YAML syntax error or a list: one error line
    naming --config and the path, exit status 2, no OSError's errno words."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("model: m\n")
    (tmp_path / "kstudy.yaml").write_text("model: m\n")  # as close to 'nosuch.yaml' as .yaml makes it: no hint
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text("model: m\n")
    (tmp_path / "broken.yaml").write_text("model: m\nargs: {output_dir: out\n")
    (tmp_path / "list.yaml").write_text("- model\n")
    expected = {
        "rnu.yaml": f"error: --config 'rnu.yaml': no such file {tmp_path / 'rnu.yaml'} (did you mean 'run.yaml'?); "
                    "give the path of the YAML config file",
        "configs": "error: --config 'configs' is a folder; give the YAML config file itself (there: a.yaml)",
        "list.yaml": "error: --config 'list.yaml' must hold a mapping (model: ..., dataset: ...), got list",
    }
    expected["nosuch.yaml"] = (f"error: --config 'nosuch.yaml': no such file {tmp_path / 'nosuch.yaml'}; give the path "
                               "of the YAML config file")
    for path, line in expected.items():
        assert main(["train", "--config", path]) == 2
        assert capsys.readouterr().err == line + "\n"
    assert main(["train", "--config", "broken.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config 'broken.yaml' is not valid YAML: while parsing a flow mapping") and \
        'line 2, column 7' in err and err.count("\n") == 1, err


def test_a_misspelt_top_level_key_as_a_bare_flag_points_to_its_flag(model_dir, dataset_file, tmp_path, capsys):
    """`--mdoel DIR` lands under args as a bare flag does; closer to `model` than to any GFPOConfig field
    (`do_eval` is close too), it is pointed to `--model`. A dotted flag says where it is: the closest field then."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path)))
    assert main(["train", "--config", str(config_file), "--mdoel", model_dir]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['mdoel'] under 'args' (did you mean --model, "
                                       "the config's own key?), given on the command line as --mdoel\n")
    assert main(["train", "--config", str(config_file), "--args.mdoel", model_dir]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['mdoel'] under 'args' (did you mean "
                                       "'do_eval'?), given on the command line as --args.mdoel\n")


def test_a_dataset_path_that_is_no_data_file_is_told_before_any_hub_lookup(model_dir, tmp_path, capsys):
    """`dataset:` naming a local path that is no data file (missing, a .txt, a typo) is one line naming where it
    looked and a close name, at once: datasets would take it for a hub name and retry the Hub for half a minute."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp_path / "data" / "notes.txt").write_text("1+1=\n")
    (tmp_path / "data" / "foo.jsonl").write_text('{"prompt": "1+1="}\n')  # close to 'bar.jsonl' by .jsonl alone
    config = _config(model_dir, "data/train.jsonl", tmp_path)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    expected = {
        "data/train.txt": f"error: dataset file 'data/train.txt' does not exist (looked for {tmp_path}/data/train.txt) "
                          "(did you mean 'train.jsonl'?); relative paths are read from the config file's folder, and a "
                          "hub data set is named namespace/name",
        "data/trian.jsonl": f"error: dataset file 'data/trian.jsonl' does not exist (looked for "
                            f"{tmp_path}/data/trian.jsonl) (did you mean 'train.jsonl'?); relative paths are read from "
                            "the config file's folder, and a hub data set is named namespace/name",
        "./train.jsonl": f"error: dataset file './train.jsonl' does not exist (looked for {tmp_path}/train.jsonl); "
                         "relative paths are read from the config file's folder, and a hub data set is named "
                         "namespace/name",
        "data/bar.jsonl": f"error: dataset file 'data/bar.jsonl' does not exist (looked for {tmp_path}/data/bar.jsonl); "
                          "relative paths are read from the config file's folder, and a hub data set is named "
                          "namespace/name",
        "data/notes.txt": f"error: dataset 'data/notes.txt': {tmp_path}/data/notes.txt is a .txt file; a local data "
                          "set is a .csv, .json, .jsonl, .parquet file (or a folder of them)",
    }
    for dataset, line in expected.items():
        assert main(["train", "--config", str(config_file), "--dataset", dataset]) == 2
        assert capsys.readouterr().err == line + "\n"
    from gfpo_trainer.cli import check_local_dataset

    check_local_dataset("openai/gsm8k", str(tmp_path))  # a hub name: left to datasets
    check_local_dataset("data", str(tmp_path))  # a local folder


def test_a_study_config_given_to_train_says_which_command_runs_it(capsys):
    """examples/gsm8k/study.yaml given to `train`: not "did you mean 'args' for 'arms'?", but the study's command."""
    assert main(["train", "--config", str(REPO / "examples" / "gsm8k" / "study.yaml")]) == 2
    assert capsys.readouterr().err == (
        "error: unknown config keys ['arms', 'checkpoint_every', 'eval', 'eval_every', 'prompts_per_step', 'seeds', "
        "'steps']: this is a "
        "length-study config (eval, arms); run it with python -m gfpo_study run --config FILE (docs/study.md)\n")


def test_resuming_from_a_checkpoint_that_is_not_there_is_one_line(model_dir, dataset_file, tmp_path, capsys):
    """A resume_from_checkpoint folder that does not exist is told before the model loads, with the checkpoints
    that do exist (transformers raised ValueError, a traceback, once training started)."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path)))
    (tmp_path / "out" / "checkpoint-24").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-8").mkdir()
    assert main(["train", "--config", str(config_file), "--resume_from_checkpoint", "out/checkpoint-99"]) == 2
    assert capsys.readouterr().err == (
        f"error: args.resume_from_checkpoint='out/checkpoint-99': no checkpoint folder {tmp_path}/out/checkpoint-99; "
        f"{tmp_path}/out holds checkpoint-8, checkpoint-24 (relative paths are read from the config file's folder)\n")
    assert main(["train", "--config", str(config_file), "--resume_from_checkpoint", "run2/checkpoint-1"]) == 2
    assert capsys.readouterr().err.endswith(f"{tmp_path}/run2 holds no checkpoint-N folder (relative paths are read "
                                            "from the config file's folder)\n")


def test_use_vllm_without_vllm_is_one_line_before_the_model_loads(model_dir, dataset_file, tmp_path, capsys):
    """`--use_vllm true` where vLLM is not installed: the trainer's own line (what to install), as a config error
    with exit status 2, not its ImportError's traceback after the model and data loaded."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from gfpo_trainer._compat import VLLM_INSTALL_HINT

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path)))
    assert main(["train", "--config", str(config_file), "--use_vllm", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: args: use_vllm=True needs vllm ") and err.endswith(
        f", and vLLM is not installed: {VLLM_INSTALL_HINT}\n") and err.count("\n") == 1, err


def test_load_reward_func_forms():
    assert load_reward_func("gfpo_study.demo.correctness_reward") is correctness_reward
    assert load_reward_func("gfpo_study.demo:correctness_reward") is correctness_reward
    with pytest.raises(ConfigError, match="must look like 'package.module:function'"):
        load_reward_func("correctness_reward")


def test_each_config_gets_the_reward_module_of_its_own_folder(tmp_path, monkeypatch):
    """Two configs in one process, each beside its own my_rewards.py (tests, notebooks): the second gets its own
    folder's module, not the one the first imported under the same name."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for folder, body in (("a", "def first(completions, **kw):\n    return [1.0]\n"),
                         ("b", "def second(completions, **kw):\n    return [2.0]\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "gfpo_test_same_name.py").write_text(body)
    monkeypatch.delitem(sys.modules, "gfpo_test_same_name", raising=False)
    try:
        assert load_reward_func("gfpo_test_same_name:first", base_dir=str(tmp_path / "a"))([]) == [1.0]
        assert load_reward_func("gfpo_test_same_name:second", base_dir=str(tmp_path / "b"))([]) == [2.0]
        assert load_reward_func("gfpo_test_same_name:first", base_dir=str(tmp_path / "a"))([]) == [1.0]
    finally:
        sys.modules.pop("gfpo_test_same_name", None)


def test_hub_names_with_dots_pass_validation(model_dir, dataset_file, tmp_path, monkeypatch):
    """`Qwen/Qwen2.5-0.5B-Instruct` is a Hub name: validation lets it through to the download (none here)."""
    import gfpo_trainer.cli as cli

    monkeypatch.setattr(cli, "load_train_dataset", lambda *a, **k: (_ for _ in ()).throw(ConfigError("reached")))
    with pytest.raises(ConfigError, match="reached"):
        build_trainer(_config("Qwen/Qwen2.5-0.5B-Instruct", dataset_file, tmp_path))


def test_model_is_a_local_directory_or_a_hub_name(tmp_path):
    """The one rule for `model:` (gfpo_trainer/cli.py, docs/cli.md): a directory of that name in the config file's
    folder, else a Hub name namespace/name, else an error naming the directory looked for (no Hub lookup)."""
    from gfpo_trainer.cli import resolve_model

    (tmp_path / "tiny-model").mkdir()
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "weights.safetensors").write_text("")
    where = f"(relative paths are read from the config file's folder {tmp_path}; a Hub model is named namespace/name)"
    assert resolve_model("tiny-model", str(tmp_path)) == str(tmp_path / "tiny-model")
    assert resolve_model("models/tiny", str(tmp_path)) == str(tmp_path / "models" / "tiny")
    assert resolve_model(str(tmp_path / "tiny-model"), "/elsewhere") == str(tmp_path / "tiny-model")
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path)) == "Qwen/Qwen2.5-0.5B-Instruct"
    for model, looked_for, hint in [
        ("tiny_model", tmp_path / "tiny_model", " (did you mean 'tiny-model'?)"),  # a typo: not a Hub name
        ("./tiny_model", tmp_path / "tiny_model", " (did you mean 'tiny-model'?)"),
        ("models/tiny2", tmp_path / "models" / "tiny2", " (did you mean 'tiny'?)"),  # models/ is here: a path
        ("gpt2", tmp_path / "gpt2", ""),
        ("~/gfpo-no-such-model", Path.home() / "gfpo-no-such-model", ""),
    ]:
        with pytest.raises(ConfigError) as error:
            resolve_model(model, str(tmp_path))
        assert str(error.value) == f"model {model!r}: no directory {looked_for}{hint} {where}"
    with pytest.raises(ConfigError, match=r"^model 'weights.safetensors': .*weights.safetensors is a file; model "
                                          r"needs the directory holding the model's files$"):
        resolve_model("weights.safetensors", str(tmp_path))


def test_paths_are_read_from_the_config_files_folder(model_dir, tmp_path, monkeypatch):
    """Started from another working directory, a run finds the model, data and reward module beside its YAML file
    and writes its output_dir there."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(model_dir, project / "tiny-model")
    (project / "data").mkdir()
    (project / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(8)))
    (project / "gfpo_cli_rewards_beside_the_yaml.py").write_text(
        "def digits(completions, **kwargs):\n    return [float(sum(c.isdigit() for c in t)) for t in completions]\n")
    config = dict(_config("tiny-model", "data/train.jsonl", tmp_path,
                          reward_funcs=["gfpo_cli_rewards_beside_the_yaml:digits"]))
    config["args"] = dict(config["args"], output_dir="out")
    (project / "run.yaml").write_text(yaml.safe_dump(config))
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a regression to a Hub lookup fails at once instead of retrying
    monkeypatch.setattr(sys, "path", list(sys.path))  # the config's folder is put first on it
    assert main(["train", "--config", "../project/run.yaml"]) == 0
    assert (project / "out" / "config.json").exists() and not (elsewhere / "out").exists()


def test_output_dir_defaults_to_gfpo_output_beside_the_config(model_dir, dataset_file, tmp_path, monkeypatch):
    config = _config(model_dir, dataset_file, tmp_path)
    del config["args"]["output_dir"]
    monkeypatch.chdir(tmp_path.parent)  # not the config's folder
    assert build_trainer(config, base_dir=str(tmp_path / "runs" / "a")).args.output_dir == str(
        tmp_path / "runs" / "a" / "gfpo-output")


def test_a_bad_value_is_exactly_one_line_whatever_the_libraries_warn(model_dir, dataset_file, tmp_path):
    """transformers' TrainingArguments warns (FutureWarning: `gradient_checkpointing` is deprecated ...) while the
    config is built; a config that fails prints its error line and nothing else. Also a mistyped local model
    directory: an error naming it, not a Hub lookup (HF_HUB_OFFLINE=1 makes a regression fail at once)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cases = [
        (dict(args={**_config(model_dir, dataset_file, tmp_path)["args"], "group_filter": "shortest"}),
         f"error: args: group_filter must be None or one of {GROUP_FILTERS}, got group_filter='shortest' (did you "
         "mean 'length'? the filter the paper calls 'shortest', which keeps the k completions with the fewest "
         "tokens)"),
        # found by GFPOConfig itself, after TrainingArguments warned
        (dict(args={**_config(model_dir, dataset_file, tmp_path)["args"], "num_remains_in_group": 9}),
         "error: args: num_remains_in_group must be an int with 2 <= k < num_generations=8 (with k = 1 every "
         "advantage is 0), got num_remains_in_group=9"),
        (dict(model="tiny_modle"), f"error: model 'tiny_modle': no directory {tmp_path / 'tiny_modle'} (did you mean "
         f"'tiny-model'?) (relative paths are read from the config file's folder {tmp_path}; a Hub model is named "
         "namespace/name)"),
    ]
    # a local file's "Generating train split" bar (an uncached file: a cache of the test's own) stays off stderr
    # (a .csv: a .jsonl's columns are read before datasets is imported)
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    question_file = tmp_path / "gsm.csv"
    question_file.write_text("question,answer\n1+1=,#### 2\n")
    cases.append((dict(dataset=str(question_file)), f"error: dataset '{question_file}' has no 'prompt' column "
                  "(columns: ['question', 'answer']); to build chat prompts from its 'question' column, add to the "
                  "config: prompt: {user: \"{question}\"} (and optionally system: \"...\"; docs/cli.md)"))
    shutil.copytree(model_dir, tmp_path / "tiny-model")
    for change, line in cases:
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path, **change)))
        done = subprocess.run([sys.executable, "-m", "gfpo_trainer", "train", "--config", str(config_file)],
                              capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
        assert (done.returncode, done.stderr) == (2, line + "\n")


def test_warnings_of_a_good_config_are_still_shown(monkeypatch, tmp_path):
    """Held back while the config is built, they are shown once it is good (a deprecation is worth seeing)."""
    import types
    import warnings

    import gfpo_trainer.cli as cli

    trained = []
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(resume_from_checkpoint=None,
                                                               output_dir=str(tmp_path / "out")),
                                    train=lambda resume_from_checkpoint: trained.append(True),
                                    save_model=lambda: (tmp_path / "out").mkdir(), is_world_process_zero=lambda: True,
                                    pop_callback=lambda callback: None)

    def build(config, base_dir=None):
        warnings.warn("`old_option` is deprecated", FutureWarning)
        return trainer

    monkeypatch.setattr(cli, "build_trainer", build)
    # the stand-in's config is no real one
    monkeypatch.setattr(cli, "check_config", lambda config, base_dir=None, flags=None: None)
    config_file = tmp_path / "config.yaml"
    config_file.write_text("model: x\n")
    with pytest.warns(FutureWarning, match="`old_option` is deprecated"):  # shown: to stderr outside pytest
        assert main(["train", "--config", str(config_file)]) == 0 and trained == [True]


# (in this process: what the whole process prints, library warnings included, and its exit status are checked by
# test_a_bad_value_is_exactly_one_line_whatever_the_libraries_warn, which starts the CLI as a user does)
def test_config_errors_are_one_line_and_exit_2(model_dir, dataset_file, tmp_path, capsys):
    config = _config(model_dir, dataset_file, tmp_path, args={"num_remains_in_group": 1, "group_filter": "length"})
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(config_file)]) == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "num_remains_in_group=1" in errors[0]


def test_a_bf16_config_on_a_machine_without_bf16_says_which_field_to_change(model_dir, dataset_file, tmp_path,
                                                                             capsys):
    """A GPU recipe (examples/gsm8k/qwen2.5-0.5b.yaml: bf16: true) on a CPU: transformers' words name no field; the
    line says the config's bf16: true and the flag that turns it off."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the error is raised where no GPU is")
    config = _config(model_dir, dataset_file, tmp_path)
    config["args"] = {**config["args"], "bf16": True, "use_cpu": False}
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(config_file)]) == 2
    err = capsys.readouterr().err  # transformers' own words first ("Your setup doesn't support bf16/gpu. ...")
    assert err.startswith("error: args: ") and err.count("\n") == 1 and err.endswith(
        " (the config sets bf16: true, which needs a GPU with bf16: on this machine set bf16: false, or --bf16 false "
        "on the command line)\n")
    assert main(["train", "--config", str(config_file), "--bf16", "false", "--max_steps", "1"]) == 0


@pytest.mark.parametrize("args", [["output_dir", "out"], "out"])
def test_config_errors_in_args_are_one_line(tmp_path, args, capsys):
    """A wrong `args` is an `error:` line with exit status 2 like every other config mistake, not a traceback."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(dict(model=str(tmp_path), dataset="x.jsonl", reward_funcs=["m:f"],
                                               args=args)))
    assert main(["train", "--config", str(config_file)]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: args must be a mapping of GFPOConfig fields (field: value), got {args!r}"


def _run_setup_script(tmp_path, has_torch: bool, index_url: str | None) -> list[str]:
    """scripts/setup.sh in a copy of the tree whose .venv/bin/python is a stub: the stub logs every call and says
    whether torch imports; returns the logged calls."""
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    (root / "csrc").mkdir()
    for script in ("setup.sh", "requirements.py"):  # setup.sh hashes both into the stamp of a finished setup
        (root / "scripts" / script).write_text((REPO / "scripts" / script).read_text())
    for name in ("setup.py", "pyproject.toml", "csrc/ops.cpp"):
        (root / name).write_text("")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    log = tmp_path / "calls.log"
    (venv_bin / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$*" >> "{log}"\n'
        f'if [ "$1" = -c ] && [ "$2" = "import torch" ]; then [ {"0" if has_torch else "1"} = 0 ]; exit; fi\n'
        'if [ "$1 $2 $3" = "-m pip show" ]; then exit 1; fi\n'
    )
    (venv_bin / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GFPO_TORCH_INDEX_URL"}
    if index_url is not None:
        env["GFPO_TORCH_INDEX_URL"] = index_url
    done = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


@pytest.mark.parametrize("has_torch, index_url, torch_install", [
    (False, None, "-m pip install torch==2.13.0"),  # pip's configuration decides (CI: its local wheels)
    (False, "https://download.pytorch.org/whl/cpu",
     "-m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"),
    (True, "https://download.pytorch.org/whl/cpu", None),  # a torch already in .venv (a user's CUDA build) is kept
])
def test_setup_script_torch_install(tmp_path, has_torch, index_url, torch_install):
    calls = _run_setup_script(tmp_path, has_torch, index_url)
    assert [c for c in calls if "torch==" in c] == ([torch_install] if torch_install else [])
    assert "-m pip install --no-build-isolation --no-deps -e ." in calls  # the script ran on past the torch step


def test_setup_if_stale_runs_only_when_the_venv_is_stale(tmp_path):
    """scripts/demo.sh and scripts/test.sh run `setup.sh --if-stale` first: the whole setup on a .venv it never
    finished, after a change to what the setup is made from, or when a requirement went missing; nothing otherwise.
    The tree's .venv/bin/python is a stub that logs its calls (torch 2.13.0 installed; the requirement check's exit
    status and message come from files the test writes)."""
    root = tmp_path / "tree"
    for name in ("scripts/setup.sh", "scripts/requirements.py", "setup.py", "pyproject.toml", "csrc/ops.cpp"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text((REPO / name).read_text() if name.startswith("scripts/") else f"{name}\n")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    log, check_rc, check_out = tmp_path / "calls.log", tmp_path / "check_rc", tmp_path / "check_out"
    check_rc.write_text("0")
    check_out.write_text("")
    (venv_bin / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$*" >> "{log}"\n'
        'case "$*" in\n'
        '  "-c import importlib.metadata as m; print(m.version(\'torch\'))") echo 2.13.0 ;;\n'
        f'  *--check) cat "{check_out}"; exit "$(cat "{check_rc}")" ;;\n'
        '  "-m pip show gfpo") exit 1 ;;\n'
        "esac\n"
    )
    (venv_bin / "python").chmod(0o755)

    def if_stale():
        log.write_text("")
        done = subprocess.run(["bash", "scripts/setup.sh", "--if-stale"], cwd=root, capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("GFPO_")})
        assert done.returncode == 0, done.stderr
        calls = log.read_text().splitlines()
        return done.stdout.splitlines()[0], "-m pip install --no-build-isolation --no-deps -e ." in calls

    assert if_stale() == ("gfpo: .venv is stale (sources or settings changed since its setup): running "
                          "scripts/setup.sh", True)  # never finished here: no stamp
    assert (root / ".venv" / ".gfpo-setup-stamp").is_file()
    up_to_date = ("gfpo: .venv is up to date (set up from these sources, every requirement installed): setup skipped",
                  False)
    assert if_stale() == up_to_date
    (root / "pyproject.toml").write_text("changed\n")
    assert if_stale()[1] is True
    assert if_stale() == up_to_date
    check_rc.write_text("1")
    check_out.write_text("fastdigest>=0.12 (not installed)")
    assert if_stale() == ("gfpo: .venv is stale (fastdigest>=0.12 (not installed)): running scripts/setup.sh", True)
    done = subprocess.run(["bash", "scripts/setup.sh", "--if-stal"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr == "usage: bash scripts/setup.sh [--if-stale]\n"


def test_requirement_check_names_what_is_missing_or_too_old():
    """scripts/requirements.py --check, which decides whether .venv is stale, against this environment."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gfpo_requirements", REPO / "scripts" / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    installed = torch.__version__.split("+")[0]
    assert module.unsatisfied([f"torch>={installed}", "numpy", "triton>=1; platform_system == 'Nowhere'"]) == []
    assert module.unsatisfied(["torch<2", "gfpo-no-such-package"]) == [
        f"torch<2 (installed: {torch.__version__})", "gfpo-no-such-package (not installed)"]


def _help(argv: list[str], capsys, monkeypatch) -> list[str]:
    """What `python -m gfpo_trainer ARGV --help` prints, in blocks (blank lines apart), at 100 columns."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out.strip("\n").split("\n\n")


def _prose(block: str) -> str:
    return " ".join(block.split())


@pytest.mark.parametrize("argv", [[], ["train"], ["env"]])
def test_help_prints_whole_sentences(argv, capsys, monkeypatch):
    """Every paragraph of prose that --help prints ends its sentence (a ':' only before an indented example), and a
    command's help opens with the summary the command list gives it, as a sentence."""
    blocks = _help(argv, capsys, monkeypatch)
    assert blocks[0].startswith("usage: python -m gfpo_trainer")
    kinds = ["usage" if b.startswith("usage:") else "options" if b.startswith(("options:", "positional arguments:"))
             else "example" if b.startswith(" ") else "prose" for b in blocks]
    prose = [(_prose(b), kinds[i + 1] if i + 1 < len(kinds) else None) for i, b in enumerate(blocks)
             if kinds[i] == "prose"]
    assert prose and kinds[1] == "prose"  # a description, right below the usage
    for text, next_kind in prose:
        assert text.endswith(".") or (text.endswith(":") and next_kind == "example"), text
    if argv:
        listing = _prose(next(b for b in _help([], capsys, monkeypatch) if b.startswith("positional arguments:")))
        others = "|".join(name for name in ("train", "env") if name != argv[0])
        summary = re.search(rf" {argv[0]} (.+?)(?= (?:{others}) |$| options:)", listing)[1]
        assert prose[0][0].lower().startswith(summary.lower().rstrip("."))


def test_top_level_help_prints_the_whole_description(capsys, monkeypatch):
    """The description is the module docstring's whole first paragraph, not its first line."""
    import gfpo_trainer.cli as cli

    first_paragraph = _prose(cli.__doc__.split("\n\n")[0])
    assert first_paragraph.endswith(".") and first_paragraph.count("python -m gfpo_trainer") == 2
    assert _prose(_help([], capsys, monkeypatch)[1]) == first_paragraph


def test_train_help_shows_a_config_that_is_valid(capsys, monkeypatch):
    """train --help prints the example config: a YAML mapping of the config's keys, with every required one, and the
    paths rule naming every path field."""
    from gfpo_trainer.cli import _TOP_LEVEL_KEYS, PATH_ARGS

    blocks = _help(["train"], capsys, monkeypatch)
    example = next(b for b in blocks if b.startswith(" "))
    assert blocks[blocks.index(example) - 1] == "A training config (YAML):"
    config = yaml.safe_load(textwrap.dedent(example))
    assert {"model", "dataset", "reward_funcs"} <= set(config) <= set(_TOP_LEVEL_KEYS)
    assert config["args"]["num_remains_in_group"] < config["args"]["num_generations"]
    rule = _prose(blocks[blocks.index(example) + 1])
    assert rule.startswith("Paths in the file are read from the file's folder")
    assert all(name in rule for name in PATH_ARGS)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_imports_no_training_stack(argv):
    """--help answers at once: TRL, transformers and datasets are imported only when a command runs."""
    probe = ("import sys, runpy; sys.argv = ['gfpo_trainer'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('gfpo_trainer', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('trl', 'transformers', 'datasets', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"


def test_a_jsonl_without_a_prompt_column_is_told_before_the_training_stack_is_imported(model_dir, tmp_path):
    """GSM8K's question/answer .jsonl and no `prompt:` key: the same one line as after loading the data set
    (test_missing_prompt_column), read from the file's first record before TRL, transformers, datasets and torch."""
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "#### 2"}) + "\n")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_config(model_dir, str(path), tmp_path)))
    probe = ("import sys, runpy; sys.argv = ['gfpo_trainer'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('gfpo_trainer', run_name='__main__')\nexcept SystemExit as exit:\n"
             "    print(exit.code)\n"
             "print(sorted(m for m in ('trl', 'transformers', 'datasets', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, "train", "--config", str(tmp_path / "config.yaml")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.stdout.splitlines() == ["2", "[]"]
    assert done.stderr == (
        f"error: dataset '{path}' has no 'prompt' column (columns: ['question', 'answer']); to build chat prompts from "
        "its 'question' column, add to the config: prompt: {user: \"{question}\"} (and optionally system: \"...\"; "
        "docs/cli.md)\n")


@pytest.mark.parametrize("command, missing", [(["train", "--config", "run.yaml"], "trl")])
def test_commands_without_the_trainer_extra_say_what_to_install(command, missing):
    """`pip install --no-build-isolation .` installs the kernels' dependencies only: a command then names the missing
    module and the install command in one line, exit status 2, instead of a ModuleNotFoundError traceback."""
    probe = (f"import sys; sys.modules[{missing!r}] = None  # import {missing} now raises ModuleNotFoundError\n"
             "from gfpo_trainer.cli import main\nsys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {missing!r} is not installed: gfpo's trainer needs its dependencies; from the checkout, pip install "
        '--no-build-isolation ".[trainer]" (docs/install.md)'], done.stderr
