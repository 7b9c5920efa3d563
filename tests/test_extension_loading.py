"""Never a silent fallback: an extension that is present but does not load, or missing, is reported once at import
with the reason (the loader's own error) and what it was built against, by the environment report, and by a
forced "cpp" backend; the ops keep running on the reference meanwhile. Each case runs a copy of the package in a
child Python, with its _C and build record made to order."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gfpo_kernels
from gfpo_kernels import _dispatch

PACKAGE = Path(gfpo_kernels.__file__).parent
BUILT = importlib.util.find_spec("gfpo_kernels._C")

# The child: imports the package with every warning recorded, runs the fused op (which must match the reference),
# forces the C++ backend, and prints what it saw as JSON.
CHILD = """
import json, sys, warnings
# the copy only: an editable install of this checkout would supply a _C the copy lacks
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import torch
{prelude}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import gfpo_kernels
    from gfpo_kernels import _dispatch, reference
    from gfpo_kernels.env_report import environment_report
    rewards, scores = torch.randn(32, generator=torch.Generator().manual_seed(0)), torch.arange(32.0)
    keep, adv = gfpo_kernels.gfpo_filter_advantages(rewards, scores, 8, 3)
    want_keep, want_adv = reference.gfpo_filter_advantages(rewards, scores, 8, 3)
    assert torch.equal(keep, want_keep) and torch.allclose(adv, want_adv)
    try:
        with gfpo_kernels.use_backend("cpp"):
            gfpo_kernels.group_topk_mask(scores, 8, 3)
        forced = None
    except RuntimeError as error:
        forced = str(error)
    report = environment_report()
print(json.dumps({{"warnings": [str(w.message) for w in caught if "gfpo_kernels._C" in str(w.message)],
                  "has_cpp": _dispatch.HAS_CPP, "forced": forced, "report": report}}))
"""


def run_copy(tmp_path, *, library: bytes | None, build: dict | None, prelude: str = "") -> dict:
    """Runs CHILD on a copy of gfpo_kernels whose _C is `library` (None: absent) and whose build record holds
    `build` (None: no record)."""
    shutil.copytree(PACKAGE, tmp_path / "gfpo_kernels",
                    ignore=shutil.ignore_patterns("_C*.so", "_build_info.py", "__pycache__"))
    if library is not None:
        (tmp_path / "gfpo_kernels" / "_C.abi3.so").write_bytes(library)
    if build is not None:
        (tmp_path / "gfpo_kernels" / "_build_info.py").write_text(
            "".join(f"{name} = {value!r}\n" for name, value in build.items()))
    done = subprocess.run([sys.executable, "-c", CHILD.format(prelude=prelude)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**_child_env(), "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    result["report"] = dict(line.split(": ", 1) for line in result["report"].splitlines())
    return result


def _child_env() -> dict:
    import os

    return {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "GFPO_KERNELS_BACKEND")}


RECORD = {"COMMIT": "abc123def456", "EXTENSION": "built", "EXTENSION_NOTE": None, "TORCH": "2.99.0+test",
          "STABLE_ABI": "2.10", "CUDA": "13.0", "CUDA_ARCHS": "8.0;9.0+PTX"}


def test_an_unloadable_extension_is_reported_with_the_loaders_error(tmp_path):
    """A _C that is there but cannot load (here not a shared library at all, as a wrong-platform or truncated
    file would be): the warning, the report and the forced backend name the loader's error and the build."""
    seen = run_copy(tmp_path, library=b"not a shared library", build=RECORD)
    assert not seen["has_cpp"]
    assert len(seen["warnings"]) == 1, seen["warnings"]
    warning = seen["warnings"][0]
    assert "gfpo_kernels._C failed to load (ImportError: " in warning
    assert "_C.abi3.so" in warning  # the loader's own message names the file it could not load
    assert "Built against: torch 2.99.0+test (LibTorch stable ABI >= 2.10), CUDA 13.0 for 8.0;9.0+PTX" in warning
    assert "the group ops run on Triton (CUDA tensors) or the PyTorch reference" in warning
    assert "pip install --no-build-isolation --no-deps --force-reinstall ." in warning
    assert "failed to load (ImportError: " in seen["forced"] and "not built" not in seen["forced"]
    assert seen["report"]["extension gfpo_kernels._C"].startswith("not loaded: it failed to load (ImportError: ")
    assert seen["report"]["extension built against"].startswith("torch 2.99.0+test")
    assert seen["report"]["gfpo commit"] == "abc123def456"


@pytest.mark.skipif(BUILT is None, reason="needs the built extension")
def test_a_torch_older_than_the_stable_abi_is_reported(tmp_path):
    """The real _C beside a torch that says it is 2.9.1: not loaded, and the warning says which torch it needs."""
    seen = run_copy(tmp_path, library=Path(BUILT.origin).read_bytes(), build=RECORD,
                    prelude="torch.__version__ = '2.9.1'")
    assert not seen["has_cpp"]
    assert seen["warnings"] == [
        "gfpo_kernels: the C++/CUDA extension gfpo_kernels._C needs torch >= 2.10 (the LibTorch stable ABI it is "
        "built on), this is torch 2.9.1: upgrade torch to use it. Built against: torch 2.99.0+test (LibTorch "
        "stable ABI >= 2.10), CUDA 13.0 for 8.0;9.0+PTX. Until then the group ops run on Triton (CUDA tensors) or "
        "the PyTorch reference."
    ]
    assert "needs torch >= 2.10" in seen["forced"]


def test_an_extension_left_out_at_build_time_is_reported(tmp_path):
    note = "torch 2.9.1 at build time; the extension needs torch>=2.10"
    seen = run_copy(tmp_path, library=None, build={"COMMIT": "unknown", "EXTENSION": "not built",
                                                   "EXTENSION_NOTE": note, "TORCH": "2.9.1"})
    assert len(seen["warnings"]) == 1 and f"gfpo_kernels._C is not built ({note})" in seen["warnings"][0]
    assert f"is not built ({note})" in seen["forced"]


def test_a_source_tree_without_a_build_is_reported(tmp_path):
    seen = run_copy(tmp_path, library=None, build=None)
    assert len(seen["warnings"]) == 1
    assert "gfpo_kernels._C is not built (no build record: a source tree); build it: pip install" in seen["warnings"][0]
    assert seen["report"]["gfpo commit"] == "unknown (no build record)"
    assert seen["report"]["extension built against"] == "unknown (no build record)"


def test_an_extension_switched_off_on_purpose_gives_no_warning(tmp_path):
    seen = run_copy(tmp_path, library=None, build={"COMMIT": "abc", "EXTENSION": "disabled",
                                                   "EXTENSION_NOTE": "GFPO_NO_EXTENSION=1 at build time"})
    assert seen["warnings"] == []
    assert seen["report"]["extension gfpo_kernels._C"] == (
        "not loaded: it is not built (GFPO_NO_EXTENSION=1 at build time)")
    assert "is not built (GFPO_NO_EXTENSION=1 at build time)" in seen["forced"]


@pytest.mark.skipif(BUILT is None, reason="needs the built extension")
def test_a_loaded_extension_gives_no_warning():
    assert _dispatch.EXTENSION.problem is None and _dispatch.HAS_CPP
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", "import gfpo_kernels"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
