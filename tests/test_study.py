"""The length study (gfpo_study/study.py, study_report.py): arms, runs in pieces and their merge, the report."""

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("scipy")

from gfpo_study import study  # noqa: E402
from gfpo_study.study_report import elr_in_words, paper_comparison_table, study_verdict  # noqa: E402
from gfpo_study.study_stats import figure  # noqa: E402
from gfpo_trainer.cli import ConfigError  # noqa: E402

REPO = Path(__file__).parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _final(accuracy, length):
    terms = {n: {"accuracy": accuracy, "mean_length": length, "stepwise_fraction": 0.5} for n in ("2", "4")}
    return {"accuracy": accuracy, "mean_length": length, "stepwise_fraction": 0.5, "filler_per_answer": 0.1,
            "accuracy_stepwise": accuracy, "accuracy_at_once": accuracy, "by_terms": terms}


def _seed_result(seed, grpo_length, arm_length):
    def run(accuracy, length):
        return {"final": _final(accuracy, length), "curve": [(50, accuracy, length), (100, accuracy, length)],
                "generated_tokens": [100.0, 100.0], "trained_tokens": [50.0, 50.0], "step_time": [1.0, 1.0],
                "train_reward": [0.5, 0.5], "train_reward_std": [0.4, 0.4], "train_frac_reward_zero_std": [0.2, 0.2]}

    return {"seed": seed, "warm-up": _final(0.5, 10.0), "warmup_time": 1.0,
            "arms": {"grpo": run(0.9, grpo_length), "shortest-8of16": run(0.9, arm_length)}}


IDENTITY = {"model": "m", "dataset": "d.jsonl", "steps": 100}


def _write_piece(directory: Path, seeds, identity=None, arms=("grpo", "shortest-8of16"), lengths=None, plan=None):
    """An output folder as `python -m gfpo_study run` leaves it: its config (and `plan`, the config's seeds and arms,
    where given), each seed's starting model figures and one file per finished (arm, seed) run."""
    directory.mkdir(parents=True)
    (directory / "study-config.json").write_text(json.dumps({"config": identity or IDENTITY, "base_dir": None,
                                                             **({"plan": plan} if plan else {})}))
    for seed in seeds:
        result = _seed_result(seed, 20.0, (lengths or {}).get(seed, 15.0 + seed))
        (directory / f"seed-{seed}").mkdir()
        (directory / f"seed-{seed}" / "start.json").write_text(json.dumps(
            {"seed": seed, "model": "m", "figures": result["warm-up"], "seconds": {"build": 1.0, "eval": 0.1}}))
        for name in arms:
            (directory / f"seed-{seed}" / f"{name}.json").write_text(json.dumps(
                {"seed": seed, "arm": name, "definition": study.ARMS[name].definition(), "run": result["arms"][name]}))
    return directory


def test_merge_joins_pieces_in_seed_order(tmp_path, capsys):
    """Pieces of one study, run apart, make one study file: every run kept, in seed order, each piece's seeds
    recorded, then the summary, the report with its verdict and the plot."""
    _write_piece(tmp_path / "piece-2-3", [2, 3])
    _write_piece(tmp_path / "piece-0-1", [0, 1])
    out = tmp_path / "merged"
    result = study.merge_studies([str(tmp_path / "piece-2-3"), str(tmp_path / "piece-0-1")], str(out))
    merged = json.loads((out / "study.json").read_text())
    assert merged["seeds"] == [0, 1, 2, 3] and merged["arms"] == ["grpo", "shortest-8of16"]
    assert merged["seed_results"] == json.loads(json.dumps([_seed_result(s, 20.0, 15.0 + s) for s in range(4)]))
    assert [p["seeds"] for p in merged["environment"]["pieces"]] == [[2, 3], [0, 1]]
    assert merged["settings"] == IDENTITY
    # ELR per seed: (20 - (15 + s)) / (20 - 10) for s = 0..3
    assert merged["summary"]["arms"]["shortest-8of16"]["elr_per_seed"]["per_seed"] == pytest.approx(
        [0.5, 0.4, 0.3, 0.2])
    assert (out / "study.md").read_text() == result["report"] + "\n" and "## Verdict" in result["report"]
    assert (out / "study.png").read_bytes()[:8] == PNG
    assert json.loads((out / "seed-3" / "shortest-8of16.json").read_text())["run"]["final"]["mean_length"] == 18.0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(f"written: {out / 'study.md'} (the tables and the verdict), {out / 'study.json'} "
                                     f"(every run per seed, and the summary), {out / 'study.png'} (the plot); the "
                                     f"models under each piece's seed-*/")
    assert elr_in_words("start") in printed  # the config's model "m" is its start (no start function)


