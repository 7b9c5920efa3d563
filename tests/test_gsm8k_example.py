"""examples/gsm8k/: the generator makes the committed files exactly, the rows are GSM8K's columns with correct
worked arithmetic and disjoint splits, and the reward functions give known values on hand-written completions."""

from __future__ import annotations

import importlib.util
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "gsm8k"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"gsm8k_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_data = _load("make_data")
rewards = _load("rewards")


def _rows(name):
    return [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines()]


def test_the_generator_makes_the_committed_files_exactly():
    train, test = make_data.make_rows()
    assert (EXAMPLE / "train.jsonl").read_text() == make_data.jsonl_text(train)
    assert (EXAMPLE / "test.jsonl").read_text() == make_data.jsonl_text(test)
    assert make_data.main(["--check"]) == 0


def test_check_reports_a_changed_file(tmp_path, monkeypatch, capsys):
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text((EXAMPLE / name).read_text())
    (tmp_path / "test.jsonl").write_text((EXAMPLE / "test.jsonl").read_text().replace("#### ", "####", 1))
    monkeypatch.setattr(make_data, "HERE", tmp_path)
    assert make_data.main(["--check"]) == 1
    assert str(tmp_path / "test.jsonl") in capsys.readouterr().err


def test_splits_are_held_out_and_have_every_number_of_steps():
    train, test = _rows("train.jsonl"), _rows("test.jsonl")
    assert (len(train), len(test)) == (400, 100)
    questions = [row["question"] for row in train + test]
    assert len(set(questions)) == len(questions)  # no question twice, so none in both splits
    assert not {row["question"] for row in train} & {row["question"] for row in test}
    for rows in (train, test):
        assert {row["answer"].count("<<") for row in rows} == {1, 2, 3, 4}


def _evaluate(expression: str) -> Fraction:
    a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", expression).groups()
    a, b = Fraction(a), Fraction(b)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]


@pytest.mark.parametrize("name", ["train.jsonl", "test.jsonl"])
def test_rows_are_gsm8k_shaped_and_their_arithmetic_is_right(name):
    """GSM8K's two columns; every <<a op b=c>> annotation is true arithmetic, the line shows the same c after it,
    the final "#### N" is the last step's result, and every intermediate result is a whole non-negative number."""
    for row in _rows(name):
        assert list(row) == ["question", "answer"]
        *lines, last = row["answer"].split("\n")
        assert re.fullmatch(r"#### \d+", last)
        results = []
        for line in lines:
            (expression, result, shown), = re.findall(r"<<([^=]+)=(\d+)>>(\d+)", line)
            assert _evaluate(expression) == int(result) == int(shown) >= 0
            results.append(int(result))
        assert int(last[5:]) == results[-1]


def test_the_rewards_give_full_marks_to_the_data_sets_own_answers():
    rows = _rows("train.jsonl") + _rows("test.jsonl")
    answers = [row["answer"] for row in rows]
    assert rewards.correctness(answers, answers) == [1.0] * len(rows)
    assert rewards.format_reward(answers) == [1.0] * len(rows)


ANSWER = "She sells 48/2 = <<48/2=24>>24 clips in May.\nShe sells 48+24 = <<48+24=72>>72 clips in all.\n#### 72"
# (completion, correctness, format_reward): the values a reader of the docstrings expects
CASES = [
    ("48 + 24 = 72\n#### 72", 1.0, 1.0),
    ("#### 72\n", 1.0, 1.0),                              # trailing newline: still the last line
    ("####72", 1.0, 1.0),                                 # no space after the marker
    ("#### 72.0", 1.0, 1.0),                              # the same number
    ("She sells 72 clips.", 1.0, 0.0),                    # right number, no "####" line
    ("#### 70", 0.0, 1.0),                                # well formed, wrong
    ("#### 72 clips", 1.0, 0.0),                          # words after the number
    ("#### 72\nI hope this helps.", 1.0, 0.0),            # the "####" number counts; the form is wrong
    ("72 is not it: #### 24 ... 72", 0.0, 0.0),           # the number after the last "####" answers, not the last
    ("I do not know.", 0.0, 0.0),
    ("", 0.0, 0.0),
]


@pytest.mark.parametrize("completion, correct, formatted", CASES)
def test_rewards_on_hand_written_text_completions(completion, correct, formatted):
    assert rewards.correctness([completion], [ANSWER]) == [correct]
    assert rewards.format_reward([completion]) == [formatted]


