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


def _step(gap, step=10e-3, core=8e-3, model=5e-3, cuts=0, rule=0.0, abort=0.0, running=4):
    clock = {"gap": gap, "rule": rule, "abort": abort, "gc": 0.0, "gc_in_step": 0.0, "step": step, "core": core,
             "model": model}
    return {"cuts": cuts, "wall": dict(clock), "cpu": dict(clock), "running": running, "processor": 0.0}


def test_summaries_take_the_add_time_and_pair_the_arms_round_by_round():
    """The add time is the caller's time before a call's first step; extras are paired round by round (here each rule
    arm's figure less the reference's, the same in every round); the one-abort-a-request arm is compared with the
    one-abort-a-step arm. The markdown names the scheduling the figures are of."""
    from vllm_host_cost import ARMS, VARIED_ARMS, markdown, summarize, summarize_varied

    add = {arm: 1e-3 * (1 + i) for i, arm in enumerate(ARMS + VARIED_ARMS)}  # 1, 2, ... ms
    per_cut = {"llm-generate-varied": (0.0, 0.0), "engine-loop-varied": (20e-6, 12e-6),
               "engine-loop-varied-tp": (25e-6, 16e-6)}
    steps, calls = {}, {}
    for arm in ARMS:
        steps[arm] = [[_step(add[arm]), _step(20e-6), _step(21e-6), _step(22e-6)] for _ in range(3)]
        calls[arm] = [{"wall": 0.1, "cpu": 0.1, "tokens": 12, "tail": {}}] * 3
    for arm in VARIED_ARMS:
        cut = arm != "llm-generate-varied"
        rule, abort = per_cut[arm]
        between = _step(300e-6 if cut else 30e-6, cuts=10 if cut else 0, rule=10 * rule, abort=10 * abort)
        tail = {"cuts": 0, "cpu": {"gap": 1e-3, "rule": 0.0, "abort": 0.0, "gc": 0.0},
                "wall": {"gap": 1e-3, "rule": 0.0, "abort": 0.0, "gc": 0.0}}
        steps[arm] = [[_step(add[arm]), between, _step(25e-6)] for _ in range(3)]
        calls[arm] = [{"wall": 0.2, "cpu": 0.2, "tokens": 30, "tail": tail}] * 3
    result = {"G": 4, "max_tokens": 4, "varied_max_tokens": 8, "lengths_seed": 0, "warmup_rounds": 0, "rounds": 3,
              "by_requests": {"4": {"steps": steps, "calls": calls, "copy_seconds": [3e-4, 1e-4, 2e-4]}}}
    summary, varied = summarize(result), summarize_varied(result)
    fixed = summary["4"]["cpu"]
    assert fixed["llm-generate"]["add_ms"] == pytest.approx(1.0)
    assert fixed["engine-loop"]["extra_add_ms"]["median"] == pytest.approx(add["engine-loop"] * 1e3 - 1.0)
    assert fixed["engine-loop"]["loop_us"] == pytest.approx(20.5)  # decode steps: neither the first nor the last
    rows = varied["4"]["cpu"]
    reference = add["llm-generate-varied"] * 1e3
    for arm in VARIED_ARMS[1:]:
        assert rows[arm]["extra_add_ms"] == {"median": pytest.approx(add[arm] * 1e3 - reference),
                                             "min": pytest.approx(add[arm] * 1e3 - reference),
                                             "max": pytest.approx(add[arm] * 1e3 - reference)}
        assert rows[arm]["rule_us_per_cut"] == pytest.approx(per_cut[arm][0] * 1e6)
    tp = rows["engine-loop-varied-tp"]
    assert tp["tp_extra_rule_us_per_cut"]["median"] == pytest.approx(5.0)
    assert tp["tp_extra_abort_us_per_cut"]["median"] == pytest.approx(4.0)
    text = markdown({"machine_info": {"device": "cpu", "versions": {}, "load_average": {"before": [0], "after": [0]}},
                     "commit_info": {"id": "0" * 40, "dirty": False}, "datetime": "now", "result": result,
                     "summary": summary, "summary_varied": varied})
    assert "synchronous scheduling (the CPU engine's only mode)" in text and "Extrapolated for synchronous" in text
    assert "| 4 | engine-loop-varied-tp | 3 | 30 | 8.0 | 2.0 (2.0, 2.0) |" in text  # added in 8 ms, 6 ms
    assert "set; thread CPU time, median over the rounds): 0.2 ms at 4 requests." in text
