"""GFPO state that outlives a step (the adaptive-difficulty digest, the run's count of groups dropped for a
non-finite reward), saved with every checkpoint.

Written into `checkpoint-N/gfpo_state.json` by GFPOTrainer._save_checkpoint after the Trainer's own save, where the
Trainer saves (`args.should_save`, the trial's output folder), as TRL writes its entropy-controller state; restored
by `GFPOTrainer.train(resume_from_checkpoint=...)` before training resumes, so a resumed run selects exactly as the
run that did not stop. The prompts' order is state too: TRL's sampler draws every epoch's order from one generator,
seeded once, which a resume in a later epoch would start afresh; replay_epoch_order makes each epoch's order a
function of the seed and the epoch (the order TRL draws), so a resumed run sees the prompts the run that did not stop
sees.
"""

from __future__ import annotations

import json
import os

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

STATE_FILE = "gfpo_state.json"


def gfpo_state(trainer) -> dict:
    """Every piece of GFPO state of `trainer`, as JSON-able data."""
    state = {"nonfinite_reward_groups_total": trainer.gfpo_nonfinite_reward_groups_total}
    if trainer.adaptive_difficulty is not None:
        state["adaptive_difficulty"] = trainer.adaptive_difficulty.state_dict()
    return state


def save_gfpo_state(trainer, trial=None) -> None:
    """Writes gfpo_state.json into the checkpoint folder the Trainer has just saved for step global_step."""
    if not trainer.args.should_save:
        return
    folder = os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATE_FILE), "w") as file:
        json.dump(gfpo_state(trainer), file)


def load_gfpo_state(trainer, resume_from_checkpoint) -> None:
    """Restores what save_gfpo_state wrote (resume_from_checkpoint: a folder, True for the last one, or None)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return
    folder = get_last_checkpoint(trainer.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    path = os.path.join(folder, STATE_FILE) if folder else None
    state = {}
    if path is not None and os.path.isfile(path):
        with open(path) as file:
            state = json.load(file)
    if trainer.adaptive_difficulty is not None:
        if "adaptive_difficulty" not in state:
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: {folder!r} holds no adaptive-difficulty state "
                f"in {STATE_FILE}, so the digest cannot be restored (was it saved by GFPOTrainer with "
                "adaptive_difficulty=True?)"
            )
        trainer.adaptive_difficulty.load_state_dict(state["adaptive_difficulty"])
    # a checkpoint written before the count was saved holds none: the run's total then counts from the resume
    trainer.gfpo_nonfinite_reward_groups_total = int(state.get("nonfinite_reward_groups_total", 0))


def replay_epoch_order(sampler):
    """Gives TRL's train sampler (RepeatSampler: one generator, seeded once, each `__iter__` drawing the next epoch's
    order) a `set_epoch(epoch)`, which the Trainer calls as every epoch starts, a resumed run's first one included:
    the generator is seeded again and the orders of epochs 0 .. epoch-1 are drawn and thrown away, as the run that
    did not stop drew them. Each epoch's order is then TRL's, resumed or not. Drawing an order runs `__iter__` up to
    its first index (TRL draws the whole order there): O(dataset) per epoch replayed, nothing kept.

    A sampler that does not shuffle, has no seed, or is not shaped so (a set_epoch of its own, no generator) is
    returned as it is. Returns `sampler`."""
    generator = getattr(sampler, "generator", None)
    if (not getattr(sampler, "shuffle", False) or getattr(sampler, "seed", None) is None
            or not isinstance(generator, torch.Generator) or hasattr(sampler, "set_epoch")):
        return sampler

    def set_epoch(epoch: int) -> None:
        generator.manual_seed(sampler.seed)
        for _ in range(epoch):
            next(iter(sampler), None)

    sampler.set_epoch = set_epoch
    return sampler