def test_pieces_by_arms_merge_too(tmp_path):
    """A piece may hold some arms of every seed (a job array by arm): the merge joins them into the whole grid."""
    _write_piece(tmp_path / "grpo", [0, 1], arms=("grpo",))
    _write_piece(tmp_path / "short", [0, 1], arms=("shortest-8of16",))
    merged = study.merge_studies([tmp_path / "short", tmp_path / "grpo"], str(tmp_path / "out"))["study"]
    assert merged["arms"] == ["grpo", "shortest-8of16"] and merged["seeds"] == [0, 1]


def test_merge_says_which_of_the_configs_seeds_and_arms_no_piece_holds(tmp_path, capsys):
    """Pieces of a 5-seed, 3-arm config, one seed's piece and one arm left out: the merge is the study of the runs
    found, and it says which of the config's seeds and arms are not in it, and records them."""
    plan = {"seeds": [0, 1, 2, 3, 4], "arms": ["grpo", "shortest-8of16", "shortest-6of8"]}
    _write_piece(tmp_path / "a", [0, 1], plan=plan)
    _write_piece(tmp_path / "b", [2, 3], plan=plan)
    merged = study.merge_studies([tmp_path / "a", tmp_path / "b"], str(tmp_path / "out"))["study"]
    assert merged["seeds"] == [0, 1, 2, 3] and merged["environment"]["not_merged"] == {"seeds": [4],
                                                                                        "arms": ["shortest-6of8"]}
    assert ("gfpo study: merge: no piece holds seed(s) 4 or arm(s) shortest-6of8 of the config; the study is of the "
            "4 seeds x 2 arms the pieces hold (merge again with their pieces to add them)") in capsys.readouterr().out
    # every planned run there: nothing said, nothing recorded
    whole = {"seeds": [0, 1], "arms": ["grpo", "shortest-8of16"]}
    _write_piece(tmp_path / "c", [0, 1], plan=whole)
    merged = study.merge_studies([tmp_path / "c"], str(tmp_path / "out-c"))["study"]
    assert "not_merged" not in merged["environment"] and "no piece holds" not in capsys.readouterr().out
    assert json.loads((tmp_path / "out-c" / "study-config.json").read_text())["plan"] == whole
    # a later session of a folder listing another seed: the folder's plan is the union of its sessions'
    study.claim_output_dir(str(tmp_path / "c"), IDENTITY, plan={"seeds": [2], "arms": ["grpo"]})
    assert json.loads((tmp_path / "c" / "study-config.json").read_text())["plan"] == {
        "seeds": [0, 1, 2], "arms": ["grpo", "shortest-8of16"]}


def test_merge_refuses_pieces_that_do_not_make_one_study(tmp_path):
    _write_piece(tmp_path / "a", [0, 1])
    _write_piece(tmp_path / "b", [2, 3], identity={**IDENTITY, "steps": 200})
    _write_piece(tmp_path / "c", [1, 4], lengths={1: 14.0})
    _write_piece(tmp_path / "e", [7], arms=("grpo",))
    _write_piece(tmp_path / "f", [8])
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'b'} and {tmp_path / 'a'} are pieces of different configs: "
                       rf"steps is 200 in {tmp_path / 'b'} and 100 in {tmp_path / 'a'}$"):
        study.merge_studies([tmp_path / "a", tmp_path / "b"], out)
    with pytest.raises(ConfigError, match=rf"^shortest-8of16 seed 1 is in two pieces with different figures: "
                       rf"{tmp_path / 'a'}/seed-1/shortest-8of16.json and {tmp_path / 'c'}/seed-1/shortest-8of16.json"):
        study.merge_studies([tmp_path / "a", tmp_path / "c"], out)
    with pytest.raises(ConfigError,
                       match=r"^the pieces lack 1 run\(s\) of their seeds x arms: shortest-8of16 seed 7; "):
        study.merge_studies([tmp_path / "a", tmp_path / "e"], out)
    with pytest.raises(ConfigError, match=r"nowhere: no study-config.json there"):
        study.merge_studies([tmp_path / "a", tmp_path / "nowhere"], out)
    with pytest.raises(ConfigError, match=r"the pieces hold 1 seed; the study needs at least 2"):
        study.merge_studies([tmp_path / "f"], out)
    assert not (tmp_path / "out").exists()  # nothing written by a refused merge
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "study-config.json").write_text(json.dumps({"config": {**IDENTITY, "model": "x"}}))
    with pytest.raises(ConfigError, match=rf"^output_dir {tmp_path / 'other'} holds the runs of another study "
                       r"config: model is 'x' there and 'm' here"):
        study.merge_studies([tmp_path / "a"], str(tmp_path / "other"))


