"""The demo's and the length study's task: sums of several small numbers, answered at once or step by step.

A toy analog of the paper's setting (a verbose SFT model that RL makes longer): the prompt is "a+b+c=" with 2 to
`max_terms` terms; a completion is correct when its last number is the sum. The warm-up (supervised) data answers
each prompt in one of two forms, chosen at random whatever the prompt:
- at once: " 17";
- step by step, a running sum per term, with filler words between the steps: " 3+5=8, hmm 8+9=17, so 17".
A small model is more accurate writing the steps than answering at once, with any number of terms (docs/demo.md has
the figures); the filler never changes the answer. RL that rewards correct answers then moves towards the steps and
lengthens the answers (with the filler they carry along), as RL lengthens a verbose SFT model's reasoning.
"""

from __future__ import annotations

import dataclasses
import random
import re

import torch

from gfpo_trainer.tiny import supervised_warm_up

_NUMBER = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True)
class SumsTask:
    """The task's distribution.

    Args:
        min_terms, max_terms: how many numbers a prompt adds (uniform in [min_terms, max_terms]).
        max_term: each number is in [0, max_term).
        steps_probability: the share of warm-up answers written step by step (the rest answer at once).
        filler_probability: the chance that filler precedes each step and the closing "so" of a stepwise answer.
        filler_words: the filler words, one drawn per gap that gets filler.
    """

    min_terms: int = 2
    max_terms: int = 4
    max_term: int = 10
    steps_probability: float = 0.5
    filler_probability: float = 0.5
    filler_words: tuple[str, ...] = ("hmm", "wait", "ok")

    def prompts(self) -> list[tuple[int, ...]]:
        """Every distinct prompt's terms, in a fixed order."""
        import itertools

        out = []
        for n in range(self.min_terms, self.max_terms + 1):
            out.extend(itertools.product(range(self.max_term), repeat=n))
        return out

    def split(self, eval_prompts: int, seed: int) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]]:
        """(train, held-out): the held-out prompts, `eval_prompts` per number of terms drawn with `seed`, and the
        training prompts by number of terms (one list each, shuffled), none of them held out. Training draws a
        number of terms uniformly first (`draw`), so prompts with few terms are as frequent as those with many."""
        rng = random.Random(seed)
        train, held_out = [], []
        prompts = self.prompts()
        for n in range(self.min_terms, self.max_terms + 1):
            same = [p for p in prompts if len(p) == n]
            rng.shuffle(same)
            held_out.extend(same[:eval_prompts])
            train.append(same[eval_prompts:])
        return train, held_out

    def kind(self, terms: tuple[int, ...]) -> str:
        """The kind of prompt the evaluation reports apart ("by_kind"): here its number of terms."""
        return str(len(terms))

    @staticmethod
    def draw(train: list[list[tuple[int, ...]]], rng: random.Random) -> tuple[int, ...]:
        """A training prompt: a number of terms uniformly, then a prompt of that many terms uniformly."""
        return rng.choice(rng.choice(train))

    @staticmethod
    def prompt(terms: tuple[int, ...]) -> str:
        return "+".join(map(str, terms)) + "="

    def warmup_completion(self, terms: tuple[int, ...], rng: random.Random) -> str:
        """One warm-up answer to `terms`: at once or step by step (with filler), as the task's probabilities say."""
        total = sum(terms)
        if rng.random() >= self.steps_probability:
            return f" {total}"
        parts, running = [], terms[0]
        for term in terms[1:]:
            parts.append(self._filler(rng) + f" {running}+{term}={running + term},")
            running += term
        return "".join(parts) + self._filler(rng) + f" so {total}"

    def _filler(self, rng: random.Random) -> str:
        return f" {rng.choice(self.filler_words)}" if rng.random() < self.filler_probability else ""


