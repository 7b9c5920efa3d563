"""The demo's task (gfpo_trainer/sums_task.py), its figures and statistics (gfpo_trainer/demo.py) and the CLI."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from gfpo_trainer import demo  # noqa: E402
from gfpo_trainer.sums_task import (  # noqa: E402
    SumsTask, answer_form, correctness_reward, evaluate, signed_correctness_reward
)
from gfpo_trainer.tiny import make_tokenizer  # noqa: E402

REPO = Path(__file__).parents[1]
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


def test_excess_length_reduction_is_the_papers_eq_4():
    # the paper's average row (Table 1): GRPO 13000, SFT 9500, Shortest 8/16 12000 -> 28.6%
    assert demo.excess_length_reduction(13000, 12000, 9500) == pytest.approx(1000 / 3500)
    assert demo.excess_length_reduction(20.0, 25.0, 10.0) == pytest.approx(-0.5)  # longer than GRPO: negative
    assert demo.excess_length_reduction(10.0, 8.0, 12.0) is None  # GRPO did not lengthen: undefined


def test_bootstrap_interval_of_two_values():
    # resamples of [0, 1]: means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5% points are 0 and 1
    assert demo.bootstrap_interval([0.0, 1.0], demo._mean) == (0.0, 1.0)
    assert demo.bootstrap_interval([3.0, 3.0, 3.0], demo._mean) == (3.0, 3.0)
    low, high = demo.bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0], demo._mean)
    assert 1.0 <= low < 3.0 < high <= 5.0


def _seed_result(warm_length, lengths, accuracies, tokens, seconds):
    return {"warm-up": {"accuracy": 0.5, "mean_length": warm_length},
            "arms": {name: {"final": {"accuracy": accuracies[name], "mean_length": lengths[name]},
                            "generated_tokens": [tokens[name]] * 3, "step_time": [seconds[name]] * 3, "curve": []}
                     for name in lengths}}


def test_summarize_pairs_each_arm_with_grpo_over_seeds():
    seeds = [
        _seed_result(10.0, {"grpo": 20.0, "shortest-8of16": 15.0}, {"grpo": 0.9, "shortest-8of16": 0.8},
                     {"grpo": 100.0, "shortest-8of16": 110.0}, {"grpo": 1.0, "shortest-8of16": 0.5}),
        _seed_result(12.0, {"grpo": 22.0, "shortest-8of16": 22.0}, {"grpo": 0.7, "shortest-8of16": 0.8},
                     {"grpo": 100.0, "shortest-8of16": 130.0}, {"grpo": 2.0, "shortest-8of16": 2.0}),
    ]
    summary = demo.summarize(seeds, ("grpo", "shortest-8of16"))
    arm = summary["arms"]["shortest-8of16"]
    # ELR of the means: (21 - 18.5) / (21 - 11)
    assert arm["elr"]["mean"] == pytest.approx(0.25)
    assert arm["accuracy_minus_grpo"]["per_seed"] == pytest.approx([-0.1, 0.1])
    assert arm["accuracy_minus_grpo"]["mean"] == pytest.approx(0.0)
    assert arm["tokens_per_step_over_grpo"]["per_seed"] == pytest.approx([1.1, 1.3])
    assert arm["seconds_per_step_over_grpo"]["per_seed"] == pytest.approx([0.5, 1.0])
    assert summary["warm-up"]["mean_length"]["mean"] == 11.0
    low, high = arm["elr"]["ci95"]  # resampling one seed twice: ELR 0.5 or 0.0; both: 0.25
    assert (low, high) == pytest.approx((0.0, 0.5))
    table = demo.study_table(summary)
    assert "shortest-8of16 | 0.800 [0.800, 0.800] | +0.000 [-0.100, +0.100] | 18.5 [15.0, 22.0] | 25% [0%, 50%]" \
        in table


def test_demo_verdict_in_words():
    result = _seed_result(10.0, {"grpo": 15.0, "shortest-8of16": 12.0}, {"grpo": 0.9, "shortest-8of16": 0.88},
                          {"grpo": 1.0, "shortest-8of16": 1.0}, {"grpo": 1.0, "shortest-8of16": 1.0})
    assert demo.demo_verdict(result) == (
        "GRPO took held-out accuracy from 0.50 to 0.90 and answers longer by 50%; shortest-8of16 +20% at accuracy "
        "0.88, 0.02 below GRPO's (60% of GRPO's extra length avoided).")


@pytest.mark.parametrize("results_file", ["results.json", "study.json"])
def test_announces_that_it_replaces_an_earlier_run(tmp_path, capsys, results_file):
    demo._announce_overwrite(str(tmp_path), results_file)
    assert capsys.readouterr().out == ""
    (tmp_path / results_file).write_text(json.dumps({"environment": {"date": "2026-11-27", "commit": "abc"}}))
    demo._announce_overwrite(str(tmp_path), results_file)
    assert capsys.readouterr().out == (f"gfpo demo: replacing the earlier run in {tmp_path}/ (its {results_file} of "
                                       "2026-11-27, commit abc); --output-dir keeps both\n")


def test_future_warnings_hidden_only_inside_the_run():
    """The demo hides transformers' FutureWarnings while it trains (unless --verbose) and gives the caller its
    warning filters back: a notebook that runs it still sees its own."""
    import warnings

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with demo._future_warnings_hidden(True):
            warnings.warn("hidden", FutureWarning)
            warnings.warn("shown", UserWarning)
        with demo._future_warnings_hidden(False):
            warnings.warn("verbose", FutureWarning)
        warnings.warn("after", FutureWarning)
    assert [str(w.message) for w in caught] == ["shown", "verbose", "after"]
    assert warnings.filters == before


def test_demo_smoke(tmp_path):
    """Every stage of `python -m gfpo_trainer demo` at toy sizes: warm-up, the demo's arms, table, verdict, plot,
    models."""
    import platform

    import trl

    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "gfpo_trainer", "demo", "--smoke", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("run | held-out accuracy | held-out length (tokens) | length vs warm-up | ELR | tokens generated / step | "
            "time / step (s)") in done.stdout
    for run in ("warm-up", *demo.DEMO_ARMS):
        assert f"\n{run} | " in done.stdout
    assert "\nGRPO took held-out accuracy from " in done.stdout
    results = json.loads((out / "results.json").read_text())
    assert list(results["result"]["arms"]) == list(demo.DEMO_ARMS)
    run = results["result"]["arms"]["shortest-8of16"]
    assert len(run["generated_tokens"]) == len(run["step_time"]) == 2 and len(run["curve"]) == 2
    environment = results["environment"]  # what docs/demo.md labels recorded runs with
    assert environment["versions"]["torch"] == torch.__version__ and environment["versions"]["trl"] == trl.__version__
    if (REPO / ".git").exists():  # a checkout (a worktree's .git is a file); a copied tree records None
        assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", environment["commit"])
    assert environment["machine"]["cpu_cores"] >= 1 and environment["python"] == platform.python_version()
    assert environment["wall_time_seconds"] > 0
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for model in ("warmup_model", *demo.DEMO_ARMS):  # what docs/demo.md says is written
        assert (out / model / "model.safetensors").exists() and (out / model / "tokenizer_config.json").exists()


def test_study_smoke(tmp_path):
    """The study at toy sizes: two seeds, two arms; its summary, table and plot are written; bad seeds or arms are
    refused before anything runs."""
    result = demo.run_study(demo.DemoSettings.smoke(), [0, 1], output_dir=str(tmp_path),
                            arms=("grpo", "shortest-8of16"))
    study = json.loads((tmp_path / "study.json").read_text())
    assert study["seeds"] == [0, 1] and [r["seed"] for r in study["seed_results"]] == [0, 1]
    assert set(study["summary"]["arms"]) == {"grpo", "shortest-8of16"}
    assert (tmp_path / "study.md").read_text() == result["table"] + "\n"
    assert (tmp_path / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"at least 2 seeds for its intervals, got seeds=\[0\]"):
        demo.run_study(demo.DemoSettings.smoke(), [0], output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"arms=\('grpo', 'nope'\): unknown arms \['nope'\]; choices: "):
        demo.run_study(demo.DemoSettings.smoke(), [0, 1], output_dir=str(tmp_path), arms=("grpo", "nope"))


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1"], "error: --seeds=1: the study needs at least 2 seeds for its intervals (leave --seeds out for "
                       "one run)"),
    (["--arms", "grpo,nope"], "error: --arms='grpo,nope': unknown arm 'nope'; choices: " + ", ".join(demo.ARMS)),
])
def test_demo_refuses_bad_options_in_one_line(argv, message, capsys):
    from gfpo_trainer.cli import main

    assert main(["demo", "--smoke", *argv]) == 2
    assert capsys.readouterr().err == message + "\n"


def test_paper_comparison_reads_the_papers_average_row():
    paper = json.loads((REPO / "docs" / "demo" / "gfpo-paper-tables.json").read_text())
    summary = {"arms": {"grpo": {}, "shortest-8of16": {
        "accuracy_minus_grpo": {"mean": -0.02, "ci95": (-0.05, 0.01)}, "elr": {"mean": 0.4, "ci95": (0.2, 0.6)}}}}
    table = demo.paper_comparison_table(summary, paper)
    # the paper's average: GRPO 72.1%, Shortest 8/16 73.4% and ELR 29.7%
    assert table.splitlines()[2] == "shortest-8of16 | +0.013 | 30% | -0.020 [-0.050, +0.010] | 40% [20%, 60%]"
    assert all(arm.paper in paper["benchmarks"]["Average"] for arm in demo.ARMS.values())
