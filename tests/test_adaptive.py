"""Adaptive difficulty's digest (gfpo_trainer/adaptive.py): its quartiles against exact quantiles within the
t-digest's bound, checkpoints in the `tdigest` package's format, the same k in every process, and a
checkpoint state that strict JSON readers take."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch

pytest.importorskip("fastdigest")

from gfpo_trainer.adaptive import MAX_CENTROIDS, QUARTILES, AdaptiveDifficulty  # noqa: E402
from gfpo_trainer.state import STATE_FILE, load_gfpo_state, save_gfpo_state  # noqa: E402

from gfpo_test_utils import subprocess_env  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
# the rank error the module docstring derives from fastdigest's size bound: within 3/d of q
RANK_ERROR = 3 / MAX_CENTROIDS


def skewed_stream(steps: int) -> list[torch.Tensor]:
    """The stream tests/data/make_adaptive_state_tdigest.py fed the tdigest-based digest: 64 group means a step,
    rand()**2."""
    g = torch.Generator().manual_seed(36)
    return [torch.rand(64, generator=g) ** 2 for _ in range(steps)]


def binary_reward_stream(steps: int) -> list[torch.Tensor]:
    """Group means of 8 completions with 0/1 rewards, each prompt with its own success rate: ties everywhere."""
    g = torch.Generator().manual_seed(7)
    return [torch.bernoulli(torch.rand(64, 1, generator=g).expand(64, 8), generator=g).mean(dim=1)
            for _ in range(steps)]


def trainer_like(adaptive, output_dir, step=60):
    """What save_gfpo_state and load_gfpo_state read of a GFPOTrainer."""
    return types.SimpleNamespace(args=types.SimpleNamespace(should_save=True, output_dir=str(output_dir)),
                                 state=types.SimpleNamespace(global_step=step), adaptive_difficulty=adaptive,
                                 gfpo_nonfinite_reward_groups_total=0,
                                 _get_output_dir=lambda trial: str(output_dir))


def exact_bracket(stream: torch.Tensor, q: float) -> tuple[float, float]:
    """The exact quantiles (torch.quantile) at q -/+ RANK_ERROR: where the digest's estimate at q must lie."""
    low, high = max(q - RANK_ERROR, 0.0), min(q + RANK_ERROR, 1.0)
    return tuple(torch.quantile(stream, torch.tensor([low, high], dtype=stream.dtype)).tolist())


@pytest.mark.parametrize("make_stream", [skewed_stream, binary_reward_stream], ids=["skewed", "binary-rewards"])
def test_quartiles_match_exact_quantiles_within_the_digest_bound(make_stream):
    adaptive = AdaptiveDifficulty([6, 4, 3, 2])
    batches = make_stream(200)  # 12800 means, past the digest's 1000 centroids: it merges
    seen = []
    for step, means in enumerate(batches):
        quartile, k = adaptive.update_and_assign(means)
        seen.append(means)
        if step % 40 == 39 or step == 10:
            stream = torch.cat(seen).double()
            thresholds = adaptive.quartile_thresholds()
            for q, estimate in zip(QUARTILES, thresholds):
                low, high = exact_bracket(stream, q)
                assert low <= estimate <= high, (step, q, estimate, low, high)
            # the k each group got follows from the thresholds: hardest quartile (lowest means) keeps most
            expected = sum((means.double() > t).long() for t in thresholds)
            assert torch.equal(quartile, expected) and torch.equal(k, torch.tensor([6, 4, 3, 2])[expected])
    assert len(adaptive.digest) < adaptive.digest.n_values == 200 * 64


