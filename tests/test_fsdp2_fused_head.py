"""FSDP2 on 2 CPU processes (torchrun, gloo): the fused loss through the patched forward of a tiny Qwen2 sharded
with `fully_shard` gives the unsharded model's losses and averaged head-weight gradient, whether the head is held
by the root unit or is a sharded unit of its own (a DTensor in the fused call)."""


import pytest
import torch

from gfpo_test_utils import launch_cpu_workers

pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Both layouts, in one launch of the worker (tests/mp_fsdp2_worker.py)."""
    out_dir = tmp_path_factory.mktemp("fsdp2")
    launch_cpu_workers("mp_fsdp2_worker.py", 2, out_dir, timeout=240)
    return out_dir


@pytest.mark.parametrize("head_alone", ["0", "1"])
def test_fsdp2_fused_loss_matches_unsharded(results, head_alone):
    for rank in range(2):
        got = torch.load(results / f"head_alone{head_alone}" / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], got["expected"]["losses"][rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["head_grad"], got["expected"]["head_grad"], rtol=1e-4, atol=1e-6)
