"""A run resumed from a checkpoint is the run that did not stop: 6 steps with checkpoints every 3, against the same
run resumed from checkpoint-3, with the length filter's early stop cutting completions (HF generate) and with adaptive
difficulty (its digest saved and restored), a reward that is sometimes infinite (the run's count of dropped groups
saved and restored), within one epoch and resumed in the second of three (the prompts' order replayed): the final
weights are identical and steps 4-6 log the same metrics."""

import math

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from test_early_stop import warm_model_dir  # noqa: E402,F401  (completions that end at varied lengths)

from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402

G = 8
PROMPTS = [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 1), (2, 7), (4, 4), (6, 3), (8, 1), (0, 9), (7, 2), (3, 3),
                                       (5, 4), (9, 0)]]
# 2 prompts a step: 6 steps in one epoch, or in three epochs of 4 prompts (step 3 then starts the second)
EPOCHS = {"one-epoch": PROMPTS, "three-epochs": PROMPTS[:4]}
SETUPS = {
    # the early-stop rule on (HF generate): it cuts the completions the filter drops
    "length-early-stop": dict(group_filter="length", num_remains_in_group=3),
    # adaptive k: its digest is GFPO state that a checkpoint must carry
    "adaptive": dict(group_filter="token_efficiency", num_remains_in_group=3, adaptive_difficulty=True,
                     adaptive_num_remains=[6, 4, 3, 2]),
}


def sum_reward(completions, prompts, **kwargs):
    """1 for the right sum, 0 otherwise, less a little per character; +inf for a completion holding a '0' and for a
    wrong answer to the first prompt (some groups are then dropped, and counted, in every epoch)."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        right = completion.strip().startswith(str(a + b))
        if "0" in completion or (prompt == PROMPTS[0] and not right):
            rewards.append(math.inf)
        else:
            rewards.append(float(right) - 0.01 * len(completion))
    return rewards


def train(model_dir, tokenizer, output_dir, setup, prompts, resume_from_checkpoint=None, seen=None):
    """6 steps; `seen` (a list) gets the prompts of every generation batch."""
    def sum_reward_seen(completions, prompts, **kwargs):
        if seen is not None:
            seen.append(prompts[::G])
        return sum_reward(completions, prompts)

    sum_reward_seen.__name__ = "sum_reward"
    args = GFPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2 * G, num_generations=G,
                      max_completion_length=12, max_steps=6, save_strategy="steps", save_steps=3, logging_steps=1,
                      learning_rate=1e-3, report_to="none", use_cpu=True, bf16=False, seed=0, loss_type="grpo",
                      temperature=1.0, **SETUPS[setup])
    trainer = GFPOTrainer(model=model_dir, reward_funcs=sum_reward_seen, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def step_logs(trainer, steps):
    """The training logs of `steps`, less the step's wall time."""
    return {log["step"]: {k: v for k, v in log.items() if k != "step_time"} for log in trainer.state.log_history
            if log["step"] in steps and "loss" in log}


@pytest.mark.parametrize("epochs", list(EPOCHS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_resumed_run_is_the_run_that_did_not_stop(warm_model_dir, tmp_path, setup, epochs):  # noqa: F811
    model_dir, tokenizer = warm_model_dir
    prompts, seen_straight, seen_resumed = EPOCHS[epochs], [], []
    straight = train(model_dir, tokenizer, tmp_path / "straight", setup, prompts, seen=seen_straight)
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    resumed = train(model_dir, tokenizer, tmp_path / "resumed", setup, prompts, resume_from_checkpoint=str(checkpoint),
                    seen=seen_resumed)
    assert resumed.state.global_step == straight.state.global_step == 6
    assert seen_resumed == seen_straight[3:]  # the prompts of steps 4-6
    weights = dict(straight.model.named_parameters())
    assert weights.keys() == dict(resumed.model.named_parameters()).keys()
    for name, value in resumed.model.named_parameters():
        assert torch.equal(value, weights[name]), name
    # steps 4-6 did train: the weights moved from checkpoint-3's
    at_step_3 = type(straight.model).from_pretrained(checkpoint).state_dict()
    assert any(not torch.equal(at_step_3[name], value) for name, value in weights.items())

    straight_logs, resumed_logs = step_logs(straight, {4, 5, 6}), step_logs(resumed, {4, 5, 6})
    assert sorted(straight_logs) == sorted(resumed_logs) == [4, 5, 6]
    for step in (4, 5, 6):
        a, b = straight_logs[step], resumed_logs[step]
        assert a.keys() == b.keys()
        # equal, or NaN in both (a metric over no rows)
        assert {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])} == {}, step
    logs = [straight_logs[step] for step in (4, 5, 6)]
    assert any(log["grad_norm"] > 0 for log in logs)
    # what the checkpoint must carry was in use: groups dropped before step 3 count in the total after it
    at_step_3_total = next(log for log in straight.state.log_history if log["step"] == 3)[
        "gfpo/nonfinite_reward_groups_total"]
    assert at_step_3_total > 0
    if setup == "adaptive":
        assert resumed.adaptive_difficulty.digest.centroids == straight.adaptive_difficulty.digest.centroids
        assert straight.adaptive_difficulty.digest.n_values == 2 * 6 - straight.gfpo_nonfinite_reward_groups_total
        assert len({log["gfpo/mean_k"] for log in logs}) > 1  # k changed with the groups' difficulty
    else:
        assert all(log["gfpo/stopped_early_fraction"] > 0 for log in logs)  # the early-stop rule cut completions


def test_each_epoch_order_is_trls(warm_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """The replayed order (state.replay_epoch_order) is the order TRL's own sampler gives a run that does not stop:
    three epochs, prompts of every step; and a sampler set to epoch 2 at once draws what the third iteration of TRL's
    draws."""
    from trl import GRPOTrainer

    model_dir, tokenizer = warm_model_dir
    ours = []
    trainer = train(model_dir, tokenizer, tmp_path / "ours", "length-early-stop", EPOCHS["three-epochs"], seen=ours)
    monkeypatch.setattr(GFPOTrainer, "_get_train_sampler", GRPOTrainer._get_train_sampler)
    trls = []
    train(model_dir, tokenizer, tmp_path / "trl", "length-early-stop", EPOCHS["three-epochs"], seen=trls)
    assert ours == trls and len({tuple(p) for p in ours}) > 2  # and the order does change between epochs
    monkeypatch.undo()

    trl_sampler = GRPOTrainer._get_train_sampler(trainer)
    trl_epochs = [list(trl_sampler) for _ in range(3)]
    assert trl_epochs[0] != trl_epochs[1]
    sampler = trainer._get_train_sampler()
    sampler.set_epoch(2)
    sampler.set_epoch(2)  # the Trainer and accelerate's loader both call it
    assert list(sampler) == trl_epochs[2]