@dataclasses.dataclass(frozen=True)
class EasyHardSumsTask(SumsTask):
    """Sums of two kinds, each half of the training prompts, both answered in both forms at warm-up (the same
    SumsTask answers, whatever the kind): easy prompts, `min_terms` numbers in [0, `easy_max_term`), a closed set the
    warm-up teaches at once and step by step alike; hard prompts, `max_terms` numbers in [0, `max_term`) (those that are
    not easy), where the steps pay. A stand-in for the paper's regime: RL lengthens the hard prompts' answers because
    the steps pay there; if the model carries the steps over to the easy prompts, where they pay nothing, that extra
    length is excess.

    The easy prompts are too few to hold any out: the held-out set has every easy prompt (repeated to as many as the
    hard ones) and `eval_prompts` held-out hard prompts; `kind` tells them apart (the evaluation's "by_kind").
    """

    min_terms: int = 2  # the easy prompts' number of terms
    max_terms: int = 4  # the hard prompts' number of terms
    easy_max_term: int = 5

    def kind(self, terms: tuple[int, ...]) -> str:
        """"easy" or "hard"."""
        return "easy" if len(terms) == self.min_terms and max(terms) < self.easy_max_term else "hard"

    def prompts(self) -> list[tuple[int, ...]]:
        import itertools

        easy = list(itertools.product(range(self.easy_max_term), repeat=self.min_terms))
        hard = itertools.product(range(self.max_term), repeat=self.max_terms)
        return easy + [p for p in hard if self.kind(p) == "hard"]

    def split(self, eval_prompts: int, seed: int) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]]:
        """(train, held-out): train is [every easy prompt, the hard prompts not held out] (shuffled); held out,
        `eval_prompts` hard prompts drawn with `seed` and as many easy ones (every easy prompt, cycled)."""
        rng = random.Random(seed)
        easy = [p for p in self.prompts() if self.kind(p) == "easy"]
        hard = [p for p in self.prompts() if self.kind(p) == "hard"]
        rng.shuffle(easy)
        rng.shuffle(hard)
        held_out_easy = [easy[i % len(easy)] for i in range(eval_prompts)]
        return [easy, hard[eval_prompts:]], held_out_easy + hard[:eval_prompts]


TASKS = {"sums": SumsTask(), "easy-hard-sums": EasyHardSumsTask(),
         "small-large-sums": EasyHardSumsTask(min_terms=4, max_terms=4, easy_max_term=3)}


def correctness_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the last number of the completion is the sum of the numbers in the prompt ("a+b+c="), else 0.0."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        numbers = _NUMBER.findall(completion)
        rewards.append(1.0 if numbers and int(numbers[-1]) == sum(map(int, _NUMBER.findall(prompt))) else 0.0)
    return rewards


def signed_correctness_reward(prompts, completions, **kwargs) -> list[float]:
    """The paper's reward range: 1.0 for a correct answer, -1.0 for a wrong one."""
    return [2.0 * r - 1.0 for r in correctness_reward(prompts, completions)]


def warm_up(model, tokenizer, task: SumsTask, train_prompts, steps: int, batch_size: int, seed: int, device,
            learning_rate: float = 3e-3, desc: str = "warm-up (supervised)") -> list[float]:
    """Supervised warm-up on the task's warm-up answers (gfpo_trainer.tiny.supervised_warm_up). Returns the losses."""

    def draw_example(rng):
        terms = task.draw(train_prompts, rng)
        return task.prompt(terms), task.warmup_completion(terms, rng)

    return supervised_warm_up(model, tokenizer, draw_example, steps, device, batch_size=batch_size, seed=seed,
                              learning_rate=learning_rate, desc=desc)


def answer_form(completion: str) -> tuple[bool, int]:
    """(whether the answer is written step by step, how many filler words it holds), read from its text."""
    words = completion.replace(",", " ").split()
    return "+" in completion, sum(w in SumsTask.filler_words for w in words)


_STEP = re.compile(r"(\d+)\+(\d+)=")


def writes_every_step(terms: tuple[int, ...], completion: str) -> bool:
    """Whether a stepwise answer adds the prompt's terms one step each, in order: as many "a+b=" steps as terms after
    the first, the i-th adding the (i+1)-th term (the running sums themselves may be wrong). A shorter stepwise answer
    skips or merges terms."""
    steps = _STEP.findall(completion)
    return len(steps) == len(terms) - 1 and all(int(b) == term for (_, b), term in zip(steps, terms[1:]))


def evaluate(model, tokenizer, task: SumsTask, prompts, max_new_tokens: int, device=None, *, samples: int = 4,
             temperature: float = 0.8, seed: int = 0, desc: str = "evaluate") -> dict:
    """Held-out figures of `model`: `samples` sampled answers per prompt at `temperature` (the paper's pass@1: the
    mean accuracy of sampled answers), seeded with `seed` (gfpo_study.evaluation.sample_answers, the study's path;
    the model answers on its own device).

    Returns accuracy, mean length (tokens, <eos> included), the share of answers written step by step and the filler
    words per answer, overall, per number of terms ("by_terms") and per kind of prompt ("by_kind": task.kind)."""
    from .evaluation import sample_answers

    texts = [task.prompt(p) for p in prompts]
    answers, lengths = sample_answers(model, tokenizer, texts, samples=samples, temperature=temperature,
                                      max_tokens=max_new_tokens, seed=seed)
    repeated = [t for t in texts for _ in range(samples)]
    return answer_figures(repeated, answers, lengths, correctness_reward(repeated, answers), task=task)


