"""Building gfpo where torch cannot be imported, as in pip's isolated build: a wheel or editable build stops at the
metadata step (before pip resolves and downloads any dependency) with one line that says what to type, and an
sdist builds and carries the extension's sources and the commit it was made from. setuptools' PEP 517 hooks run
in a child Python in which `import torch` fails."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
NO_TORCH_CHILD = "import sys; sys.modules['torch'] = None; from setuptools import build_meta; "


def run_hook(hook: str, out_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH_CHILD + f"print(build_meta.{hook}({str(out_dir)!r}))"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("hook", ["prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable"])
def test_a_build_without_torch_stops_with_one_line(tmp_path, hook):
    done = run_hook(hook, tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: gfpo compiles its C++/CUDA extension against your installed torch, which pip's isolated build cannot "
        "see: with torch installed, run  pip install --no-build-isolation .  (or your sdist's path instead of .)"
    ]
    assert list(tmp_path.iterdir()) == []  # stopped before writing any metadata


def test_an_sdist_builds_without_torch(tmp_path):
    done = run_hook("build_sdist", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with tarfile.open(tmp_path / done.stdout.split()[-1]) as sdist:
        names = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in sdist.getnames()}
        assert {"csrc/group_ops.h", "csrc/group_ops.cpp", "csrc/group_ops_cuda.cu", "setup.py",
                "gfpo_study/configs/sums.yaml", "gfpo_study/paper_tables.json"} <= names
        record = sdist.extractfile(next(n for n in sdist.getnames() if n.endswith("gfpo_kernels/_build_info.py")))
        record = record.read().decode()
    assert "EXTENSION = 'not built'\nEXTENSION_NOTE = 'an sdist'" in record  # not a copy of this tree's own build's
    commit = re.search(r"^COMMIT = '(.*)'$", record, re.MULTILINE).group(1)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the sdist records its commit (+dirty with uncommitted changes)
        assert commit.split("+")[0] == head.stdout.strip()


def test_an_old_setuptools_stops_with_one_line(tmp_path):
    """Without build isolation the environment's setuptools builds; one older than 77 cannot read pyproject.toml's
    SPDX `license` (a 20-line schema error from setuptools 65.5, Python 3.11's venv default): one line instead."""
    child = ("import setuptools; setuptools.__version__ = '65.5.0'; from setuptools import build_meta; "
             f"build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        'error: gfpo needs setuptools>=77 to build, this environment has 65.5.0: run  pip install "setuptools>=77"  '
        "and then the same pip install again"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_licence_is_an_spdx_expression_with_its_text(tmp_path):
    """PEP 639 metadata (setuptools >= 77): License-Expression and the licence file, not the deprecated License."""
    done = subprocess.run([sys.executable, "-c", NO_TORCH_CHILD + f"print(build_meta.build_sdist({str(tmp_path)!r}))"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with tarfile.open(tmp_path / done.stdout.split()[-1]) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        metadata = sdist.extractfile(f"{top}/PKG-INFO").read().decode()
        licence = sdist.extractfile(f"{top}/LICENSE").read().decode()
    headers = metadata.split("\n\n")[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    assert not any(line.startswith("License:") for line in headers)
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence


def test_the_shipped_study_configs_are_a_declared_package(tmp_path):
    """The wheel's Python files and data (setuptools' build_py, no extension built): the study's YAML configs are in
    it, from a folder declared as a package (an undeclared data folder is shipped with a warning that setuptools
    will stop shipping it)."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "absent from the `packages` configuration" not in done.stdout + done.stderr
    assert (tmp_path / "gfpo_study" / "configs" / "sums.yaml").read_text() == (
        REPO / "gfpo_study" / "configs" / "sums.yaml").read_text()


def test_an_installed_study_reports_beside_the_paper(tmp_path):
    """The wheel's gfpo_study (setuptools' build_py) carries the paper's tables, and the copy imported from there, not
    from this checkout, reads them: a study run from a pip-installed gfpo gets its "Beside the paper" table."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    child = ("import json, gfpo_study.study as s; "
             "print(json.dumps({'file': s.__file__, 'tables': s.paper_tables()}))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert Path(loaded["file"]).is_relative_to(tmp_path / "site")
    assert loaded["tables"] == json.loads((REPO / "gfpo_study" / "paper_tables.json").read_text())
    assert {"GRPO", "8/16"} <= set(loaded["tables"]["benchmarks"]["Average"])
