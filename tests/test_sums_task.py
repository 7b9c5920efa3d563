"""The demo's and the study's tasks (gfpo_study/sums_task.py): prompts, warm-up answers, reward, evaluation."""

import random
import re

import pytest
import torch

from gfpo_study.sums_task import (
    TASKS, EasyHardSumsTask, SumsTask, answer_form, correctness_reward, evaluate, signed_correctness_reward
)
from gfpo_trainer.tiny import make_tokenizer

STEP = re.compile(r"(\d+)\+(\d+)=(\d+),")


def test_warmup_answers_are_correct_in_both_forms():
    """Every warm-up answer ends with the sum; a stepwise one adds one term per step with the right running sums,
    and holds only the task's filler words besides; the share of each form and of filler is the task's."""
    task = SumsTask()
    rng = random.Random(0)
    stepwise = filler_gaps = gaps = 0
    prompts = [[p for p in task.prompts() if len(p) == n] for n in (2, 3, 4)]
    for _ in range(4000):
        terms = task.draw(prompts, rng)
        answer = task.warmup_completion(terms, rng)
        assert correctness_reward([task.prompt(terms)], [answer]) == [1.0]
        if "+" not in answer:
            assert answer == f" {sum(terms)}"
            continue
        stepwise += 1
        steps = STEP.findall(answer)
        running = terms[0]
        assert len(steps) == len(terms) - 1
        for (a, b, total), term in zip(steps, terms[1:]):
            assert (int(a), int(b), int(total)) == (running, term, running + term)
            running += term
        rest = STEP.sub(" ", answer).split()
        assert rest[-2:] == ["so", str(sum(terms))]
        assert all(word in task.filler_words for word in rest[:-2])
        filler_gaps += len(rest) - 2
        gaps += len(terms)  # before each step and before "so"
    assert abs(stepwise / 4000 - task.steps_probability) < 0.03
    assert abs(filler_gaps / gaps - task.filler_probability) < 0.03


def test_split_holds_out_the_same_prompts_and_never_trains_on_them():
    task = SumsTask()
    train, held_out = task.split(40, seed=1234)
    assert len(held_out) == 3 * 40 and [len(t) for t in held_out] == [2] * 40 + [3] * 40 + [4] * 40
    assert not set(held_out) & {p for group in train for p in group}
    assert sum(map(len, train)) + len(held_out) == 10**2 + 10**3 + 10**4
    assert task.split(40, seed=1234) == (train, held_out)  # the same held-out set for every arm and seed
    assert task.split(40, seed=1)[1] != held_out
    counts = {2: 0, 3: 0, 4: 0}
    rng = random.Random(0)
    for _ in range(3000):
        counts[len(task.draw(train, rng))] += 1
    assert all(abs(c / 3000 - 1 / 3) < 0.03 for c in counts.values())  # as many short sums as long ones


@pytest.mark.parametrize("prompt, completion, reward", [
    ("3+5=", " 8", 1.0), ("3+5+9=", " 3+5=8, hmm 8+9=17, so 17", 1.0), ("3+5+9=", " 3+5=8, so 8", 0.0),
    ("1+2+3+4=", " 10", 1.0), ("1+2+3+4=", " wait", 0.0), ("0+0=", " 0", 1.0), ("9+9=", " 18 ok", 1.0),
])
def test_correctness_reward(prompt, completion, reward):
    assert correctness_reward([prompt], [completion]) == [reward]
    assert signed_correctness_reward([prompt], [completion]) == [2 * reward - 1]


def test_answer_form():
    assert answer_form(" 17") == (False, 0)
    assert answer_form(" hmm 3+5=8, wait ok 8+9=17, so 17") == (True, 3)
    assert answer_form(" 3+5=8, so 8") == (True, 0)


