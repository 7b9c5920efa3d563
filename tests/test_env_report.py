"""The environment report for bug reports: `python -m gfpo_trainer env` (the kernel package's report, `python -m
gfpo_kernels`, and the trainer's TRL and vLLM lines), and the import direction: gfpo_kernels imports nothing from
gfpo_trainer."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gfpo_kernels import _dispatch
from gfpo_kernels.env_report import environment_report as kernels_report
from gfpo_kernels.env_report import package_versions
from gfpo_trainer.env_report import environment_report

from gfpo_test_utils import subprocess_env

ROOT = Path(__file__).parents[1]


def test_report_names_versions_extension_and_backends():
    lines = dict(line.split(": ", 1) for line in environment_report().splitlines())
    assert lines["torch"] == torch.__version__
    extension = _dispatch.EXTENSION
    if not _dispatch.HAS_CPP:
        assert lines["extension gfpo_kernels._C"] == f"not loaded: it {extension.problem}"
    else:  # the wording of each case: test_report_says_whether_this_torch_runs_the_cuda_kernels
        assert lines["extension gfpo_kernels._C"].startswith("loaded, ")
        assert ("CUDA" in lines["extension gfpo_kernels._C"]) == _dispatch.HAS_CPP_CUDA
    if "TORCH" in extension.build:  # a build of the extension: what it recorded
        assert lines["gfpo commit"] == extension.build["COMMIT"]
        assert lines["extension built against"].startswith(f"torch {extension.build['TORCH']} (LibTorch stable ABI")
    for op in ("group", "linear_grpo"):
        assert lines[f"backend {op} ops, cpu tensors"] == _dispatch.select_backend(op, torch.device("cpu"))
        assert lines[f"backend {op} ops, cuda tensors"].startswith(_dispatch.select_backend(op, torch.device("cuda")))
    for name in ("python", "gfpo", "gfpo commit", "triton", "trl", "transformers", "accelerate", "torch CUDA"):
        assert lines[name]
    versions = package_versions()  # what the demo records beside its results: the report's lines
    assert versions["torch"] == torch.__version__ and set(versions) >= {"triton", "trl", "transformers"}
    assert all(lines[name] == version for name, version in versions.items())


@pytest.mark.parametrize("torch_cuda, hip, cuda_kernels, torch_line, extension_line, cuda_backend_suffix", [
    # a CPU torch beside a build with CUDA kernels (setup.py compiles them whenever nvcc is found)
    (None, None, True, "none (CPU build)", "loaded, CUDA kernels compiled, unusable: this torch is a CPU build",
     " (beside a CUDA build of torch: this one is a CPU build)"),
    (None, None, False, "none (CPU build)", "loaded, built for CPU only",
     " (beside a CUDA build of torch: this one is a CPU build)"),
    (None, "6.4.0", True, "none (ROCm build)", "loaded, CUDA kernels compiled, unusable: this torch is a ROCm build",
     " (beside a CUDA build of torch: this one is a ROCm build)"),
    # a CUDA torch on a machine without a visible GPU: the kernels would run once one is there
    ("13.0", None, True, "13.0", "loaded, built with CUDA", " (if CUDA tensors were given)"),
    ("13.0", None, False, "13.0", "loaded, built for CPU only", " (if CUDA tensors were given)"),
])
def test_report_says_whether_this_torch_runs_the_cuda_kernels(monkeypatch, torch_cuda, hip, cuda_kernels, torch_line,
                                                               extension_line, cuda_backend_suffix):
    """A bug report never reads as if CUDA kernels had run beside a torch that has no CUDA: what the report reads (the
    torch build, the extension's kernels, whether a GPU is visible) is replaced, and each line is checked whole."""
    import dataclasses

    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_dispatch, "EXTENSION", dataclasses.replace(_dispatch.EXTENSION, loaded=True,
                                                                    cuda=cuda_kernels, problem=None))
    lines = dict(line.split(": ", 1) for line in kernels_report().splitlines())
    assert lines["torch CUDA"] == torch_line
    assert lines["extension gfpo_kernels._C"] == extension_line
    for op in ("group", "linear_grpo"):
        assert lines[f"backend {op} ops, cuda tensors"].endswith(cuda_backend_suffix)


