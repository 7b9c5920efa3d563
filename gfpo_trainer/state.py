"""GFPO state that outlives a step (today: the adaptive-difficulty digest), saved with every checkpoint.

Saved by a TrainerCallback's `on_save` next to the model in `checkpoint-N/gfpo_state.json`, and restored by
`GFPOTrainer.train(resume_from_checkpoint=...)` before training resumes: both public transformers surfaces, so a
resumed run selects exactly as the run that did not stop.
"""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

STATE_FILE = "gfpo_state.json"


def gfpo_state(trainer) -> dict:
    """Every piece of GFPO state of `trainer`, as JSON-able data."""
    state = {}
    if trainer.adaptive_difficulty is not None:
        state["adaptive_difficulty"] = trainer.adaptive_difficulty.state_dict()
    return state


class SaveGFPOState(TrainerCallback):
    """Writes gfpo_state.json into each checkpoint folder the Trainer saves."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as file:
                json.dump(gfpo_state(self.trainer), file)
        return control


def load_gfpo_state(trainer, resume_from_checkpoint) -> None:
    """Restores what SaveGFPOState wrote (resume_from_checkpoint: a folder, True for the last one, or None)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return
    folder = get_last_checkpoint(trainer.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    path = os.path.join(folder, STATE_FILE) if folder else None
    if path is None or not os.path.isfile(path):
        if trainer.adaptive_difficulty is not None:
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: no {STATE_FILE} in {folder!r}, so "
                             "the adaptive-difficulty digest cannot be restored (was it saved by GFPOTrainer?)")
        return
    with open(path) as file:
        state = json.load(file)
    if trainer.adaptive_difficulty is not None:
        trainer.adaptive_difficulty.load_state_dict(state["adaptive_difficulty"])
