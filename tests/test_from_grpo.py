"""docs/from-grpo.md: the diff it shows is exactly the diff of its two scripts, it changes only the class names and
adds the two fields, and the two scripts, run (two steps), log what the page says: the same TRL metrics under the
same names, and the gfpo/ ones besides, which only the GFPO script logs."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from test_readme_examples import code_blocks, prose, runnable

PAGE = Path(__file__).parents[1] / "docs" / "from-grpo.md"
GRPO_SCRIPT, GFPO_SCRIPT = code_blocks(PAGE, "python")
(SHOWN_DIFF,) = code_blocks(PAGE, "text")


def test_the_shown_diff_is_the_diff_of_the_two_scripts():
    diff = difflib.unified_diff(GRPO_SCRIPT.code.splitlines(), GFPO_SCRIPT.code.splitlines(), "grpo.py", "gfpo.py",
                                n=0, lineterm="")
    assert SHOWN_DIFF.code.rstrip("\n").splitlines() == list(diff)


def test_the_diff_is_the_two_class_names_and_the_two_fields():
    removed = [line[1:] for line in SHOWN_DIFF.code.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in SHOWN_DIFF.code.splitlines() if line.startswith("+") and not line.startswith("+++")]
    renamed = [line.replace("GRPOConfig", "GFPOConfig").replace("GRPOTrainer", "GFPOTrainer")
               .replace("from trl ", "from gfpo_trainer ") for line in removed]
    assert renamed == added[:2] + added[4:]  # the import, the config and the trainer: only the names change
    fields = [re.match(r"\s+(\w+)=", line).group(1) for line in added[2:4]]
    assert fields == ["num_remains_in_group", "group_filter"]
    assert "four changed lines" in prose(PAGE) and len(removed) == 3 and len(added) == 5


def _logs(block, tmp_path, monkeypatch):
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs_example__"}
    exec(compile(runnable(block), str(block), "exec"), namespace)
    return [log for log in namespace["trainer"].state.log_history if "reward" in log]


def test_both_scripts_run_and_log_what_the_page_says(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    grpo = _logs(GRPO_SCRIPT, tmp_path / "grpo", monkeypatch)
    gfpo = _logs(GFPO_SCRIPT, tmp_path / "gfpo", monkeypatch)
    assert len(grpo) == len(gfpo) == 1
    grpo, gfpo = grpo[0], gfpo[0]
    assert not [name for name in grpo if name.startswith("gfpo/")]
    assert set(grpo) <= set(gfpo)  # every TRL metric keeps its name
    named = set(re.findall(r"`(gfpo/[a-z_]+)`", PAGE.read_text()))
    logged_elsewhere = {"gfpo/dropped_completion_length"}  # the page: without the early-stop rule
    logged = {name for name in gfpo if name.startswith("gfpo/")}
    assert named - logged_elsewhere == logged, (named ^ logged) - logged_elsewhere  # the page names them all
    assert gfpo["gfpo/kept_fraction"] == 0.5  # k / G = 4 / 8
    # with the length filter TRL's reward and lengths describe the kept rows
    assert gfpo["reward"] == pytest.approx(gfpo["gfpo/kept_reward_mean"])
    assert gfpo["completions/mean_length"] == pytest.approx(gfpo["gfpo/kept_completion_length"])


def test_bf16_left_unset_runs_on_a_cpu_where_grpos_default_fails(tmp_path):
    """The page: without bf16=False the GFPO script would still run on a CPU; TRL's GRPOConfig fails there."""
    pytest.importorskip("trl")
    import torch
    from trl import GRPOConfig

    from gfpo_trainer import GFPOConfig

    if torch.cuda.is_available():
        pytest.skip("a CPU-only machine's defaults")
    args = GFPOConfig(output_dir=str(tmp_path), num_generations=8, num_remains_in_group=4, group_filter="length",
                      per_device_train_batch_size=32)
    assert args.bf16 is False
    with pytest.raises(ValueError, match="bf16"):
        GRPOConfig(output_dir=str(tmp_path), num_generations=8, per_device_train_batch_size=32)
