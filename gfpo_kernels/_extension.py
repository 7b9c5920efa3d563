"""Loads the C++/CUDA extension gfpo_kernels._C, once, and says why not when it does not.

The extension is optional: without it the group ops run on Triton (CUDA tensors) or the PyTorch reference. It is
never left out silently: unless the build switched it off on purpose (GFPO_NO_EXTENSION=1), a missing or unloadable
extension (a torch older than its stable ABI, an undefined symbol, a damaged file) gives one RuntimeWarning at
import with the reason (the loader's own error) and what the extension was built against, and the environment
report (`python -m gfpo_kernels`) and a forced "cpp" backend give the same reason.

What it was built against comes from gfpo_kernels/_build_info.py, written by setup.py at build time.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import warnings

import torch

# The stable ABI version the sources target (setup.py's STABLE_ABI); a build record says which one it used.
STABLE_ABI = "2.10"
REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall ."


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """loaded: the ops torch.ops.gfpo.* are registered; cuda: with their CUDA kernels (whether or not this torch has
    CUDA); problem: why the extension is not loaded (None when it is), with what to do about it; disabled: the build
    left it out on purpose; build: the build record (empty without one)."""

    loaded: bool
    cuda: bool
    problem: str | None
    disabled: bool
    build: dict

    def built_against(self) -> str:
        """What the extension was compiled against, from the build record."""
        if "TORCH" not in self.build:
            return "unknown (no build record)"
        if self.build.get("EXTENSION") != "built":
            return f"nothing: no extension in this build (torch {self.build['TORCH']} at build time)"
        text = f"torch {self.build['TORCH']} (LibTorch stable ABI >= {self.build.get('STABLE_ABI', STABLE_ABI)})"
        if self.build.get("CUDA"):
            text += f", CUDA {self.build['CUDA']} for {self.build.get('CUDA_ARCHS')}"
        if self.build.get("CUDA_NOTE"):
            text += f" ({self.build['CUDA_NOTE']})"
        return text


def _build_record() -> dict:
    try:
        info = importlib.import_module(f"{__package__}._build_info")
    except ImportError:
        return {}
    return {name: value for name, value in vars(info).items() if name.isupper()}


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def _load() -> ExtensionStatus:
    build = _build_record()
    status = dict(loaded=False, cuda=False, disabled=build.get("EXTENSION") == "disabled", build=build)
    if importlib.util.find_spec(f"{__package__}._C") is None:
        if status["disabled"]:
            return ExtensionStatus(problem="is not built (GFPO_NO_EXTENSION=1 at build time)", **status)
        if build.get("EXTENSION") == "not built":
            why = build.get("EXTENSION_NOTE") or "no reason recorded"
            return ExtensionStatus(problem=f"is not built ({why}); with torch >= {STABLE_ABI}: {REBUILD}", **status)
        why = "the build record says it was built: a damaged install?" if build else "no build record: a source tree"
        return ExtensionStatus(problem=f"is not built ({why}); build it: {REBUILD}", **status)
    floor = build.get("STABLE_ABI", STABLE_ABI)
    if _major_minor(torch.__version__) < _major_minor(floor):
        return ExtensionStatus(
            problem=f"needs torch >= {floor} (the LibTorch stable ABI it is built on), this is torch "
            f"{torch.__version__}: upgrade torch to use it",
            **status,
        )
    try:
        importlib.import_module(f"{__package__}._C")  # registers torch.ops.gfpo.*
    except Exception as error:  # the loader's error, whatever its type, is the reason to report
        return ExtensionStatus(
            problem=f"failed to load ({type(error).__name__}: {error}); reinstall it for this torch: {REBUILD}",
            **status,
        )
    status.update(loaded=True, cuda=torch._C._dispatch_has_kernel_for_dispatch_key("gfpo::group_topk_mask", "CUDA"))
    return ExtensionStatus(problem=None, **status)


STATUS = _load()
if STATUS.problem is not None and not STATUS.disabled:
    warnings.warn(
        f"gfpo_kernels: the C++/CUDA extension gfpo_kernels._C {STATUS.problem}. Built against: "
        f"{STATUS.built_against()}. Until then the group ops run on Triton (CUDA tensors) or the PyTorch reference.",
        RuntimeWarning,
    )
