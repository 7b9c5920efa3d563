"""Every code example of the README runs as written (issue: a README that drifted from the code).

The Hub model name is replaced by a tiny local model (no downloads here) and training gets a one-step limit;
nothing else of an example is changed. The bash blocks are the setup/test commands that CI itself runs."""

import re
import textwrap
from pathlib import Path

import pytest
import yaml

README = (Path(__file__).parents[1] / "README.md").read_text()
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _blocks(language: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    path = tmp_path_factory.mktemp("readme-model")
    tokenizer = make_tokenizer()
    make_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _training_block() -> str:
    blocks = [b for b in _blocks("python") if "GFPOTrainer(" in b]
    assert len(blocks) == 1, "the README's 'Training with GFPO' example"
    return blocks[0]


def _limit_steps(code: str, model_dir: str) -> str:
    assert HUB_MODEL in code and "per_device_train_batch_size=16," in code
    code = code.replace(f'"{HUB_MODEL}"', repr(model_dir))
    return code.replace("per_device_train_batch_size=16,",
                        'per_device_train_batch_size=16, max_steps=1, max_completion_length=4, report_to="none",')


def test_python_examples_without_training_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in _blocks("python") if "GFPOTrainer(" not in b]
    assert len(blocks) >= 2  # the kernels and the fused loss
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_training_example_runs(tmp_path, monkeypatch, tiny_model_dir):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(_limit_steps(_training_block(), tiny_model_dir), "README.md", "exec"), namespace)
    assert namespace["trainer"].state.global_step == 1


def test_yaml_example_runs_with_the_cli(tmp_path, monkeypatch, tiny_model_dir):
    pytest.importorskip("trl")
    from gfpo_trainer.cli import main

    (yaml_block,) = _blocks("yaml")
    config = yaml.safe_load(yaml_block)
    assert config["model"] == HUB_MODEL
    config["model"] = tiny_model_dir
    config["args"].update(max_steps=1, max_completion_length=4, report_to="none")
    monkeypatch.chdir(tmp_path)
    # my_rewards.py holds the reward function of the training example, as the README says
    correctness = re.search(r"def correctness\(.*?\n\n", _training_block(), flags=re.S).group(0)
    (tmp_path / "my_rewards.py").write_text(correctness)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join('{"prompt": "6*7="}\n' for _ in range(16)))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", "run.yaml"]) == 0
    assert (tmp_path / "out" / "config.json").exists()


def test_bash_examples_are_the_ci_commands():
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    for block in _blocks("bash"):
        command = block.strip()
        if command.startswith("accelerate launch"):
            continue  # multi-GPU launches: test_multi_gpu_launch_configs_exist
        assert command.startswith("bash scripts/setup.sh && .venv/bin/python -m ")
        if "pytest" in command:
            assert command.split(" && ", 1)[1] in ci  # CI runs the README's test command


def test_multi_gpu_launch_configs_exist():
    """The multi-GPU launches name accelerate configs that exist and say which engine they use (the launches
    themselves need several GPUs)."""
    launches = [line for block in _blocks("bash") for line in block.splitlines() if line.startswith("accelerate launch")]
    engines = set()
    for line in launches:
        assert line.split()[-4:] == ["gfpo_trainer", "train", "--config", "run.yaml"], line
        config = yaml.safe_load((Path(__file__).parents[1] / line.split("--config_file")[1].split()[0]).read_text())
        engines.add(config["distributed_type"])
    assert engines == {"MULTI_GPU", "DEEPSPEED", "FSDP"}
