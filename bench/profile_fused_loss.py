"""torch.profiler summary of the fused linear GRPO loss (forward + backward): the top ops by device time, so
the note can say where the time goes beside the two GEMMs.

    python bench/profile_fused_loss.py [--fast] [--rows 100]

On CUDA: bf16, B*T = 32*512 tokens, H=4096, V=151936 (--fast: 16*256, H=2048). Without CUDA (rehearsal):
fp32, tiny sizes, CPU time.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import gfpo_kernels


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="smaller sizes")
    parser.add_argument("--rows", type=int, default=25, help="rows of the table")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    B, T, H, V = (
        ((16, 256, 2048, 151936) if args.fast else (32, 512, 4096, 151936))
        if cuda
        else (2, 8, 32, 500)
    )
    g = torch.Generator(device=device).manual_seed(0)
    hidden = (
        (torch.randn(B, T, H, generator=g, device=device) / H**0.5)
        .to(dtype)
        .requires_grad_()
    )
    weight = torch.randn(V, H, generator=g, device=device).to(dtype).requires_grad_()
    target = torch.randint(0, V, (B, T), generator=g, device=device)
    mask = (torch.rand(B, T, generator=g, device=device) < 0.9).float()
    adv = torch.randn(B, generator=g, device=device)

    def step():
        loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, adv)
        loss.backward()
        hidden.grad = weight.grad = None

    for _ in range(
        2
    ):  # warm-up: Triton compilation and cuBLAS handles stay out of the trace
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(
        f"fused_linear_grpo_loss fwd+bwd, 3 steps, B={B} T={T} H={H} V={V} {dtype} on {device}"
    )
    if cuda:
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print(
        prof.key_averages().table(
            sort_by=sort, row_limit=args.rows, max_name_column_width=60
        )
    )
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr, 0) for e in events)
    gemm = sum(
        getattr(e, attr, 0)
        for e in events
        if any(s in e.key.lower() for s in ("gemm", "mm", "matmul", "cutlass", "nvjet"))
    )
    if total:
        print(
            f"share of self time in GEMM-like ops: {gemm / total:.1%}; the rest ({(total - gemm) / total:.1%}) is row kernels, copies, reductions"
        )


if __name__ == "__main__":
    main()