def test_merge_refuses_a_seed_whose_starting_model_differs_between_pieces(tmp_path):
    """Pieces by arm each evaluate the seed's starting model: where their figures differ, the arms did not start
    from one model (or it was evaluated otherwise), and ELR would measure one piece's arm from another's start.
    Merge names both files, as it does for a run found twice with different figures."""
    _write_piece(tmp_path / "grpo", [0, 1], arms=("grpo",))
    _write_piece(tmp_path / "short", [0, 1], arms=("shortest-8of16",))
    start = tmp_path / "short" / "seed-1" / "start.json"
    record = json.loads(start.read_text())
    record["figures"]["mean_length"] += 0.5
    start.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=rf"^seed 1's starting model has other figures in {start} than in "
                       rf"{tmp_path / 'grpo' / 'seed-1' / 'start.json'}: the pieces' arms of that seed did not start "
                       "from one model"):
        study.merge_studies([tmp_path / "grpo", tmp_path / "short"], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_merged_study_reports_a_user_arm_beside_the_paper(tmp_path):
    """A user arm's `paper` key (its row of the paper's tables) is recorded with its runs, so the merged study's
    report sets it beside the paper as the study run in one folder does (finish_study with the config's arms)."""
    from gfpo_study.study_report import paper_comparison_table

    mine = study.Arm("mine", 16, 4, "length", paper="4/16")
    for piece, seeds in (("a", [0, 1]), ("b", [2])):
        directory = _write_piece(tmp_path / piece, seeds, arms=("grpo",))
        for seed in seeds:
            run = _seed_result(seed, 20.0, 12.0 + seed)["arms"]["shortest-8of16"]
            (directory / f"seed-{seed}" / "mine.json").write_text(json.dumps(
                {"seed": seed, "arm": "mine", "definition": mine.definition(), "paper": mine.paper, "run": run}))
    result = study.merge_studies([tmp_path / "a", tmp_path / "b"], str(tmp_path / "out"))
    table = paper_comparison_table(result["summary"], study.paper_tables(), {"grpo": study.ARMS["grpo"], "mine": mine})
    assert "\nmine | " in table and table in result["report"]


def test_merge_on_the_command_line(tmp_path, capsys):
    from gfpo_study.cli import main

    _write_piece(tmp_path / "a", [0, 1])
    _write_piece(tmp_path / "b", [2, 3], identity={**IDENTITY, "steps": 200})
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "out")]) == 2
    expected = (f"error: merge: {tmp_path / 'b'} and {tmp_path / 'a'} are pieces of different configs: steps is 200 "
                f"in {tmp_path / 'b'} and 100 in {tmp_path / 'a'}\n")
    assert capsys.readouterr().err == expected


