"""Device time of the group filter + advantages kernels, without the Python around them, against the goal
of "within 3x of an empty kernel launch", measured with CUDA graphs or events so the figure is the kernel. CUDA only.

For each size and backend (Triton, the CUDA extension), and for an empty Triton kernel as the floor:
- graph: CALLS calls captured in one CUDA graph, replayed; CUDA events around the replays; time per call. This
  is the device time including the gaps between the graph's kernels, without any host launch cost.
- kernels: the summed device time of the kernels one call runs, from torch.profiler (no gaps at all).
The end-to-end time from Python is pytest-benchmark's (bench/test_bench_group_ops.py).

    python bench/group_kernel_time.py            # prints a markdown table
"""

from __future__ import annotations

import argparse

import torch

import gfpo_kernels
from gfpo_kernels import _dispatch, reference

from bench_utils import group_inputs

SIZES = [(4096, 16), (8192, 64)]
CALLS = 20


def _graph_us(fn, replays: int = 50) -> float:
    """Per-call device time of fn from CUDA-graph replays (CALLS calls per graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up off the graph: compilation, allocator
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def _kernel_us(fn, calls: int = 50) -> tuple[float, int]:
    """(summed kernel device time per call in us, kernels per call) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)  # us
    return total / calls, round(len(kernels) / calls)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA only")
        return 1
    import triton

    @triton.jit
    def _empty_kernel(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    rows = []
    floor_graph = _graph_us(lambda: _empty_kernel[(1,)](x))
    floor_kernel, _ = _kernel_us(lambda: _empty_kernel[(1,)](x))
    backends = [b for b in ("triton", "cpp") if b in _dispatch.available_backends("group", "cuda")]
    for num_groups, G in SIZES:
        rewards, lengths = group_inputs(num_groups, G)
        k = G // 2
        want_keep, want_adv = reference.gfpo_filter_advantages(rewards, lengths, G, k, largest=False)
        for backend in backends:
            def call(backend=backend):
                with gfpo_kernels.use_backend(backend):
                    return gfpo_kernels.gfpo_filter_advantages(rewards, lengths, G, k, largest=False)

            keep, adv = call()
            assert torch.equal(keep, want_keep), backend
            torch.testing.assert_close(adv, want_adv, rtol=1e-4, atol=1e-4)
            try:
                graph = _graph_us(call)
            except Exception as exc:  # noqa: BLE001  (a host sync inside the call cannot be captured: say so)
                graph = float("nan")
                print(f"{backend} {num_groups}x{G}: not capturable in a CUDA graph: {type(exc).__name__}: {exc}")
            kernel, launches = _kernel_us(call)
            rows.append((f"{num_groups}x{G}", backend, graph, kernel, launches))
    print("\n## group filter + advantages: device time per call (us)\n")
    print(f"empty Triton kernel: graph {floor_graph:.2f} us, kernel {floor_kernel:.2f} us\n")
    print("| size | backend | graph replay | / empty (graph) | kernels only | kernels per call |")
    print("|---|---|---|---|---|---|")
    for size, backend, graph, kernel, launches in rows:
        print(f"| {size} | {backend} | {graph:.2f} | {graph / floor_graph:.2f}x | {kernel:.2f} | {launches} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
