"""docs/gpu-recipe.md stays true on a CPU: its training configs (the YAML blocks marked `<!-- docs-test: recipe -->`)
build their GFPOConfig as written and train one step on a tiny model with the sizes shrunk (vLLM off here; the
colocate ones on vLLM's CPU engine where vLLM is installed: scripts/test_vllm_cpu.sh runs the tests named *vllm*),
the accelerate configs load as accelerate loads them, the commands name the configs the page defines, the `trl
vllm-serve` line becomes a `vllm serve` command vLLM's own parser reads, and the arithmetic the page states follows
from the models' shapes, the reward module and data set the configs name are the ones the page defines, and its install
has what its commands need. The shell commands' scripts, modules and flags: tests/test_readme_examples.py."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from test_readme_examples import code_blocks, prose, shell_commands

ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "gpu-recipe.md"
RECIPES = {re.match(r"# (\S+\.yaml):", block.code).group(1): yaml.safe_load(block.code)
           for block in code_blocks(PAGE, "yaml") if block.directive == "recipe"}
COMMANDS = [words for block in code_blocks(PAGE, "bash") for words in shell_commands(block)]
ACCELERATE_CONFIGS = sorted((ROOT / "examples" / "accelerate").glob("*.yaml"))
# what a CPU run changes, and why: the Hub model becomes a tiny local one, one short step, no reports or checkpoints
SHRUNK = {"max_steps": 1, "max_completion_length": 4, "report_to": "none", "save_strategy": "no", "logging_steps": 1}
# on vLLM's CPU engine: one process (no tensor parallelism), no sleep mode (the CPU platform has none), a context
# the tiny model has (256 positions)
CPU_ENGINE = {"vllm_tensor_parallel_size": 1, "vllm_enable_sleep_mode": False, "vllm_max_model_length": 128,
              "max_completion_length": 8}
# Qwen2.5's published shapes (config.json of the Hub models): layers, KV heads, head dimension, vocabulary, parameters
QWEN25 = {"0.5B": dict(layers=24, kv_heads=2, head_dim=64, vocab=151936, params=0.494e9),
          "7B": dict(layers=28, kv_heads=4, head_dim=128, vocab=152064, params=7.62e9)}
GiB = 2**30


def test_the_page_defines_three_configs_and_every_command_uses_one():
    assert set(RECIPES) == {"gfpo-0.5b.yaml", "gfpo-7b.yaml", "gfpo-7b-server.yaml"}
    used = {words[words.index("--config") + 1] for words in COMMANDS if "--config" in words}
    assert used == set(RECIPES)
    launch_configs = {words[words.index("--config_file") + 1] for words in COMMANDS if "--config_file" in words}
    assert launch_configs == {f"examples/accelerate/{name}.yaml" for name in ("ddp", "zero3", "fsdp2", "zero3-offload")}


def test_the_page_is_a_short_read_without_history():
    """Read in five minutes: under 1200 words of prose (configs and commands aside, about 400 words more); no commit
    ids or dates in its sentences (history and figures stay in the other pages)."""
    text = prose(PAGE)
    words = re.sub(r"<!--.*?-->|\(([^)\s]+\.md[^)\s]*)\)", " ", text).split()
    assert len(words) < 1200, len(words)
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not commits, commits
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads_as_accelerate_loads_it(path):
    """accelerate's own loader (which refuses unknown keys), and every DeepSpeed / FSDP key with its value through
    `accelerate launch`'s parser, whose options those keys are (it checks their choices)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    config = ClusterConfig.from_yaml_file(str(path))
    assert config.distributed_type.value in ("MULTI_GPU", "DEEPSPEED", "FSDP") and config.mixed_precision == "bf16"
    nested = {**(config.deepspeed_config or {}), **(config.fsdp_config or {})}
    flags = [word for key, value in nested.items() for word in (f"--{key}", str(value).lower()
                                                                 if isinstance(value, bool) else str(value))]
    options = launch_command_parser().parse_args([*flags, "-m", "gfpo_trainer", "train", "--config", "run.yaml"])
    for key, value in nested.items():
        assert str(getattr(options, key)).lower() == str(value).lower(), key
    if path.name == "zero3-offload.yaml":  # one GPU, the optimizer's state in host RAM
        assert (config.num_processes, nested["offload_optimizer_device"], nested["zero_stage"]) == (1, "cpu", 3)


