"""Writes tests/data/adaptive_state_tdigest_0.1.0.json (a gfpo_state.json as gfpo 0.1.0 saved it, digest by tdigest
0.5.2.2) and tests/data/adaptive_state_tdigest_0.1.0.expected.json (what that release computed after resuming from
it). It runs only at a commit whose gfpo_trainer/adaptive.py still uses tdigest (07f0174 wrote the committed files),
from the repository root: `.venv/bin/python tests/data/make_adaptive_state_tdigest.py`. tests/test_adaptive.py checks
that later code resumes from these files."""

import json
import os
import shutil
import tempfile
import types

import torch

from gfpo_trainer.adaptive import AdaptiveDifficulty
from gfpo_trainer.state import STATE_FILE, load_gfpo_state, save_gfpo_state

OUT = tempfile.mkdtemp()
STEPS = 60


def stream(steps):
    """Group mean rewards of `steps` generation batches of 64 groups, skewed (quartiles 1/16, 1/4, 9/16)."""
    g = torch.Generator().manual_seed(36)
    return [torch.rand(64, generator=g) ** 2 for _ in range(steps)]


def trainer_like(adaptive):
    """What save_gfpo_state / load_gfpo_state read of a GFPOTrainer."""
    return types.SimpleNamespace(args=types.SimpleNamespace(should_save=True, output_dir=OUT),
                                 state=types.SimpleNamespace(global_step=STEPS), adaptive_difficulty=adaptive,
                                 _get_output_dir=lambda trial: OUT)


batches = stream(STEPS + 1)
adaptive = AdaptiveDifficulty([6, 4, 3, 2])
for means in batches[:STEPS]:
    adaptive.update_and_assign(means)
save_gfpo_state(trainer_like(adaptive))
checkpoint = os.path.join(OUT, f"checkpoint-{STEPS}")
resumed = AdaptiveDifficulty([6, 4, 3, 2])
load_gfpo_state(trainer_like(resumed), checkpoint)
loaded = {"n": resumed.digest.n, "num_centroids": len(resumed.digest),
          "quartile_thresholds_after_load": list(resumed.quartile_thresholds())}
_, k = resumed.update_and_assign(batches[STEPS])
assert torch.equal(k, adaptive.update_and_assign(batches[STEPS])[1])  # the resumed run picks what the straight one does
expected = {
    "written_by": "gfpo 0.1.0 at commit 07f0174 (tdigest 0.5.2.2), save_gfpo_state after 60 update_and_assign calls",
    "stream": "torch.Generator().manual_seed(36); 61 batches of torch.rand(64, generator=g) ** 2; the first 60 fed",
    **loaded,
    "next_batch_k": k.tolist(),
}
with open("tests/data/adaptive_state_tdigest_0.1.0.expected.json", "w") as file:
    items = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in expected.items()]
    file.write("{\n" + ",\n".join(items) + "\n}\n")
shutil.copy(os.path.join(checkpoint, STATE_FILE), "tests/data/adaptive_state_tdigest_0.1.0.json")
shutil.rmtree(OUT)