def test_a_folder_that_is_no_seeds_is_one_error(tmp_path, capsys):
    """A `seed-` folder whose suffix is no number (a user's copy, `seed-old`) in a piece: merge says which folder
    in one line, as does reading the folder's config (reevaluate_final_models)."""
    from gfpo_study.cli import main

    _write_piece(tmp_path / "a", [0, 1])
    (tmp_path / "a" / "seed-old").mkdir()
    assert main(["merge", str(tmp_path / "a"), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: merge: {tmp_path / 'a' / 'seed-old'}: a study's seed folders are "
                                       f"seed-<number>, as run writes them; move this one out of {tmp_path / 'a'}\n")
    with pytest.raises(ConfigError, match=r"seed-old: a study's seed folders are seed-<number>"):
        study.config_of_output_dir(str(tmp_path / "a"))
    assert not (tmp_path / "out").exists()


def test_pieces_merged_are_the_study_run_at_once(tmp_path):
    """One-seed pieces merged hold the same runs as the two seeds run in one study (times apart)."""
    settings, arms = study.DemoSettings.smoke(), ("grpo", "shortest-8of16")

    def run(seeds, folder, only=None):
        config = study.study_config(study.sums_config(settings, seeds=seeds, arms=arms,
                                                      output_dir=str(tmp_path / folder)))
        return study.run_study(config, seeds=only)

    whole = run("0-1", "whole")["study"]
    for seed in (0, 1):
        piece = run("0-1", f"piece-{seed}", only=[seed])
        assert piece["study"] is None and piece["missing"] == [(1 - seed, a) for a in arms]
    for seed in (0, 1):  # each piece records the config's seeds and arms, not its selection
        assert json.loads((tmp_path / f"piece-{seed}" / "study-config.json").read_text())["plan"] == {
            "seeds": [0, 1], "arms": list(arms)}
    merged = study.merge_studies([str(tmp_path / "piece-1"), str(tmp_path / "piece-0")], str(tmp_path / "merged"))

    def without_times(results):
        results = json.loads(json.dumps(results))  # as study.json holds them
        for r in results:
            r.pop("warmup_time")
            for run in r["arms"].values():
                run.pop("step_time"), run.pop("load_average_1min_at_start"), run.pop("seconds")
        return results

    assert without_times(merged["study"]["seed_results"]) == without_times(whole["study"]["seed_results"])
    # the sums study's start function warms the tiny model up: the report names its start so
    assert "\nwarm-up | " in merged["report"] and "(L_GRPO - L_warm-up)" in merged["report"]
    assert merged["study"]["settings"] == whole["study"]["settings"]
    for name in ("study.json", "study.md", "study.png"):
        assert (tmp_path / "whole" / name).exists()
    # the saved final models, evaluated again, give the answers the runs recorded, and the figures they did not
    again = study.reevaluate_final_models(str(tmp_path / "piece-1"))
    recorded = json.loads((tmp_path / "merged" / "study.json").read_text())["seed_results"][1]
    for name in arms:
        for key in ("accuracy", "mean_length", "stepwise_fraction", "filler_per_answer"):
            assert again[0]["arms"][name]["final"][key] == recorded["arms"][name]["final"][key]
        assert "accuracy_every_step" in again[0]["arms"][name]["final"]
    assert again[0]["warm-up"]["mean_length"] == recorded["warm-up"]["mean_length"]
    # scripts/study_answer_forms.py: those figures over the pieces' seeds, with intervals and paired differences
    import importlib.util

    spec = importlib.util.spec_from_file_location("forms", REPO / "scripts" / "study_answer_forms.py")
    forms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forms)
    assert forms.main([str(tmp_path / "piece-0"), str(tmp_path / "piece-1"), "--output", str(tmp_path / "f")]) == 0
    written = json.loads((tmp_path / "f.json").read_text())
    assert [r["seed"] for r in written["seed_results"]] == [0, 1]


def test_paper_objective_arm():
    arm = study.ARMS["shortest-8of16-paper-objective"]
    assert arm.config_fields() == {"num_generations": 16, "num_remains_in_group": 8, "group_filter": "length",
                                   "loss_includes_rejected": True}
    assert "loss_includes_rejected" not in study.ARMS["shortest-8of16"].config_fields()