def test_tdigest_format_checkpoint_resumes(tmp_path):
    """tests/data/adaptive_state_tdigest_0.1.0.json is gfpo_state.json as the tdigest-based digest (tdigest 0.5.2.2)
    saved it after 60 steps of skewed_stream; its .expected.json holds what that code computed after resuming."""
    checkpoint = tmp_path / "checkpoint-60"
    checkpoint.mkdir()
    shutil.copy(os.path.join(DATA, "adaptive_state_tdigest_0.1.0.json"), checkpoint / STATE_FILE)
    with open(os.path.join(DATA, "adaptive_state_tdigest_0.1.0.expected.json")) as file:
        expected = json.load(file)
    with open(checkpoint / STATE_FILE) as file:
        saved = json.load(file)["adaptive_difficulty"]["digest"]

    adaptive = AdaptiveDifficulty([6, 4, 3, 2])
    load_gfpo_state(trainer_like(adaptive, tmp_path), str(checkpoint))
    # the centroids as saved, in order: not re-inserted (that would merge them)
    assert adaptive.digest.centroids == [(c["m"], c["c"]) for c in saved["centroids"]]
    assert adaptive.digest.n_values == expected["n"] == 3840 and len(adaptive.digest) == expected["num_centroids"]
    assert adaptive.digest.max_centroids == MAX_CENTROIDS

    batches = skewed_stream(61)
    stream = torch.cat(batches[:60]).double()
    thresholds = adaptive.quartile_thresholds()
    # both digests' estimates from these centroids lie within the old digest's own centroid widths of the exact
    # quartiles (tdigest's delta=0.01 bounds a centroid by 4 * delta * q(1-q) of the ranks: 0.0075 at a quartile)
    for q, new, old in zip(QUARTILES, thresholds, expected["quartile_thresholds_after_load"]):
        low, high = torch.quantile(stream, torch.tensor([q - 0.0075, q + 0.0075], dtype=torch.double)).tolist()
        assert low <= new <= high and low <= old <= high, (q, new, old, low, high)
    # the resumed run's next step picks the k that the tdigest-based digest picked after the same resume
    _, k = adaptive.update_and_assign(batches[60])
    assert k.tolist() == expected["next_batch_k"]

    # and what this release saves from there loads back as the same digest
    save_gfpo_state(trainer_like(adaptive, tmp_path / "again", step=61))
    again = AdaptiveDifficulty([6, 4, 3, 2])
    load_gfpo_state(trainer_like(again, tmp_path / "again"), str(tmp_path / "again" / "checkpoint-61"))
    assert again.digest.centroids == adaptive.digest.centroids and again.digest.n_values == 3904


def test_state_is_strict_json_empty_or_not():
    """An empty digest's min and max are NaN in fastdigest's dict; json.dump would write the non-JSON token NaN."""
    adaptive = AdaptiveDifficulty([6, 4, 3, 2])
    for means in (torch.tensor([float("nan")]), torch.tensor([0.5, 0.25])):
        adaptive.update_and_assign(means)
        text = json.dumps(adaptive.state_dict(), allow_nan=False)
        restored = AdaptiveDifficulty([6, 4, 3, 2])
        restored.load_state_dict(json.loads(text))
        assert restored.digest.centroids == adaptive.digest.centroids
    assert adaptive.digest.centroids == [(0.25, 1.0), (0.5, 1.0)]


_CHILD = textwrap.dedent("""
    import json, random, sys, torch
    from gfpo_trainer.adaptive import AdaptiveDifficulty
    seed = int(sys.argv[1])
    random.seed(seed); torch.manual_seed(seed)  # TRL seeds each process differently
    g = torch.Generator().manual_seed(3)
    adaptive, ks = AdaptiveDifficulty([6, 4, 3, 2]), []
    for step in range(100):
        if step % (seed % 5 + 2) == 0:
            random.random(); torch.rand(3)  # other code drawing from the global generators, unevenly
        ks.append(adaptive.update_and_assign(torch.rand(64, generator=g))[1].tolist())
    print(json.dumps({"state": adaptive.state_dict(), "k": ks}))
""")


def test_every_process_picks_the_same_k():
    """Two Python processes (each its own hash seed and random seeds, as TRL's per-process set_seed gives) fed the
    same group means hold the same digest and pick the same k at every step."""
    runs = []
    for seed in (11, 12):
        env = {**subprocess_env(), "PYTHONHASHSEED": str(seed)}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(seed)], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout))
    assert len(runs[0]["state"]["digest"]["centroids"]) < 6400  # merged, not one centroid per mean
    assert runs[0] == runs[1]
