"""GFPOTrainer takes the arguments GRPOTrainer takes, with the same defaults: TRL's tests (and users) call it as
they call GRPOTrainer (found by scripts/trl_grpo_suite.py: `reward_funcs` omitted for environment-owned rewards)."""

import inspect

from trl import GRPOTrainer

from gfpo_trainer import GFPOTrainer


def test_grpo_arguments_keep_their_defaults():
    ours = inspect.signature(GFPOTrainer.__init__).parameters
    for name, theirs in inspect.signature(GRPOTrainer.__init__).parameters.items():
        if name not in ours:  # passed through **grpo_kwargs
            continue
        assert ours[name].default == theirs.default, (
            f"{name}: GFPOTrainer's default {ours[name].default!r}, GRPOTrainer's {theirs.default!r}")
