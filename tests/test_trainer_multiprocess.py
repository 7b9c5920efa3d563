"""Two CPU processes (torchrun, gloo): groups straddle processes; every process must run equal micro-batches
holding exactly the global top-k rows, and training must not hang. The scenarios the selected tests read run in one
launch of the worker (the `runs` fixture): each test marks the scenarios it reads."""

import json

import pytest
import torch

from gfpo_test_utils import launch_cpu_workers

pytest.importorskip("trl")

from gfpo_kernels import reference as ref  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402


# what the worker runs (tests/mp_gfpo_worker.py): name -> use_gfpo_kernels, gfpo_stop_dropped_generations, variant
SCENARIOS = {
    "plain": ("0", "0", "none"),
    "kernels": ("1", "0", "none"),
    "stop": ("0", "1", "none"),
    "random_filter": ("0", "0", "random_filter"),
    "skip_on": ("0", "0", "skip_on"),
    "skip_off": ("0", "0", "skip_off"),
    # loss_includes_rejected, with gfpo_stop_dropped_generations left on (the option turns it off)
    "rejected_skip": ("0", "1", "rejected_skip"),
    "rejected_skip_kernels": ("1", "1", "rejected_skip"),
    "rejected_kl": ("0", "1", "rejected_kl"),
    "rejected_kl_kernels": ("1", "1", "rejected_kl"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, warm_model_dir):
    """Every scenario that the selected tests of this module read (their `scenarios` marks), run in one launch of
    two processes; scenario name -> the two processes' results."""
    wanted = sorted({name for item in request.session.items if item.module is request.module
                     for mark in item.iter_markers("scenarios") for name in mark.args})
    out_dir = tmp_path_factory.mktemp("multiprocess")
    specs = [":".join((name, *SCENARIOS[name])) for name in wanted]
    launch_cpu_workers("mp_gfpo_worker.py", 2, out_dir, warm_model_dir, *specs, timeout=900)
    return {name: [json.loads((out_dir / name / f"rank{r}.json").read_text()) for r in range(2)] for name in wanted}


@pytest.fixture(scope="module")
def warm_model_dir(tmp_path_factory):
    """Warmed up on pair sums with filler so completions end at varied lengths (early stopping has work to do)."""
    from gfpo_trainer.tiny import warm_up_on_pair_sums

    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer)
    warm_up_on_pair_sums(model, tokenizer, [(a, b) for a in range(10) for b in range(10)], 80, "cpu")
    path = tmp_path_factory.mktemp("warm-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _check_global_top_k(results):
    # every process holds the same number of rows, and ran the same number of steps without hanging
    assert results[0]["num_rows"] == results[1]["num_rows"] == 5  # 3 groups x k=3 = 9 kept -> 5 + 5 (one pad)
    assert results[0]["train_steps"] == results[1]["train_steps"] == 2
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)
    # together they hold exactly the global top-k, in global order, with advantages over the kept rows
    all_ids, all_rewards = results[0]["all_ids"], torch.tensor(results[0]["all_rewards"])
    assert results[1]["all_ids"] == all_ids and len(all_ids) == 24
    lengths = torch.tensor([len(x) for x in all_ids], dtype=torch.float32)
    keep, adv = ref.gfpo_filter_advantages(all_rewards, lengths, 8, 3, largest=False)
    kept = keep.nonzero().squeeze(1).tolist()
    assert results[0]["rows"] + results[1]["rows"] == [all_ids[i] for i in kept]
    got_adv = torch.tensor(results[0]["advantages"] + results[1]["advantages"])
    torch.testing.assert_close(got_adv, adv[keep], rtol=1e-5, atol=1e-6)
    # the deferred reference-model pass ran on each process's kept rows only
    assert [r["logp_rows"] for r in results] == [5, 4]


@pytest.mark.parametrize("scenario", [pytest.param(name, marks=pytest.mark.scenarios(name))
                                      for name in ("plain", "kernels")])
def test_two_processes_straddling_groups(runs, scenario):
    _check_global_top_k(runs[scenario])


