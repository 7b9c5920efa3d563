"""What GFPO does with what the reward functions return: TRL's summed reward, the groups a non-finite reward
drops (with one warning per reward function that names it and the prompt), and errors that name the reward
function that raised or returned something that is not a number.

How each kind of value is treated (docs/trainer.md, "Rewards that are not numbers"):
- None or NaN from a function: as in TRL, the function did not score the row; the row's reward is the weighted sum
  of the functions that did, and a row no function scored is unscorable (NaN: no part in its group's statistics,
  advantage 0).
- +-inf (or a weighted sum that is not finite: inf - inf, a float32 overflow): the row's whole group is treated as
  unscorable: advantage 0 for every row of it, no part in the batch statistics nor in adaptive difficulty's digest.
  With scale_rewards="group" that is what TRL's advantages come to (its nan_to_num of inf - inf); GFPO does the same
  with "batch" and "none", where TRL's would zero the whole batch or overflow.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn
from trl.trainer.utils import is_async_callable

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """A reward function raised: names the function (TRL's name for it and its index in `reward_funcs`); the
    function's own exception is chained (`__cause__`)."""

    def __init__(self, name: str, index: int, error: BaseException):
        super().__init__(f"reward function {name!r} (reward_funcs[{index}]) raised {type(error).__name__}: {error}")
        self.reward_func_name = name
        self.reward_func_index = index


def _naming_errors(func, name: str, index: int):
    """`func` called as it is, but an exception it raises comes out as a RewardFunctionError naming it, and a value
    that is neither a number nor None as a ValueError naming it (TRL's own conversion would fail without the name).
    An async function stays async (TRL awaits the ones it finds async)."""
    if is_async_callable(func):
        async def named(*args, **kwargs):
            try:
                rewards = await func(*args, **kwargs)
            except Exception as error:
                raise RewardFunctionError(name, index, error) from error
            return _checked(rewards, name, index)
    else:
        def named(*args, **kwargs):
            try:
                rewards = func(*args, **kwargs)
            except Exception as error:
                raise RewardFunctionError(name, index, error) from error
            return _checked(rewards, name, index)
    return functools.update_wrapper(named, func) if hasattr(func, "__name__") else named


def _checked(rewards, name: str, index: int) -> list:
    """The rewards as a list (a generator is read once, here), each a number (anything float() takes: int, float,
    bool, a NumPy or 0-d torch scalar) or None; ValueError naming the function, the completion and the value."""
    try:
        rewards = list(rewards)
    except TypeError:
        raise ValueError(f"reward function {name!r} (reward_funcs[{index}]) returned {type(rewards).__name__} "
                         f"{_short(rewards)}: it must return a list with one reward per completion") from None
    for position, reward in enumerate(rewards):
        if reward is not None and not hasattr(type(reward), "__float__"):
            raise ValueError(f"reward function {name!r} (reward_funcs[{index}]) returned {_short(reward)} "
                             f"({type(reward).__name__}) for completion {position}: a reward must be a number or "
                             "None (None: this function does not score the completion)")
    return rewards


@contextlib.contextmanager
def reward_errors_named(trainer):
    """While TRL's _calculate_rewards runs: every reward function that is not a model (TRL calls a model's forward
    itself) raises a RewardFunctionError naming it, and a ValueError naming it for a reward that is not a number.
    `trainer.reward_funcs` holds the user's own objects again after, whatever happened."""
    functions = trainer.reward_funcs
    trainer.reward_funcs = [
        func if isinstance(func, nn.Module) else _naming_errors(func, name, i)
        for i, (func, name) in enumerate(zip(functions, trainer.reward_func_names))
    ]
    try:
        yield
    finally:
        trainer.reward_funcs = functions


def summed_rewards(trainer, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """TRL's summed reward of each row, (N,) from (N, reward functions): the weighted sum over the functions that
    scored the row, NaN where none did."""
    rewards = (rewards_per_func * trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def nonfinite_rows(rewards: torch.Tensor, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows whose summed reward (summed_rewards) is +-inf or NaN while some function scored them."""
    return ~torch.isfinite(rewards) & ~torch.isnan(rewards_per_func).all(dim=1)


def warn_nonfinite_rewards(trainer, rewards_per_func: torch.Tensor, bad_rows: torch.Tensor, prompts=None) -> None:
    """One warning per reward function (the first time it gives a non-finite reward), naming it, the completion and
    the prompt (its index in the generation batch, and its text on the process that holds the row).

    Args:
        rewards_per_func: (N, reward functions), the global batch as TRL gathered it.
        bad_rows: (N,) bool, from nonfinite_rows.
        prompts: this process's prompts (one per row), or None.
    """
    G = trainer.num_generations
    weights = trainer.reward_weights.to(rewards_per_func.device)
    infinite = torch.isinf(rewards_per_func) & (weights != 0) & bad_rows[:, None]  # (N, functions)
    culprits = [(f"reward function {trainer.reward_func_names[i]!r}", row, rewards_per_func[row, i].item())
                for i in range(infinite.size(1)) if infinite[:, i].any()
                for row in [int(infinite[:, i].nonzero()[0])]]
    if not culprits:  # each term finite, the weighted sum not: it overflowed float32
        row = int(bad_rows.nonzero()[0])
        names = ", ".join(repr(name) for name in trainer.reward_func_names)
        culprits = [(f"the weighted sum of the reward functions {names}", row, rewards_per_func[row].tolist())]
    n_local = len(prompts) if prompts else 0
    groups = int(bad_rows.view(-1, G).any(dim=1).sum())
    for name, row, value in culprits:
        key = f"non-finite: {name}"
        if key in trainer._gfpo_warned:
            continue
        trainer._gfpo_warned.add(key)
        on_this_process = n_local > 0 and row // n_local == trainer.accelerator.process_index
        if trainer.accelerator.num_processes > 1 and not on_this_process:
            continue  # the process holding the row warns, with the prompt's text
        text = f": {_short(prompts[row % n_local])}" if on_this_process else ""
        logger.warning(
            f"gfpo: {name} gave {value} for completion {row % G} of prompt {row // G} of the "
            f"generation batch{text}. A group holding a non-finite reward gets advantage 0 and trains nothing (as "
            f"TRL does with scale_rewards='group'); {groups} group(s) of this batch dropped so. "
            "gfpo/nonfinite_reward_groups counts them at every step; this warning is given once per reward function."
        )


def _short(prompt, limit: int = 200) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[: limit - 3] + "..."
