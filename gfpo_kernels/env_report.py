"""The kernel package's environment report for bug reports: `python -m gfpo_kernels`.

Versions (and the commit gfpo was built from), devices, the extension (loaded or why not, and what it was built
against), and the backend each op family would use for CPU and CUDA tensors (asked of `_dispatch`, the one place that
decides). Needs neither TRL nor a GPU. What only the trainer knows (whether the installed TRL is supported, and the
vLLM it generates with) is added by `python -m gfpo_trainer env` (gfpo_trainer/env_report.py): this package imports
nothing from gfpo_trainer.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from . import _dispatch

_PACKAGES = ("torch", "triton", "trl", "transformers", "accelerate", "liger-kernel", "fastdigest")


def _version(package: str) -> str:
    if package == "torch":  # with its local tag (+cu130, +cpu): which build it is matters in a bug report
        return torch.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def package_versions() -> dict[str, str]:
    """{package: version} of the packages gfpo's figures depend on (torch with its build tag; "not installed" where
    absent), as the report prints them: the demo records the same beside its results."""
    return {name: _version(name) for name in _PACKAGES}


def torch_without_cuda() -> str | None:
    """Which build this torch is when it has no CUDA ("CPU", "ROCm"), None for a CUDA build: the extension's CUDA
    kernels, compiled whenever nvcc is found (setup.py), run only beside a CUDA build of torch."""
    if torch.version.cuda is not None:
        return None
    return "ROCm" if getattr(torch.version, "hip", None) else "CPU"


def extension_state(extension) -> str:
    """The report's `extension gfpo_kernels._C` line: loaded or why not, and which of its kernels this torch runs. A
    build with CUDA kernels beside a torch without CUDA says they are unusable, so a bug report never reads as if
    the CUDA kernels had run."""
    if not extension.loaded:
        return f"not loaded: it {extension.problem}"
    if not extension.cuda:
        return "loaded, built for CPU only"
    build = torch_without_cuda()
    if build is None:
        return "loaded, built with CUDA"
    return f"loaded, CUDA kernels compiled, unusable: this torch is a {build} build"


def environment_report() -> str:
    """A plain-text report of what gfpo_kernels runs on, one `name: value` per line."""
    extension = _dispatch.EXTENSION
    lines = [f"python: {sys.version.split()[0]} ({platform.platform()})", f"gfpo: {_version('gfpo')}",
             f"gfpo commit: {extension.build.get('COMMIT', 'unknown (no build record)')}"]
    lines += [f"{name}: {version}" for name, version in package_versions().items()]
    lines.append(f"torch CUDA: {torch.version.cuda or f'none ({torch_without_cuda()} build)'}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"device cuda:{index}: {props.name}, sm_{props.major}{props.minor}, "
                         f"{props.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("device: CPU only (no CUDA device visible)")
    lines.append(f"extension gfpo_kernels._C: {extension_state(extension)}")
    lines.append(f"extension built against: {extension.built_against()}")
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
            suffix = ""
            if device == "cuda" and not torch.cuda.is_available():  # what the extension would run, hypothetically
                build = torch_without_cuda()
                suffix = (" (if CUDA tensors were given)" if build is None
                          else f" (beside a CUDA build of torch: this one is a {build} build)")
            lines.append(f"backend {op} ops, {device} tensors: {chosen}{suffix}")
    return "\n".join(lines)
