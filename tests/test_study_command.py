"""The study as a command for any model, data and reward (`python -m gfpo_study`): the config and its errors, a
user's own study end to end on CPU, a killed run started again, pieces and their merge, the trainer kept apart."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")
pytest.importorskip("scipy")

from gfpo_test_utils import save_tiny_model, subprocess_env  # noqa: E402

from gfpo_study import study  # noqa: E402
from gfpo_study.config import ConfigError, parse_study_config  # noqa: E402
from gfpo_study.evaluation import score_answers  # noqa: E402

REPO = Path(__file__).parents[1]

REWARDS = textwrap.dedent('''
    import os
    import re
    import signal
    import time

    CALLS = [0]
    SCORE_CALLS = [0]


    def correct(prompts, completions, answer, **kwargs):
        """The training reward (matches). The test's kill switches: the
        process ends itself (SIGKILL, as a cluster's scheduler ends a job) at the reward call KILL_AT_CALL, or waits
        at the call HANG_AT_CALL, having created the file HANG_FILE, for the test to kill it."""
        CALLS[0] += 1
        if CALLS[0] == int(os.environ.get("KILL_AT_CALL", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        if CALLS[0] == int(os.environ.get("HANG_AT_CALL", "0")):
            open(os.environ["HANG_FILE"], "w").close()
            time.sleep(600)
        return matches(completions, answer)


    def score(prompts, completions, answer, **kwargs):
        """The held-out correctness: the same test. The test's pause: at the held-out evaluation PAUSE_AT_SCORE_CALL
        the process creates the file HANG_FILE and waits until the file RELEASE_FILE exists."""
        SCORE_CALLS[0] += 1
        if SCORE_CALLS[0] == int(os.environ.get("PAUSE_AT_SCORE_CALL", "0")):
            open(os.environ["HANG_FILE"], "w").close()
            while not os.path.exists(os.environ["RELEASE_FILE"]):
                time.sleep(0.05)
        return matches(completions, answer)


    def matches(completions, answer):
        """1.0 where the completion's last number is the answer."""
        out = []
        for completion, expected in zip(completions, answer):
            numbers = re.findall(r"\\d+", completion)
            out.append(1.0 if numbers and int(numbers[-1]) == expected else 0.0)
        return out
''')

STEPS = 3
CONFIG = {
    "model": "tiny_model",
    "dataset": "data/train.jsonl",
    "reward_funcs": ["my_rewards:correct"],
    "args": {"max_completion_length": 6, "learning_rate": 0.003, "use_cpu": True},
    "eval": {"dataset": "data/test.jsonl", "correct": "my_rewards:score", "samples": 2, "temperature": 0.8},
    "arms": ["grpo", {"name": "shortest-4of8", "num_generations": 8, "num_remains_in_group": 4,
                      "group_filter": "length"}],
    "seeds": "0-1",
    "steps": STEPS,
    "eval_every": 2,
    "prompts_per_step": 2,
    "output_dir": "out",
}


def make_user_folder(folder: Path, config: dict = CONFIG) -> Path:
    """A user's study: an own reward file, own .jsonl data (held-out sums apart from the trained ones), a local model
    folder saved from the tiny model, and the config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_rewards.py").write_text(REWARDS)
    (folder / "data").mkdir(exist_ok=True)
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if (r["answer"] % 7)))
    (folder / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if not r["answer"] % 7))
    if not (folder / "tiny_model").exists():
        save_tiny_model(folder / "tiny_model")
    (folder / "study.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def study_command(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gfpo_study", *args], cwd=folder, capture_output=True, text=True,
                          timeout=600, env=subprocess_env(OMP_NUM_THREADS="1", **env))


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory):
    """The user's study, killed during its second run, then run again to the end (the README's command)."""
    folder = make_user_folder(tmp_path_factory.mktemp("user"))
    killed = study_command(folder, "run", "--config", "study.yaml", KILL_AT_CALL=str(STEPS + 1))
    first_run = folder / "out" / "seed-0" / "grpo.json"
    state = {"killed": killed, "first_run": first_run.read_bytes() if first_run.exists() else None,
             "after_kill": sorted(p.name for p in (folder / "out" / "seed-0").glob("*.json"))}
    state["rerun"] = study_command(folder, "run", "--config", "study.yaml")
    state["third"] = study_command(folder, "run", "--config", "study.yaml")
    return folder, state


def test_a_killed_study_keeps_its_finished_run_and_redoes_nothing_finished(finished_study):
    folder, state = finished_study
    assert state["killed"].returncode == -9, state["killed"].stderr[-2000:]
    # killed in the second run (the first step of shortest-4of8 on seed 0): the first run's file is there, whole
    assert state["after_kill"] == ["grpo.json", "start.json"]
    rerun = state["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert ("gfpo study: 1 run(s) already finished in " f"{folder / 'out'}, not run again: grpo seed 0") in rerun.stdout
    assert (folder / "out" / "seed-0" / "grpo.json").read_bytes() == state["first_run"]  # not trained again
    # the progress bar: the run, the step of all steps left, the time left
    assert re.search(r"seed 1, shortest-4of8: +\d+%\|.*\| \d+/\d+ \[\d\d:\d\d<\d\d:\d\d", rerun.stderr)
    third = state["third"]
    assert third.returncode == 0 and "4 run(s) already finished" in third.stdout
    assert "seed 0, grpo" not in third.stderr  # no progress bar: nothing trained


def test_a_users_study_runs_end_to_end(finished_study):
    """Own reward file, own .jsonl, a local model folder, 2 arms x 2 seeds: the runs, study.json (the runs and the
    summary), study.md (tables, verdict with its few-seeds warning) and study.png."""
    folder, state = finished_study
    out = folder / "out"
    written = json.loads((out / "study.json").read_text())
    assert written["seeds"] == [0, 1] and written["arms"] == ["grpo", "shortest-4of8"]
    assert set(written) == {"environment", "settings", "task", "arms", "seeds", "seed_results", "summary"}
    for result in written["seed_results"]:
        start = json.loads((out / f"seed-{result['seed']}" / "start.json").read_text())
        assert result["warm-up"] == start["figures"]
        for name in ("grpo", "shortest-4of8"):
            run = result["arms"][name]
            assert len(run["generated_tokens"]) == len(run["step_time"]) == STEPS
            assert [c[0] for c in run["curve"]] == [2, 3]  # eval_every 2, and the last step
            # the held-out set: 14 prompts (sums 0, 7, 14), 2 samples each; accuracy a multiple of 1/28
            assert round(run["final"]["accuracy"] * 28, 6) == round(run["final"]["accuracy"] * 28)
            assert (out / f"seed-{result['seed']}" / name / "model.safetensors").exists()
    summary = written["summary"]["arms"]["shortest-4of8"]
    # the paired accuracy difference is the per-seed difference of the recorded figures
    assert summary["accuracy_minus_grpo"]["per_seed"] == pytest.approx(
        [r["arms"]["shortest-4of8"]["final"]["accuracy"] - r["arms"]["grpo"]["final"]["accuracy"]
         for r in written["seed_results"]])
    report = (out / "study.md").read_text()
    assert "## Verdict" in report and "Only 2 seeds (fewer than 5): the t-intervals are wide" in report
    assert "## Held-out figures at the end (2 samples a prompt)" in report  # the config's eval.samples, not 8
    # the config's own model is the "start" (nothing warmed it up), in the table and in ELR's words
    assert "\nstart | " in report and "(L_GRPO - L_start)" in report and "warm-up" not in report
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"


def test_the_report_and_plot_say_the_configs_sample_counts(finished_study, tmp_path, monkeypatch):
    """The headings and plot titles give eval.samples and eval.curve_samples as the study's config sets them."""
    import matplotlib.figure

    from gfpo_study.study_report import plot_study, study_report

    folder, _ = finished_study
    study = json.loads((folder / "out" / "study.json").read_text())
    report = study_report(study["summary"], 2, None, {}, samples=3, curve_samples=1)
    assert "## Held-out figures at the end (3 samples a prompt)" in report  # (3 steps: no curve checkpoints)
    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda figure, *args, **kwargs: titles.extend(ax.get_title() for ax in figure.axes))
    plot_study(study["seed_results"], study["summary"], str(tmp_path / "study.png"), samples=3, curve_samples=1)
    assert titles == ["held-out at the end (3 samples a prompt; 95% t-intervals)",
                      "held-out length over training (1 sample a prompt)",
                      "held-out accuracy over training (1 sample a prompt)"]


def test_pieces_on_other_machines_merge_into_the_study(finished_study, tmp_path):
    """--seeds pieces into their own folders, then merge: the runs of the study run at once (times apart)."""
    folder, _ = finished_study
    for seed in (0, 1):
        done = study_command(folder, "run", "--config", "study.yaml", "--seeds", str(seed), "--output-dir",
                             str(tmp_path / f"piece-{seed}"))
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Run the other pieces, then  python -m gfpo_study merge" in done.stdout
    done = study_command(folder, "merge", str(tmp_path / "piece-1"), str(tmp_path / "piece-0"), "--output-dir",
                         str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr[-3000:]
    merged = json.loads((tmp_path / "merged" / "study.json").read_text())
    whole = json.loads((folder / "out" / "study.json").read_text())
    for a, b in zip(merged["seed_results"], whole["seed_results"], strict=True):
        assert a["warm-up"] == b["warm-up"]
        for name in ("grpo", "shortest-4of8"):
            assert a["arms"][name]["final"] == b["arms"][name]["final"]
            assert a["arms"][name]["curve"] == b["arms"][name]["curve"]
    # a folder of another config: one line naming the value, nothing there changed
    other = dict(CONFIG, steps=STEPS + 1)
    (folder / "other.yaml").write_text(yaml.safe_dump(other))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (folder / "out").rglob("*.json"))
    done = study_command(folder, "run", "--config", "other.yaml")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: output_dir {folder / 'out'} holds the runs of another study config: "
                                        f"steps is {STEPS} there and {STEPS + 1} here; give another output_dir (its "
                                        "runs stay as they are)"]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (folder / "out").rglob("*.json")) == before


# ------------------------------------------------------------------ the config's errors, before anything trains
@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    return make_user_folder(tmp_path_factory.mktemp("config"))


def parse(folder: Path, **changes):
    config = json.loads(json.dumps(CONFIG))
    for key, value in changes.items():
        if "__" in key:
            section, field = key.split("__")
            config[section][field] = value
        elif value is None:
            config.pop(key)
        else:
            config[key] = value
    return parse_study_config(config, str(folder))


@pytest.mark.parametrize("changes, message", [
    (dict(eval__correct="my_rewards:scor"), r"^eval.correct: function 'my_rewards:scor': module 'my_rewards' has "
     r"no function 'scor' \(did you mean 'score'\?\)"),
    (dict(eval__correct="nowhere:correct"), r"^eval.correct: function 'nowhere:correct': no module 'nowhere'"),
    (dict(eval__samles=4), r"^eval: unknown keys \['samles'\] \(did you mean 'samples'\?\)"),
    (dict(eval__temperature=0), r"^eval.temperature=0: a number > 0"),
    (dict(arms=["grpo", "shortest-8of61"]), r"^arms: unknown arm 'shortest-8of61' \(did you mean 'shortest-8of16'\?\)"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 8, "num_remain_in_group": 4, "group_filter": "length"}]),
     r"^arms: arm 'mine' has unknown GFPOConfig fields \['num_remain_in_group'\] \(did you mean "
     r"'num_remains_in_group'\?\)"),
    (dict(arms=["grpo", {"name": "grpo-too", "num_generations": 8}]),
     r"^arms: 'grpo' and 'grpo-too' are the same config \(.*\); drop one or change a field$"),
    (dict(arms=[{"name": "a", "num_generations": 8, "num_remains_in_group": 4, "group_filter": "length"},
                {"name": "b", "num_generations": 8, "num_remains_in_group": 4, "group_filter": "length",
                 "beta": 0.0}]), r"^arms: 'a' and 'b' are the same config"),
    (dict(arms=["grpo", "grpo"]), r"^arms: 'grpo' is listed twice"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 8, "num_remains_in_group": 4}]),
     r"^arms: arm 'mine' sets num_remains_in_group=4 without group_filter \(one of length, token_efficiency\): a "
     r"GFPO arm keeps k completions of each group by a filter; set both, or neither for GRPO$"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 8, "group_filter": "length"}]),
     r"^arms: arm 'mine' sets group_filter='length' without num_remains_in_group \(k\)"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 8, "num_remains_in_group": 4,
                         "group_filter": "shortest-4of8"}]),
     r"^arms: arm 'mine': group_filter must be None or one of \('length', 'token_efficiency'\), got "
     r"group_filter='shortest-4of8' \(did you mean 'length'\? the filter the paper calls 'shortest-4of8'"),
    (dict(arms=[{"name": "grpo", "num_generations": 4}]), r"^arms: 'grpo' is a built-in arm's name"),
    (dict(arms=[{"name": "mine", "max_steps": 4}]), r"^arms: arm 'mine' sets 'max_steps', which the study sets for "
     r"every run; set steps"),
    (dict(args__max_steps=10), r"^args.max_steps: the study sets it for every run; set steps$"),
    (dict(args__disable_tqdm=True), r"^args.disable_tqdm: the study sets it for every run; set nothing: the study "
     r"shows one progress bar \(run --verbose prints TRL's metrics at every step instead\)$"),
    (dict(args__per_device_train_batch_size=8), r"^args.per_device_train_batch_size: the study sets it for every run; "
     r"set prompts_per_step"),
    # the study resumes each run itself (trainer.train(resume_from_checkpoint=...)): the field would go unread
    (dict(args__resume_from_checkpoint="tiny_model"), r"^args.resume_from_checkpoint: the study sets it for every "
     r"run; set checkpoint_every \(a rerun resumes each run from its latest checkpoint\)$"),
    (dict(arms=[{"name": "mine", "num_generations": 4, "resume_from_checkpoint": True}]), r"^arms: arm 'mine' sets "
     r"'resume_from_checkpoint', which the study sets for every run; set checkpoint_every"),
    (dict(args__use_vllm=True, args__vllm_mode="server"), r"^args.use_vllm=true with vllm_mode='server': the study "
     r"evaluates held-out answers through the trainer's own vLLM engine, which only colocate mode holds; set "
     r"vllm_mode: colocate, or use_vllm: false \(docs/study.md\)$"),
    (dict(args__use_vllm=True, args__vllm_enable_sleep_mode=True), r"^args.vllm_enable_sleep_mode=true: the study's "
     r"held-out evaluation generates on the trainer's engine between training steps"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 4, "use_vllm": True}]), r"^arms: arm 'mine' sets "
     r"'use_vllm': every arm generates on the same path \(the same sampling for the same weights\); set it under "
     r"args$"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 4, "model_init_kwargs": {"dtype": "bfloat16"}}]),
     r"^arms: arm 'mine' sets 'model_init_kwargs': every arm loads the start model alike \(the seed's starting model "
     r"is evaluated once, as every arm's start\); set it under args$"),
    (dict(arms=["grpo", {"name": "mine", "num_generations": 4, "use_cpu": True}]), r"^arms: arm 'mine' sets "
     r"'use_cpu': every arm loads the start model alike"),
    (dict(args__learning_rat=1e-3), r"^unknown GFPOConfig fields \['learning_rat'\] under 'args' \(did you mean "
     r"'learning_rate'\?\)"),
    (dict(seeds=5), r"^seeds='5': a bare number is ambiguous"),
    (dict(seeds=[0, 0]), r"^seeds=\[0, 0\]: a seed appears more than once"),
    (dict(steps=0), r"^steps=0: give a whole number of at least 1"),
    (dict(stpes=3), r"^unknown config keys \['stpes'\] \(did you mean 'steps'\?\)"),
    (dict(eval=None), r"^the study config needs 'eval'$"),
    (dict(eval=None, arms=None, seeds=None, steps=None), r"^the study config needs 'eval'; this looks like a training "
     r"config \(no eval, no arms\): train with python -m gfpo_trainer train --config FILE, or add the study's keys"),
    (dict(model="tiny_modle"), r"^model 'tiny_modle': no directory .*tiny_modle \(did you mean 'tiny_model'\?\)"),
    (dict(eval__dataset="data/tset.jsonl"), r"^eval.dataset file 'data/tset.jsonl' does not exist \(looked for "
     r".*/data/tset.jsonl\) \(did you mean 'test.jsonl'\?\); relative paths are read from the config file's folder"),
    (dict(dataset="data/train.txt"), r"^dataset file 'data/train.txt' does not exist \(looked for .*/data/train.txt\) "
     r"\(did you mean 'train.jsonl'\?\)"),
])
def test_config_errors_name_the_key_and_the_fix(user_folder, changes, message):
    with pytest.raises(ConfigError, match=message):
        parse(user_folder, **changes)


def test_a_good_config_parses(user_folder):
    config = parse(user_folder)
    assert list(config.arms) == ["grpo", "shortest-4of8"] and config.seeds == [0, 1]
    assert config.arms["shortest-4of8"].kept_share() == 0.5 and config.arms["grpo"].kept_share() is None
    assert config.output_dir == str(user_folder / "out")
    args = study.arm_args(config, config.arms["shortest-4of8"], 1, str(user_folder / "x"))
    # prompts_per_step prompts a step whatever G: 2 x 8 completions; the seed and steps the study's; no shuffling
    assert (args.per_device_train_batch_size, args.max_steps, args.seed, args.shuffle_dataset) == (16, STEPS, 1, False)
    assert args.learning_rate == 0.003 and args.num_remains_in_group == 4 and args.group_filter == "length"
    rows = study.training_rows(config, 0)
    assert len(rows) == STEPS * 2 and rows == study.training_rows(config, 0) != study.training_rows(config, 1)
    lines = (user_folder / "data/train.jsonl").read_text().splitlines()
    trained = {json.dumps(json.loads(line), sort_keys=True) for line in lines}
    assert {json.dumps(r, sort_keys=True) for r in rows} <= trained


def test_use_vllm_colocate_parses(user_folder):
    """use_vllm in colocate mode (GFPOConfig's default mode) is a study config: training and the held-out evaluation
    then generate on the trainer's engine (tests/test_vllm.py runs one)."""
    for mode in ({}, {"args__vllm_mode": "colocate"}):
        config = parse(user_folder, args__use_vllm=True, **mode)
        assert study.arm_args(config, config.arms["grpo"], 0, str(user_folder / "x")).use_vllm is True


def test_eval_function_results_are_checked():
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}]
    answers = ["2", "5", "4", "4"]

    def exact(prompts, completions, answer, **kwargs):
        return [c == str(a) for c, a in zip(completions, answer)]

    assert score_answers(exact, rows, answers, samples=2) == [1.0, 0.0, 1.0, 1.0]
    assert score_answers(lambda completions, **k: [0.2, 0.7, 0.5, 0.9], rows, answers, 2, threshold=0.5) == [
        0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"^eval.correct <lambda>: returned 3 values for 4 completions; it must return "
                       r"one bool or number per completion$"):
        score_answers(lambda completions, **k: [1.0] * 3, rows, answers, 2)
    with pytest.raises(ValueError, match=r"^eval.correct <lambda>: value 'yes' for completion 1 is not a bool or a "
                       r"finite number$"):
        score_answers(lambda completions, **k: [1.0, "yes", 0.0, 0.0], rows, answers, 2)
    with pytest.raises(ValueError, match=r"value nan for completion 0 is not a bool or a finite number"):
        score_answers(lambda completions, **k: [float("nan")] * 4, rows, answers, 2)
    with pytest.raises(ValueError, match=r"returned NoneType, not a list"):
        score_answers(lambda completions, **k: None, rows, answers, 2)
    with pytest.raises(ValueError, match=r"value None for completion 2 is not a bool or a finite number"):
        score_answers(lambda completions, **k: [1.0, 0.0, None, 1.0], rows, answers, 2)


def test_eval_correct_takes_what_the_trainer_takes_as_a_reward():
    """A NumPy bool or number, or a one-element tensor, as the trainer takes a reward (rewards.py): one function
    serves as the reward and as eval.correct (the sums study's does)."""
    import numpy as np
    import torch

    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}]
    answers = ["2", "5", "4", "4"]

    def exact(prompts, completions, answer, **kwargs):
        return list(np.array(completions) == np.array([str(a) for a in answer]))  # np.bool_

    assert score_answers(exact, rows, answers, samples=2) == [1.0, 0.0, 1.0, 1.0]
    values = [np.float32(0.25), np.int64(1), torch.tensor(0.5), torch.tensor([1.0])]
    assert score_answers(lambda completions, **k: values, rows, answers, 2) == [0.25, 1.0, 0.5, 1.0]
    assert score_answers(lambda completions, **k: values, rows, answers, 2, threshold=0.5) == [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"value tensor\(\[1\., 0\.\]\) for completion 0 is not a bool or a finite "
                       r"number$"):
        score_answers(lambda completions, **k: [torch.tensor([1.0, 0.0])] * 4, rows, answers, 2)


def test_held_out_lengths_count_every_token_up_to_the_first_eos():
    """sample_answers' lengths, as docs/study.md and sample_answers_vllm count them: up to and including the first
    EOS, or every generated token where none came, a sampled pad token among them (training counts it too)."""
    import torch

    from gfpo_study.evaluation import sample_answers
    from gfpo_trainer.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    pad, eos, a, b = tokenizer.pad_token_id, tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["1", "2"])
    completions = torch.tensor([[a, pad, b, b],  # no EOS: 4 tokens, the pad id sampled among them
                                [a, eos, pad, pad],  # EOS, then generate's padding: 2
                                [eos, pad, pad, pad]])  # 1

    class Model(torch.nn.Module):
        """generate() answers with the completions above (a stand-in with known outputs)."""

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos})()

        def generate(self, input_ids, attention_mask, **kwargs):
            return torch.cat([input_ids, completions[: len(input_ids)]], dim=1)

    answers, lengths = sample_answers(Model(), tokenizer, ["1+1=", "2+2=", "3+3="], samples=1, temperature=1.0,
                                      max_tokens=4, seed=0)
    assert lengths == [4, 2, 1]
    assert answers == ["122", "1", ""]


def test_held_out_prompts_that_are_training_prompts_warn():
    with pytest.warns(UserWarning, match=r"^1 of the 2 held-out prompts are also training prompts \(the first: "
                      r"'1\+1='\)"):
        train, held_out = [{"prompt": "1+1="}, {"prompt": "3+3="}], [{"prompt": "1+1="}, {"prompt": "2+2="}]
        assert study.warn_overlap(train, held_out) == 1


def test_every_seeds_training_prompts_are_checked_against_the_held_out_ones(user_folder, tmp_path, monkeypatch):
    """Each seed draws its own training prompts: a seed after the first whose prompts hold held-out ones is warned
    about, naming it, before anything trains."""
    (user_folder / "seeded_rows.py").write_text(textwrap.dedent('''
        def rows(seed, rows):
            """Training rows of one sum; seed 1's is "7+0=", a held-out prompt of data/test.jsonl."""
            prompt, answer = ("7+0=", 7) if seed == 1 else ("1+1=", 2)
            return [{"prompt": prompt, "answer": answer}] * rows
    '''))

    class Built(Exception):
        pass

    def stop(self, config, rows, max_tokens):
        raise Built

    monkeypatch.setattr(study.Evaluator, "__init__", stop)
    config = parse(user_folder, dataset={"function": "seeded_rows:rows"}, output_dir=str(tmp_path / "out"))
    with pytest.warns(UserWarning, match=r"^seed 1: 1 of the \d+ held-out prompts are also training prompts \(the "
                      r"first: '7\+0='\)") as caught, pytest.raises(Built):
        study.run_study(config)
    assert [str(w.message)[:7] for w in caught if "held-out prompts" in str(w.message)] == ["seed 1:"]


def test_grpos_zero_std_share_is_per_group_or_not_recorded(user_folder, tmp_path):
    """The learning signal's "share of trained rows in groups whose rewards are all equal": a GFPO arm's is per
    group (gfpo/kept_frac_reward_zero_std); GRPO's comes from TRL's frac_reward_zero_std, which is per group with
    scale_rewards "group" or "none" but a batch-wide 0 or 1 with "batch" (TRL tests the batch's std there). With
    "batch" GRPO's is recorded as undefined (None: "-" in the report), not as a share it is not."""
    for scale, defined in (("batch", False), ("group", True)):
        config = parse(user_folder, args={**CONFIG["args"], "scale_rewards": scale}, seeds=[0, 1],
                       output_dir=str(tmp_path / scale))
        study.run_study(config, seeds=[0])
        for arm, always in (("grpo", False), ("shortest-4of8", True)):
            run = json.loads((tmp_path / scale / "seed-0" / f"{arm}.json").read_text())["run"]
            shares = run["train_frac_reward_zero_std"]
            assert len(shares) == STEPS and len(run["train_reward_std"]) == STEPS
            if defined or always:
                assert all(0.0 <= share <= 1.0 for share in shares), (scale, arm, shares)
            else:
                assert shares == [None] * STEPS, (scale, arm, shares)
                assert all(std is not None for std in run["train_reward_std"])


def test_a_selection_outside_the_config_is_refused(user_folder):
    config = parse(user_folder, output_dir=str(user_folder / "never"))
    with pytest.raises(ConfigError, match=r"^--arms: 'shortest-4of9' is not an arm of the config \(did you mean "
                       r"'shortest-4of8'\?\); its arms: grpo, shortest-4of8$"):
        study.run_study(config, arms=["shortest-4of9"])
    with pytest.raises(ConfigError, match=r"^--seeds: \[7\] are not among the config's seeds \[0, 1\]$"):
        study.run_study(config, seeds=[7])
    with pytest.raises(ConfigError, match=r"^--arms: the selection is empty; give some of the config's \(grpo, "
                       r"shortest-4of8\), or leave it out to run them all$"):
        study.run_study(config, arms=[])  # what `run --arms ,` selects
    with pytest.raises(ConfigError, match=r"^--seeds: the selection is empty; give some of the config's \(0, 1\)"):
        study.run_study(config, seeds=[])
    assert not (user_folder / "never").exists()


@pytest.mark.parametrize("arm, message", [
    ({"name": "bad", "num_generations": 8, "num_remains_in_group": 8, "group_filter": "length"},
     r"^arm 'bad': num_remains_in_group must be an int with 2 <= k < num_generations=8"),
    ({"name": "bad", "num_generations": 8, "num_remains_in_group": 4, "group_filter": "length",
      "adaptive_num_remains": [8, 8, 6, 9]},
     r"^arm 'bad': adaptive_num_remains must be 4 ints \(k per difficulty quartile, hardest first\), each 2 <= k <= "
     r"num_generations=8, got adaptive_num_remains=\[8, 8, 6, 9\]$"),
])
def test_an_arm_the_trainer_refuses_is_an_error_before_anything_trains(user_folder, tmp_path, arm, message):
    """An arm whose GFPOConfig cannot be built is refused before the first run (docs/study.md: errors before
    anything trains), not when its turn comes after the arms listed before it have trained."""
    config = parse(user_folder, output_dir=str(tmp_path / "out"), arms=["grpo", arm])
    with pytest.raises(ConfigError, match=message):
        study.run_study(config)
    assert not (tmp_path / "out").exists()  # no start model, no grpo run


def test_held_out_answers_have_one_token_limit_whatever_arm_comes_first(user_folder, tmp_path, monkeypatch):
    """Without eval.max_tokens the held-out answers end at args.max_completion_length (docs/study.md), for every
    selection of arms (pieces) and for reevaluate_final_models: an arm that trains with a limit of its own does not
    set the limit of the starting model's evaluation because it is listed first."""

    class Built(Exception):
        pass

    limits = []

    def record(self, config, rows, max_tokens):
        limits.append(max_tokens)
        raise Built

    monkeypatch.setattr(study.Evaluator, "__init__", record)
    longer = {"name": "longer", "num_generations": 8, "max_completion_length": 12}
    config = parse(user_folder, output_dir=str(tmp_path / "out"), arms=[longer, "grpo"])
    for arms in (["longer", "grpo"], ["grpo"], ["longer"]):
        with pytest.raises(Built):
            study.run_study(config, arms=arms)
    monkeypatch.setattr(study, "config_of_output_dir", lambda output_dir: config)
    with pytest.raises(Built):
        study.reevaluate_final_models(str(tmp_path / "out"))
    assert limits == [CONFIG["args"]["max_completion_length"]] * 4 == [6] * 4


@pytest.mark.parametrize("changes", [
    dict(args__steps_per_generation=2),
    dict(args__gradient_accumulation_steps=2, args__generation_batch_size=64),
    dict(arms=["grpo", {"name": "mine", "num_generations": 8, "num_remains_in_group": 4, "group_filter": "length",
                        "num_iterations": 2}]),
])
def test_a_step_that_does_not_generate_its_own_batch_is_refused(user_folder, tmp_path, changes):
    """TRL generates every steps_per_generation x num_iterations micro-batches; the study reads each step's tokens,
    time and learning signal from the generation it trains on. With a generation spanning 2 steps a GFPO arm recorded
    the generation's tokens (184 a step) and GRPO one step's (89.5): tokens_per_step_over_grpo read 2x for the same
    sampling. Such a config is refused before anything trains."""
    config = parse(user_folder, output_dir=str(tmp_path / "out"), **changes)
    arm = list(config.arms)[-1]
    with pytest.raises(ConfigError, match=rf"^arm '{arm}': steps_per_generation=\d+ \(generation_batch_size=\d+\), "
                       r"num_iterations=\d with gradient_accumulation_steps=\d: the study records every optimizer "
                       r"step from its own generation"):
        study.arm_args(config, config.arms[arm], 0, str(tmp_path / "x"))
    with pytest.raises(ConfigError, match=r"the study records every optimizer step from its own generation"):
        study.run_study(config)
    assert not (tmp_path / "out").exists()


def test_an_arm_that_changed_is_not_taken_for_its_finished_run(tmp_path):
    """A run file records its arm's definition: the same name with other fields is an error, not a skipped run."""
    run_dir = tmp_path / "seed-0"
    run_dir.mkdir(parents=True)
    (run_dir / "mine.json").write_text(json.dumps({"definition": {"fields": {"num_generations": 8,
                                                                             "num_remains_in_group": 4,
                                                                             "group_filter": "length"},
                                                                  "reward": "correct"}}))
    arm = study.Arm("mine", 8, 6, "length")
    with pytest.raises(ConfigError, match=r"mine.json: arm 'mine' ran with fields.num_remains_in_group=4, the config "
                       r"now says 6; give the changed arm another name"):
        study._check_run_definition(str(run_dir / "mine.json"), json.loads((run_dir / "mine.json").read_text()), arm)


# ------------------------------------------------------------------ the shipped configs, the command line, the rooms
def test_the_sums_config_is_the_committed_studys_settings():
    """gfpo_study/configs/sums.yaml is the quick preset (the 200-step study of docs/demo/study-quick-5seeds.json):
    the same warm-up, steps, prompts, evaluation and arms."""
    shipped = yaml.safe_load((REPO / "gfpo_study" / "configs" / "sums.yaml").read_text())
    assert shipped == study.sums_config(study.DemoSettings.quick())
    committed = json.loads((REPO / "docs" / "demo" / "study-quick-5seeds.json").read_text())
    settings = committed["settings"]
    assert (shipped["model"]["warmup_steps"], shipped["steps"], shipped["eval"]["samples"], shipped["arms"]) == (
        settings["warmup_steps"], settings["rl_steps"], settings["eval_samples"], committed["arms"])
    config = parse_study_config(shipped, str(REPO))
    assert config.seeds == [0, 1, 2, 3, 4] and config.arms["token-efficiency-8of16-signed"].reward == "signed"


def test_the_trainer_imports_nothing_of_the_study():
    """Every gfpo_trainer module imported: no gfpo_study module comes along (the study is beside the trainer)."""
    modules = sorted(p.stem for p in (REPO / "gfpo_trainer").glob("*.py") if p.stem != "__main__")
    probe = textwrap.dedent(f"""
        import importlib, sys
        for name in {modules!r}:
            try:
                importlib.import_module("gfpo_trainer." + name)
            except ImportError as error:  # an optional dependency (vLLM) missing here
                if "gfpo_study" in str(error):
                    raise
        print(sorted(m for m in sys.modules if m.split(".")[0] == "gfpo_study"))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    for path in (REPO / "gfpo_trainer").glob("*.py"):  # nor a lazy import inside a function
        assert not re.search(r"^\s*(from|import) gfpo_study", path.read_text(), re.M), path


def test_the_trainers_demo_command_points_to_the_study(capsys):
    from gfpo_trainer.cli import main

    assert main(["demo", "--quick"]) == 2
    assert capsys.readouterr().err == (
        "error: the demo is the length study's command: python -m gfpo_study demo --quick\n")


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["merge", "--help"], ["demo", "--help"]])
def test_help_imports_no_training_stack(argv):
    probe = ("import sys, runpy; sys.argv = ['gfpo_study'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('gfpo_study', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('trl', 'transformers', 'datasets', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("change, line", [
    (dict(arms=["grpo", {"name": "mine", "num_generations": 8, "num_remain_in_group": 4}]),
     "error: arms: arm 'mine' has unknown GFPOConfig fields ['num_remain_in_group'] (did you mean "
     "'num_remains_in_group'?)"),
    (dict(args={**CONFIG["args"], "max_step": 3}),
     "error: unknown GFPOConfig fields ['max_step'] under 'args' (did you mean 'max_steps'?)"),
])
def test_a_config_mistake_is_told_before_the_training_stack_is_imported(user_folder, change, line):
    """`run` checks the config (names, types, arms' fields) before importing torch and TRL, as `train` does: the
    mistake is one line at once, not after seconds of imports."""
    (user_folder / "mistake.yaml").write_text(yaml.safe_dump({**CONFIG, **change}, sort_keys=False))
    probe = ("import sys, runpy; sys.argv = ['gfpo_study'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('gfpo_study', run_name='__main__')\nexcept SystemExit as exit:\n"
             "    print(exit.code)\n"
             "print(sorted(m for m in ('trl', 'transformers', 'datasets', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, "run", "--config", "mistake.yaml"], capture_output=True,
                          text=True, timeout=120, cwd=user_folder, env=subprocess_env())
    assert (done.stderr, done.stdout.splitlines()) == (line + "\n", ["2", "[]"])


def test_a_misspelt_field_on_the_command_line_is_named_as_typed(user_folder, capsys):
    """`run --config study.yaml --max-step 3`: the error names the flag, as train's does (the file has no max_step)."""
    from gfpo_study.cli import main

    assert main(["run", "--config", str(user_folder / "study.yaml"), "--max-step", "3"]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['max_step'] under 'args' (did you mean "
                                       "'max_steps'?), given on the command line as --max-step\n")


def test_a_bf16_config_on_a_machine_without_bf16_says_which_field_to_change(user_folder, capsys):
    """examples/gsm8k/study.yaml sets bf16: true; on a CPU the study's line says which field to change, as train's
    does (transformers' words name neither the field nor its value)."""
    import torch

    from gfpo_study.cli import main

    if torch.cuda.is_available():
        pytest.skip("the error is raised where no GPU is")
    assert main(["run", "--config", str(user_folder / "study.yaml"), "--bf16", "true", "--use_cpu", "false",
                 "--output-dir", str(user_folder / "bf16-out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: arm 'grpo': ") and err.count("\n") == 1 and err.endswith(
        " (the config sets bf16: true, which needs a GPU with bf16: on this machine set bf16: false, or --bf16 false "
        "on the command line)\n"), err


def test_a_model_that_cannot_be_loaded_is_one_line(user_folder, capsys):
    """A model that exists as a name but not as a model (a Hub name offline, a folder without its files) is
    train's one line, `cannot load model`, not transformers' traceback."""
    from gfpo_study.cli import main

    (user_folder / "no_weights").mkdir(exist_ok=True)  # a model's config without its weights
    (user_folder / "no_weights" / "config.json").write_text((user_folder / "tiny_model" / "config.json").read_text())
    assert main(["run", "--config", str(user_folder / "study.yaml"), "--model", "no_weights",
                 "--output-dir", str(user_folder / "no-model-out")]) == 2
    err = capsys.readouterr().err  # after the progress bar's line, which the error does not continue
    assert "Traceback" not in err and len(re.findall("error", err)) == 1, err
    line = next(line for line in err.splitlines() if "error" in line)
    assert line.startswith(f"error: cannot load model '{user_folder / 'no_weights'}': ") and "model.safetensors" in line


def test_a_misspelt_study_key_on_the_command_line_points_to_its_flag(user_folder, capsys):
    """A bare flag is a GFPOConfig field unless it is a key of the config: `--stepz 3` close to no field is pointed
    to `--steps`, the study's own key, not left as an unknown field with no hint."""
    from gfpo_study.cli import main

    assert main(["run", "--config", str(user_folder / "study.yaml"), "--stepz", "3"]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['stepz'] under 'args' (did you mean --steps, "
                                       "the config's own key?), given on the command line as --stepz\n")
    assert main(["run", "--config", str(user_folder / "study.yaml"), "--prompts-per-stp", "3"]) == 2
    assert "(did you mean --prompts_per_step, the config's own key?), given on the command line as --prompts-per-stp" \
        in capsys.readouterr().err


def test_use_vllm_without_vllm_is_one_line_before_anything_runs(user_folder, capsys):
    """A study with use_vllm where vLLM is not installed: the trainer's line, before the output folder is made."""
    import importlib.util

    from gfpo_study.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    out = user_folder / "vllm-out"
    assert main(["run", "--config", str(user_folder / "study.yaml"), "--use_vllm", "true",
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: args: use_vllm=True needs vllm ") and "vLLM is not installed" in err, err
    assert err.count("\n") == 1 and not out.exists()


def test_a_held_out_split_that_is_not_there_names_eval(user_folder, capsys):
    """eval.dataset_split of a local file (one split, train): the line says it is the held-out data's, not the
    training data's, which has the same words."""
    from gfpo_study.cli import main

    assert main(["run", "--config", str(user_folder / "study.yaml"), "--eval.dataset_split", "test",
                 "--output-dir", str(user_folder / "split-out")]) == 2
    assert capsys.readouterr().err == (
        f"error: eval: cannot load dataset file '{user_folder / 'data' / 'test.jsonl'}' with dataset_split='test': "
        "Unknown split \"test\". Should be one of ['train'].\n")


def test_without_the_trainer_extra_the_command_says_what_to_install():
    probe = "import sys; sys.modules['trl'] = None\nfrom gfpo_study.cli import main\nsys.exit(main(sys.argv[1:]))"
    for command in (["demo", "--smoke"], ["run", "--config", "study.yaml"]):
        done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True,
                              timeout=120, cwd=REPO, env=subprocess_env())
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            "error: 'trl' is not installed: the study needs gfpo's trainer dependencies; from the checkout, pip "
            'install --no-build-isolation ".[trainer]" (docs/install.md)']


def test_overrides_set_the_study_keys_and_args(user_folder, capsys):
    """`run --config F --steps 2`: study keys, dotted sections and bare GFPOConfig fields set on the command line
    (gfpo_trainer.cli.apply_overrides, the study's keys among the top-level ones); a bare unknown name goes under
    args, and its error names the flag."""
    from gfpo_study.cli import main
    from gfpo_study.config import load_study_config

    config = load_study_config(str(user_folder / "study.yaml"), ["--steps", "2", "--eval.samples", "4",
                                                                 "--learning-rate", "1e-5", "--prompts_per_step=1"])
    assert (config.steps, config.eval.samples, config.prompts_per_step) == (2, 4, 1)
    assert config.train["args"]["learning_rate"] == "1e-5" and config.identity["steps"] == 2
    assert main(["run", "--config", str(user_folder / "study.yaml"), "--stpes", "2"]) == 2
    assert capsys.readouterr().err == ("error: unknown GFPOConfig fields ['stpes'] under 'args' (did you mean --steps, "
                                       "the config's own key?), given on the command line as --stpes\n")


def test_the_gsm8k_study_config_parses_and_builds_its_trainers_on_the_tiny_model(tmp_path):
    """examples/gsm8k/study.yaml, the real setup (Qwen2.5-0.5B-Instruct, not downloaded here): with the model and
    sizes overridden on the command line's terms, every arm's trainer builds from it on the tiny model, the prompts
    are the chat messages of the `prompt:` key, and the held-out answers are scored by the correctness function,
    which receives the `answer` column."""
    import importlib.util

    from gfpo_study.config import load_study_config

    spec = importlib.util.spec_from_file_location("save_tiny", REPO / "examples" / "gsm8k" / "save_tiny_model.py")
    saver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(saver)
    model = saver.save_tiny_model(tmp_path / "tiny-model")
    shipped = load_study_config(str(REPO / "examples" / "gsm8k" / "study.yaml"))
    assert shipped.train["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and list(shipped.arms) == [
        "grpo", "shortest-8of16", "shortest-6of8", "token-efficiency-8of16"]
    assert shipped.checkpoint_every == 50  # a preempted run resumes (docs/study.md)
    # its header's word: use_vllm under args (colocate, GFPOConfig's default mode) is a study of this config
    on_vllm = load_study_config(str(REPO / "examples" / "gsm8k" / "study.yaml"), [
        "--model", model, "--use_vllm", "true", "--bf16", "false", "--use_cpu", "true"])
    assert "use_vllm: true under args (colocate mode)" in (REPO / "examples" / "gsm8k" / "study.yaml").read_text()
    assert study.arm_args(on_vllm, on_vllm.arms["grpo"], 0, str(tmp_path / "x")).use_vllm is True
    config = load_study_config(str(REPO / "examples" / "gsm8k" / "study.yaml"), [
        "--model", model, "--max_completion_length", "8", "--bf16", "false", "--use_cpu", "true",
        "--steps", "2", "--checkpoint_every", "1", "--eval.max_tokens", "4", "--eval.samples", "1",
        "--output_dir", str(tmp_path / "out")])
    rows = study.training_rows(config, 0)
    assert len(rows) == 2 * 8 and rows[0]["prompt"][0]["role"] == "system" and rows[0]["prompt"][1]["content"] == (
        rows[0]["question"])
    held_out = study.eval_rows(config)
    assert len(held_out) == 100 and study.warn_overlap(rows, held_out) == 0
    for name, arm in config.arms.items():
        trainer = study.build_run_trainer(config, arm, 0, model, rows, str(tmp_path / name))
        generations = arm.num_generations
        # 8 prompts a step, over gradient_accumulation_steps 4: 2 prompts' completions a micro-batch
        assert trainer.args.per_device_train_batch_size == 8 * generations // 4
        assert (trainer.args.max_steps, trainer.args.learning_rate, trainer.args.num_generations) == (
            2, 1e-6, generations)
        assert (trainer.args.save_strategy, trainer.args.save_steps) == ("steps", 1)
        assert trainer.args.reward_weights == [1.0, 0.5]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    evaluate = study.Evaluator(config, held_out[:3], config.eval.max_tokens)
    figures = evaluate(AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model), 0, 1)
    assert figures["accuracy"] in (0.0, 1 / 3, 2 / 3, 1.0) and 1 <= figures["mean_length"] <= 4


def test_a_piece_on_two_processes_is_written_by_the_main_process(finished_study, tmp_path):
    """2 CPU processes (torchrun, gloo; `accelerate launch --cpu` would start one): both train and evaluate, the main
    process alone writes the run files and speaks; run again, both skip the finished runs."""
    import socket

    folder, _ = finished_study
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "-m", "gfpo_study", "run", "--config", "study.yaml", "--seeds", "0", "--output-dir",
               str(tmp_path / "piece")]

    def launch():
        return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600,
                              env=subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))

    done = launch()
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "piece" / "seed-0").glob("*.json*")) == [
        "grpo.json", "shortest-4of8.json", "start.json"]  # whole files only, no process's leftovers
    assert done.stdout.count("Run the other pieces, then") == 1
    record = json.loads((tmp_path / "piece" / "seed-0" / "grpo.json").read_text())
    assert len(record["run"]["step_time"]) == STEPS and record["run"]["curve"][-1][0] == STEPS
    again = launch()
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("gfpo study: 2 run(s) already finished") == 1


def test_pieces_by_arm_into_one_folder_make_the_study(finished_study, tmp_path):
    """A job array by arm writing into one shared folder: the piece that completes the config writes the report, and
    the runs are those of the study run at once."""
    folder, _ = finished_study
    first = study_command(folder, "run", "--config", "study.yaml", "--arms", "grpo", "--output-dir", str(tmp_path))
    assert first.returncode == 0 and not (tmp_path / "study.json").exists()
    second = study_command(folder, "run", "--config", "study.yaml", "--arms", "shortest-4of8", "--output-dir",
                           str(tmp_path))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"written: {tmp_path / 'study.md'}" in second.stdout
    pieces = json.loads((tmp_path / "study.json").read_text())["seed_results"]
    whole = json.loads((folder / "out" / "study.json").read_text())["seed_results"]
    assert [r["warm-up"] for r in pieces] == [r["warm-up"] for r in whole]
    assert [{a: r["arms"][a]["final"] for a in r["arms"]} for r in pieces] == [
        {a: r["arms"][a]["final"] for a in r["arms"]} for r in whole]
