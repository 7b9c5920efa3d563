"""The one-seed demo (gfpo_study/demo.py): its table, verdict, plot and files, and its command line."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from gfpo_study import demo, study  # noqa: E402

REPO = Path(__file__).parents[1]


def _arm(accuracy, length, generated=100.0, trained=100.0):
    return {"final": {"accuracy": accuracy, "mean_length": length}, "generated_tokens": [generated] * 3,
            "trained_tokens": [trained] * 3, "step_time": [1.0] * 3, "curve": []}


def test_demo_verdict_in_words(monkeypatch):
    result = {"warm-up": {"accuracy": 0.5, "mean_length": 10.0},
              "arms": {"grpo": _arm(0.9, 15.0), "shortest-8of16": _arm(0.88, 12.0)}}
    monkeypatch.setattr(demo, "STUDY_FINDINGS", "")
    assert demo.demo_verdict(result) == (
        "On this seed GRPO took held-out accuracy from 0.50 to 0.90 and answers longer by 50%; shortest-8of16 +20% at "
        "accuracy 0.88, 0.02 below GRPO's (ELR 60%).\n" + demo.ELR_IN_WORDS + ".")
    monkeypatch.setattr(demo, "STUDY_FINDINGS", "The study found this.")
    assert demo.demo_verdict(result).endswith(".\nThe study found this.")


def test_the_demos_study_figures_are_the_study_files():
    """Every figure the demo's verdict quotes from the study is the study file's, as printed (ELR to 0.1 point,
    accuracy to 0.0001)."""
    summary = json.loads((REPO / demo.STUDY_FILE).read_text())["summary"]["arms"]
    assert list(demo.STUDY_FIGURES) == ["shortest-8of16", "shortest-6of8"]
    for name, (elr, accuracy) in demo.STUDY_FIGURES.items():
        f = summary[name]
        assert elr == pytest.approx((f["elr_per_seed"]["mean"], *f["elr_per_seed"]["t95"]), abs=6e-4)
        assert accuracy == pytest.approx((f["accuracy_minus_grpo"]["mean"], *f["accuracy_minus_grpo"]["t95"]),
                                         abs=6e-5)
    assert demo.STUDY_FINDINGS == (
        "The study (8 seeds, 1500 RL steps, docs/demo.md; means and 95% t-intervals over seeds, against GRPO): "
        "shortest-8of16 ELR 22% [-0.4%, 45%], accuracy -0.022 [-0.045, +0.0003]; shortest-6of8 ELR 21% [1%, 42%], "
        "accuracy -0.013 [-0.026, -0.0001].")


def test_demo_table_counts_tokens_generated_and_trained():
    result = {"warm-up": {"accuracy": 0.5, "mean_length": 10.0},
              "arms": {"grpo": _arm(0.9, 15.0, 120.0, 120.0), "shortest-8of16": _arm(0.88, 12.0, 180.0, 90.0)}}
    lines = demo.demo_table(result).splitlines()
    assert lines[0].endswith("| tokens generated / step | tokens trained / step")
    assert lines[4] == "shortest-8of16 | 0.880 | 12.0 | +20% | 60% | 180 | 90"


def test_future_warnings_hidden_only_inside_the_run():
    """The demo hides transformers' FutureWarnings while it trains (unless --verbose) and gives the caller its
    warning filters back: a notebook that runs it still sees its own."""
    import warnings

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with study.future_warnings_hidden(True):
            warnings.warn("hidden", FutureWarning)
            warnings.warn("shown", UserWarning)
        with study.future_warnings_hidden(False):
            warnings.warn("verbose", FutureWarning)
        warnings.warn("after", FutureWarning)
    assert [str(w.message) for w in caught] == ["shown", "verbose", "after"]
    assert warnings.filters == before


def test_demo_smoke(tmp_path):
    """Every stage of `python -m gfpo_study demo` at toy sizes: warm-up, the demo's arms, table, verdict, plot,
    models; run again into the same folder, its finished runs are kept; another preset there is refused."""
    import platform

    import trl

    out = tmp_path / "demo"
    def run_demo(*options):
        return subprocess.run([sys.executable, "-m", "gfpo_study", "demo", *options, "--output-dir", str(out)],
                              capture_output=True, text=True, timeout=600, cwd=REPO)

    done = run_demo("--smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("run | held-out accuracy | held-out length (tokens) | length vs warm-up | ELR | tokens generated / step | "
            "tokens trained / step") in done.stdout
    for run in ("warm-up", *demo.DEMO_ARMS):
        assert f"\n{run} | " in done.stdout
    assert "\nOn this seed GRPO took held-out accuracy from " in done.stdout
    assert f"\n{demo.ELR_IN_WORDS}." in done.stdout
    assert f"\nwritten: {out / 'demo.png'} (the plot), {out / 'results.json'} (every figure; commit " in done.stdout
    results = json.loads((out / "results.json").read_text())
    assert list(results["result"]["arms"]) == list(demo.DEMO_ARMS)
    run = results["result"]["arms"]["shortest-8of16"]
    assert len(run["generated_tokens"]) == len(run["trained_tokens"]) == len(run["step_time"]) == 2
    assert len(run["curve"]) == len(run["curve_figures"]) == 2 and run["curve_figures"][1]["step"] == 2
    environment = results["environment"]  # what docs/demo.md labels recorded runs with
    assert environment["versions"]["torch"] == torch.__version__ and environment["versions"]["trl"] == trl.__version__
    if (REPO / ".git").exists():  # a checkout (a worktree's .git is a file); outside git: its build's commit
        assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", environment["commit"])
    assert environment["machine"]["cpu_cores"] >= 1 and environment["python"] == platform.python_version()
    assert environment["wall_time_seconds"] > 0
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for model in ("start_model", *demo.DEMO_ARMS):  # what docs/demo.md says is written
        folder = out / "seed-0" / model
        assert (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists()
    again = run_demo("--smoke")
    assert again.returncode == 0 and "gfpo study: 2 run(s) already finished in " in again.stdout
    assert json.loads((out / "results.json").read_text())["result"] == results["result"]
    other = run_demo("--quick")
    assert other.returncode == 2
    assert other.stderr.splitlines() == [f"error: output_dir {out} holds the runs of another study config: "
                                         "model.warmup_steps is 5 there and 800 here; give another output_dir (its "
                                         "runs stay as they are)"]


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "5"], "error: --seeds='5': a bare number is ambiguous; give a range or a list: --seeds 0-4 for the 5 "
                       "seeds 0..4, or --seeds 5-5 for seed 5 alone"),
    (["--seeds", "0-x"], "error: --seeds='0-x': '0-x' is neither a seed nor a range; give seeds as a range or a list, "
                         "e.g. --seeds 0-3 or --seeds 0,2,5"),
    (["--seeds", "3-1"], "error: --seeds='3-1': the range '3-1' is empty (its end is below its start)"),
    (["--seeds", "0-2,2"], "error: --seeds='0-2,2': seeds [2] appear more than once"),
    (["--arms", "grpo,nope"], "error: --arms='grpo,nope': unknown arm 'nope'; choices: " + ", ".join(demo.ARMS)),
    (["--arms", "grpo,shortest-8of61"], "error: --arms='grpo,shortest-8of61': unknown arm 'shortest-8of61' (did you "
                                        "mean 'shortest-8of16'?); choices: " + ", ".join(demo.ARMS)),
    (["--rl-steps", "0"], "error: --rl-steps=0: give at least 1 RL step"),
])
def test_demo_refuses_bad_options_in_one_line(argv, message, capsys):
    from gfpo_study.cli import main

    assert main(["demo", "--smoke", *argv]) == 2
    assert capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize("text, seeds", [("0-3", [0, 1, 2, 3]), ("4-7", [4, 5, 6, 7]), ("0,2,5", [0, 2, 5]),
                                         ("0-1,8", [0, 1, 8]), ("7-7", [7])])
def test_parse_seeds(text, seeds):
    from gfpo_trainer.cli import parse_seeds

    assert parse_seeds(text) == seeds


def test_task_choices_are_the_tasks(capsys):
    """The CLI's --task choices (written out, so that building the parser imports no torch) are sums_task.TASKS."""
    from gfpo_study.cli import main
    from gfpo_study.sums_task import TASKS

    with pytest.raises(SystemExit):
        main(["demo", "--task", "nope"])
    choices = re.search(r"choose from (.*)\)", capsys.readouterr().err).group(1)
    assert [c.strip(" '") for c in choices.split(",")] == list(TASKS)
