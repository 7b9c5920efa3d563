"""take_global_rows on 2 and 3 CPU processes (torchrun, gloo): the all-to-all row exchange returns exactly what an
all-gather of the batch returned, and a process receives only the bytes of its own rows."""

import json

import pytest

from gfpo_test_utils import launch_cpu_workers


def _launch(tmp_path, world):
    launch_cpu_workers("mp_row_exchange_worker.py", world, tmp_path, timeout=240)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3])
def results(request, tmp_path_factory):
    return _launch(tmp_path_factory.mktemp(f"rows{request.param}"), request.param)


def test_rows_equal_the_all_gather(results):
    cases = [c for rank in results for c in rank]
    assert len(cases) == 6 * 4 * len(results)
    assert any(c["rows"] == 0 for c in cases)  # an empty share was exercised
    bad = [c for c in cases if not (c["equal"] and c["dtype_kept"])]
    assert not bad, bad


def test_bytes_received_are_the_process_rows(results):
    for rank in results:
        for c in rank:
            # a process receives its rows (padded to the common width), never the batch of every process
            assert c["row_bytes"] == c["rows"] * c["row_size"], c
    assert any(c["rows"] < c["total_rows"] for rank in results for c in rank)