@pytest.mark.scenarios("plain", "stop")
def test_early_stop_changes_nothing_across_processes(runs):
    """Groups straddle the two processes; the rule (on by default with the length filter) stops dropped
    completions early, and the kept rows, advantages, reference log-probs and training losses are identical."""
    off, on = runs["plain"], runs["stop"]
    _check_global_top_k(on)
    for a, b in zip(on, off):
        for key in ("rows", "advantages", "ref_logps", "losses"):
            assert a[key] == b[key], key
    assert max(r["stopped_early"] for r in on) > 0
    assert sum(map(len, on[0]["all_ids"])) < sum(map(len, off[0]["all_ids"]))
    # TRL's reward and completion metrics describe the global kept rows, the same on both processes, rule on or off
    assert on[0]["trl_metrics"] == on[1]["trl_metrics"] == off[0]["trl_metrics"] == off[1]["trl_metrics"]
    lengths = torch.tensor([len(x) for x in off[0]["all_ids"]], dtype=torch.float32)
    keep = ref.group_topk_mask(lengths, 8, 3, largest=False)
    kept_rewards = torch.tensor(off[0]["all_rewards"])[keep]
    assert on[0]["trl_metrics"]["reward"] == pytest.approx(kept_rewards.mean().item(), rel=1e-5)
    assert on[0]["trl_metrics"]["completions/mean_length"] == pytest.approx(lengths[keep].mean().item())


@pytest.mark.scenarios("random_filter")
def test_non_deterministic_filter_func_gives_one_selection(runs):
    """group_filter_func draws different random scores on each process; it is called on the main process only and
    its scores are shared, so together the processes train exactly the top-k of those scores."""
    results = runs["random_filter"]
    assert len(results[0]["filter_scores"]) == 1 and results[1]["filter_scores"] == []
    scores = torch.tensor(results[0]["filter_scores"][0]).flatten()
    keep = ref.group_topk_mask(scores, 8, 3)
    all_ids = results[0]["all_ids"]
    assert results[0]["rows"] + results[1]["rows"] == [all_ids[i] for i in keep.nonzero().squeeze(1).tolist()]
    assert results[0]["train_steps"] == results[1]["train_steps"] == 2


@pytest.mark.scenarios("skip_on", "skip_off")
def test_skipping_zero_gradient_rows_across_processes(runs):
    """Two processes, a zero-variance group straddling them: skipping its rows trains the same parameters (each
    process's gradient is weighted against the global row count, so DDP's average is unchanged). One generation
    batch: a later one samples differently, since TRL's shuffle draws a permutation of the rows it was given."""
    on, off = runs["skip_on"], runs["skip_off"]
    assert on[0]["skipped"][0] > 0 and off[0]["skipped"] == [None]
    assert on[0]["num_rows"] < off[0]["num_rows"]
    for a, b in zip(on, off):
        torch.testing.assert_close(torch.tensor(a["parameters"]), torch.tensor(b["parameters"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scenario", [pytest.param(name, marks=pytest.mark.scenarios(name)) for name in (
    "rejected_skip", "rejected_skip_kernels", "rejected_kl", "rejected_kl_kernels")])
def test_loss_includes_rejected_equals_trls_loss_over_every_row(runs, scenario):
    """loss_includes_rejected on two processes, groups straddling them: the loss and gradients (averaged over the
    processes, as DDP does) equal TRL's GRPOTrainer's over every row with GFPO's advantages, the rejected at 0. Beta
    0: only the kept rows of nonzero advantage are trained (rebalanced across the processes, padded, weighted);
    beta 0.04: every row is trained. The early-stop rule is off."""
    results = runs[scenario]
    for r in results:
        assert r["stopped_early"] is None
        assert r["num_items_in_batch"] == sum(map(len, r["all_ids"]))  # every sampled completion's tokens
        assert r["gfpo_loss"] == pytest.approx(r["trl_loss"], rel=1e-5, abs=1e-6)
        torch.testing.assert_close(torch.tensor(r["gfpo_grads"]), torch.tensor(r["trl_grads"]), rtol=1e-4, atol=1e-6)
        assert max(map(abs, r["trl_grads"])) > 0
    if scenario.startswith("rejected_skip"):
        assert sum(r["n_real"] for r in results) <= 9 and results[0]["num_rows"] < 12  # the kept rows only
    else:
        assert [r["n_real"] for r in results] == [12, 12]
