"""bench/report.py: the ratio table and the plot from a pytest-benchmark JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import report  # noqa: E402


def _bench(group, name, median, params=None, extra=None):
    return {"group": group, "name": name, "params": params or {}, "stats": {"median": median},
            "extra_info": extra or {}}


def test_report_table_and_plot(tmp_path):
    data = {
        "machine_info": {"device": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0", "triton": "3.6.0"}},
        "commit_info": {"id": "0123456789abcdef", "dirty": False},
        "datetime": "2026-11-22T06:00:00",
        "benchmarks": [
            _bench("loss N16", "test_loss[gfpo]", 0.010, {"impl": "gfpo"}, {"peak_extra_memory_GiB": 3.5}),
            _bench("loss N16", "test_loss[trl]", 0.015, {"impl": "trl"}, {"peak_extra_memory_GiB": 4.0}),
            _bench("step", "test_step[x]", 2e-6, {"use_kernels": True}),
        ],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    report.main([str(path)])
    md = (tmp_path / "run.md").read_text()
    assert "# Benchmarks: NVIDIA H100 80GB HBM3" in md and "commit: 0123456789ab" in md
    assert "torch 2.11.0, triton 3.6.0" in md
    assert "| gfpo | 10 ms | 1.00x | 0.67x | 3.5 |" in md
    assert "| trl | 15 ms | 1.50x | 1.00x | 4 |" in md
    assert "| gfpo-kernels | 2 us | 1.00x |" in md
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