def test_rewards_on_conversational_completions_read_the_assistants_reply():
    completions = [[{"role": "assistant", "content": text}] for text, _, _ in CASES]
    assert rewards.correctness(completions, [ANSWER] * len(CASES)) == [c for _, c, _ in CASES]
    assert rewards.format_reward(completions) == [f for _, _, f in CASES]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "so\n"}, {"type": "text", "text": "#### 72"}]}]
    tool_turns = [{"role": "assistant", "content": "#### 5"}, {"role": "tool", "content": "72"},
                  {"role": "assistant", "content": "#### 72"}]
    assert rewards.correctness([parts, tool_turns, []], [ANSWER] * 3) == [1.0, 1.0, 0.0]
    assert rewards.format_reward([parts, tool_turns, []]) == [1.0, 1.0, 0.0]


def test_numbers_are_read_as_gsm8k_writes_them():
    answer = "#### 1250"
    assert rewards.correctness(["#### 1,250", "$1,250", "#### 1250.00", "#### 125", "3,4 and 1,250"],
                               [answer] * 5) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert rewards.correctness(["#### -3", "#### 3"], ["#### -3"] * 2) == [1.0, 0.0]


def test_reward_errors_name_the_row_and_the_fix():
    with pytest.raises(ValueError, match=r"answer of row 1 has no '#### <number>' line"):
        rewards.correctness(["#### 1", "#### 2"], ["#### 1", "the answer is 2"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        rewards.correctness(["#### 1", "#### 2"], ["#### 1"])
    with pytest.raises(TypeError, match="a completion must be a string or a list of"):
        rewards.format_reward([42])


# --- the tiny tokenizer's chat template (gfpo_trainer/tiny.py) --------------------------------------------------

def test_the_tiny_tokenizer_renders_a_conversation_in_its_own_characters():
    from gfpo_trainer.tiny import CHARACTERS, SPECIAL_TOKENS, make_tokenizer

    tokenizer = make_tokenizer()
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 2+3?"}]
    text = "system: be brief. user: what is 2+3? assistant: "
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert set(text) <= set(CHARACTERS)  # nothing the vocabulary lacks, so no unknown (pad) ids in a prompt
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    one_per_character = [len(SPECIAL_TOKENS) + sorted(set(CHARACTERS)).index(c) for c in text]
    assert ids["input_ids"] == one_per_character and ids["attention_mask"] == [1] * len(text)
    assert tokenizer("12+7=").input_ids == [len(SPECIAL_TOKENS) + sorted(set(CHARACTERS)).index(c) for c in "12+7="]
    # a whole conversation: the assistant's turn ends with <eos>, as a completion does; without the generation prompt
    # nothing follows the last message
    answered = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "5"}], tokenize=False)
    assert answered == "system: be brief. user: what is 2+3? assistant: 5<eos>"
    assert tokenizer.apply_chat_template(messages[1:], tokenize=False) == "user: what is 2+3?"


def test_the_examples_tiny_model_reads_gsm8k_text_whole(tmp_path):
    """save_tiny_model.py's tokenizer has every character of the data set and of the configs' system message, so
    no character of a prompt becomes the unknown (pad) id; the model declares room for the longest prompt."""
    import yaml

    save = _load("save_tiny_model")
    from transformers import AutoConfig, AutoTokenizer

    path = save.save_tiny_model(tmp_path / "tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    system = yaml.safe_load((EXAMPLE / "tiny.yaml").read_text())["prompt"]["system"]
    rows = _rows("train.jsonl") + _rows("test.jsonl")
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": row["question"]}],
                                             tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
               for row in rows]
    assert all(tokenizer.pad_token_id not in ids for ids in prompts)
    assert all(tokenizer.pad_token_id not in tokenizer(row["answer"]).input_ids for row in rows)
    longest = max(map(len, prompts))
    assert longest + yaml.safe_load((EXAMPLE / "tiny.yaml").read_text())["args"]["max_completion_length"] <= \
        AutoConfig.from_pretrained(path).max_position_embeddings


# --- the configs through the train command ----------------------------------------------------------------------

