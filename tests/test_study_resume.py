"""A study run killed part-way resumes from its latest complete checkpoint (`checkpoint_every`): the tiny study (one
arm that filters, one seed, 5 steps, a checkpoint every 2) run once without a stop, and once killed (SIGKILL from
outside, as a cluster's scheduler ends a job) in step 3, after checkpoint-2 is whole, then run again. The resumed
run's file holds the same figures as the run that did not stop and its final weights are identical; a checkpoint
half written is not used, one of another definition of the run is refused, and a finished run keeps none."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytest.importorskip("trl")
pytest.importorskip("scipy")

from gfpo_test_utils import subprocess_env  # noqa: E402
from test_study_command import CONFIG, make_user_folder, study_command  # noqa: E402

from gfpo_study import study  # noqa: E402
from gfpo_study.config import ConfigError, parse_study_config  # noqa: E402

ARM = {"name": "shortest-4of8", "num_generations": 8, "num_remains_in_group": 4, "group_filter": "length"}
STEPS, EVERY = 5, 2
RESUME_CONFIG = {**CONFIG, "arms": [ARM], "seeds": [0], "steps": STEPS, "eval_every": 2, "checkpoint_every": EVERY}


def run_dir(out):
    return out / "seed-0" / ARM["name"]


def start_command(folder, out, **env):
    return subprocess.Popen(
        [sys.executable, "-m", "gfpo_study", "run", "--config", "study.yaml", "--output-dir", str(out)], cwd=folder,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(OMP_NUM_THREADS="1", **env))


def wait_for(process, *paths):
    deadline = time.monotonic() + 600
    while not all(p.exists() for p in paths):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{paths} not there before the run ended: {process.communicate()[1][-3000:]}")
        time.sleep(0.1)


def run_paused_at_the_final_evaluation(folder, out):
    """The command run to its end, paused in the final evaluation (the 5th held-out scoring: the starting model's,
    the curve's at steps 2, 4 and 5, the final one): the checkpoint folders then, and the command's output."""
    hang, release = folder / "paused", folder / "release"
    process = start_command(folder, out, PAUSE_AT_SCORE_CALL="5", HANG_FILE=str(hang), RELEASE_FILE=str(release))
    wait_for(process, hang)
    checkpoints = sorted(p.name for p in run_dir(out).iterdir() if p.name.startswith("checkpoint-"))
    release.touch()
    stdout, stderr = process.communicate(timeout=600)
    return process.returncode, checkpoints, stderr


def kill_after_checkpoint(folder, out, hang_file):
    """The command started, then SIGKILLed once checkpoint-2 is whole and the run waits in step 3's reward."""
    process = start_command(folder, out, HANG_AT_CALL="3", HANG_FILE=str(hang_file))
    wait_for(process, run_dir(out) / "checkpoint-2" / study.CHECKPOINT_STATE, hang_file)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    return process.returncode


@pytest.fixture(scope="module")
def resumed_study(tmp_path_factory):
    folder = make_user_folder(tmp_path_factory.mktemp("resume"), RESUME_CONFIG)
    code, at_the_end, stderr = run_paused_at_the_final_evaluation(folder, folder / "straight")
    assert code == 0, stderr[-3000:]
    out = folder / "resumed"
    state = {"returncode": kill_after_checkpoint(folder, out, folder / "hanging"), "at_the_end": at_the_end}
    state["after_kill"] = sorted(p.name for p in run_dir(out).iterdir() if p.name.startswith("checkpoint-"))
    state["saved_state"] = json.loads((run_dir(out) / "checkpoint-2" / study.CHECKPOINT_STATE).read_text())
    state["killed_step_times"] = [log["step_time"] for log in json.loads(
        (run_dir(out) / "checkpoint-2" / "trainer_state.json").read_text())["log_history"] if "step_time" in log]
    shutil.copytree(out, folder / "mismatch")  # the killed run, for the changed config below
    # a checkpoint killed while being saved: step 4's folder without the study's state, its optimizer cut short
    half = run_dir(out) / "checkpoint-4"
    shutil.copytree(run_dir(out) / "checkpoint-2", half)
    (half / study.CHECKPOINT_STATE).unlink()
    (half / "optimizer.pt").write_bytes((half / "optimizer.pt").read_bytes()[:100])
    state["rerun"] = study_command(folder, "run", "--config", "study.yaml", "--output-dir", str(out))
    return folder, state


def test_a_killed_run_resumes_to_the_figures_and_weights_of_the_run_that_did_not_stop(resumed_study):
    from safetensors.torch import load_file
    import torch

    folder, state = resumed_study
    assert state["returncode"] == -signal.SIGKILL
    assert state["after_kill"] == ["checkpoint-2"]  # killed in step 3: no record, one whole checkpoint
    assert state["saved_state"]["step"] == 2 and [p[0] for p in state["saved_state"]["curve"]] == [2]
    rerun = state["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    out = folder / "resumed"
    assert (f"gfpo study: {ARM['name']} seed 0: checkpoint(s) at step 4 were not saved whole (killed while saving): "
            "not used, removed") in rerun.stdout
    assert (f"gfpo study: resuming {ARM['name']} seed 0 from step 2 of {STEPS} ({run_dir(out) / 'checkpoint-2'})"
            ) in rerun.stdout
    # the bar counts the 3 steps left, labelled with the step the run resumed from
    assert re.search(rf"seed 0, {ARM['name']} \(from step 2\): +100%\|.*\| 3/3 ", rerun.stderr)

    straight = json.loads((folder / "straight" / "seed-0" / f"{ARM['name']}.json").read_text())["run"]
    resumed = json.loads((out / "seed-0" / f"{ARM['name']}.json").read_text())["run"]
    timings = {"seconds", "step_time", "load_average_1min_at_start"}
    assert straight.keys() == resumed.keys()
    assert {k: v for k, v in resumed.items() if k not in timings} == {
        k: v for k, v in straight.items() if k not in timings}
    assert [p[0] for p in resumed["curve"]] == [2, 4, 5] and len(resumed["generated_tokens"]) == STEPS
    # steps 1-2 were not trained again: their times are the killed session's, from its checkpoint
    assert len(resumed["step_time"]) == STEPS and resumed["step_time"][:2] == state["killed_step_times"]
    # the filter kept half of every group: the trained tokens are fewer than those generated, at every step
    assert all(t < g for t, g in zip(resumed["trained_tokens"], resumed["generated_tokens"]))
    # the time split says what came before the resume (up to checkpoint-2) and what this session spent
    seconds = resumed["seconds"]
    assert seconds["resumed_from_step"] == 2
    assert set(seconds["before_resume"]) == {"setup", "train", "curve_eval", "checkpoint"}
    assert seconds["before_resume"]["checkpoint"] > 0 and seconds["checkpoint"] > 0
    assert "resumed_from_step" not in straight["seconds"] and straight["seconds"]["checkpoint"] > 0

    a = load_file(str(folder / "straight" / "seed-0" / ARM["name"] / "model.safetensors"))
    b = load_file(str(run_dir(out) / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    start = load_file(str(folder / "tiny_model" / "model.safetensors"))
    assert any(not torch.equal(start[name], a[name]) for name in start)  # the run did train


def test_a_finished_run_keeps_no_checkpoint(resumed_study):
    """At the final evaluation the run holds its latest checkpoint only (step 4's: step 2's removed once it was
    whole, none at the last step); once its file is written, none."""
    folder, state = resumed_study
    assert state["at_the_end"] == ["checkpoint-4"]
    for out in ("straight", "resumed"):
        left = sorted(p.name for p in run_dir(folder / out).iterdir())
        assert not [name for name in left if name.startswith("checkpoint-")], (out, left)
        assert "model.safetensors" in left


def test_a_checkpoint_of_another_definition_is_refused(resumed_study):
    """The killed run's folder, the arm changed under the same name (k 4 -> 2): one error naming the checkpoint, the
    field and both values; nothing trained, the checkpoint kept."""
    folder, _ = resumed_study
    changed = {**RESUME_CONFIG, "arms": [{**ARM, "num_remains_in_group": 2}]}
    (folder / "changed.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
    out = folder / "mismatch"
    before = sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*"))
    done = study_command(folder, "run", "--config", "changed.yaml", "--output-dir", str(out))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {run_dir(out) / 'checkpoint-2'}: a checkpoint of {ARM['name']} seed 0 made with "
        f"definition.fields.num_remains_in_group=4; this run has 2, and resuming it would mix the two; remove "
        f"{run_dir(out)} to train the run from its start, or give a changed arm another name"]
    assert sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_a_rerun_without_checkpoint_every_resumes_and_clears_its_checkpoints(resumed_study):
    """checkpoint_every is no part of the config: a rerun without it resumes the killed run from its complete
    checkpoint to the figures of the run that did not stop. Its args ask for no checkpoints of their own (nor could
    they in the session that set checkpoint_every), so every checkpoint folder of the run is the study's: the one
    killed while being saved is said and removed, and none is left once the run's file is written."""
    folder, _ = resumed_study
    out = folder / "without"
    shutil.copytree(folder / "mismatch", out)  # the killed run: checkpoint-2 whole
    half = run_dir(out) / "checkpoint-4"
    shutil.copytree(run_dir(out) / "checkpoint-2", half)
    (half / study.CHECKPOINT_STATE).unlink()
    (folder / "without.yaml").write_text(yaml.safe_dump(
        {k: v for k, v in RESUME_CONFIG.items() if k != "checkpoint_every"}, sort_keys=False))
    done = study_command(folder, "run", "--config", "without.yaml", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"gfpo study: {ARM['name']} seed 0: checkpoint(s) at step 4 were not saved whole (killed while saving): "
            "not used, removed") in done.stdout
    assert f"gfpo study: resuming {ARM['name']} seed 0 from step 2 of {STEPS}" in done.stdout
    assert not [p.name for p in run_dir(out).iterdir() if p.name.startswith("checkpoint-")]
    straight = json.loads((folder / "straight" / "seed-0" / f"{ARM['name']}.json").read_text())["run"]
    resumed = json.loads((out / "seed-0" / f"{ARM['name']}.json").read_text())["run"]
    assert resumed["final"] == straight["final"] and resumed["curve"] == straight["curve"]


def test_a_checkpoint_of_another_process_count_is_refused(resumed_study):
    """Each process's generator state is in a checkpoint: one made on 1 process is not resumed by 2."""
    folder, _ = resumed_study
    config = parse_study_config(RESUME_CONFIG, str(folder))
    key = study.run_key(config, config.arms[ARM["name"]], 0, num_processes=2)
    out = folder / "mismatch"
    with pytest.raises(ConfigError, match=r"checkpoint-2: a checkpoint of shortest-4of8 seed 0 made with "
                       r"num_processes=1; this run has 2, and resuming it would mix the two"):
        study.find_resume(str(run_dir(out)), key, ARM["name"], 0)
    found = study.find_resume(str(run_dir(out)), study.run_key(config, config.arms[ARM["name"]], 0, 1), ARM["name"], 0)
    assert (found.step, found.folder) == (2, str(run_dir(out) / "checkpoint-2"))


@pytest.mark.parametrize("changes, message", [
    (dict(checkpoint_every=0), r"^checkpoint_every=0: give a whole number of at least 1$"),
    (dict(checkpoint_every="5"), r"^checkpoint_every='5': give a whole number of at least 1$"),
    (dict(checkpoint_every=STEPS), rf"^checkpoint_every={STEPS} with steps={STEPS}: no checkpoint would be saved "
     rf"before the run ends \(the last step saves none, the final model is saved right after it\); give a "
     rf"checkpoint_every below {STEPS}, or leave checkpoint_every out$"),
    (dict(args={**CONFIG["args"], "save_strategy": "steps"}), r"^args.save_strategy='steps' with checkpoint_every=2: "
     r"checkpoint_every sets each run's checkpoints \(one every N steps, the older removed, the optimizer's state in "
     r"each\); leave args.save_strategy out$"),
    (dict(args={**CONFIG["args"], "save_total_limit": 1}), r"^args.save_total_limit=1 with checkpoint_every=2"),
    (dict(args={**CONFIG["args"], "save_only_model": True}), r"^args.save_only_model=True with checkpoint_every=2"),
    # an arm's own checkpoint fields: save_steps would be replaced without a word, save_only_model would leave the
    # optimizer's state out of the checkpoints the rerun resumes
    (dict(arms=[{**ARM, "save_only_model": True}]), rf"^arms: arm '{ARM['name']}' sets save_only_model=True with "
     r"checkpoint_every=2: checkpoint_every sets each run's checkpoints \(one every N steps, the older removed, the "
     r"optimizer's state in each\); leave save_only_model out of the arm$"),
    (dict(arms=[{**ARM, "save_steps": 1}]), rf"^arms: arm '{ARM['name']}' sets save_steps=1 with checkpoint_every=2"),
])
def test_checkpoint_every_errors(tmp_path, changes, message):
    folder = make_user_folder(tmp_path, RESUME_CONFIG)
    with pytest.raises(ConfigError, match=message):
        parse_study_config({**RESUME_CONFIG, **changes}, str(folder))


def test_checkpoint_every_is_no_part_of_the_studys_identity(tmp_path):
    """Checkpoints change no figure: a folder's runs may be resumed or continued with or without them; the GFPOConfig
    of a run saves every N steps, into the run's own folder."""
    folder = make_user_folder(tmp_path, RESUME_CONFIG)
    with_checkpoints = parse_study_config(RESUME_CONFIG, str(folder))
    without = parse_study_config({k: v for k, v in RESUME_CONFIG.items() if k != "checkpoint_every"}, str(folder))
    assert with_checkpoints.identity == without.identity and without.checkpoint_every is None
    arm = with_checkpoints.arms[ARM["name"]]
    args = study.arm_args(with_checkpoints, arm, 0, str(tmp_path / "run"))
    assert (args.save_strategy, args.save_steps, args.save_total_limit) == ("steps", EVERY, None)
    assert study.arm_args(without, arm, 0, str(tmp_path / "run")).save_strategy == "no"
    # a config saying save_strategy 'no' (the GSM8K example's) takes checkpoint_every
    saying_no = {**RESUME_CONFIG, "args": {**CONFIG["args"], "save_strategy": "no"}}
    assert study.arm_args(parse_study_config(saying_no, str(folder)), arm, 0, "run").save_strategy == "steps"
    assert os.path.basename(args.output_dir) == "run"


def test_without_checkpoint_every_the_checkpoints_args_ask_for_are_left_alone(tmp_path):
    """args.save_strategy steps without checkpoint_every: transformers' checkpoints, the last step's included, stay
    after the run as the user asked (the study neither marks them as its own nor removes them)."""
    config = {**RESUME_CONFIG, "args": {**CONFIG["args"], "save_strategy": "steps", "save_steps": EVERY}}
    del config["checkpoint_every"]
    folder = make_user_folder(tmp_path, config)
    done = study_command(folder, "run", "--config", "study.yaml", "--output-dir", str(folder / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoints = sorted(p for p in run_dir(folder / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert [p.name for p in checkpoints] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    assert not any((p / study.CHECKPOINT_STATE).exists() for p in checkpoints)


def test_a_run_on_two_processes_resumes_on_them(tmp_path):
    """2 CPU processes (torchrun, gloo; `accelerate launch --cpu` starts one): each saves its generator state into
    the checkpoint, the main process alone the study's state once both are saved; killed (the whole launch) in step
    3 after checkpoint-2, launched again, the run resumes on both and ends with the figures and weights of a launch
    that did not stop."""
    import socket

    import torch
    from safetensors.torch import load_file

    folder = make_user_folder(tmp_path, RESUME_CONFIG)

    def launch(out, wait=True, **env):
        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(port), "-m", "gfpo_study", "run", "--config", "study.yaml", "--output-dir", str(out)]
        process = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env))
        if wait:
            stdout, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, stderr[-3000:]
            return stdout
        return process

    launch(folder / "straight")
    process = launch(folder / "resumed", wait=False, HANG_AT_CALL="3", HANG_FILE=str(folder / "hanging"))
    checkpoint = run_dir(folder / "resumed") / "checkpoint-2"
    wait_for(process, checkpoint / study.CHECKPOINT_STATE, folder / "hanging")
    assert sorted(p.name for p in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    import psutil

    for worker in psutil.Process(process.pid).children(recursive=True):  # in sessions of their own
        worker.send_signal(signal.SIGKILL)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    stdout = launch(folder / "resumed")
    assert stdout.count(f"gfpo study: resuming {ARM['name']} seed 0 from step 2 of {STEPS}") == 1
    straight, resumed = (json.loads((folder / out / "seed-0" / f"{ARM['name']}.json").read_text())["run"]
                         for out in ("straight", "resumed"))
    timings = {"seconds", "step_time", "load_average_1min_at_start"}
    assert {k: v for k, v in resumed.items() if k not in timings} == {
        k: v for k, v in straight.items() if k not in timings}
    assert resumed["seconds"]["resumed_from_step"] == 2
    a, b = (load_file(str(run_dir(folder / out) / "model.safetensors")) for out in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert not list(run_dir(folder / "resumed").glob("checkpoint-*"))
