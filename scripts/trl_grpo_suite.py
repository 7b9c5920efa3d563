"""Run TRL's own tests/test_grpo_trainer.py against GFPOTrainer (length filter on), with and without
use_gfpo_kernels, and print one table: test -> pass / skip (reason) / refused (GFPO's ValueError) / fail.

TRL's test files are not part of this repository. They are looked for, in this order, in
  1. $GFPO_TRL_TESTS_DIR (a folder holding TRL's tests/: test_grpo_trainer.py, testing_utils.py, __init__.py,
     conftest.py),
  2. the git-ignored cache .trl_tests/src/tests (filled by 4 or 5),
  3. ../shared/trl_tests/tests beside the clone (where CI has shared/), with its SOURCE.json,
  4. the sdist of the installed trl release on PyPI (`pip download --no-binary`), where it ships tests/
     (trl 1.16.0's sdist does not),
  5. `--from-git DIR[@REF]`: a local clone of huggingface/trl, copied into the cache.
With none of them the check skips, saying so. The cache records the trl version its tests come from; a version
other than the installed one is reported, and the "trl" baseline mode (TRL's own GRPOTrainer on the same local
stand-ins) tells such drift from a GFPO failure: a test that fails under TRL's trainer too is "fails in TRL too".

Modes: trl (baseline), gfpo (use_gfpo_kernels=False), gfpo-kernels (use_gfpo_kernels=True).
Usage:
    python scripts/trl_grpo_suite.py [--subset ci|full] [--modes gfpo,gfpo-kernels] [--baseline] [--from-git DIR@REF]
Exit status 1 when a test fails in a GFPO mode and is neither a GFPO refusal nor failing under TRL's trainer too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".trl_tests" / "src"
SHARED = REPO.parent / "shared" / "trl_tests"
PLUGIN_DIR = REPO / "tests" / "trl_suite"
TRL_TEST_FILES = ("__init__.py", "conftest.py", "testing_utils.py", "test_grpo_trainer.py")
GFPO_MODES = ("gfpo", "gfpo-kernels")

# The CI subset: one test per GRPO feature GFPO touches: construction, the high-entropy mask helper, training on
# standard and conversational prompts, every loss type, eval, several iterations (old-policy log-probs), beta > 0
# (reference model), weighted reward functions, mask_truncated_completions (not its all-masked variant: it needs
# a model that never ends a completion, which the stand-in is not), and more generations than the batch
CI_SUBSET = " or ".join(  # noqa: FLY002 (one -k term a line)
    [
        "TestGetHighEntropyMask",
        "test_init_minimal",
        "test_train_dataset_format",
        "(test_train_loss_types and False)",
        "test_train_with_eval",
        "test_train_multiple_iterations",
        "test_train_beta_non_zero",
        "test_train_multiple_reward_funcs_with_weights",
        "(test_train_with_mask_truncated_completions and not all_masked)",
        "test_train_num_generations_larger_than_batch_size",
    ]
)


def installed_trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def _has_trl_tests(folder: Path) -> bool:
    return all((folder / name).is_file() for name in TRL_TEST_FILES)


def _fill_cache(tests_dir: Path, trl_version: str, origin: str) -> Path:
    target = CACHE / "tests"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in TRL_TEST_FILES:
        shutil.copy(tests_dir / name, target / name)
    (CACHE / "SOURCE.json").write_text(json.dumps({"trl_version": trl_version, "origin": origin}) + "\n")
    return target


def _from_sdist(trl_version: str) -> tuple[Path | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"trl=={trl_version}",
             "-d", tmp, "-q"],
            capture_output=True, text=True, timeout=300, check=False,
        )
        archives = list(Path(tmp).glob("trl-*.tar.gz"))
        if download.returncode != 0 or not archives:
            return None, f"pip download of the trl=={trl_version} sdist failed: {download.stderr.strip()[-300:]}"
        with tarfile.open(archives[0]) as archive:
            archive.extractall(tmp, filter="data")
        tests_dir = Path(tmp) / f"trl-{trl_version}" / "tests"
        if not _has_trl_tests(tests_dir):
            return None, f"the trl=={trl_version} sdist on PyPI ships no tests/"
        return _fill_cache(tests_dir, trl_version, f"PyPI sdist trl=={trl_version}"), ""


def _from_git(spec: str) -> Path:
    clone, _, ref = spec.partition("@")
    ref = ref or "HEAD"
    tmp = Path(tempfile.mkdtemp())
    try:
        archive = subprocess.run(["git", "-C", clone, "archive", ref, "tests", "VERSION"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "x", "-C", str(tmp)], input=archive, check=True)
        commit = subprocess.run(["git", "-C", clone, "rev-parse", ref], capture_output=True, text=True,
                                check=True).stdout.strip()
        version = (tmp / "VERSION").read_text().strip()
        return _fill_cache(tmp / "tests", version, f"git {commit}")
    finally:
        shutil.rmtree(tmp)


def obtain_trl_tests(from_git: str | None = None) -> tuple[Path | None, dict]:
    """TRL's tests/ folder and where it came from, or (None, {"reason": why not})."""
    installed = installed_trl_version()
    if from_git:
        _from_git(from_git)
    env_dir = os.environ.get("GFPO_TRL_TESTS_DIR")
    if env_dir:
        if not _has_trl_tests(Path(env_dir)):
            return None, {"reason": f"GFPO_TRL_TESTS_DIR={env_dir} lacks one of {TRL_TEST_FILES}"}
        return Path(env_dir), {"trl_version": "unknown", "origin": f"GFPO_TRL_TESTS_DIR={env_dir}"}
    for folder in (CACHE, SHARED):
        if _has_trl_tests(folder / "tests"):
            source = folder / "SOURCE.json"
            info = json.loads(source.read_text()) if source.is_file() else {"trl_version": "unknown"}
            return folder / "tests", {**info, "origin": f"{info.get('origin', '?')} via {folder}"}
    try:
        tests_dir, why = _from_sdist(installed)
    except (OSError, subprocess.SubprocessError) as error:
        tests_dir, why = None, f"pip download failed: {error}"
    if tests_dir is None:
        return None, {"reason": f"TRL's tests/test_grpo_trainer.py for trl {installed} not found: {why}; set "
                                "GFPO_TRL_TESTS_DIR or run scripts/trl_grpo_suite.py --from-git <trl clone>@<ref>"}
    return tests_dir, json.loads((CACHE / "SOURCE.json").read_text())


