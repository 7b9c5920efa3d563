"""What a run prints besides its own lines: no warnings about defaults the config never set, none of TRL's calls to
transformers' deprecated names, and progress bars that stay small in a log file."""

import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("trl")
yaml = pytest.importorskip("yaml")

from gfpo_trainer.config import GFPOConfig  # noqa: E402
from gfpo_trainer.progress import NON_TERMINAL_REFRESH_S, progress_bar, refresh_interval  # noqa: E402

REPO = Path(__file__).parents[1]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bars_refresh_rarely_off_a_terminal():
    assert refresh_interval(io.StringIO()) == NON_TERMINAL_REFRESH_S
    assert refresh_interval(_Terminal()) is None
    log = io.StringIO()
    for _ in progress_bar(range(500), desc="steps", file=log):
        pass
    # drawn at the start and at the end only (500 updates in well under 30 s), where tqdm's 0.1 s draws many more
    assert log.getvalue().count("/500 [") == 2, log.getvalue()
    assert progress_bar(total=3, file=log, mininterval=0.5).mininterval == 0.5  # a given interval is kept
    assert progress_bar(total=3, file=_Terminal()).mininterval == 0.1  # tqdm's own on a terminal


def test_defaults_that_only_warn_are_set_quietly(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = GFPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    # TRL's default, under the name transformers reads now
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    import torch

    assert args.dataloader_pin_memory is torch.accelerator.is_available()  # pinning needs an accelerator
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):  # the config's own value
        GFPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_checkpointing=False)


def test_a_train_run_logged_to_a_file_is_quiet(tmp_path):
    """`train` with stderr to a file: no FutureWarning, no pin_memory warning, and the training bar drawn a few times
    for 12 steps logged at every step (tqdm redraws it at every metrics line and ten times a second)."""
    from gfpo_test_utils import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(8)))
    config = {"model": str(model), "dataset": "train.jsonl", "reward_funcs": ["gfpo_study.sums_task:correctness_reward"],
              "args": dict(output_dir="out", per_device_train_batch_size=4, num_generations=4, num_remains_in_group=2,
                           group_filter="length", max_completion_length=6, max_steps=12, logging_steps=1,
                           report_to="none", save_strategy="no")}  # no use_cpu: the data loader's own choice
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    with open(tmp_path / "stderr.txt", "w") as stderr, open(tmp_path / "stdout.txt", "w") as stdout:
        done = subprocess.run([sys.executable, "-m", "gfpo_trainer", "train", "--config", str(tmp_path / "run.yaml")],
                              stdout=stdout, stderr=stderr, timeout=600, cwd=REPO)
    err = (tmp_path / "stderr.txt").read_text()
    assert done.returncode == 0, err
    assert "Warning" not in err and "pin_memory" not in err, err
    assert 2 <= err.count("/12 [") <= 3, err  # start and end (and a redraw if the run took over 30 s)
    logged = [line for line in (tmp_path / "stdout.txt").read_text().splitlines() if line.startswith("{'loss'")]
    assert len(logged) == 12  # the metrics lines are all there
