"""The C++ extension: built where CI expects it, registered as torch custom ops that trace under
torch.compile, and picked by the dispatcher."""

import os

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import _dispatch
from gfpo_kernels import reference as ref

needs_cpp = pytest.mark.skipif(not _dispatch.HAS_CPP, reason="gfpo_kernels._C not built")


@pytest.mark.skipif(os.environ.get("GFPO_NO_EXTENSION") == "1", reason="built without the extension on purpose")
def test_extension_is_built():
    assert _dispatch.HAS_CPP, "gfpo_kernels._C is missing: run pip install --no-build-isolation -e ."


def test_default_dispatch():
    forced = _dispatch.forced_backend()
    if forced is None:
        assert _dispatch.select_backend("group", torch.device("cpu"), 16) == ("cpp" if _dispatch.HAS_CPP else "reference")
        if _dispatch.HAS_TRITON:
            want = "cpp" if _dispatch.HAS_CPP_CUDA else "triton"  # the CUDA op when built with CUDA
            assert _dispatch.select_backend("group", torch.device("cuda"), 16) == want
            assert _dispatch.select_backend("group", torch.device("cuda"), 8192) in ("reference",)


@needs_cpp
def test_ops_trace_under_torch_compile():
    def step(rewards, scores, k):
        keep, adv = torch.ops.gfpo.gfpo_filter_advantages(rewards, scores, k, False, "group", 1e-4)
        return keep, adv * 2.0, torch.ops.gfpo.group_advantages(rewards, keep, "batch", 1e-4)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    rewards, scores = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    k = torch.full((6,), 3)
    keep, adv2, adv_batch = compiled(rewards, scores, k)
    want_keep, want_adv = ref.gfpo_filter_advantages(rewards, scores, 8, 3, largest=False)
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(adv2, want_adv * 2.0)
    torch.testing.assert_close(adv_batch, ref.group_advantages(rewards, 8, keep=want_keep, scale="batch"))


@needs_cpp
def test_public_op_traces_under_torch_compile():
    compiled = torch.compile(
        lambda r, s: gfpo_kernels.gfpo_filter_advantages(r, s, 8, 2), backend="aot_eager", fullgraph=True
    )
    r, s = torch.randn(32), torch.randn(32)
    with gfpo_kernels.use_backend("cpp"):
        keep, adv = compiled(r, s)
    want_keep, want_adv = ref.gfpo_filter_advantages(r, s, 8, 2)
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(adv, want_adv)


@needs_cpp
def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        keep, adv = torch.ops.gfpo.gfpo_filter_advantages(
            torch.empty(5, 16), torch.empty(5, 16, dtype=torch.bfloat16), torch.empty(5, dtype=torch.int64), True,
            "group", 1e-4,
        )
    assert keep.shape == adv.shape == (5, 16) and keep.dtype == torch.bool and adv.dtype == torch.float32
