"""Checks that only mean something on a CUDA machine (skipped elsewhere; the rest of the suite also runs on CUDA
tensors there, through gfpo_test_utils.DEVICE)."""

import os

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import _dispatch
from gfpo_kernels import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_kernels_are_built_and_chosen():
    assert _dispatch.HAS_TRITON and _dispatch.select_backend("group", torch.device("cuda"), 16) == "triton"
    if os.environ.get("GFPO_NO_EXTENSION") != "1" and torch.version.cuda is not None:
        assert _dispatch.HAS_CPP_CUDA, "the extension was built without its CUDA kernel"


@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_filter_advantages_4096x16_on_cuda(backend):
    if backend not in gfpo_kernels.available_backends("group", "cuda"):
        pytest.skip(f"{backend} cannot run CUDA tensors here")
    g = torch.Generator(device="cuda").manual_seed(0)
    rewards = torch.rand(4096 * 16, generator=g, device="cuda")
    lengths = torch.randint(16, 4096, (4096 * 16,), generator=g, device="cuda").float()
    with gfpo_kernels.use_backend(backend):
        keep, adv = gfpo_kernels.gfpo_filter_advantages(rewards, lengths, 16, 8, largest=False, scale="batch")
    want_keep, want_adv = ref.gfpo_filter_advantages(rewards, lengths, 16, 8, largest=False, scale="batch")
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5)


def test_fused_loss_bf16_uses_fp32_gemm_output():
    from gfpo_kernels import fused_linear_grpo as flg

    hidden = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h, w = flg._gemm_operands(hidden.reshape(-1, 64), weight)
    assert h.dtype == w.dtype == torch.bfloat16  # no fp32 copy: cuBLAS writes fp32 itself
    target = torch.randint(0, 1000, (2, 8), device="cuda")
    mask, adv = torch.ones(2, 8, device="cuda"), torch.randn(2, device="cuda")
    loss, _ = gfpo_kernels.fused_linear_grpo_loss(hidden, weight, target, mask, adv)
    want, _ = ref.fused_linear_grpo_loss(hidden, weight, target, mask, adv)
    torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)
