"""bench/gpu_run.sh's plan for a 15-minute GPU lease, checked on a CPU: the two calls' budgets fit their
device commands, docs/performance.md gives the plan the script runs and command lines the run tool takes, the tests
the first call selects exist, and the shell logic keeps what a call measured when a step or the whole call is cut
short. The shell logic runs with every command replaced by a sleep (GFPO_GPU_RUN_STUB); the real commands are
rehearsed with GFPO_GPU_RUN_ON_CPU=1 (docs/performance.md), which takes minutes."""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "bench" / "gpu_run.sh"
DOC = ROOT / "docs" / "performance.md"
RUN_TOOL_COMMAND_CHARS, RUN_TOOL_TIMEOUT_S, RUN_TOOL_CARRY = 2000, 600, 8


def _script_value(name: str) -> str:
    match = re.search(rf"^{name}=(?:\$\{{\w+:-)?(\d+)", SCRIPT.read_text(), re.M)
    assert match, name
    return match.group(1)


def _plan(call: int) -> list[tuple[str, str, str]]:
    """(step, budget, expected) of a call, from the script's dry run."""
    out = subprocess.run(["bash", str(SCRIPT), "--call", str(call), "--dry-run", "/nonexistent"], check=True,
                         capture_output=True, text=True, env={**os.environ, "GFPO_GPU_RUN_ON_CPU": "1"}).stdout
    return re.findall(rf"^PLAN call={call} step=(\S+) budget=(\S+) expected=(\S+)$", out, re.M)


def _doc_section() -> str:
    text = DOC.read_text()
    start = text.index("## Running on a GPU")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _doc_calls() -> dict[int, dict]:
    """The device calls as the docs write them: a JSON object per call in a ```json block after 'Call N'."""
    calls = {}
    for number, block in re.findall(r"Call (\d)[^\n]*\n+```json\n(.*?)\n```", _doc_section(), re.S):
        calls[int(number)] = json.loads(block)
    return calls


def test_each_call_fits_its_device_command():
    reserve = int(_script_value("RESERVE"))
    calls = _doc_calls()
    for call in (1, 2):
        given = re.search(r"GFPO_CALL_SECONDS=(\d+)", calls[call]["command"])
        seconds = int(given.group(1)) if given else int(_script_value(f"CALL_SECONDS_{call}"))
        # the script ends (its last archive written) 15 s before the run tool stops the command
        assert seconds + 15 == calls[call]["timeout_s"]
        plan = _plan(call)
        assert [budget for _, budget, _ in plan].count("rest") <= 1
        if call == 1:
            # every step's own budget fits the call, and the last (the whole steps) keeps at least 100 s even if every
            # step before it runs to its budget
            assert plan[-1][1] == "rest"
            assert sum(int(budget) for _, budget, _ in plan[:-1]) + reserve + 100 <= seconds
    assert calls[1]["timeout_s"] <= 480  # the issue's 8 minutes


def test_the_first_call_measures_in_the_issues_order():
    assert [step for step, _, _ in _plan(1)] == ["setup", "bench-loss", "bench-group", "tests-gpu", "bench-e2e"]


def test_the_docs_give_the_scripts_plan():
    rows = re.findall(r"^\| (\d) \| `([\w-]+)` \| (\w+) \| (\d+) \|", _doc_section(), re.M)
    documented = {call: [(step, budget, expected) for c, step, budget, expected in rows if int(c) == call]
                  for call in (1, 2)}
    assert documented == {1: _plan(1), 2: _plan(2)}


def test_the_docs_command_lines_fit_the_run_tool():
    calls = _doc_calls()
    assert set(calls) == {1, 2}
    for call in calls.values():
        assert len(call["command"]) <= RUN_TOOL_COMMAND_CHARS
        assert 1 <= call["timeout_s"] <= RUN_TOOL_TIMEOUT_S
        assert call["carry"] == [".whl"] and len(call["carry"]) <= RUN_TOOL_CARRY
        assert "bench/gpu_run.sh --call" in call["command"] and '--return "$OUT"' in call["command"]


