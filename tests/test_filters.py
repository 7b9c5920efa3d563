"""The built-in group filters' table (gfpo_trainer/filters.py): its names, each filter's ranking, and what its flags
promise."""

import re
from pathlib import Path

import pytest
import torch

from gfpo_kernels import reference as ref
from gfpo_trainer.filters import GROUP_FILTER_SPECS, GROUP_FILTERS, FilterInputs, group_filter_spec

ROOT = Path(__file__).parents[1]


def test_group_filters_are_the_table_keys():
    assert GROUP_FILTERS == tuple(GROUP_FILTER_SPECS) and len(GROUP_FILTERS) >= 2
    assert all(spec.name == name for name, spec in GROUP_FILTER_SPECS.items())
    assert group_filter_spec(None) is None


@pytest.mark.parametrize("bad", ["shortest", "Length", ["length"], 3])
def test_unknown_filter_names_value_and_choices(bad):
    with pytest.raises(ValueError, match=re.escape(f"group_filter must be None or one of {GROUP_FILTERS}, got "
                                                   f"group_filter={bad!r}")):
        group_filter_spec(bad)


def test_length_score_puts_a_cut_row_one_token_further():
    lengths, stopped = torch.tensor([3.0, 5.0, 5.0, 2.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])
    spec = GROUP_FILTER_SPECS["length"]
    assert spec.score(FilterInputs(torch.zeros(4), lengths, stopped, 4)).tolist() == [3.0, 6.0, 5.0, 2.0]
    assert not spec.largest


@pytest.mark.parametrize("name", [name for name, spec in GROUP_FILTER_SPECS.items() if spec.early_stop])
@pytest.mark.parametrize("cut_extra", [0, 1])  # vLLM aborts a row holding s tokens; HF generate forces EOS at s + 1
def test_early_stop_filters_keep_the_shortest_and_never_a_cut_row(name, cut_extra):
    """What `early_stop` promises: once k rows of a group have ended (the k-th of them at length s), the rule cuts
    the others, which hold s (+1) tokens and are marked stopped; the filter then keeps exactly the rows it keeps
    without the rule (the k shortest, ties to the lower index), none of them cut."""
    spec = GROUP_FILTER_SPECS[name]
    g = torch.Generator().manual_seed(0)
    G, k, groups = 8, 3, 200
    full = torch.randint(1, 12, (groups * G,), generator=g).float()  # many ties
    rewards = torch.randn(groups * G, generator=g)
    s = full.view(groups, G).sort(dim=1).values[:, k - 1].repeat_interleave(G)
    stopped = (full > s).float()
    cut = torch.where(stopped.bool(), s + cut_extra, full)
    keep, _ = ref.gfpo_filter_advantages(rewards, spec.score(FilterInputs(rewards, cut, stopped, G)), G, k,
                                         largest=spec.largest)
    assert stopped.any() and not (keep & stopped.bool()).any()
    assert torch.equal(keep, ref.group_topk_mask(full, G, k, largest=False))


def test_own_generation_is_early_stop_or_seeded_requests():
    for spec in GROUP_FILTER_SPECS.values():
        assert spec.own_generation == (spec.early_stop or spec.vllm_request_seeds)


def test_trainer_docs_table_matches_the_specs():
    """docs/trainer.md's table of built-in filters: one row per filter, its flags as the table has them."""
    text = (ROOT / "docs" / "trainer.md").read_text()
    section = text.split("### Built-in filters", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `\"(\w+)\"` \| .*? \| (yes|no) \| (yes|no) \| (yes|no) \|$", section, re.M)
    assert {name: tuple(flags) for name, *flags in rows} == {
        name: tuple("yes" if flag else "no" for flag in (spec.early_stop, spec.trl_metrics_over_kept_rows,
                                                           spec.vllm_request_seeds))
        for name, spec in GROUP_FILTER_SPECS.items()}