DOC = Path(__file__).parents[1] / "docs" / "gsm8k-example.md"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """tiny.yaml run as written by `python -m gfpo_trainer train --config` (in this process, so that the reward
    functions can be watched), in a copy of the example's folder with the tiny model saved beside it as
    save_tiny_model.py saves it. Returns the folder, the config, and the calls the reward functions received."""
    pytest.importorskip("trl")
    import functools
    import shutil

    import yaml

    from gfpo_trainer import cli

    work = tmp_path_factory.mktemp("gsm8k")
    for name in ("tiny.yaml", "train.jsonl", "rewards.py"):
        shutil.copy(EXAMPLE / name, work / name)
    _load("save_tiny_model").save_tiny_model(work / "tiny-model")
    calls = []
    load = cli.load_reward_func

    def watched(spec, base_dir=None):
        func = load(spec, base_dir)

        @functools.wraps(func)  # TRL names the metrics after __name__
        def record(completions, **kwargs):
            rewards = func(completions, **kwargs)
            calls.append(dict(func=func.__name__, completions=completions, rewards=rewards, **kwargs))
            return rewards

        return record

    original = cli.load_reward_func
    cli.load_reward_func = watched
    try:
        assert cli.main(["train", "--config", str(work / "tiny.yaml")]) == 0
    finally:
        cli.load_reward_func = original
    return work, yaml.safe_load((work / "tiny.yaml").read_text()), calls


