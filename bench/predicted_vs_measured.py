"""The cost model's predictions beside a GPU run's measurements of the fused loss: every GPU run checks the model
again, and it is recalibrated where it was wrong.

    python bench/predicted_vs_measured.py bench/results/<date>-<gpu>-<commit>.json [--plan current|cec7c50]

For every linear_grpo case of the results JSON (bench/test_bench_linear_grpo.py: gfpo and trl, forward and
forward+backward, each mask), the measured median time and peak extra memory beside the model's (H100 constants,
bench/fused_loss_cost.py), their ratio, and a flag where the model misses by more than its tolerances (15% in
time, 3% in memory; tests/test_fused_loss_cost.py holds it to those on the cec7c50 run). The gfpo rows are predicted
for the plan the loss makes now (--plan current; the default unless the JSON's commit is cec7c50, whose plan the
model also knows). Each case's scored tokens come from its scored_fraction; the run's first case paid the process's
cuBLAS workspace (32 MiB), which the model adds there. Cases at other shapes than the model's device were measured
on are printed too: the constants are the H100's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fused_loss_cost as cost  # noqa: E402

GROUP = re.compile(r"linear_grpo (forward\+backward|forward) (\S+) N(\d+)-H(\d+)-V(\d+) (\w+)")
TIME_TOLERANCE, MEMORY_TOLERANCE = 0.15, 0.03


def rows(data: dict, plan: str) -> list[dict]:
    """One row per gfpo/trl case of the JSON: measured and predicted time and peak."""
    out, first = [], True
    for bench in data["benchmarks"]:
        match = GROUP.fullmatch(bench.get("group") or "")
        impl = (bench.get("params") or {}).get("impl")
        if not match or impl not in ("gfpo", "trl"):
            first = first and not match
            continue
        passes, mask, positions, H, V, dtype = match.groups()
        positions, H, V = int(positions), int(H), int(V)
        info = bench.get("extra_info") or {}
        n = round(info.get("scored_fraction", 1.0) * positions)
        backward = passes == "forward+backward"
        operand_bytes = 4 if dtype == "float32" else 2
        shape = dict(positions=positions, H=H, V=V, operand_bytes=operand_bytes, first_gemm=first)
        if impl == "trl":
            predicted = cost.trl_chunked_head(n, backward=backward, **shape)
        else:
            loss_plan = (cost.cec7c50_plan(n, V, operand_bytes) if plan == "cec7c50"
                         else cost.current_plan(n, positions, H, V, operand_bytes=operand_bytes))
            predicted = cost.fused_loss(loss_plan, n, backward=backward, **shape)
        first = False
        out.append(dict(case=f"{impl} {passes} {mask} N{positions} H{H} V{V} {dtype} (n={n})",
                        time=bench["stats"]["median"], predicted_time=predicted.time_s,
                        peak=info.get("peak_extra_memory_GiB"), predicted_peak=predicted.peak_bytes / cost.GiB))
    return out


def table(data: dict, plan: str) -> str:
    lines = ["| case | measured | model | model / measured | peak measured | peak model | model / measured |",
             "|---|---|---|---|---|---|---|"]
    misses = 0
    for r in rows(data, plan):
        t_ratio = r["predicted_time"] / r["time"]
        t_flag = "" if abs(t_ratio - 1) <= TIME_TOLERANCE else " MISS"
        if r["peak"] is None:
            peak, p_ratio, p_flag = "-", "-", ""
        else:
            ratio = r["predicted_peak"] / r["peak"] if r["peak"] else float("inf")
            peak, p_ratio = f"{r['peak']:.2f} GiB", f"{ratio:.3f}"
            p_flag = "" if abs(ratio - 1) <= MEMORY_TOLERANCE else " MISS"
        misses += bool(t_flag or p_flag)
        lines.append(f"| {r['case']} | {r['time'] * 1e3:.2f} ms | {r['predicted_time'] * 1e3:.2f} ms | "
                     f"{t_ratio:.3f}{t_flag} | {peak} | {r['predicted_peak']:.2f} GiB | {p_ratio}{p_flag} |")
    lines.append(f"\n{misses} case(s) outside the model's tolerances ({TIME_TOLERANCE:.0%} time, "
                 f"{MEMORY_TOLERANCE:.0%} memory); constants: {cost.H100.name} (bench/fused_loss_cost.py)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a pytest-benchmark JSON holding bench/test_bench_linear_grpo.py cases")
    parser.add_argument("--plan", choices=("current", "cec7c50"), help="the plan the gfpo cases ran (default: "
                        "cec7c50 for that commit's JSON, else the loss's plan now)")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    commit = (data.get("commit_info") or {}).get("id", "")
    plan = args.plan or ("cec7c50" if commit.startswith("cec7c50") else "current")
    print(f"# Cost model vs {Path(args.results).name} (commit {commit[:12] or '?'}, gfpo plan: {plan})\n")
    print(table(data, plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