def test_the_first_calls_tests_exist():
    """A node id that no longer exists makes pytest stop with 'not found': the whole step would measure nothing."""
    out = subprocess.run(["bash", str(SCRIPT), "--call", "1", "--dry-run", "/nonexistent"], check=True,
                         capture_output=True, text=True, env={**os.environ, "GFPO_GPU_RUN_ON_CPU": "1"}).stdout
    command = next(line for line in out.splitlines() if line.startswith("RUN tests-gpu"))
    selected = [arg for arg in command.split() if arg.startswith("tests/")]
    assert "tests/test_gpu.py" in selected
    for arg in selected:
        path, _, function = arg.partition("::")
        assert (ROOT / path).is_file(), path
        if function:
            assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), arg


def _stub_env(tmp_path, **extra):
    return {**os.environ, "GFPO_GPU_RUN_ON_CPU": "1", "PYTHON": sys.executable, "GFPO_SNAPSHOT_SECONDS": "1",
            "GFPO_RESERVE_SECONDS": "1", "GFPO_MIN_START_SECONDS": "2", **extra}


def _archived(path: Path) -> dict[str, str]:
    with tarfile.open(path) as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_a_step_over_the_calls_end_is_cut_and_the_rest_skipped(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(["bash", str(SCRIPT), "--call", "1", "--return", str(out), str(work)],
                          env=_stub_env(tmp_path, GFPO_GPU_RUN_STUB="bench-loss=60", GFPO_CALL_SECONDS="12"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:]  # a step cut at its budget is the plan working
    assert sorted(p.name for p in out.iterdir()) == ["gpu-run-1-summary.txt", "gpu-run-1.log", "gpu-run-1.tgz"]
    summary = (out / "gpu-run-1-summary.txt").read_text()
    assert re.search(r"^setup .* rc 0 ", summary, re.M)
    assert re.search(r"^bench-loss .* rc 124 ", summary, re.M)
    for step in ("bench-group", "tests-gpu", "bench-e2e"):
        assert re.search(rf"^{step} .* skipped", summary, re.M), step
    files = _archived(out / "gpu-run-1.tgz")
    assert "stub bench-loss" in files["bench-loss.log"]
    assert files["summary-1.txt"] == summary
    assert ">>> step bench-loss: rc=124" in (out / "gpu-run-1.log").read_text()


def test_a_call_killed_midway_returns_what_it_finished(tmp_path):
    """The run tool kills a command at its limit with all its processes; what is under $OUT by then comes back."""
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.Popen(["bash", str(SCRIPT), "--call", "1", "--return", str(out), str(work)],
                               env=_stub_env(tmp_path, GFPO_GPU_RUN_STUB="tests-gpu=60"), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "gpu-run-1.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and "stub tests-gpu" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.5)  # past a snapshot tick (1 s) while tests-gpu runs
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    files = _archived(out / "gpu-run-1.tgz")
    for name in ("env.log", "bench-loss.log", "bench-group.log"):
        assert name in files, name
    assert "stub tests-gpu" in files["tests-gpu.log"]  # the running step's log so far, from a tick
    assert re.search(r"^bench-group .* rc 0 ", (out / "gpu-run-1-summary.txt").read_text(), re.M)
    assert ">>> step tests-gpu: budget" in log.read_text()


@pytest.mark.parametrize("call", [1, 2])
def test_dry_run_runs_nothing(tmp_path, call):
    work = tmp_path / "work"
    subprocess.run(["bash", str(SCRIPT), "--call", str(call), "--dry-run", "--return", str(tmp_path / "out"),
                    str(work)], check=True, capture_output=True, env={**os.environ, "GFPO_GPU_RUN_ON_CPU": "1"})
    assert not work.exists() and not (tmp_path / "out").exists()
