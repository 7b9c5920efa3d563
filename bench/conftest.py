"""Benchmark setup: full sizes on CUDA, small ones on CPU (where CI runs the suites with
--benchmark-disable as a smoke test). Records device and versions in the JSON of every run."""

import pytest
import torch

from bench_utils import device_name, machine_versions, sync

import gfpo_kernels  # noqa: E402, F401  (after bench_utils has set TRITON_INTERPRET)


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["device"] = device_name()
    machine_info["versions"] = machine_versions()
    machine_info["torch_threads"] = torch.get_num_threads()


@pytest.fixture
def run(benchmark):
    """benchmark(fn) that waits for the GPU, so each round times the work and not only the launch."""

    def timed(fn, *args, **kwargs):
        def call():
            out = fn(*args, **kwargs)
            sync()
            return out

        return benchmark(call)

    return timed