def test_fsdp2_wraps_the_recipe_models_decoder_layers():
    """The FSDP2 config's unit is Qwen2.5's decoder layer: a class of transformers' Qwen2 model, which the tiny model
    (Qwen2-shaped, as the recipes' models) is made of."""
    from transformers.models.qwen2 import modeling_qwen2

    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    name = yaml.safe_load((ROOT / "examples/accelerate/fsdp2.yaml").read_text())["fsdp_config"][
        "fsdp_transformer_layer_cls_to_wrap"]
    layer = getattr(modeling_qwen2, name)
    assert sum(isinstance(m, layer) for m in make_tiny_model(make_tokenizer()).modules()) == 2


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_builds_its_gfpo_config_as_written(name):
    """The args as the command line converts them, unshrunk: a valid GFPOConfig whose kept rows fill micro-batches
    exactly (per-device batch x k a multiple of G), and whose step the config's comment counts right."""
    pytest.importorskip("trl")
    from gfpo_trainer import GFPOConfig
    from gfpo_trainer.cli import _convert_args
    from gfpo_trainer.config_fields import field_specs

    recipe = RECIPES[name]
    args = GFPOConfig(**_convert_args(recipe["args"], field_specs()), use_cpu=True)
    G, k, batch = args.num_generations, args.num_remains_in_group, args.per_device_train_batch_size
    assert (G, k, args.group_filter, args.use_gfpo_kernels, args.use_vllm) == (16, 8, "length", True, True)
    assert args.gfpo_stop_dropped_generations and batch * k % G == 0
    prompts_per_gpu = batch * args.gradient_accumulation_steps // G
    comment = next(line for line in (PAGE.read_text().split(f"# {name}:")[1]).splitlines()
                   if "gradient_accumulation_steps" in line)
    gpus = {"gfpo-0.5b.yaml": 1, "gfpo-7b.yaml": 8, "gfpo-7b-server.yaml": 6}[name]
    stated = {"gfpo-0.5b.yaml": f"{prompts_per_gpu} prompts per GPU",
              "gfpo-7b.yaml": f"{prompts_per_gpu} prompts per GPU ({prompts_per_gpu * gpus} on eight)",
              "gfpo-7b-server.yaml": f"{prompts_per_gpu * gpus} prompts, {prompts_per_gpu * gpus * G} completions"}
    assert stated[name] in comment, comment


def test_the_pages_arithmetic_follows_from_the_models_shapes():
    """KV cache a token (K and V, every layer, bf16), the requests a colocated engine runs at once (TRL's
    max_num_seqs: per-device batch x steps per generation) at full length, logits a token and a micro-batch, and a
    7B full fine-tune's 16 bytes a parameter (12 of them fp32)."""
    text = PAGE.read_text()
    kv = {size: 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2 for size, s in QWEN25.items()}
    assert (kv["0.5B"], kv["7B"]) == (12 * 1024, 56 * 1024)
    assert "at 56 KiB a token" in text and "at 12 KiB" in text
    for size, name in (("7B", "gfpo-7b.yaml"), ("0.5B", "gfpo-0.5b.yaml")):
        args = RECIPES[name]["args"]
        requests = args["per_device_train_batch_size"] * args["gradient_accumulation_steps"]
        tokens = args["vllm_max_model_length"]
        assert args["vllm_max_model_length"] >= args["max_completion_length"]
        assert f"{requests} x {tokens} " in text
        assert f"({round(requests * tokens * kv[size] / GiB)} GiB)" in text
    logits_token = QWEN25["7B"]["vocab"] * 2
    assert round(logits_token / 1e6, 1) == 0.3 and "0.3 MB a token" in text
    assert round(8 * 4096 * logits_token / GiB) == 9 and "9 GiB for a micro-batch of 8 rows x 4096 tokens" in text
    params = QWEN25["7B"]["params"]
    assert (round(16 * params / 1e9), round(12 * params / 1e9)) == (122, 91)
    assert "122 GB" in text and "(91 GB)" in text
    assert round(params * 2 / GiB) == 14 and "14 GiB of weights" in text


