"""Turns a pytest-benchmark JSON into a markdown table of ratios and a PNG plot, next to the JSON.

    python bench/report.py bench/results/2026-11-22-cpu-x86_64-2cores-abc1234.json

For every benchmark group: each implementation's median time, and its ratio to every other implementation of
the group (">1" = the row is slower than the column), plus the extra_info each case recorded (peak memory,
TFLOP/s). The header names the device, versions, commit and date of the run.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path


def _impl(bench: dict) -> str:
    """The implementation of a case: "empty-launch" for the launch floor, its 'impl'/'use_kernels' parameter, else
    the test name's bracket."""
    if bench["name"].startswith("test_empty_launch"):  # its only parameter is the size of its group
        return "empty-launch"
    params = bench.get("params") or {}
    for key in ("impl", "use_kernels"):
        if key in params:
            value = params[key]
            return {False: "reference", True: "gfpo-kernels"}.get(value, str(value)) if key == "use_kernels" else value
    match = re.search(r"\[(.*)\]", bench["name"])
    return match.group(1) if match else bench["name"]


def _fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def groups_of(data: dict) -> dict[str, dict[str, dict]]:
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        groups[bench.get("group") or bench["name"]][_impl(bench)] = bench
    return dict(groups)


def markdown(data: dict) -> str:
    info, commit = data.get("machine_info", {}), data.get("commit_info", {})
    lines = [
        f"# Benchmarks: {info.get('device', info.get('node', '?'))}",
        "",
        f"- date: {data.get('datetime', '?')}",
        f"- commit: {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in (info.get('versions') or {}).items())}",
        "",
        "Median times; `a / b` is how many times longer implementation a takes than b.",
    ]
    for group, cases in groups_of(data).items():
        names = list(cases)
        extra_keys = sorted({k for c in cases.values() for k in (c.get("extra_info") or {})})
        lines += ["", f"## {group}", ""]
        header = ["implementation", "median"] + [f"/ {n}" for n in names] + extra_keys
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for name in names:
            median = cases[name]["stats"]["median"]
            ratios = [f"{median / cases[other]['stats']['median']:.2f}x" for other in names]
            extras = []
            for key in extra_keys:
                value = (cases[name].get("extra_info") or {}).get(key)
                extras.append("-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value))
            lines.append("| " + " | ".join([name, _fmt_time(median)] + ratios + extras) + " |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = groups_of(data)
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 1.2 + 0.45 * sum(len(c) for c in groups.values())),
                             squeeze=False)
    for ax, (group, cases) in zip(axes[:, 0], groups.items()):
        names = list(cases)
        medians = [cases[n]["stats"]["median"] for n in names]
        fastest = min(medians)
        bars = ax.barh(names, [m / fastest for m in medians])
        for bar, median in zip(bars, medians):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {_fmt_time(median)}", va="center",
                    fontsize=7)
        ax.set_xlim(0, max(m / fastest for m in medians) * 1.25)
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("median time / fastest", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(data.get("machine_info", {}).get("device", ""), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # room for the title above the first plot
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="a pytest-benchmark --benchmark-json file")
    options = parser.parse_args(argv)
    data = json.loads(options.json.read_text())
    options.json.with_suffix(".md").write_text(markdown(data))
    plot(data, options.json.with_suffix(".png"))
    print(f"wrote {options.json.with_suffix('.md')} and {options.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
