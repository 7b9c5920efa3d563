"""The LM head's full weight and bias for the fused loss, under the engines that shard parameters.

The fused loss reads the head's parameters directly instead of calling the head module, so the engine's own
gathering (which runs in the head module's forward hooks) never fires:
- DeepSpeed ZeRO-3: the parameters are empty placeholders; they are gathered for the duration of the fused call.
  The fused loss computes its gradients inside its forward (its backward only scales them), so no gather is needed
  in the backward, and ZeRO-3's gradient reduction is armed because the loss runs inside the model's forward.
- FSDP2: when the root unit holds the head, its parameters are unsharded plain tensors during the forward already;
  when the head is a sharded DTensor, `full_tensor()` all-gathers it, and autograd carries the gradient back to
  the sharded parameter as a sharded gradient.
"""

from __future__ import annotations

import contextlib

import torch

from ._compat import lm_head_gather_context


def _full(param):
    if param is None:
        return None
    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:  # a torch without DTensor has no FSDP2 either
        return param
    if not isinstance(param, DTensor):
        return param
    # each process's gradient of the full weight is its own part: averaged and scattered to the shards, as FSDP2
    # averages the gradients of the parameters it unshards itself
    return param.full_tensor(grad_placements=[Partial("avg")] * param.device_mesh.ndim)


@contextlib.contextmanager
def full_head_parameters(head: torch.nn.Module):
    """Yields (weight, bias) of the LM head `head` in full, gradients flowing back to the (sharded) parameters;
    hold it while the fused loss runs."""
    with lm_head_gather_context(head.weight, getattr(head, "bias", None)):
        yield _full(head.weight), _full(getattr(head, "bias", None))
