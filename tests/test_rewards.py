"""Rewards that are not numbers (gfpo_trainer/rewards.py, docs/trainer.md "Rewards that are not numbers"): None and
NaN as TRL treats them, an infinite reward dropping its group (one warning naming the function and the prompt, the
logged count), and a reward function that raises, named in the error; with the length filter (its early stop on),
the token-efficiency filter and adaptive k, on the fused path and the reference path."""

import logging
import math

import pytest
import torch

pytest.importorskip("trl")

from test_early_stop import warm_model_dir  # noqa: E402,F401  (completions that end at varied lengths)
from test_trainer import PROMPTS, digit_reward, make_trainer, scored_batch  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

import gfpo_kernels  # noqa: E402
from gfpo_kernels import reference as ref  # noqa: E402
from gfpo_trainer.adaptive import AdaptiveDifficulty  # noqa: E402
from gfpo_trainer.filters import GROUP_FILTER_SPECS, FilterInputs  # noqa: E402
from gfpo_trainer.rewards import RewardFunctionError  # noqa: E402

G, K, GROUPS = 8, 3, 4
ADAPTIVE_K = [6, 4, 3, 2]
# the selections under test: a filter, with or without adaptive k
SETUPS = {
    "length": dict(group_filter="length"),
    "token_efficiency": dict(group_filter="token_efficiency"),
    "adaptive": dict(group_filter="token_efficiency", adaptive_difficulty=True, adaptive_num_remains=ADAPTIVE_K),
}
BAD_GROUP = 1  # the group that holds the bad reward


def shortest_of_group(completions, group):
    """The index (in the batch) of the group's shortest completion, the lower index on ties: a row every filter
    under test can keep."""
    rows = range(group * G, (group + 1) * G)
    return min(rows, key=lambda i: (len(completions[i]), i))


def varied_reward(completions, **kwargs):
    """digit_reward plus a step by position: no group of equal rewards (whose advantages would all be 0)."""
    return [r + 0.25 * (i % 4) for i, r in enumerate(digit_reward(completions))]


def reward_with(bad):
    """varied_reward, with `bad` (None, NaN, +-inf) for the shortest completion of BAD_GROUP."""
    def bad_reward(completions, **kwargs):
        rewards = varied_reward(completions)
        rewards[shortest_of_group(completions, BAD_GROUP)] = bad
        return rewards
    return bad_reward


def trl_advantages(rewards: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """TRL's sum_then_normalize advantages (scale_rewards="group") computed over the kept rows: NaN rewards take no
    part in the mean and std (nanmean, TRL's nanstd) and get 0, as do the rows not kept. In float64: a group of
    equal rewards then gets exactly 0, not float32's (ulp of the mean) / 1e-4."""
    kept = torch.where(keep, rewards.double(), torch.nan).view(-1, G)
    mean = torch.nanmean(kept, dim=1, keepdim=True)
    std = nanstd(kept, dim=1, keepdim=True)
    advantages = torch.nan_to_num((kept - mean) / (std + 1e-4), nan=0.0)
    return advantages.flatten().float()


def expected_selection(setup, rewards, lengths, stopped, use_kernels):
    """Kept mask and advantages of `rewards` (summed, NaN where unscorable) by the setup's filter, computed apart
    from the trainer: the filter's score, k fixed or from a fresh digest fed these groups' means."""
    spec = GROUP_FILTER_SPECS[SETUPS[setup]["group_filter"]]
    scores = spec.score(FilterInputs(rewards, lengths, stopped, G))
    if setup == "adaptive":
        k = AdaptiveDifficulty(ADAPTIVE_K).update_and_assign(torch.nanmean(rewards.view(-1, G), dim=1))[1]
    else:
        k = K
    ops = gfpo_kernels if use_kernels else ref
    return ops.gfpo_filter_advantages(rewards, scores, G, k, largest=spec.largest), (scores, k)


def trainer_of(warm_model_dir, tmp_path, **options):  # noqa: F811
    model_dir, tokenizer = warm_model_dir
    options = dict(per_device_train_batch_size=G * GROUPS, num_remains_in_group=K, max_completion_length=16) | options
    return make_trainer(model_dir, tokenizer, tmp_path, **options)


def run_batch(warm_model_dir, tmp_path, setup, bad, use_kernels, **overrides):  # noqa: F811
    trainer = trainer_of(warm_model_dir, tmp_path, reward=reward_with(bad), use_gfpo_kernels=use_kernels,
                         skip_zero_gradient_rows=False, **SETUPS[setup], **overrides)
    output, seen = scored_batch(trainer)
    batch = trainer._gfpo_batch
    lengths = torch.tensor([float(len(ids)) for ids in seen["ids"]])
    stopped = torch.zeros(G * GROUPS) if batch.stopped_rows is None else batch.stopped_rows.float()
    return trainer, output, seen, batch.selection, lengths, stopped


def assert_trains_finite(trainer, output):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, output)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)  # the other groups do train