# --------------------------------------------------------------------------- one step on a tiny model


# what a CPU run changes in the data: GSM8K from the Hub becomes a local file of its columns, its questions short
# sums in the tiny tokenizer's characters, and the prompt the bare question (vLLM's CPU engine runs the tiny model
# with a 128-token context, which the system message would fill)
LOCAL_DATA = {"dataset": "data/train.jsonl", "dataset_config": None, "prompt": {"user": "{question}"}}


def _write_run(tmp_path, monkeypatch, recipe, model_dir, **changes) -> Path:
    """The config beside its data and the page's reward module (examples/gsm8k/rewards.py, copied as the page says)
    in tmp_path, the model, LOCAL_DATA and `changes` applied to a copy."""
    config = yaml.safe_load(yaml.safe_dump(recipe))
    config["model"] = model_dir
    config.update(LOCAL_DATA)
    config["args"].update(changes)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text((ROOT / "examples" / "gsm8k" / "rewards.py").read_text())
    monkeypatch.delitem(sys.modules, "rewards", raising=False)  # another test's module of that name
    data = tmp_path / config["dataset"]
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}\n"
                                        f"#### {a + b}"}) + "\n" for a in range(4) for b in range(4)))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_recipes_train_on_the_hub_gsm8k_with_the_examples_rewards():
    """The page defines what its configs name: the reward module is examples/gsm8k/rewards.py (copied beside the
    config, which is where the command line looks first), whose functions exist; the data set is GSM8K by its Hub
    name and configuration, its `question` turned into chat messages."""
    pytest.importorskip("trl")
    from gfpo_trainer.cli import load_reward_func

    assert "`rewards.py`, a copy of `examples/gsm8k/rewards.py`" in " ".join(prose(PAGE).split())
    for recipe in RECIPES.values():
        assert (recipe["dataset"], recipe["dataset_config"], recipe["prompt"]["user"]) == (
            "openai/gsm8k", "main", "{question}")
        assert recipe["reward_funcs"] == ["rewards:correctness", "rewards:format_reward"]
        for spec in recipe["reward_funcs"]:
            assert callable(load_reward_func(spec, str(ROOT / "examples" / "gsm8k")))


def test_the_install_has_what_the_commands_need():
    """DeepSpeed, which the ZeRO-3 commands need, installed as docs/multi-gpu.md installs it (without build
    isolation, the same version floor), and the driver requirement of docs/install.md."""
    (install,) = [block for block in code_blocks(PAGE, "bash") if "scripts/setup.sh" in block.code]
    deepspeed = [words for words in shell_commands(install) if any("deepspeed" in w for w in words)]
    assert deepspeed == [[".venv/bin/pip", "install", "--no-build-isolation", "deepspeed>=0.19"]]
    assert '.venv/bin/pip install --no-build-isolation "deepspeed>=0.19"' in (ROOT / "docs" / "multi-gpu.md").read_text()
    assert any("zero3" in " ".join(words) for words in COMMANDS)
    driver = re.search(r"\((CUDA \d+: driver >= \d+)\)", (ROOT / "docs" / "install.md").read_text()).group(1)
    assert driver in " ".join(prose(PAGE).split())


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from gfpo_test_utils import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("recipe-model"))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_trains_a_step_on_the_tiny_model(name, tmp_path, monkeypatch, tiny_model_dir):
    """Through the command line as the page runs it (`python -m gfpo_trainer train --config ...`), with vLLM off:
    every other setting of the config as written (G, k, the filter, the kernels, the batch, gradient checkpointing)."""
    pytest.importorskip("trl")
    from gfpo_trainer.cli import main

    path = _write_run(tmp_path, monkeypatch, RECIPES[name], tiny_model_dir, **SHRUNK, use_vllm=False)
    assert main(["train", "--config", str(path)]) == 0
    assert (tmp_path / RECIPES[name]["args"]["output_dir"] / "config.json").exists()


