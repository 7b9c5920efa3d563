"""`python -m gfpo_kernels`: the environment report for bug reports."""

import subprocess
import sys

import torch

from gfpo_kernels import _dispatch
from gfpo_kernels.env_report import environment_report

from gfpo_test_utils import subprocess_env


def test_report_names_versions_extension_and_backends():
    lines = dict(line.split(": ", 1) for line in environment_report().splitlines())
    assert lines["torch"] == torch.__version__
    extension = _dispatch.EXTENSION
    assert lines["extension gfpo_kernels._C"] == (
        f"loaded, {'built with CUDA' if _dispatch.HAS_CPP_CUDA else 'built for CPU only'}" if _dispatch.HAS_CPP
        else f"not loaded: it {extension.problem}"
    )
    if "TORCH" in extension.build:  # a build of the extension: what it recorded
        assert lines["gfpo commit"] == extension.build["COMMIT"]
        assert lines["extension built against"].startswith(f"torch {extension.build['TORCH']} (LibTorch stable ABI")
    for op in ("group", "linear_grpo"):
        assert lines[f"backend {op} ops, cpu tensors"] == _dispatch.select_backend(op, torch.device("cpu"))
        assert lines[f"backend {op} ops, cuda tensors"].startswith(_dispatch.select_backend(op, torch.device("cuda")))
    for name in ("python", "gfpo", "gfpo commit", "triton", "trl", "transformers", "accelerate", "torch CUDA"):
        assert lines[name]


def test_module_runs_without_trl():
    """A bug report must be possible from a broken install: the report imports no TRL."""
    blocker = "import sys; sys.modules['trl'] = None; sys.modules['transformers'] = None; import runpy; " \
              "runpy.run_module('gfpo_kernels', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend group ops, cpu tensors: " in done.stdout and "torch: " in done.stdout