def nonfinite_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "non-finite reward" in r.getMessage()]


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("bad", [math.inf, -math.inf], ids=["inf", "-inf"])
def test_an_infinite_reward_drops_its_group_only(warm_model_dir, tmp_path, setup, bad, use_kernels, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="gfpo_trainer"):
        trainer, output, seen, selection, lengths, stopped = run_batch(warm_model_dir, tmp_path, setup, bad,
                                                                       use_kernels)
    rewards = seen["rewards"][:, 0].clone()
    bad_row = shortest_of_group(seen["completions"], BAD_GROUP)
    assert rewards[bad_row].item() == bad and torch.isfinite(rewards[torch.arange(G * GROUPS) != bad_row]).all()
    if setup == "length":
        assert stopped.any()  # the early-stop rule ran
    # the bad group trains nothing
    in_bad = (torch.arange(G * GROUPS) // G) == BAD_GROUP
    assert selection.advantages[in_bad].eq(0).all()
    # every other group: kept rows and advantages exactly those of the batch without the bad group (same ops), and
    # TRL's advantages over those kept rows
    others = ~in_bad
    (keep, advantages), (_, k) = expected_selection(setup, rewards[others], lengths[others], stopped[others],
                                                    use_kernels)
    assert torch.equal(selection.keep[others], keep)
    assert torch.equal(selection.advantages[others], advantages)
    torch.testing.assert_close(advantages, trl_advantages(rewards[others], keep), rtol=1e-5, atol=1e-6)
    if setup == "adaptive":  # the bad group took no part in the digest and counts as hardest
        assert trainer.adaptive_difficulty.digest.n_values == GROUPS - 1
        assert torch.equal(selection.k[torch.arange(GROUPS) != BAD_GROUP], k)
        assert selection.k[BAD_GROUP] == ADAPTIVE_K[0]
    metrics = trainer._metrics["train"]
    assert metrics["gfpo/nonfinite_reward_groups"] == [1.0]
    assert metrics["gfpo/nonfinite_reward_groups_total"] == [1.0]
    # one warning, naming the function, the completion and the prompt
    (warning,) = nonfinite_warnings(caplog)
    assert f"reward function 'bad_reward' gave {bad}" in warning
    assert f"completion {bad_row % G} of prompt {BAD_GROUP} of the generation batch: {PROMPTS[BAD_GROUP]!r}" in warning
    assert "1 group(s) of this batch" in warning
    assert_trains_finite(trainer, output)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("bad", [None, math.nan], ids=["None", "NaN"])
def test_a_missing_reward_is_unscorable_as_in_trl(warm_model_dir, tmp_path, setup, bad, use_kernels, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="gfpo_trainer"):
        trainer, output, seen, selection, lengths, stopped = run_batch(warm_model_dir, tmp_path, setup, bad,
                                                                       use_kernels)
    rewards = seen["rewards"][:, 0].clone()
    bad_row = shortest_of_group(seen["completions"], BAD_GROUP)
    assert math.isnan(rewards[bad_row]) and torch.isnan(rewards).sum() == 1
    # only the row is out: the whole batch, its group included, is selected and normalised as TRL normalises (NaN
    # out of the mean and std, advantage 0)
    (keep, advantages), _ = expected_selection(setup, rewards, lengths, stopped, use_kernels)
    assert torch.equal(selection.keep, keep) and torch.equal(selection.advantages, advantages)
    torch.testing.assert_close(advantages, trl_advantages(rewards, keep), rtol=1e-5, atol=1e-6)
    assert selection.advantages[bad_row] == 0
    in_bad = (torch.arange(G * GROUPS) // G) == BAD_GROUP
    assert selection.advantages[in_bad].ne(0).any()  # the rest of its group trains
    if setup == "length":  # ranked by length, the unscorable row is kept, at advantage 0
        assert selection.keep[bad_row]
    else:  # ranked by reward per token, it ranks last
        assert not selection.keep[bad_row]
    assert trainer._metrics["train"]["gfpo/nonfinite_reward_groups"] == [0.0]
    assert nonfinite_warnings(caplog) == []
    assert_trains_finite(trainer, output)


def test_none_from_one_function_sums_the_others_as_trl(warm_model_dir, tmp_path):  # noqa: F811
    """Two functions: where one returns None the row's reward is the other's weighted reward (TRL's nansum)."""
    def sometimes_none(completions, **kwargs):
        return [None if i % 3 == 0 else 1.0 for i in range(len(completions))]

    trainer = trainer_of(warm_model_dir, tmp_path, reward=[digit_reward, sometimes_none], reward_weights=[1.0, 0.5],
                           group_filter="token_efficiency", per_device_train_batch_size=G * GROUPS)
    _, seen = scored_batch(trainer)
    selection = trainer._gfpo_batch.selection
    digits = torch.tensor(digit_reward(seen["completions"]), dtype=torch.float32)
    extra = torch.tensor([0.0 if i % 3 == 0 else 0.5 for i in range(G * GROUPS)])
    assert torch.equal(selection.rewards, digits + extra)


def test_the_warning_is_given_once_and_the_count_adds_up(warm_model_dir, tmp_path, caplog):  # noqa: F811
    """Two batches, each with one group holding inf: one warning; the count is 1 per batch, the run's total 2."""
    with caplog.at_level(logging.WARNING, logger="gfpo_trainer"):
        trainer, *_ = run_batch(warm_model_dir, tmp_path, "length", math.inf, False)
        scored_batch(trainer, seed=1)
    assert len(nonfinite_warnings(caplog)) == 1
    metrics = trainer._metrics["train"]
    assert metrics["gfpo/nonfinite_reward_groups"] == [1.0, 1.0]
    assert metrics["gfpo/nonfinite_reward_groups_total"] == [2.0]
    assert trainer.gfpo_nonfinite_reward_groups_total == 2


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("scale", ["batch", "none"])
def test_other_groups_are_untouched_whatever_the_scale(warm_model_dir, tmp_path, scale, use_kernels):  # noqa: F811
    """TRL zeroes the whole batch with scale_rewards="batch" and overflows with "none"; GFPO drops the group only,
    and the others get the advantages of the batch without it."""
    trainer, output, seen, selection, lengths, stopped = run_batch(warm_model_dir, tmp_path, "length", math.inf,
                                                                   use_kernels, scale_rewards=scale)
    rewards = seen["rewards"][:, 0].clone()
    others = (torch.arange(G * GROUPS) // G) != BAD_GROUP
    scores = GROUP_FILTER_SPECS["length"].score(FilterInputs(rewards[others], lengths[others], stopped[others], G))
    ops = gfpo_kernels if use_kernels else ref
    keep, advantages = ops.gfpo_filter_advantages(rewards[others], scores, G, K, largest=False, scale=scale)
    assert torch.equal(selection.keep[others], keep) and torch.equal(selection.advantages[others], advantages)
    assert selection.advantages[~others].eq(0).all() and advantages.ne(0).any()
    assert_trains_finite(trainer, output)


def test_an_overflowing_sum_names_the_functions(warm_model_dir, tmp_path, caplog):  # noqa: F811
    """Each reward finite, their weighted sum not (float32 overflow): the group is dropped and the warning says so."""
    def huge(completions, **kwargs):
        return [3e38 if i == 2 else 0.0 for i in range(len(completions))]

    def also_huge(completions, **kwargs):
        return huge(completions)

    with caplog.at_level(logging.WARNING, logger="gfpo_trainer"):
        trainer = trainer_of(warm_model_dir, tmp_path, reward=[huge, also_huge], per_device_train_batch_size=16)
        scored_batch(trainer)
    assert trainer._gfpo_batch.selection.advantages[:G].eq(0).all()
    assert trainer._metrics["train"]["gfpo/nonfinite_reward_groups"] == [1.0]
    (warning,) = nonfinite_warnings(caplog)
    assert "the weighted sum of the reward functions 'huge', 'also_huge' gave" in warning
    assert "for completion 2 of prompt 0 of the generation batch: '1+2='" in warning


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_raising_reward_function_is_named(warm_model_dir, tmp_path, setup, kind):  # noqa: F811
    def exploding(completions, **kwargs):
        raise KeyError("answer")

    async def exploding_async(completions, **kwargs):
        raise KeyError("answer")

    func = exploding if kind == "sync" else exploding_async
    trainer = trainer_of(warm_model_dir, tmp_path, reward=[digit_reward, func], **SETUPS[setup])
    name = func.__name__
    with pytest.raises(RewardFunctionError,
                       match=rf"^reward function '{name}' \(reward_funcs\[1\]\) raised KeyError: 'answer'$") as info:
        scored_batch(trainer)
    assert isinstance(info.value.__cause__, KeyError) and info.value.__cause__.args == ("answer",)
    assert info.value.reward_func_name == name and info.value.reward_func_index == 1
    assert trainer.reward_funcs == [digit_reward, func]  # the user's own functions, as they were


@pytest.mark.parametrize("returned, match", [
    (lambda n: ["1.0"] * n, r"^reward function 'not_numbers' \(reward_funcs\[1\]\) returned '1.0' \(str\) for "
                            r"completion 0: a reward must be a number or None"),
    (lambda n: [0.5] * (n - 1) + [[1.0]], r"returned \[1.0\] \(list\) for completion 15:"),
    (lambda n: 1.0, r"returned float 1.0: it must return a list with one reward per completion"),
])
def test_a_reward_that_is_not_a_number_is_named(warm_model_dir, tmp_path, returned, match):  # noqa: F811
    def not_numbers(completions, **kwargs):
        return returned(len(completions))

    trainer = trainer_of(warm_model_dir, tmp_path, reward=[digit_reward, not_numbers], per_device_train_batch_size=16)
    with pytest.raises(ValueError, match=match):
        scored_batch(trainer)


def test_rewards_of_any_number_type_or_a_generator_are_taken(warm_model_dir, tmp_path):  # noqa: F811
    """What TRL's conversion takes still goes through: NumPy and 0-d torch scalars, bools, a generator (read once)."""
    import numpy as np

    def mixed(completions, **kwargs):
        kinds = [np.float32(0.5), torch.tensor(2.0), True, 3]
        return (kinds[i % 4] for i in range(len(completions)))

    trainer = trainer_of(warm_model_dir, tmp_path, reward=mixed, per_device_train_batch_size=16)
    _, seen = scored_batch(trainer)
    assert seen["rewards"][:, 0].tolist() == [0.5, 2.0, 1.0, 3.0] * 4


@pytest.mark.parametrize("process_index", [0, 1])
def test_the_process_holding_the_row_warns_with_its_prompt(process_index, caplog):
    """Two processes, 2 groups of 4 rows each, 4 rows a process: the infinite reward in row 6 (group 1, completion 2)
    is on process 1, which alone warns, quoting its prompt; both count it."""
    import types

    from gfpo_trainer.rewards import nonfinite_rows, summed_rewards, warn_nonfinite_rewards

    trainer = types.SimpleNamespace(
        num_generations=4, reward_weights=torch.tensor([1.0, 2.0]), reward_func_names=["score", "judge"],
        _gfpo_warned=set(), accelerator=types.SimpleNamespace(process_index=process_index, num_processes=2))
    rewards_per_func = torch.tensor([[0.0, 1.0]] * 8)
    rewards_per_func[6, 1] = -math.inf
    bad = nonfinite_rows(summed_rewards(trainer, rewards_per_func), rewards_per_func)
    assert bad.tolist() == [False] * 6 + [True, False]
    prompts = [f"prompt of process {process_index}, row {i}" for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="gfpo_trainer"):
        warn_nonfinite_rewards(trainer, rewards_per_func, bad, prompts)
        warn_nonfinite_rewards(trainer, rewards_per_func, bad, prompts)  # once
    warnings = nonfinite_warnings(caplog)
    if process_index == 1:
        (warning,) = warnings
        assert ("reward function 'judge' gave -inf for completion 2 of prompt 1 of the generation batch: "
                "'prompt of process 1, row 2'") in warning
    else:
        assert warnings == []
    assert trainer._gfpo_warned == {"non-finite: reward function 'judge'"}
