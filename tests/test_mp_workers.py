"""Every torchrun worker (tests/mp_*.py) ends through gfpo_test_utils.end_worker_process: a worker that returns into
Python's finalization while torch's gloo threads live on aborts now and then under load (its docstring says why)."""

from pathlib import Path

WORKERS = sorted(Path(__file__).parent.glob("mp_*.py"))


def test_every_worker_ends_through_end_worker_process():
    assert len(WORKERS) >= 4
    for worker in WORKERS:
        source = worker.read_text()
        main_block = source.split('if __name__ == "__main__":', 1)[1]
        assert main_block.rstrip().endswith("end_worker_process()"), f"{worker.name} ends otherwise"
        assert "destroy_process_group" not in source, f"{worker.name} tears its group down itself"