def test_study_verdict_follows_the_intervals():
    summary = {"warm-up": {"accuracy": figure([0.5, 0.6]), "mean_length": figure([10.0, 12.0])},
               "arms": {"grpo": {"accuracy": figure([0.9, 0.9]), "mean_length": figure([20.0, 22.0])},
                        "shortest-8of16": {"elr_per_seed": figure([0.5, 0.52]),
                                           "accuracy_minus_grpo": figure([-0.01, 0.01])},
                        "token-efficiency-8of16": {"elr_per_seed": figure([-0.1, 0.3]),
                                                   "accuracy_minus_grpo": figure([-0.05, -0.06])}}}
    lines = study_verdict(summary, seeds=2).splitlines()
    assert lines[0] == ("Over 2 seeds GRPO took held-out accuracy from 0.550 [-0.085, 1.185] to 0.900 [0.900, 0.900] "
                        "and answers from 11.0 [-1.7, 23.7] to 21.0 [8.3, 33.7] tokens (means, 95% t-intervals over "
                        "seeds).")
    assert lines[1] == ("- shortest-8of16: avoided 51% [38%, 64%] of GRPO's extra length; accuracy +0.000 [-0.127, "
                        "+0.127] against GRPO: not resolved (the interval contains 0 but is wider than +-0.03).")
    assert lines[2] == ("- token-efficiency-8of16: ELR 10% [-244%, 264%]: not shown shorter than GRPO; accuracy "
                        "-0.055 [-0.119, +0.009] against GRPO: not resolved (the interval contains 0 but is wider "
                        "than +-0.03).")
    assert lines[-1] == ("Only 2 seeds (fewer than 5): the t-intervals are wide (t = 12.71 standard errors on each "
                         "side) and the verdicts above weak; the protocols run 8.")
    assert "(the mean's condition was added after the first study's results were seen: stricter" in lines[-2]


def test_bounds_that_print_as_zero_get_a_digit_and_fewer_seeds_are_said():
    """Which side of zero a bound lies on decides the verdicts: a bound that is not 0 is never printed as 0."""
    from gfpo_study.study_report import fmt

    elr = {"mean": 0.221, "t95": (-0.004, 0.446), "per_seed": [0.2] * 8, "n": 8}
    assert fmt(elr, "{:.0%}") == "22% [-0.4%, 45%]"
    accuracy = {"mean": -0.0223, "t95": (-0.0448, 0.0003), "per_seed": [0.0] * 8, "n": 8}
    assert fmt(accuracy, "{:+.3f}") == "-0.022 [-0.045, +0.0003]"
    assert fmt({"mean": 0.0, "t95": (-0.00004, 0.0), "per_seed": [0.0] * 2, "n": 2}, "{:+.3f}") == (
        "+0.000 [-0.00004, +0.000]")
    # ELR is undefined on a seed where GRPO did not lengthen answers: the figure says over how many seeds it is
    assert fmt(figure([0.5, None, 0.3]), "{:.0%}").endswith(" (2 of 3 seeds)")


def test_paper_comparison_reads_the_papers_average_row():
    paper = json.loads((REPO / "gfpo_study" / "paper_tables.json").read_text())
    summary = {"arms": {"grpo": {}, "shortest-8of16": {"accuracy_minus_grpo": figure([-0.03, -0.01]),
                                                       "elr_per_seed": figure([0.3, 0.5])}}}
    table = paper_comparison_table(summary, paper, study.ARMS)
    # the paper's average: GRPO 72.1%, Shortest 8/16 73.4% and ELR 29.7%
    assert table.splitlines()[2] == "shortest-8of16 | +0.013 | 30% | -0.020 [-0.147, +0.107] | 40% [-87%, 167%]"
    assert all(arm.paper in paper["benchmarks"]["Average"] for arm in study.ARMS.values())


@pytest.mark.parametrize("name", ["study-quick-5seeds", "study-sums-1500-8seeds"])
def test_the_committed_study_reports_are_what_the_report_code_writes(name):
    """docs/demo's study .md files are the report of their own study.json's summary as the code writes it now: a
    change to the report's wording shows in the committed files too."""
    from gfpo_study.study_report import study_report

    recorded = json.loads((REPO / "docs" / "demo" / f"{name}.json").read_text())
    report = study_report(recorded["summary"], len(recorded["seeds"]), study.paper_tables(), study.ARMS,
                          **study.sample_counts(recorded))
    assert (REPO / "docs" / "demo" / f"{name}.md").read_text() == report + "\n"


def test_an_installed_copy_records_the_commit_its_build_recorded(monkeypatch):
    """Outside a git checkout (a pip-installed gfpo) a run's environment names the commit the build recorded, as the
    environment report does, not None ("commit None" in the demo's last line)."""
    build_info = pytest.importorskip("gfpo_kernels._build_info")

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(study.subprocess, "run", no_git)
    assert study._git_commit() == build_info.COMMIT and len(build_info.COMMIT) == 12
    monkeypatch.setitem(__import__("sys").modules, "gfpo_kernels._build_info", None)  # a tree never built
    assert study._git_commit() is None
