"""The stepwise answers of a study's final models apart: every step written or a term skipped, with filler or without.

    python scripts/study_answer_forms.py PIECE_DIR [PIECE_DIR ...] --output docs/demo/STEM-forms

Evaluates each piece's saved models again as its runs did (gfpo_study.study.reevaluate_final_models: the same
answers, checked against the recorded accuracy and length) and writes STEM.json (the figures per seed) and STEM.md (per
arm the mean over seeds with its 95% t-interval, and the paired difference to GRPO). Run with the thread count the
study ran with (OMP_NUM_THREADS=1 for the convergence study), or the answers differ and it stops saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gfpo_study.study import reevaluate_final_models  # noqa: E402
from gfpo_study.study_report import fmt, markdown_table  # noqa: E402
from gfpo_study.study_stats import figure  # noqa: E402

KEYS = {  # figure -> its column
    "stepwise_fraction": "stepwise share",
    "every_step_fraction": "stepwise answers writing every step",
    "accuracy_every_step": "accuracy: every step",
    "accuracy_steps_skipped": "accuracy: a step skipped",
    "filler_per_answer": "filler words per answer",
    "accuracy_stepwise_with_filler": "accuracy: stepwise with filler",
    "accuracy_stepwise_without_filler": "accuracy: stepwise without filler",
}
PAIRED = ("every_step_fraction", "accuracy_every_step", "accuracy_stepwise_without_filler")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pieces", nargs="+")
    parser.add_argument("--output", required=True, help="STEM: STEM.json and STEM.md are written")
    options = parser.parse_args(argv)
    results = sorted((r for piece in options.pieces for r in reevaluate_final_models(piece)), key=lambda r: r["seed"])
    arms = ["warm-up", *results[0]["arms"]]

    def final(result, name):
        return result["warm-up"] if name == "warm-up" else result["arms"][name]["final"]

    rows, summary = [], {}
    for name in arms:
        summary[name] = {key: figure([final(r, name)[key] for r in results], False) for key in KEYS}
        rows.append([name] + [fmt(summary[name][key], "{:.3f}") for key in KEYS])
        if name not in ("warm-up", "grpo"):
            for key in PAIRED:
                summary[name][f"{key}_minus_grpo"] = figure(
                    [None if final(r, name)[key] is None or final(r, "grpo")[key] is None
                     else final(r, name)[key] - final(r, "grpo")[key] for r in results], False)
    paired = [[name] + [fmt(summary[name][f"{key}_minus_grpo"], "{:+.3f}") for key in PAIRED]
              for name in arms if name not in ("warm-up", "grpo")]
    table = (markdown_table(["model", *KEYS.values()], rows) + "\n\n"
             + markdown_table(["arm", *(f"{KEYS[key]} - GRPO (paired)" for key in PAIRED)], paired))
    stem = Path(options.output)
    stem.with_suffix(".json").write_text(json.dumps({"pieces": options.pieces, "seed_results": results,
                                                     "summary": summary}, indent=1))
    stem.with_suffix(".md").write_text(f"Seeds {[r['seed'] for r in results]}; means over seeds and 95% t-intervals "
                                       f"(held-out, 8 samples a prompt, the final models).\n\n{table}\n")
    print(table)
    print(f"\nwritten: {stem.with_suffix('.json')}, {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
