"""FSDP2 on 2 CPU processes (torchrun, gloo): the fused loss through the patched forward of a tiny Qwen2 sharded
with `fully_shard` gives the unsharded model's losses and averaged head-weight gradient, whether the head is held
by the root unit or is a sharded unit of its own (a DTensor in the fused call)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch.distributed.fsdp")


@pytest.mark.parametrize("head_alone", ["0", "1"])
def test_fsdp2_fused_loss_matches_unsharded(tmp_path, head_alone):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               "--master_addr=127.0.0.1", str(Path(__file__).with_name("mp_fsdp2_worker.py")), str(tmp_path),
               head_alone]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], got["expected"]["losses"][rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["head_grad"], got["expected"]["head_grad"], rtol=1e-4, atol=1e-6)
