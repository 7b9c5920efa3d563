"""gfpo_trainer: Group Filtered Policy Optimization (arXiv 2508.09726) on TRL's GRPOTrainer.

- GFPOConfig: GRPOConfig plus num_remains_in_group, group_filter, use_gfpo_kernels, adaptive_difficulty,
  adaptive_num_remains.
- GFPOTrainer: GRPOTrainer that trains on the top-k completions of every group.
"""

from .config import GROUP_FILTERS, GFPOConfig
from .trainer import GFPOTrainer

__all__ = ["GFPOConfig", "GFPOTrainer", "GROUP_FILTERS"]
