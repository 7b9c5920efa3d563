import os

import pytest
import torch

from gfpo_test_utils import DEVICE, KERNEL_BACKENDS

import gfpo_kernels  # noqa: E402  (after gfpo_test_utils has set TRITON_INTERPRET)


@pytest.fixture(params=KERNEL_BACKENDS)
def backend(request):
    """Runs the test once per kernel backend, with that backend forced."""
    with gfpo_kernels.use_backend(request.param):
        yield request.param


def pytest_report_header(config):
    return (
        f"gfpo_kernels device={DEVICE} kernel backends={KERNEL_BACKENDS} "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    )


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """For the vLLM tests: a tiny Qwen2 whose head dimension vLLM's CPU attention supports (hidden 64, one head),
    warmed up on pair sums with filler (gfpo_trainer.tiny) so that completions end at varied lengths (3 to about 20 tokens), saved to disk as
    vLLM loads it. Built once a session (the warm-up is the costly part)."""
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer, warm_up_on_pair_sums

    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, hidden_size=64, num_heads=1)
    warm_up_on_pair_sums(model, tokenizer, [(a, b) for a in range(10) for b in range(10)], 80, "cpu")
    path = tmp_path_factory.mktemp("warm-vllm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def pytest_sessionstart(session):
    """Where vLLM's tests must run (scripts/test_vllm_cpu.sh sets GFPO_REQUIRE_VLLM=1), a vLLM that fails to import
    fails the run here instead of skipping every vLLM test; the versions tested are printed."""
    if os.environ.get("GFPO_REQUIRE_VLLM") == "1":
        try:
            import transformers
            import trl
            import vllm
        except ImportError as error:
            raise pytest.UsageError(f"GFPO_REQUIRE_VLLM=1, but the vLLM tests cannot run here: {error!r}") from error
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"vLLM tests on: vllm {vllm.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
            f"torch {torch.__version__}")
