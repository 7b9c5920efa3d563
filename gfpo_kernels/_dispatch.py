"""The one place that decides which implementation runs an op.

Op families and their backends (OP_BACKENDS), in order of preference:
- "group" (group_topk_mask, group_advantages, gfpo_filter_advantages):
  "cpp" (the C++/CUDA extension gfpo_kernels._C, torch custom ops; default for CPU tensors, and for CUDA tensors
  when built with CUDA and group_size <= 1024), "triton" (CUDA otherwise: groups up to 4096, or no CUDA build),
  "reference". The CUDA op before Triton: Triton's kernel can be faster on the device, but its Python launch costs
  more, and a trainer pays the launch (the measurements: docs/performance.md, GPU).
- "linear_grpo" (fused_linear_grpo_loss): "triton" (Triton row kernels between cuBLAS GEMMs; default for
  CUDA), "torch" (the same chunked algorithm in torch ops; default elsewhere), "reference".
Triton runs CPU tensors only under TRITON_INTERPRET=1 (the tests do that).

`GFPO_KERNELS_BACKEND=<name>` in the environment, or the `use_backend(name)` context manager, forces a
backend for the op families that have it (tests and benchmarks use it); the others choose as usual. A forced
backend that cannot run the input raises RuntimeError.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from ._extension import STATUS as EXTENSION
from ._validation import did_you_mean

BACKENDS = ("triton", "cpp", "torch", "reference")
OP_BACKENDS = {
    "group": ("cpp", "triton", "reference"),
    "linear_grpo": ("triton", "torch", "reference"),
}

# The extension's ops (torch.ops.gfpo.*), and their CUDA kernels; _extension says why not when they are missing.
HAS_CPP = EXTENSION.loaded
HAS_CPP_CUDA = EXTENSION.cuda

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


def _can_run(backend: str, op: str, device: torch.device, group_size: int = 1) -> str | None:
    """None when `backend` can run op family `op` on `device` (with groups of `group_size` rows), else why not."""
    if backend not in OP_BACKENDS[op]:
        return f"{backend!r} does not implement the {op} ops"
    if backend in ("reference", "torch"):
        return None
    if backend == "triton":
        if not HAS_TRITON:
            return "triton is not installed"
        if device.type != "cuda" and not triton_interpreting():
            return f"Triton runs {device.type} tensors only under TRITON_INTERPRET=1"
        if op == "group" and group_size > MAX_GROUP_SIZE["triton"]:
            return f"group_size={group_size} > {MAX_GROUP_SIZE['triton']}"
        return None
    # cpp
    if not HAS_CPP:
        return f"the extension gfpo_kernels._C {EXTENSION.problem}"
    if device.type == "cuda":
        if not HAS_CPP_CUDA:
            return "gfpo_kernels._C was built without CUDA"
        if group_size > MAX_GROUP_SIZE["cpp_cuda"]:
            return f"group_size={group_size} > {MAX_GROUP_SIZE['cpp_cuda']}"
    elif device.type != "cpu":
        return f"gfpo_kernels._C has no {device.type} kernel"
    return None


def forced_backend() -> str | None:
    name = getattr(_forced, "name", None) or os.environ.get("GFPO_KERNELS_BACKEND") or None
    if name is not None and name not in BACKENDS:  # a misspelt name would otherwise force nothing, silently
        raise ValueError(f"GFPO_KERNELS_BACKEND must be one of {BACKENDS} (or unset), got {name!r}"
                         f"{did_you_mean(name, BACKENDS)}")
    return name


def select_backend(op: str, device: torch.device, group_size: int = 1) -> str:
    """The backend that runs op family `op` ("group" or "linear_grpo") on `device`."""
    forced = forced_backend()
    if forced is not None and forced in OP_BACKENDS[op]:
        reason = _can_run(forced, op, device, group_size)
        if reason is not None:
            raise RuntimeError(f"gfpo_kernels backend {forced!r} was forced but cannot run this input: {reason}")
        return forced
    for backend in OP_BACKENDS[op]:
        if backend == "triton" and device.type != "cuda":
            continue  # the interpreter is for tests, never a default
        if _can_run(backend, op, device, group_size) is None:
            return backend
    return "reference"


def on_device(device: torch.device):
    """Makes `device` the current CUDA device for a Triton launch (a no-op context elsewhere): Triton launches on the
    current device's current stream whatever device the tensors are on, so a tensor on cuda:1 while cuda:0 is
    current would be read from the wrong device, or on a stream not ordered after the work that wrote it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def use_backend(name: str | None):
    """Forces one backend for the ops run inside the block, to compare or test implementations.

    Args:
        name: one of BACKENDS ("triton", "cpp", "torch", "reference"), applied to the op families that have it;
            None: automatic choice again.

    Raises:
        ValueError: an unknown name. RuntimeError (at the op's call): the forced backend cannot run that input.
    """
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}{did_you_mean(name, BACKENDS)}")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def available_backends(op: str = "group", device: torch.device | str = "cpu", group_size: int = 16) -> list[str]:
    """The backends that can run an op family here, for tests, benchmarks and bug reports.

    Args:
        op: "group" (the group ops) or "linear_grpo" (the fused loss).
        device: the device of the tensors the op would get.
        group_size: G (the group kernels have a largest group per backend).

    Returns:
        The backend names, most preferred first.
    """
    device = torch.device(device)
    return [b for b in OP_BACKENDS[op] if _can_run(b, op, device, group_size) is None]
