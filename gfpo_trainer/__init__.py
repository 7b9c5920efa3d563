"""gfpo_trainer: Group Filtered Policy Optimization (arXiv 2508.09726) on TRL's GRPOTrainer.

- GFPOConfig: GRPOConfig plus GFPO's fields (num_remains_in_group, group_filter, use_gfpo_kernels, ...;
  docs/trainer.md lists them).
- GFPOTrainer: GRPOTrainer that trains on the top-k completions of every group.
- GROUP_FILTERS: the names of the built-in filters GFPOConfig.group_filter takes (the keys of
  gfpo_trainer.filters.GROUP_FILTER_SPECS).

The names load TRL on first use, not on `import gfpo_trainer`: `python -m gfpo_trainer --help` stays instant.
"""

from __future__ import annotations

import importlib

_LAZY = {"GFPOConfig": ".config", "GROUP_FILTERS": ".filters", "GFPOTrainer": ".trainer"}

__all__ = ["GFPOConfig", "GFPOTrainer", "GROUP_FILTERS"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