def _run_without_trl(*module_and_args: str) -> subprocess.CompletedProcess:
    module, *args = module_and_args
    blocker = ("import sys; sys.modules['trl'] = None; sys.modules['transformers'] = None; "
               f"sys.argv = [{module!r}, *{args!r}]; import runpy; runpy.run_module({module!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())


def test_module_runs_without_trl():
    """A bug report must be possible from a broken install: the reports import no TRL."""
    done = _run_without_trl("gfpo_kernels")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend group ops, cpu tensors: " in done.stdout and "torch: " in done.stdout
    assert done.stdout.endswith("\ntrainer: python -m gfpo_trainer env adds whether TRL is supported and the vLLM "
                                "it generates with\n")
    done = _run_without_trl("gfpo_trainer", "env")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend group ops, cpu tensors: " in done.stdout and "torch: " in done.stdout
    # TRL blocked at import (installed or not): the vLLM line says it was not checked, and why
    assert "\nvllm: not checked (" in done.stdout and "\ntrl support: not checked (" in done.stdout


def test_trainer_report_is_the_kernel_report_and_the_trainer_lines():
    lines = environment_report().splitlines()
    kernel_lines = kernels_report().splitlines()
    assert lines[: len(kernel_lines)] == kernel_lines
    assert [line.split(": ", 1)[0] for line in lines[len(kernel_lines):]] == ["trl support", "vllm"]


def test_trainer_command_prints_the_report():
    done = subprocess.run([sys.executable, "-m", "gfpo_trainer", "env"], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["torch"] == torch.__version__ and "trl support" in lines and "vllm" in lines


def test_gfpo_kernels_imports_nothing_from_gfpo_trainer():
    """The kernel package sits below the trainer: no module of it imports gfpo_trainer, at the top or inside a
    function (read from the sources), and importing it with its report loads none (in a fresh Python)."""
    for path in sorted((ROOT / "gfpo_kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.split(".")[0] == "gfpo_trainer" for name in names), f"{path.name}:{node.lineno}"
    check = ("import sys, gfpo_kernels, gfpo_kernels.reference, gfpo_kernels.env_report as r; r.environment_report(); "
             "import runpy, contextlib, io; out = io.StringIO()\n"
             "with contextlib.redirect_stdout(out): runpy.run_module('gfpo_kernels', run_name='__main__')\n"
             "print(sorted(m for m in sys.modules if m.startswith('gfpo_trainer')))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def _vllm_line() -> str:
    return next(line for line in environment_report().splitlines() if line.startswith("vllm: "))


# _compat.VLLM_INSTALL_HINT: the install line of docs/vllm.md (tests/test_compat.py checks the page says it)
HINT = "pip install --no-build-isolation '.[trainer,vllm]' in gfpo's source tree (docs/vllm.md)"


@pytest.mark.parametrize("installed, expected", [
    (None, f"vllm: not installed (trl 1.16.0 generates with vllm 0.22.0 to 0.31.0; {HINT} installs one)"),
    ("0.31.0", "vllm: 0.31.0, supported (trl 1.16.0 generates with vllm 0.22.0 to 0.31.0)"),
    ("0.22.0rc1", "vllm: 0.22.0rc1, supported (trl 1.16.0 generates with vllm 0.22.0 to 0.31.0)"),  # TRL's base version
    ("0.21.0", f"vllm: 0.21.0, NOT supported (trl 1.16.0 generates with vllm 0.22.0 to 0.31.0; {HINT} installs one)"),
    ("0.32.0", f"vllm: 0.32.0, NOT supported (trl 1.16.0 generates with vllm 0.22.0 to 0.31.0; {HINT} installs one)"),
])
def test_report_names_vllm_and_whether_trl_supports_it(monkeypatch, installed, expected):
    """The version lookup is replaced (no vLLM in .venv); the range is the table in gfpo_trainer._compat for the
    TRL installed, also replaced, by 1.16.0 (0.22.0 to 0.31.0 in that table)."""
    pytest.importorskip("trl")
    from gfpo_trainer import _compat, env_report

    real_version = env_report._version
    monkeypatch.setattr(env_report, "_version", lambda name: "1.16.0" if name == "trl" else real_version(name))
    monkeypatch.setattr(_compat, "vllm_version", lambda: installed)
    assert _compat.VLLM_RANGE_BY_TRL["1.16"] == ("0.22.0", "0.31.0")
    assert _vllm_line() == expected


@pytest.mark.parametrize("declares, installed, expected", [
    (['vllm<=0.33.0,>=0.23.0; extra == "vllm"'], "0.31.0",
     "0.31.0, supported (trl 1.17.0 generates with vllm <=0.33.0,>=0.23.0 (its metadata's range; gfpo has not tested "
     "that trl))"),
    (['vllm<=0.33.0,>=0.23.0; extra == "vllm"'], "0.22.1",
     f"0.22.1, NOT supported (trl 1.17.0 generates with vllm <=0.33.0,>=0.23.0 (its metadata's range; gfpo has not "
     f"tested that trl); {HINT} installs one)"),
    ([], "0.31.0", "0.31.0 (trl 1.17.0 is not a release gfpo knows the vLLM range of: trl 1.14, 1.15, 1.16; and its "
                   "metadata declares none)"),
])
def test_report_on_a_trl_outside_the_vllm_table(monkeypatch, declares, installed, expected):
    """An untested TRL (1.17.0, simulated: the metadata gfpo reads is replaced): its vLLM range is the one its own
    `vllm` extra declares, said to be that."""
    pytest.importorskip("trl")
    from gfpo_trainer import _compat, env_report

    monkeypatch.setattr(_compat, "vllm_version", lambda: installed)
    monkeypatch.setattr(_compat, "_installed_trl_metadata", lambda: ("1.17.0", ["accelerate>=1.4.0", *declares]))
    assert env_report.vllm_report("1.17.0") == expected


def test_report_without_trl_says_vllm_was_not_checked(monkeypatch):
    from gfpo_trainer import env_report

    real_version = env_report._version
    monkeypatch.setattr(env_report, "_version", lambda name: "not installed" if name == "trl" else real_version(name))
    assert _vllm_line() == "vllm: not checked (the check needs TRL, which is not installed)"
    assert "\ntrl support: not checked (TRL is not installed)\n" in environment_report()


@pytest.mark.parametrize("version, tested", [("1.16.0", True), ("1.14.2", True), ("1.14.1", False),
                                             ("1.17.0.dev0", False), ("1.18.0", False)])
def test_report_says_whether_the_trl_installed_is_tested(monkeypatch, version, tested):
    """The range is the table in gfpo_trainer._compat (>= 1.14.2, < 1.17, tested with 1.14.2, 1.15.0 and 1.16.0)."""
    pytest.importorskip("trl")
    from gfpo_trainer import _compat, env_report

    assert _compat.TESTED_TRL == (">=1.14.2", "<1.17")
    assert _compat.KNOWN_WORKING_TRL == ("1.14.2", "1.15.0", "1.16.0")
    table = "gfpo is tested on trl >=1.14.2, <1.17, with 1.14.2, 1.15.0, 1.16.0"
    expected = (f"trl support: {version}, tested ({table})" if tested else
                f"trl support: {version}, UNTESTED ({table}; GFPOTrainer trains with a warning where the GRPOTrainer "
                "internals it hooks match, and stops where they moved; pip install 'trl>=1.14.2,<1.17' installs a "
                "tested one)")
    real_version = env_report._version
    monkeypatch.setattr(env_report, "_version", lambda name: version if name == "trl" else real_version(name))
    assert next(line for line in environment_report().splitlines() if line.startswith("trl support: ")) == expected


def test_the_vllm_ci_step_fails_where_vllm_does_not_import(tmp_path):
    """scripts/test_vllm_cpu.sh sets GFPO_REQUIRE_VLLM=1: a vLLM that fails to import must fail that run (exit 4,
    naming the error), where the vLLM tests would otherwise all be skipped and the step pass."""
    (tmp_path / "vllm.py").write_text("raise ImportError('this vLLM is broken')\n")
    env = subprocess_env(GFPO_REQUIRE_VLLM="1")
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "tests/test_env_report.py"], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert ("GFPO_REQUIRE_VLLM=1, but the vLLM tests cannot run here: ImportError('this vLLM is broken')"
            in done.stderr)
