"""The one place that decides which implementation runs an op.

Backends:
- "triton":    the Triton kernels; the default for CUDA tensors. CPU tensors only under TRITON_INTERPRET=1.
- "cpp":       the C++/CUDA extension gfpo_kernels._C (torch custom ops); the default for CPU tensors, and for
               CUDA tensors when Triton is missing.
- "reference": gfpo_kernels.reference, plain PyTorch; used when nothing else can run the input.

`GFPO_KERNELS_BACKEND=<name>` in the environment, or the `use_backend(name)` context manager, forces one
backend (tests and benchmarks use it); a forced backend that cannot run the input raises RuntimeError.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

BACKENDS = ("triton", "cpp", "reference")

try:
    from . import _C  # noqa: F401  (registers torch.ops.gfpo.*)

    HAS_CPP = True
    HAS_CPP_CUDA = hasattr(torch.ops.gfpo, "group_topk_mask") and torch._C._dispatch_has_kernel_for_dispatch_key(
        "gfpo::group_topk_mask", "CUDA"
    )
except ImportError:  # built with GFPO_NO_EXTENSION=1, or no compiler at install time
    HAS_CPP = HAS_CPP_CUDA = False

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# Largest group each kernel handles; larger groups go to the next backend that can.
MAX_GROUP_SIZE = {"triton": 4096, "cpp_cuda": 1024}

_forced = threading.local()


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _can_run(backend: str, device: torch.device, group_size: int) -> str | None:
    """None when `backend` can run a (.., group_size) input on `device`, else the reason it cannot."""
    if backend == "reference":
        return None
    if backend == "triton":
        if not HAS_TRITON:
            return "triton is not installed"
        if device.type != "cuda" and not triton_interpreting():
            return f"Triton runs {device.type} tensors only under TRITON_INTERPRET=1"
        if group_size > MAX_GROUP_SIZE["triton"]:
            return f"group_size={group_size} > {MAX_GROUP_SIZE['triton']}"
        return None
    if backend == "cpp":
        if not HAS_CPP:
            return "the extension gfpo_kernels._C is not built (pip install --no-build-isolation -e .)"
        if device.type == "cuda":
            if not HAS_CPP_CUDA:
                return "gfpo_kernels._C was built without CUDA"
            if group_size > MAX_GROUP_SIZE["cpp_cuda"]:
                return f"group_size={group_size} > {MAX_GROUP_SIZE['cpp_cuda']}"
        elif device.type != "cpu":
            return f"gfpo_kernels._C has no {device.type} kernel"
        return None
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def forced_backend() -> str | None:
    return getattr(_forced, "name", None) or os.environ.get("GFPO_KERNELS_BACKEND") or None


def select_backend(device: torch.device, group_size: int) -> str:
    """The backend that runs an op on `device` with groups of `group_size` rows."""
    forced = forced_backend()
    if forced is not None:
        reason = _can_run(forced, device, group_size)
        if reason is not None:
            raise RuntimeError(f"gfpo_kernels backend {forced!r} was forced but cannot run this input: {reason}")
        return forced
    preference = ("triton", "cpp") if device.type == "cuda" else ("cpp",)
    for backend in preference:
        if _can_run(backend, device, group_size) is None:
            return backend
    return "reference"


@contextlib.contextmanager
def use_backend(name: str | None):
    """Forces `name` ("triton", "cpp", "reference"; None = automatic) for the ops run inside the block."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def available_backends(device: torch.device | str = "cpu", group_size: int = 16) -> list[str]:
    """The backends that can run ops on `device` here (for tests, benchmarks and bug reports)."""
    device = torch.device(device)
    return [b for b in BACKENDS if _can_run(b, device, group_size) is None]