COLOCATE = sorted(name for name, recipe in RECIPES.items() if recipe["args"].get("vllm_mode") == "colocate")


@pytest.mark.parametrize("name", COLOCATE)
def test_recipe_trains_a_step_on_vllms_cpu_engine(name, tmp_path, monkeypatch, vllm_model_dir):
    """The colocate configs with vLLM on, on its CPU engine (CPU_ENGINE's changes): the trainer builds its engine
    from the config and the step's completions come from it, the early-stop rule driving it."""
    pytest.importorskip("vllm")
    from gfpo_test_utils import run_vllm_engines_eagerly

    from gfpo_trainer.cli import build_trainer
    from gfpo_trainer.vllm_cpu import keep_linear_weights

    recipe = RECIPES[name]
    assert recipe["args"]["use_vllm"] is True
    path = _write_run(tmp_path, monkeypatch, recipe, vllm_model_dir, **{**SHRUNK, **CPU_ENGINE}, use_cpu=True)
    keep_linear_weights()
    with run_vllm_engines_eagerly():
        trainer = build_trainer(yaml.safe_load(path.read_text()), base_dir=str(tmp_path))
    try:
        assert trainer.vllm_generation.llm is not None
        trainer.train()
        logged = trainer.state.log_history[0]
        assert logged["gfpo/vllm_engine_steps"] > 0 and logged["gfpo/kept_fraction"] == 0.5
    finally:
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()


def test_vllm_serve_line_becomes_a_command_vllm_reads():
    """`trl vllm-serve` runs `vllm serve` with TRL's flags translated (TRL's build_command); vLLM's serve parser
    reads that command, with the page's tensor parallelism and context length."""
    pytest.importorskip("vllm")
    from trl.scripts.vllm_serve import build_command, make_parser

    (words,) = [w for w in COMMANDS if w[:2] == ["trl", "vllm-serve"] or w[1:3] == ["trl", "vllm-serve"]]
    words = words[words.index("vllm-serve") + 1:]
    script_args, rest = make_parser().parse_args_and_config(args=words, return_remaining_strings=True)
    command = build_command(script_args, rest)
    serve = command[command.index("serve") + 1:]
    parser = _vllm_serve_parser()
    options = parser.parse_args(serve)
    assert (options.model_tag, options.tensor_parallel_size, options.max_model_len) == (
        "Qwen/Qwen2.5-7B-Instruct", 2, RECIPES["gfpo-7b.yaml"]["args"]["vllm_max_model_length"])
    assert shlex.join(words).startswith("--model Qwen/Qwen2.5-7B-Instruct")


def _vllm_serve_parser():
    """vLLM's `vllm serve` argument parser (its module moved between the releases TRL supports)."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def test_the_vllm_quickstart_names_fields_that_exist_and_a_config_that_sets_them():
    """docs/vllm-quickstart.md's settings are GFPOConfig fields (or its TRL server's client fields), and the config its
    colocate commands run sets the colocate ones as the table says."""
    pytest.importorskip("trl")
    import dataclasses

    from gfpo_trainer import GFPOConfig

    page = ROOT / "docs" / "vllm-quickstart.md"
    fields = {f.name for f in dataclasses.fields(GFPOConfig)}
    named = set(re.findall(r"`((?:vllm|gfpo|use|group)_\w+)`", prose(page)))
    assert len(named) >= 10 and named <= fields, named - fields
    used = {words[words.index("--config") + 1] for block in code_blocks(page, "bash") for words in shell_commands(block)
            if "--config" in words}
    assert used == {"examples/gsm8k/qwen2.5-0.5b.yaml"}
    args = yaml.safe_load((ROOT / "examples/gsm8k/qwen2.5-0.5b.yaml").read_text())["args"]
    assert (args["use_vllm"], args["vllm_mode"], args["group_filter"]) == (True, "colocate", "length")
    assert args["vllm_max_model_length"] >= args["max_completion_length"]
