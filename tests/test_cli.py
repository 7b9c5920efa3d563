"""The command line: the demo (smoke sizes) and `train --config` with its errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
yaml = pytest.importorskip("yaml")

from gfpo_trainer.cli import ConfigError, build_trainer, load_reward_func, main  # noqa: E402
from gfpo_trainer.demo import correctness_reward, format_table  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402

REPO = Path(__file__).parents[1]


def test_correctness_reward():
    prompts = ["12+7=", "3+4=", "3+4=", "3+4=", "3+4="]
    completions = [" 19", " hmm hmm so 7", " 8", "", " 7 or 17"]
    assert correctness_reward(prompts, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_table():
    table = format_table([dict(run="grpo", accuracy=0.5, mean_length=4.0, inflation=0.25, tokens_per_second=100.0,
                               wall_time=2.0)])
    assert table.splitlines()[2] == "grpo | 0.500 | 4.00 | +25.0% | 100 | 2.0 | -"
    table = format_table([dict(run="gfpo", accuracy=0.5, mean_length=4.0, inflation=0.25, tokens_per_second=100.0,
                               wall_time=2.0, skipped_fraction=0.375)])
    assert table.splitlines()[2] == "gfpo | 0.500 | 4.00 | +25.0% | 100 | 2.0 | 38%"


def test_demo_smoke(tmp_path):
    """Every stage of `python -m gfpo_trainer demo` at toy sizes: warm-up, three RL runs, table, plot."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "gfpo_trainer", "demo", "--smoke", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run | accuracy | mean length | length inflation | tokens/s | wall time (s) | zero-gradient rows skipped" \
        in done.stdout
    for run in ("warm-up", "grpo", "gfpo-length", "gfpo-token-efficiency"):
        assert f"\n{run} | " in done.stdout
    results = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in results["rows"]] == ["warm-up", "grpo", "gfpo-length", "gfpo-token-efficiency"]
    assert len(results["history"]["gfpo-length"]) == 2
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-model")
    tokenizer = make_tokenizer()
    make_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def dataset_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(8)))
    return str(path)


def _config(model_dir, dataset_file, tmp_path, **changes):
    config = {
        "model": model_dir,
        "dataset": dataset_file,
        "reward_funcs": ["gfpo_trainer.demo:correctness_reward"],
        "args": dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=8,
                     num_remains_in_group=4, group_filter="length", max_completion_length=6, max_steps=1,
                     use_cpu=True, bf16=False, report_to="none", save_strategy="no"),
    }
    config.update(changes)
    return config


def test_train_command(model_dir, dataset_file, tmp_path):
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_config(model_dir, dataset_file, tmp_path)))
    assert main(["train", "--config", str(config_file)]) == 0
    assert (tmp_path / "out" / "config.json").exists()  # the trained model was saved


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model="/nonexistent/model"), r"model '/nonexistent/model' is neither a local directory nor a hub model name"),
        (dict(model="./models/tiny"), r"model './models/tiny' is neither a local directory nor a hub model name"),
        (dict(model="Qwen/../x"), r"model 'Qwen/../x' is neither"),
        (dict(reward_funcs=[]), r"reward_funcs must be one or more 'package.module:function' strings, got \[\]"),
        (dict(args={"num_remains_in_group": 9, "num_generations": 8}),
         r"args: num_remains_in_group must be an int with 2 <= k < num_generations=8 .*got num_remains_in_group=9"),
        (dict(args={"group_filter": "shortest", "num_remains_in_group": 4}),
         r"args: group_filter must be None or one of \('length', 'token_efficiency'\), got group_filter='shortest'"),
        (dict(args={"per_device_train_batch_size": 8, "num_generations": 16}), r"args: .*num_generations \(16\)"),
        (dict(args={"num_remains_in_group": 4, "num_generations": 8, "per_device_train_batch_size": 8}),
         r"num_remains_in_group is set: give exactly one of GFPOConfig.group_filter"),
        (dict(dataset="/nonexistent/train.jsonl"), r"dataset file '/nonexistent/train.jsonl' does not exist"),
        (dict(reward_funcs=["gfpo_trainer.demo:nope"]), r"module 'gfpo_trainer.demo' has no function 'nope'"),
        (dict(reward_funcs=["no_such_module:f"]), r"cannot import module 'no_such_module'"),
        (dict(args={"num_generationz": 8}), r"unknown GFPOConfig fields \['num_generationz'\]"),
        (dict(optimiser="adam"), r"unknown config keys \['optimiser'\]"),
    ],
)
def test_train_config_errors(model_dir, dataset_file, tmp_path, change, match):
    with pytest.raises(ConfigError, match=match):
        build_trainer(_config(model_dir, dataset_file, tmp_path, **change))


def test_missing_prompt_column(model_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(ConfigError, match=r"has no 'prompt' column \(columns: \['question'\]\)"):
        build_trainer(_config(model_dir, str(path), tmp_path))


def test_train_command_reports_errors(tmp_path, capsys):
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({"dataset": "x.jsonl", "reward_funcs": []}))
    assert main(["train", "--config", str(config_file)]) == 2
    assert "error: the config needs 'model'" in capsys.readouterr().err


def test_load_reward_func_forms():
    assert load_reward_func("gfpo_trainer.demo.correctness_reward") is correctness_reward
    assert load_reward_func("gfpo_trainer.demo:correctness_reward") is correctness_reward
    with pytest.raises(ConfigError, match="must look like 'package.module:function'"):
        load_reward_func("correctness_reward")


def test_hub_names_with_dots_pass_validation(model_dir, dataset_file, tmp_path, monkeypatch):
    """`Qwen/Qwen2.5-0.5B-Instruct` is a Hub name: validation lets it through to the download (none here)."""
    import gfpo_trainer.cli as cli

    monkeypatch.setattr(cli, "load_train_dataset", lambda *a, **k: (_ for _ in ()).throw(ConfigError("reached")))
    with pytest.raises(ConfigError, match="reached"):
        build_trainer(_config("Qwen/Qwen2.5-0.5B-Instruct", dataset_file, tmp_path))


def test_config_errors_are_one_line_and_exit_2(model_dir, dataset_file, tmp_path):
    config = _config(model_dir, dataset_file, tmp_path, args={"num_remains_in_group": 1, "group_filter": "length"})
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "gfpo_trainer", "train", "--config", str(config_file)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "num_remains_in_group=1" in errors[0]


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["train", "--help"]])
def test_help_imports_no_training_stack(argv):
    """--help answers at once: TRL, transformers and datasets are imported only when a command runs."""
    probe = ("import sys, runpy; sys.argv = ['gfpo_trainer'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('gfpo_trainer', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('trl', 'transformers', 'datasets', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"
