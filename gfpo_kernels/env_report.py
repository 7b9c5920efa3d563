"""The environment report for bug reports: `python -m gfpo_kernels`.

Versions, devices, how the extension was built, and the backend each op family would use for CPU and CUDA
tensors (asked of `_dispatch`, the one place that decides). Needs neither TRL nor a GPU.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from . import _dispatch

_PACKAGES = ("gfpo", "torch", "triton", "trl", "transformers", "accelerate", "liger-kernel", "tdigest")


def _version(package: str) -> str:
    if package == "torch":  # with its local tag (+cu130, +cpu): which build it is matters in a bug report
        return torch.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> str:
    """A plain-text report of what gfpo_kernels runs on, one `name: value` per line."""
    lines = [f"python: {sys.version.split()[0]} ({platform.platform()})"]
    lines += [f"{name}: {_version(name)}" for name in _PACKAGES]
    lines.append(f"torch CUDA: {torch.version.cuda or 'none (CPU build)'}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"device cuda:{index}: {props.name}, sm_{props.major}{props.minor}, "
                         f"{props.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("device: CPU only (no CUDA device visible)")
    extension = "built with CUDA" if _dispatch.HAS_CPP_CUDA else "built (CPU only)" if _dispatch.HAS_CPP else "not built"
    lines.append(f"extension gfpo_kernels._C: {extension}")
    lines.append(f"TRITON_INTERPRET: {'on' if _dispatch.triton_interpreting() else 'off'}")
    forced = _dispatch.forced_backend()
    if forced:
        lines.append(f"forced backend (GFPO_KERNELS_BACKEND / use_backend): {forced}")
    for op in _dispatch.OP_BACKENDS:
        for device in ("cpu", "cuda"):
            try:
                chosen = _dispatch.select_backend(op, torch.device(device))
            except RuntimeError as error:
                chosen = f"error: {error}"
            suffix = "" if device == "cpu" or torch.cuda.is_available() else " (if CUDA tensors were given)"
            lines.append(f"backend {op} ops, {device} tensors: {chosen}{suffix}")
    return "\n".join(lines)