def run_mode(tests_dir: Path, mode: str, subset: str, only: list[str] | None = None) -> tuple[dict[str, dict], float]:
    """Runs TRL's GRPO test file (the subset, or the tests named in `only`) under the plugin in one mode; returns
    {test id: record} and the wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env = {
            **os.environ,
            "GFPO_TRL_SUITE_MODE": mode,
            "GFPO_TRL_SUITE_REPORT": str(report),
            # every Hub id the tests load is a local stand-in or skips; without this, a Hub lookup the stand-ins do not
            # cover (the reward model's adapter_config.json, by its Hub id) retries for 31 s each time offline
            "HF_HUB_OFFLINE": "1",
            # the suite is how an untested TRL is checked: its kernel mode runs the fused kernels there too
            "GFPO_FUSED_KERNELS_ON_UNTESTED_TRL": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]),
        }
        command = [sys.executable, "-m", "pytest", "-p", "gfpo_trl_plugin", "-p", "no:cacheprovider", "-q",
                   "--rootdir", str(tests_dir.parent)]
        test_file = str(tests_dir / "test_grpo_trainer.py")
        command += [f"{test_file}::{test}" for test in only] if only else [test_file]
        if subset == "ci" and not only:
            command += ["-k", CI_SUBSET]
        start = time.monotonic()
        run = subprocess.run(command, check=False, cwd=tests_dir.parent, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        records = {}
        if report.exists():
            for line in report.read_text().splitlines():
                record = json.loads(line)
                records[record["nodeid"]] = record
        if not records:
            raise RuntimeError(f"mode {mode}: pytest reported no test (exit {run.returncode}):\n{run.stdout[-3000:]}"
                               f"\n{run.stderr[-3000:]}")
        return records, wall


def classify(record: dict, baseline: dict | None) -> str:
    """pass / skip / refused / fails in TRL too / FAIL."""
    if record["outcome"] == "passed":
        return "pass"
    if record["outcome"] == "skipped":
        return "skip"
    if record["refusal"]:
        return "refused"
    if baseline is not None and baseline.get(record["nodeid"], {}).get("outcome") == "failed":
        return "fails in TRL too"
    return "FAIL"


def table(results: dict[str, dict[str, dict]], modes: list[str]) -> str:
    baseline = results.get("trl")
    tests = sorted({test for records in results.values() for test in records})
    lines = ["| test | " + " | ".join(modes) + " | reason |", "|---" * (len(modes) + 2) + "|"]
    for test in tests:
        cells, reasons = [], []
        for mode in modes:
            record = results[mode].get(test)
            if record is None:
                cells.append("-")
                continue
            verdict = "pass" if mode == "trl" and record["outcome"] == "passed" else (
                record["outcome"] if mode == "trl" else classify(record, baseline))
            cells.append(verdict)
            if record["reason"] and record["reason"] not in reasons:
                reasons.append(record["reason"])
        lines.append(f"| {test} | " + " | ".join(cells) + " | " + "; ".join(reasons).replace("|", "/") + " |")
    return "\n".join(lines)


def summarize(results: dict[str, dict[str, dict]], walls: dict[str, float]) -> tuple[str, int]:
    baseline = results.get("trl")
    lines, failures = [], 0
    for mode, records in results.items():
        counts: dict[str, int] = {}
        for record in records.values():
            verdict = record["outcome"] if mode == "trl" else classify(record, baseline)
            counts[verdict] = counts.get(verdict, 0) + 1
        if mode != "trl":
            failures += counts.get("FAIL", 0)
        lines.append(f"{mode}: {len(records)} tests, " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
                     + f" ({walls[mode]:.0f} s)")
    return "\n".join(lines), failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subset", choices=("ci", "full"), default="full")
    parser.add_argument("--modes", default=",".join(GFPO_MODES), help="comma-separated, of trl, gfpo, gfpo-kernels")
    parser.add_argument("--baseline", action="store_true", help="also run TRL's own trainer (mode trl) first")
    parser.add_argument("--from-git", help="fill the cache from a local huggingface/trl clone: DIR[@REF]")
    parser.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if args.baseline and "trl" not in modes:
        modes.insert(0, "trl")

    tests_dir, source = obtain_trl_tests(args.from_git)
    if tests_dir is None:
        print(f"SKIPPED: {source['reason']}")
        return 0
    installed = installed_trl_version()
    print(f"TRL tests from {source['origin']} (trl {source['trl_version']}); installed trl {installed}")
    if source["trl_version"] != installed:
        print(f"note: the tests are of trl {source['trl_version']}, not the installed {installed}; run with "
              "--baseline to tell version drift from GFPO failures")
    results, walls = {}, {}
    for mode in modes:
        results[mode], walls[mode] = run_mode(tests_dir, mode, args.subset)
    text = table(results, modes)
    summary, failures = summarize(results, walls)
    print(text)
    print(summary)
    if args.output:
        args.output.write_text(f"TRL tests: {source['origin']} (trl {source['trl_version']}), installed trl "
                               f"{installed}\n\n{text}\n\n{summary}\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
