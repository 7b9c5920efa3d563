"""gfpo_kernels: fused kernels for GFPO (Group Filtered Policy Optimization, arXiv 2508.09726).

Public ops (semantics in docs/design.md; `gfpo_kernels.reference` holds the same functions in plain PyTorch):
- group_topk_mask: the top-k rows of every group (segmented top-k, deterministic ties, NaN last).
- group_advantages: GRPO advantages over the kept rows of every group.
- gfpo_filter_advantages: both in one pass.
- fused_linear_grpo_loss / FusedLinearGRPOLoss: TRL's GRPO loss of the LM head without the (tokens x vocab)
  logits.

Which implementation runs (Triton, the C++/CUDA extension, or the reference) is decided in one place,
`gfpo_kernels._dispatch`; `use_backend` forces one.
"""

from . import reference
from ._dispatch import available_backends, use_backend
from .fused_linear_grpo import FusedLinearGRPOLoss, fused_linear_grpo_loss
from .group_ops import gfpo_filter_advantages, group_advantages, group_topk_mask

__version__ = "0.1.0"

__all__ = [
    "group_topk_mask",
    "group_advantages",
    "gfpo_filter_advantages",
    "fused_linear_grpo_loss",
    "FusedLinearGRPOLoss",
    "reference",
    "use_backend",
    "available_backends",
]
