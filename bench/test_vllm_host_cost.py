"""bench/vllm_host_cost.py's own logic, without vLLM: the varied arms' lengths and the check that the rule's kept
rows are LLM.generate's (the bench itself runs under scripts/test_vllm_cpu.sh's venv, by hand)."""

import statistics
from types import SimpleNamespace

import pytest

from vllm_host_cost import check_varied, varied_lengths


def test_varied_lengths_are_seeded_and_long_tailed():
    lengths = varied_lengths(4096, 64)
    assert lengths == varied_lengths(4096, 64) and lengths != varied_lengths(4096, 64, seed=1)
    assert min(lengths) >= 1 and max(lengths) == 64
    assert 14 <= statistics.median(lengths) <= 19  # the law's median: 1 + 16
    assert 0.04 <= sum(x == 64 for x in lengths) / len(lengths) <= 0.09  # P(length >= 64) = 0.5 ** (63 / 16) = 6.5%
    assert varied_lengths(64, 64) == lengths[:64]  # the requests of a smaller batch are the first of a larger one


def _outputs(*rows):
    return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=row)]) for row in rows]


def test_check_varied_counts_cuts_and_refuses_a_differing_row():
    reference = _outputs([1, 2, 3], [4, 5, 6, 7], [8])
    assert check_varied(_outputs([1, 2, 3], [4, 5], [8]), [False, True, False], reference) == 1
    with pytest.raises(RuntimeError, match=r"row 0 \(kept\) differs"):
        check_varied(_outputs([1, 2], [4, 5], [8]), [False, True, False], reference)
    with pytest.raises(RuntimeError, match=r"row 1 \(cut\) differs"):
        check_varied(_outputs([1, 2, 3], [4, 6], [8]), [False, True, False], reference)
    with pytest.raises(RuntimeError, match="cut no request"):
        check_varied(reference, [False] * 3, reference)
