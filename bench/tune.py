"""Sweeps the kernels' tuning knobs and prints a table and the best value of each (CUDA only; --fast: fewer
values). Knobs are module attributes read at call time, set here and restored after each sweep, and the fused loss's
plan limits, passed in through gfpo_kernels.chunk_plan.planning:

- gfpo_kernels.group_ops_triton._TILE_ELEMENTS: elements per program of the group kernel (4096x16, 8192x64);
- gfpo_kernels.linear_grpo_triton.BLOCK_V (and NUM_WARPS when the module has one): the row kernels' block;
- gfpo_kernels.linear_grpo_triton._TARGET_PROGRAMS: how finely the log-prob pass cuts a 256-row stage's vocabulary;
- gfpo_kernels.chunk_plan.PlanLimits.stage_rows and buffer_share_of_weight: the fused loss's rows per projection
  stage and the share of the LM head's size its buffers take (fewer, longer chunks), at the benchmark's inputs (both
  masks), with each value's peak extra memory and the cost model's predicted time and peak beside its time. Without
  CUDA the predictions alone.

Times are medians of triton.testing.do_bench (CUDA events). Each value is checked against the default's output
first, so a knob that breaks the result is reported, not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types

import torch


def _median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _peak_extra_gib(fn) -> float:
    """GiB allocated by one call of fn beyond what was allocated before it (its outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _copied(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_copied(x) for x in out)
    return out


def _sweep(title, module, attr, values, make_fn, check, key=None, peak_memory=False, predict=None):
    """Times make_fn() for each value of module.attr (or module.attr[key]); restores the default. peak_memory: the
    note column gives each value's peak extra memory; predict(): a string (the cost model's numbers) beside it."""
    # a dict entry may be absent (the fused loss's _CHUNK_BYTES: absent = derived from free memory)
    default = getattr(module, attr) if key is None else getattr(module, attr).get(key)
    # a copy: a kernel writing into a preallocated buffer (out=) would otherwise be compared with itself
    reference_out = _copied(make_fn()())
    rows = []
    try:
        for value in values:
            if key is None:
                setattr(module, attr, value)
            else:
                getattr(module, attr)[key] = value
            fn = make_fn()
            try:
                check(fn(), reference_out)
                note = f"peak extra {_peak_extra_gib(fn):.2f} GiB" if peak_memory else ""
                if predict is not None:
                    note += f"; {predict()}"
                rows.append((value, _median_ms(fn), note))
            except Exception as exc:  # noqa: BLE001  (a value that fails, a Triton compile error too, is a finding)
                rows.append(
                    (value, float("nan"), f"{type(exc).__name__}: {str(exc)[:60]}")
                )
    finally:
        if key is None:
            setattr(module, attr, default)
        elif default is None:
            getattr(module, attr).pop(key, None)
        else:
            getattr(module, attr)[key] = default
    print(f"\n## {title} (default {default})")
    print("| value | median ms | note |\n|---|---|---|")
    for value, ms, note in rows:
        print(
            f"| {value}{' (default)' if value == default else ''} | {ms:.4f} | {note} |"
        )
    timed = [r for r in rows if r[1] == r[1]]
    if timed:
        best = min(timed, key=lambda r: r[1])
        base = next((r[1] for r in timed if r[0] == default), float("nan"))
        print(f"best: {best[0]} at {best[1]:.4f} ms ({base / best[1]:.2f}x vs default)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer values and sizes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/tune.py: no CUDA device; the knobs are tuned only on a GPU (nothing timed). The cost model's "
              "predictions for the fused loss's plan constants:")
        _fused_loss_sweeps(args.fast)
        return
    import gfpo_kernels
    from gfpo_kernels import fused_linear_grpo as flg
    from gfpo_kernels import group_ops_triton as got
    from gfpo_kernels import linear_grpo_triton as lgt

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    g = torch.Generator(device="cuda").manual_seed(0)

    def same_group(out, want):
        assert torch.equal(out[0], want[0]) and torch.allclose(
            out[1], want[1], rtol=1e-5, atol=1e-6
        )

    for n, G in [(4096, 16), (8192, 64)]:
        rewards = torch.rand(n * G, generator=g, device="cuda")
        lengths = torch.randint(16, 4096, (n * G,), generator=g, device="cuda").float()

        def make(rewards=rewards, lengths=lengths, G=G):
            def fn():
                with gfpo_kernels.use_backend("triton"):
                    return gfpo_kernels.gfpo_filter_advantages(
                        rewards, lengths, G, G // 2, largest=False, scale="batch"
                    )

            return fn

        tiles = (
            [256, 1024, 4096] if args.fast else [128, 256, 512, 1024, 2048, 4096, 8192]
        )
        _sweep(
            f"group kernel _TILE_ELEMENTS at {n}x{G}",
            got,
            "_TILE_ELEMENTS",
            tiles,
            make,
            same_group,
        )

    n_rows, V = (1024, 151936) if args.fast else (4096, 151936)
    logits = torch.randn(n_rows, V, generator=g, device="cuda") * 3
    targets = torch.randint(0, V, (n_rows,), generator=g, device="cuda")
    upstream = torch.randn(n_rows, generator=g, device="cuda")

    def same_rows(out, want):
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    def make_fwd():
        return lambda: lgt.logprob_entropy_triton(logits, targets, 1.0)

    lse = make_fwd()()[2] if len(make_fwd()()) > 2 else None
    blocks = [512, 1024, 4096] if args.fast else [256, 512, 1024, 2048, 4096, 8192]
    _sweep(
        f"row kernel BLOCK_V, log-prob+entropy pass, {n_rows}x{V}",
        lgt,
        "BLOCK_V",
        blocks,
        make_fwd,
        same_rows,
    )
    if lse is not None:

        half = torch.empty(n_rows, V, dtype=torch.bfloat16, device="cuda")

        def make_bwd():  # as the bf16 fused loss runs it: rounded into the gradient GEMMs' operand buffer
            return lambda: (
                lgt.grad_logits_triton(logits, targets, lse, upstream, 1.0, out=half),
            )

        _sweep(
            f"row kernel BLOCK_V, grad-logits pass, {n_rows}x{V}",
            lgt,
            "BLOCK_V",
            blocks,
            make_bwd,
            same_rows,
        )
    # the log-prob pass at the fused loss's stage size (256 rows at H=4096): vocabulary spans per row
    stage_logits, stage_targets = logits[:256], targets[:256]
    _sweep(
        f"log-prob pass _TARGET_PROGRAMS at 256x{V} (256: one program a row)",
        lgt,
        "_TARGET_PROGRAMS",
        [256, 1024, 2048, 8192] if args.fast else [256, 512, 1024, 2048, 4096, 8192],
        lambda: lambda: lgt.logprob_entropy_triton(stage_logits, stage_targets, 1.0),
        same_rows,
    )
    if hasattr(lgt, "NUM_WARPS"):
        _sweep(
            "row kernels NUM_WARPS (log-prob pass)",
            lgt,
            "NUM_WARPS",
            [2, 4, 8, 16],
            make_fwd,
            same_rows,
        )
    else:
        print(
            "\n(linear_grpo_triton has no NUM_WARPS attribute: the row kernels use Triton's default warps)"
        )

    _fused_loss_sweeps(args.fast)
    sys.stdout.flush()


# the fused loss's plan limits (gfpo_kernels.chunk_plan.PlanLimits fields), each value with the cost model's
# prediction beside it
LOSS_KNOBS = {
    "stage_rows": ([256, 512, 1024], [128, 256, 384, 512, 768, 1024]),
    "buffer_share_of_weight": ([0.5, 1.0, 2.0], [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]),
}


def _plan_limits(knobs):
    """The PlanLimits the knobs (a namespace of its fields, which _sweep sets) say."""
    from gfpo_kernels.chunk_plan import PlanLimits

    return PlanLimits(**vars(knobs))


def _predicted(knobs, B, T, H, V, n) -> str:
    """The cost model's time and peak for the plan the loss makes with the limits as set, H100 constants."""
    import fused_loss_cost as cost

    plan = cost.current_plan(n, B * T, H, V, limits=_plan_limits(knobs))
    c = cost.fused_loss(plan, n, B * T, H, V, backward=True)
    return (f"model {c.time_s * 1e3:.1f} ms, {c.peak_bytes / 2**30:.2f} GiB "
            f"({len(plan.chunk_layout(n))} chunks, stages of {plan.stage_rows})")


def _fused_loss_sweeps(fast: bool) -> None:
    """The fused loss's plan constants at the benchmark's inputs (bench/test_bench_linear_grpo.py, both masks),
    forward+backward: measured time and peak extra memory beside the cost model's prediction. Without CUDA only
    the predictions are printed."""
    from gfpo_kernels.chunk_plan import DEFAULT_LIMITS, planning

    knobs = types.SimpleNamespace(**dataclasses.asdict(DEFAULT_LIMITS))
    B, T, H, V = (16, 256, 2048, 151936) if fast else (32, 512, 4096, 151936)
    on_gpu = torch.cuda.is_available()
    for mask_kind in ("ragged-ends", "grpo-lengths"):
        if on_gpu:
            import gfpo_kernels
            from test_bench_linear_grpo import LOSS, _inputs

            hidden, weight, target, mask, adv, _ = _inputs(B, T, H, V, mask_kind)
            hidden.requires_grad_()
            weight.requires_grad_()
            n = int(mask.sum())
        else:
            n = {"ragged-ends": 0.87335205078125, "grpo-lengths": 0.26458740234375}[mask_kind]
            n = round(n * B * T)  # the benchmark's masks at the goal shape

        def make_loss():
            limits = _plan_limits(knobs)

            def fn():
                with planning(limits=limits):
                    loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, adv, **LOSS)
                loss.backward()
                out = (loss.detach(), hidden.grad.float().norm(), weight.grad.float().norm())
                hidden.grad = weight.grad = None
                return out

            return fn

        def same_loss(out, want):
            for a, b in zip(out, want):
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)

        for knob, (few, many) in LOSS_KNOBS.items():
            title = f"fused loss {knob}, fwd+bwd, {mask_kind} (n={n}), B={B} T={T} H={H} V={V} bf16"
            if on_gpu:
                _sweep(title, knobs, knob, few if fast else many, make_loss, same_loss, peak_memory=True,
                       predict=lambda: _predicted(knobs, B, T, H, V, n))
                continue
            default = getattr(knobs, knob)
            print(f"\n## {title} (default {default}): predictions only, no CUDA device")
            try:
                for value in few if fast else many:
                    setattr(knobs, knob, value)
                    print(f"| {value}{' (default)' if value == default else ''} | "
                          f"{_predicted(knobs, B, T, H, V, n)} |")
            finally:
                setattr(knobs, knob, default)


if __name__ == "__main__":
    main()