def test_the_tiny_config_trains_and_the_answer_column_reaches_the_rewards(tiny_run):
    work, config, calls = tiny_run
    answers = {row["question"]: row["answer"] for row in _rows("train.jsonl")}
    steps, group = config["args"]["max_steps"], config["args"]["num_generations"]
    assert [c["func"] for c in calls] == ["correctness", "format_reward"] * steps
    for call in calls:
        assert len(call["completions"]) == len(call["prompts"]) == len(call["answer"]) == group
        for prompt, answer, completion in zip(call["prompts"], call["answer"], call["completions"]):
            # the prompt: key's chat messages, and each row's own answer beside its question
            assert prompt == [{"role": "system", "content": config["prompt"]["system"]},
                              {"role": "user", "content": prompt[1]["content"]}]
            assert answers[prompt[1]["content"]] == answer
            assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
        assert call["rewards"] == rewards.__dict__[call["func"]](call["completions"], answer=call["answer"])
    out = work / config["args"]["output_dir"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template  # the saved model still takes chat prompts


def _logged_steps(work, config):
    out = work / config["args"]["output_dir"]
    state = json.loads((out / f"checkpoint-{config['args']['max_steps']}" / "trainer_state.json").read_text())
    return [log for log in state["log_history"] if "reward" in log]


def test_the_tiny_run_logs_what_the_page_says(tiny_run):
    """docs/gsm8k-example.md: the random model's run has no signal (every reward 0, nothing trained) while the
    rewards are computed and logged per function, half of each group kept."""
    work, config, calls = tiny_run
    logs = _logged_steps(work, config)
    assert len(logs) == config["args"]["max_steps"]
    assert all(c["rewards"] == [0.0] * len(c["rewards"]) for c in calls)
    for log in logs:
        assert log["reward"] == log["rewards/correctness/mean"] == log["rewards/format_reward/mean"] == 0.0
        assert log["frac_reward_zero_std"] == log["gfpo/skipped_zero_gradient_fraction"] == 1.0
        assert log["loss"] == log["grad_norm"] == 0.0
        assert log["entropy"] is None and log["clip_ratio/region_mean"] is None
        assert log["gfpo/kept_fraction"] == 0.5


def test_every_metric_the_page_names_is_logged(tiny_run):
    """The healthy-run table names metrics the trainer logs (the tiny run's log, whose keys are those of a length-
    filtered run), except the ones it marks as logged only elsewhere: vLLM's, and kl with beta > 0."""
    work, config, _ = tiny_run
    logged = set().union(*(log.keys() for log in _logged_steps(work, config)))
    table = DOC.read_text().split("## What a healthy run looks like", 1)[1]
    named = {name for row in re.findall(r"^\| (.*?) \|", table, re.M) for name in re.findall(r"`([^`]+)`", row)}
    named |= {"completions/mean_length", "gfpo/kept_completion_length"}  # named in the paragraph above the table
    assert len(named) > 12 and not named - logged - {"sampling/sampling_logp_difference/mean"}, named - logged
    assert "kl" not in logged  # beta = 0: the page says kl is logged only above 0
    # the early-stop rule on: the dropped lengths are logged as truncated, the untruncated name not at all
    assert "gfpo/dropped_completion_length_truncated" in logged and "gfpo/dropped_completion_length" not in logged


def test_the_real_config_builds_and_trains_a_step_on_the_tiny_model(tiny_run, tmp_path):
    """qwen2.5-0.5b.yaml, with what a CPU changes given as command-line overrides: the tiny model for the Hub one, the
    local file for the Hub data set, no vLLM, no bf16, one short step."""
    pytest.importorskip("trl")
    import shutil

    from gfpo_trainer.cli import main

    work, _, _ = tiny_run
    for name in ("qwen2.5-0.5b.yaml", "train.jsonl", "rewards.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    overrides = ["--model", str(work / "tiny-model"), "--dataset", "train.jsonl", "--dataset_config", "null",
                 "--use_vllm", "false", "--bf16", "false", "--use_cpu", "true", "--max_steps", "1",
                 "--max_completion_length", "8", "--gradient_accumulation_steps", "1", "--log_completions", "false"]
    assert main(["train", "--config", str(tmp_path / "qwen2.5-0.5b.yaml"), *overrides]) == 0
    assert (tmp_path / "out-qwen2.5-0.5b" / "model.safetensors").exists()


def test_the_real_config_names_the_hub_gsm8k_and_the_settings_of_the_page():
    import yaml

    config = yaml.safe_load((EXAMPLE / "qwen2.5-0.5b.yaml").read_text())
    assert (config["model"], config["dataset"], config["dataset_config"]) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k", "main")
    assert config["prompt"] == yaml.safe_load((EXAMPLE / "tiny.yaml").read_text())["prompt"]
    args = config["args"]
    assert (args["num_generations"], args["num_remains_in_group"], args["group_filter"]) == (16, 8, "length")
    assert (args["max_completion_length"], args["beta"], args["loss_type"], args["use_vllm"]) == (512, 0.0, "dapo", True)
    assert args["reward_weights"] == [1.0, 0.5] and str(args["learning_rate"]) == "1e-6"


# --- dataset_config: a hub data set's configuration -----------------------------------------------------------

def test_dataset_config_reaches_load_dataset(monkeypatch):
    pytest.importorskip("trl")
    import datasets

    from gfpo_trainer.cli import load_train_dataset

    asked = []

    def fake_load_dataset(name, config_name=None, split=None, **kwargs):
        asked.append((name, config_name, split))
        if config_name is None:  # what datasets says for a data set of several configurations
            raise ValueError("Config name is missing.\nPlease pick one among the available configs: ['main', "
                             "'socratic']")
        return datasets.Dataset.from_list(_rows("test.jsonl")[:3])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset = load_train_dataset("openai/gsm8k", "test", config_name="main", prompt={"user": "{question}"})
    assert asked == [("openai/gsm8k", "main", "test")]
    assert dataset.column_names == ["question", "answer", "prompt"]
    with pytest.raises(ValueError, match=r"cannot load dataset 'openai/gsm8k' \(split 'train'\): Config name is "
                       r"missing\. .*; a data set of several configurations needs one named: dataset_config: NAME"):
        load_train_dataset("openai/gsm8k", prompt={"user": "{question}"})


def test_dataset_config_with_a_local_file_is_refused():
    pytest.importorskip("trl")
    from gfpo_trainer.cli import ConfigError, load_train_dataset

    with pytest.raises(ConfigError, match=r"dataset_config='main' names a configuration of a hub data set; the file "
                       r"'train.jsonl' has none: remove dataset_config"):
        load_train_dataset("train.jsonl", base_dir=str(EXAMPLE), config_name="main")


def test_dataset_config_is_checked_with_the_config_before_any_loading(tmp_path):
    """check_config (the command line's check before the training stack is imported) refuses it too."""
    pytest.importorskip("trl")
    import yaml

    from gfpo_trainer.cli import ConfigError, check_config

    config = yaml.safe_load((EXAMPLE / "tiny.yaml").read_text())
    (tmp_path / "tiny-model").mkdir()
    (tmp_path / "train.jsonl").write_text("")
    assert check_config(config, str(tmp_path))["reward_specs"] == ["rewards:correctness", "rewards:format_reward"]
    with pytest.raises(ConfigError, match=r"^dataset_config='main' names a configuration of a hub data set; the file "
                       r"'train.jsonl' has none: remove dataset_config$"):
        check_config({**config, "dataset_config": "main"}, str(tmp_path))
    with pytest.raises(ConfigError, match=r"^dataset_config must be the name of a configuration of the data set, "
                       r"got \['main'\]$"):
        check_config({**config, "dataset": "openai/gsm8k", "dataset_config": ["main"]}, str(tmp_path))