class _FixedAnswers(torch.nn.Module):
    """Answers every prompt with the given text (then pads), as model.generate would return it."""

    def __init__(self, tokenizer, answers: dict):
        super().__init__()
        self.tokenizer, self.answers = tokenizer, answers
        self.device = torch.device("cpu")

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        prompts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        rows = [self.tokenizer(self.answers[p], add_special_tokens=False).input_ids[:max_new_tokens] for p in prompts]
        rows = [r + [self.tokenizer.eos_token_id] if len(r) < max_new_tokens else r for r in rows]
        width = max(map(len, rows))
        rows = [r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_evaluate_counts_accuracy_length_and_form_per_number_of_terms():
    tokenizer = make_tokenizer()
    task = SumsTask()
    answers = {"1+2=": " 3", "2+2=": " 5", "1+2+3=": " 1+2=3, hmm 3+3=6, so 6", "4+4+4=": " 1" * 20}
    model = _FixedAnswers(tokenizer, answers)
    result = evaluate(model, tokenizer, task, [(1, 2), (2, 2), (1, 2, 3), (4, 4, 4)], 24, "cpu", samples=2)
    # lengths in tokens (one per character), <eos> included; the last answer runs to max_new_tokens (no <eos>)
    lengths = [2 + 1, 2 + 1, len(answers["1+2+3="]) + 1, 24]
    assert result["mean_length"] == pytest.approx(sum(lengths) / 4)
    assert result["accuracy"] == pytest.approx(2 / 4)
    assert result["stepwise_fraction"] == pytest.approx(1 / 4) and result["filler_per_answer"] == pytest.approx(1 / 4)
    assert result["accuracy_stepwise"] == 1.0 and result["accuracy_at_once"] == pytest.approx(1 / 3)
    assert result["by_terms"]["2"]["accuracy"] == 0.5 and result["by_terms"]["2"]["mean_length"] == 3.0
    assert result["by_terms"]["3"]["accuracy"] == 0.5 and result["by_terms"]["3"]["mean_length"] == (lengths[2] + 24) / 2


def test_evaluate_is_seeded_and_leaves_the_random_state_alone():
    """Held-out evaluation during training draws from its own seed and leaves the training's random state as it was."""
    from gfpo_trainer.tiny import make_tiny_model

    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, hidden_size=32)
    prompts = [(1, 2), (3, 4, 5)]
    state = torch.get_rng_state()
    first = evaluate(model, tokenizer, SumsTask(), prompts, 6, "cpu", samples=3, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    torch.rand(10)  # the training's draws in between change nothing
    assert evaluate(model, tokenizer, SumsTask(), prompts, 6, "cpu", samples=3, seed=5) == first


def test_easy_hard_split():
    """Easy prompts (2 numbers in [0, 5)) are a closed set, all trained on and all in the held-out set; the held-out
    hard prompts (4 numbers in [0, 10)) are never trained on; training draws either kind half the time."""
    task = EasyHardSumsTask()
    train, held_out = task.split(40, seed=1234)
    easy, hard = train
    assert sorted(easy) == [(a, b) for a in range(5) for b in range(5)]
    assert len(hard) == 10**4 - 40 and all(len(p) == 4 for p in hard)
    held_easy, held_hard = held_out[:40], held_out[40:]
    assert set(held_easy) == set(easy) and len(held_easy) == 40  # every easy prompt, cycled to 40
    assert len(held_hard) == 40 and not set(held_hard) & set(hard)
    assert task.split(40, seed=1234) == (train, held_out)
    rng = random.Random(0)
    kinds = [len(task.draw(train, rng)) for _ in range(4000)]
    assert abs(kinds.count(2) / 4000 - 0.5) < 0.03
    for terms in held_out:  # the warm-up answers are the sums task's, correct in both forms
        answer = task.warmup_completion(terms, rng)
        assert correctness_reward([task.prompt(terms)], [answer]) == [1.0]


def test_tasks_table():
    assert TASKS["sums"] == SumsTask() and type(TASKS["easy-hard-sums"]) is EasyHardSumsTask


def test_small_large_split_tells_the_kinds_by_their_digits():
    """small-large-sums: every prompt has 4 numbers; easy ones all below 3 (81, a closed set), hard ones not."""
    task = TASKS["small-large-sums"]
    train, held_out = task.split(40, seed=1234)
    easy, hard = train
    assert len(easy) == 81 and all(len(p) == 4 and max(p) < 3 for p in easy)
    assert len(hard) == 10**4 - 81 - 40 and all(len(p) == 4 and max(p) >= 3 for p in hard)
    assert [task.kind(p) for p in held_out] == ["easy"] * 40 + ["hard"] * 40
    assert not set(held_out[40:]) & set(hard)


def test_evaluate_reports_by_kind():
    tokenizer = make_tokenizer()
    task = TASKS["small-large-sums"]
    answers = {"1+1+0+2=": " 4", "9+1+0+2=": " 1"}
    result = evaluate(_FixedAnswers(tokenizer, answers), tokenizer, task, [(1, 1, 0, 2), (9, 1, 0, 2)], 8, "cpu",
                      samples=2)
    assert result["by_kind"]["easy"]["accuracy"] == 1.0 and result["by_kind"]["hard"]["accuracy"] == 0.0
    assert result["by_terms"]["4"]["accuracy"] == 0.5


@pytest.mark.parametrize("terms, completion, every", [
    ((3, 5, 9), " 3+5=8, hmm 8+9=17, so 17", True),
    ((3, 5, 9), " 3+5=8, 8+9=18, so 18", True),  # every step written, one sum wrong
    ((3, 5, 9), " 3+14=17, so 17", False),  # two terms merged
    ((3, 5, 9), " 3+5=8, so 17", False),  # a step skipped
    ((3, 5, 9), " 3+9=12, 12+5=17, so 17", False),  # out of order
    ((3, 5), " 17", False),
])
def test_writes_every_step(terms, completion, every):
    from gfpo_study.sums_task import writes_every_step

    assert writes_every_step(terms, completion) is every


def test_evaluate_tells_stepwise_answers_apart():
    """Stepwise answers with every step or a step skipped, with filler or without, each with its accuracy."""
    tokenizer = make_tokenizer()
    answers = {"1+2+3=": " 1+2=3, hmm 3+3=6, so 6", "2+2+2=": " 2+2=4, so 6", "3+3+3=": " 3+3=6, 6+3=9, so 9",
               "4+4+4=": " 4+8=13, so 13"}
    result = evaluate(_FixedAnswers(tokenizer, answers), tokenizer, SumsTask(),
                      [(1, 2, 3), (2, 2, 2), (3, 3, 3), (4, 4, 4)], 40, "cpu", samples=1)
    assert result["every_step_fraction"] == 0.5
    assert result["accuracy_every_step"] == 1.0 and result["accuracy_steps_skipped"] == 0.5
    assert result["accuracy_stepwise_with_filler"] == 1.0 and result["accuracy_stepwise_without_filler"] == 2 / 3
