"""Real DeepSpeed ZeRO-3 on 2 CPU processes (torchrun, DS_ACCELERATOR=cpu, gloo): the fused loss through the patched
forward of a tiny Qwen2 whose parameters (the LM head's included) are all partitioned gives the unsharded model's
losses and averaged head-weight gradient, and one clipped SGD step gives the plain torch step's parameters; for a
model loaded inside `zero.Init` (partitioned when the fused forward is installed) and one built outside it, with
the LM head its own parameter or tied to the input embedding.
DeepSpeed is not a dependency: scripts/test_zero3_cpu.sh installs it in .venv-deepspeed and runs this test."""

import importlib.util

import pytest
import torch

from gfpo_test_utils import launch_cpu_workers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/test_zero3_cpu.sh installs it and runs this)")


def test_zero3_fused_loss_gradient_and_step_match_unsharded(tmp_path):
    launch_cpu_workers("mp_zero3_worker.py", 2, tmp_path, DS_ACCELERATOR="cpu")
    for run in ("untied_init", "untied_plain", "tied_init", "tied_plain"):
        for rank in range(2):
            got = torch.load(tmp_path / run / f"rank{rank}.pt")
            expected = got["expected"]
            assert got["partitioned_at_install"] == run.endswith("init")
            torch.testing.assert_close(got["loss"], expected["losses"][rank], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["head_grad"], expected["head_grad"], rtol=1e-4, atol=1e-6)
            assert got["params"].keys() == expected["params"].keys()
            for name, param in got["params"].items():
                torch.testing.assert_close(param, expected["params"][name], rtol=1e-5, atol=1e-6, msg=f"{run} {name}")
