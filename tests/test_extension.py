"""The C++ extension: built where CI expects it, registered as torch custom ops that trace under
torch.compile, and picked by the dispatcher."""

import os

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import _dispatch
from gfpo_kernels import reference as ref

from gfpo_test_utils import DEVICE

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
        keep, adv = torch.ops.gfpo.gfpo_filter_advantages(rewards, scores, k, 0, False, "group", 1e-4)
        fixed_keep = torch.ops.gfpo.group_topk_mask(scores, None, 3, False)
        return keep, adv * 2.0, torch.ops.gfpo.group_advantages(rewards, keep, "batch", 1e-4), fixed_keep

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    rewards, scores = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    k = torch.full((6,), 3)
    keep, adv2, adv_batch, fixed_keep = compiled(rewards, scores, k)
    want_keep, want_adv = ref.gfpo_filter_advantages(rewards, scores, 8, 3, largest=False)
    assert torch.equal(keep, want_keep) and torch.equal(fixed_keep, want_keep)
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
            torch.empty(5, 16), torch.empty(5, 16, dtype=torch.bfloat16), torch.empty(5, dtype=torch.int64), 0, True,
            "group", 1e-4,
        )
        fixed = torch.ops.gfpo.group_topk_mask(torch.empty(5, 16), None, 4, True)
    assert keep.shape == adv.shape == fixed.shape == (5, 16) and keep.dtype == fixed.dtype == torch.bool
    assert adv.dtype == torch.float32


@needs_cpp
@pytest.mark.parametrize("k", [3, "adaptive"])
def test_one_op_per_call(k):
    """gfpo_filter_advantages with the extension runs the custom op and nothing else on the groups (one launch on
    CUDA, as DESIGN.md says): a single k reaches the op as an int, not as a tensor filled on the device; an
    adaptive k is range-checked on a host copy (its min and max are then host ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
            self.ops.append((str(func.overloadpacket), devices))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    rewards, scores = torch.randn(64, generator=g).to(DEVICE), torch.randn(64, generator=g).to(DEVICE)
    kk = torch.tensor([3, 0, 8, 5, 1, 2, 4, 6]).to(DEVICE) if k == "adaptive" else k
    with gfpo_kernels.use_backend("cpp"), OpLog() as log:
        keep, adv = gfpo_kernels.gfpo_filter_advantages(rewards, scores, 8, kk)
    views = ("aten.view", "aten._reshape_alias", "aten.reshape")
    ops = [(op, devices) for op, devices in log.ops if op not in views]
    assert ops[-1][0] == "gfpo.gfpo_filter_advantages"
    if k == "adaptive":  # a copy of k to the host (on CUDA), then its min and max read there
        reads = {"aten._to_copy", "aten.min", "aten.max", "aten._local_scalar_dense"}
        assert {op for op, _ in ops[:-1]} <= reads
        assert all(devices == {"cpu"} for op, devices in ops[:-1] if op != "aten._to_copy")
    else:
        assert ops[:-1] == []
    want_keep, want_adv = ref.gfpo_filter_advantages(rewards, scores, 8, kk)
    assert torch.equal(keep.cpu(), want_keep.cpu())
    torch.testing.assert_close(adv.cpu(), want_adv.cpu())
