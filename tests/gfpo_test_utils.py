"""Shared test constants. Imported by conftest.py before anything imports gfpo_kernels: without a GPU,
Triton kernels run under the interpreter, and TRITON_INTERPRET=1 must be set before triton.jit decorates
them."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gfpo_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every backend that can run here, except the reference itself (it is the oracle).
KERNEL_BACKENDS = [b for b in gfpo_kernels.available_backends("group", DEVICE) if b != "reference"]
LOSS_BACKENDS = [b for b in gfpo_kernels.available_backends("linear_grpo", DEVICE) if b != "reference"]
