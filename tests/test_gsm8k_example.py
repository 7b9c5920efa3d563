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
