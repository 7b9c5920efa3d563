import os

import pytest

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