def _task(task) -> SumsTask:
    """A task given by its name in TASKS, by a SumsTask's fields (a mapping, as a config holds a task of its own) or
    as itself."""
    if isinstance(task, str):
        if task not in TASKS:
            raise ValueError(f"task={task!r}: one of {list(TASKS)}, or a mapping of SumsTask's fields")
        return TASKS[task]
    if isinstance(task, dict):
        return SumsTask(**{k: tuple(v) if isinstance(v, list) else v for k, v in task.items()})
    return task


def answer_figures(prompts, completions, lengths, correct, task="sums") -> dict:
    """The sums study's figures of sampled answers (the study's `eval.details` function): accuracy and mean length,
    the stepwise share, filler words, accuracy per form; overall, per number of terms ("by_terms") and per kind.

    Args:
        prompts, completions, lengths, correct: one per answer (prompt text, answer text, tokens, 0/1).
        task: a SumsTask or its name in TASKS.
    """
    task = _task(task)
    rows = []
    for prompt, text, length, ok in zip(prompts, completions, lengths, correct, strict=True):
        terms = tuple(int(n) for n in _NUMBER.findall(prompt))
        stepwise, filler = answer_form(text)
        rows.append((len(terms), ok, length, stepwise, filler, task.kind(terms),
                     stepwise and writes_every_step(terms, text)))

    def accuracy(rows):
        return sum(r[1] for r in rows) / len(rows) if rows else None

    def summary(selected):
        n = max(len(selected), 1)
        stepwise = [r for r in selected if r[3]]
        every_step = [r for r in stepwise if r[6]]
        return {"accuracy": sum(r[1] for r in selected) / n, "mean_length": sum(r[2] for r in selected) / n,
                "stepwise_fraction": len(stepwise) / n, "filler_per_answer": sum(r[4] for r in selected) / n,
                "accuracy_stepwise": accuracy(stepwise),
                "accuracy_at_once": accuracy([r for r in selected if not r[3]]),
                # the stepwise answers apart: every step written or some skipped; with filler or without
                "every_step_fraction": len(every_step) / len(stepwise) if stepwise else None,
                "accuracy_every_step": accuracy(every_step),
                "accuracy_steps_skipped": accuracy([r for r in stepwise if not r[6]]),
                "accuracy_stepwise_with_filler": accuracy([r for r in stepwise if r[4]]),
                "accuracy_stepwise_without_filler": accuracy([r for r in stepwise if not r[4]])}

    result = summary(rows)
    result["by_terms"] = {str(n): summary([r for r in rows if r[0] == n]) for n in sorted({r[0] for r in rows})}
    result["by_kind"] = {kind: summary([r for r in rows if r[5] == kind]) for kind in sorted({r[5] for r in rows})}
    return result


# ------------------------------------------------------------------ the study config's functions (configs/sums.yaml)
def start_model(seed: int, output_dir: str, task="sums", warmup_steps: int = 800, warmup_batch: int = 64,
                hidden_size: int = 64, num_layers: int = 2, eval_prompts: int = 40, held_out_seed: int = 1234) -> str:
    """The study's starting model for `seed` (its `model: {function: ...}`): the tiny model initialised with `seed`
    and warmed up (supervised, `warmup_steps` batches of `warmup_batch`) on the task's training prompts, saved with
    its tokenizer into `output_dir`, which it returns."""
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    task = _task(task)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = make_tokenizer()
    train, _ = task.split(eval_prompts, held_out_seed)
    model = make_tiny_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed).to(device)
    warm_up(model, tokenizer, task, train, warmup_steps, warmup_batch, seed, device, desc=f"warm-up, seed {seed}")
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def training_prompts(seed: int, rows: int, task="sums", eval_prompts: int = 40, held_out_seed: int = 1234) -> list:
    """`rows` training prompts for `seed` (the study's `dataset: {function: ...}`): a number of terms uniformly, then
    a prompt of that many terms, drawn with `seed` from the prompts not held out."""
    task = _task(task)
    train, _ = task.split(eval_prompts, held_out_seed)
    rng = random.Random(seed)
    return [{"prompt": task.prompt(task.draw(train, rng))} for _ in range(rows)]


def held_out_prompts(task="sums", eval_prompts: int = 40, held_out_seed: int = 1234) -> list:
    """The held-out prompts (the study's `eval.dataset: {function: ...}`), `eval_prompts` per number of terms."""
    task = _task(task)
    return [{"prompt": task.prompt(p)} for p in task.split(eval_prompts, held_out_seed)[1]]
