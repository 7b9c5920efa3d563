"""The built-in group filters' table (gfpo_trainer/filters.py): its names, each filter's ranking, and what its flags
promise."""

import math
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import gfpo_kernels
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


def test_unknown_filter_gets_the_closest_name():
    with pytest.raises(ValueError) as error:
        group_filter_spec("lenght")
    assert str(error.value) == f"group_filter must be None or one of {GROUP_FILTERS}, got group_filter='lenght' (did " \
                               "you mean 'length'?)"


@pytest.mark.parametrize("word, name", [
    ("shortest", "length"), ("Shortest k/G", "length"), ("shortest-8of16", "length"), ("shortest_4/16", "length"),
    ("reward per token", "token_efficiency"), ("efficiency", "token_efficiency"), ("token-efficiency-8of16", "token_efficiency"),
])
def test_paper_names_point_to_the_filter(word, name):
    """The paper's words (and the study's arm names) are told the name to write, with what that filter keeps; they
    are not taken as values."""
    with pytest.raises(ValueError) as error:
        group_filter_spec(word)
    assert str(error.value) == (f"group_filter must be None or one of {GROUP_FILTERS}, got group_filter={word!r} (did "
                                f"you mean {name!r}? the filter the paper calls {word!r}, which keeps "
                                f"{GROUP_FILTER_SPECS[name].summary})")


@pytest.mark.parametrize("word, hint", [("Length", " (did you mean 'length'?)"),
                                        ("TOKEN-EFFICIENCY", " (did you mean 'token_efficiency'?)"),
                                        ("token efficiency", " (did you mean 'token_efficiency'?)"),
                                        ("shortestpath", ""), ("xyz", "")])
def test_names_that_differ_in_case_or_are_no_paper_word(word, hint):
    with pytest.raises(ValueError) as error:
        group_filter_spec(word)
    assert str(error.value) == f"group_filter must be None or one of {GROUP_FILTERS}, got group_filter={word!r}{hint}"


def test_the_table_loads_without_torch():
    """The command line reads the names before torch is imported."""
    probe = "import sys; import gfpo_trainer.filters as f; print(f.GROUP_FILTERS, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.stdout.strip() == "('length', 'token_efficiency') False", done.stderr


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


# --------------------------------------------------------------------------- token efficiency's ranking

NAN = float("nan")


def token_efficiency_order_by_loop(rewards: list[float], lengths: list[float], G: int) -> list[list[int]]:
    """The rows of each group best first, in plain Python with exact fractions (docs/design.md, `group_filter`):
    reward / length descending; exact ties to the shorter where the reward is > 0, to the longer where it is <= 0;
    then the lower index; unscorable rows (NaN reward) last, by index."""
    def key(i):
        r, n = rewards[i], lengths[i]
        if math.isnan(r):
            return (1, 0, 0, i)
        return (0, -Fraction(r) / max(Fraction(n), 1), n if r > 0 else -n, i)

    return [sorted(range(g * G, (g + 1) * G), key=key) for g in range(len(rewards) // G)]


def token_efficiency_keep_by_loop(rewards: list[float], lengths: list[float], G: int, k: int) -> torch.Tensor:
    keep = torch.zeros(len(rewards), dtype=torch.bool)
    for order in token_efficiency_order_by_loop(rewards, lengths, G):
        keep[order[:k]] = True
    return keep


token_efficiency = GROUP_FILTER_SPECS["token_efficiency"]


def _order_of_scores(rewards, lengths, G):
    """The group orders the trainer's device path gives (best first; NaN scores last, by index, as the kernels)."""
    rewards, lengths = torch.tensor(rewards), torch.tensor(lengths)
    scores = token_efficiency.score(FilterInputs(rewards, lengths, torch.zeros_like(lengths), G)).tolist()
    assert all(math.isnan(score) == math.isnan(r) for score, r in zip(scores, rewards.tolist()))
    key = lambda i: (math.isnan(scores[i]), 0 if math.isnan(scores[i]) else -scores[i], i)  # noqa: E731
    return [sorted(range(g * G, (g + 1) * G), key=key) for g in range(len(scores) // G)]


@pytest.mark.parametrize("rewards, lengths, want", [
    # ties at 0 (0/1 rewards, wrong answers): the longer first
    ([0.0, 0.0, 0.0, 1.0], [3.0, 7.0, 5.0, 4.0], [3, 1, 2, 0]),
    # ties at a positive ratio: the shorter first (1/4 = 2/8 = 0.5/2)
    ([1.0, 2.0, 1.0, 0.5], [4.0, 8.0, 2.0, 2.0], [2, 3, 0, 1]),
    # ties at a negative ratio: the longer first, equal lengths by index (-1/4 = -2/8 = -0.5/2)
    ([-1.0, -2.0, -0.5, -1.0], [4.0, 8.0, 2.0, 4.0], [1, 0, 3, 2]),
    # -0.0 is a reward of 0: the longer first, ties with 0.0 by index
    ([0.0, -0.0, 0.0, -0.0], [2.0, 6.0, 6.0, 4.0], [1, 2, 3, 0]),
    # unscorable rows last, by index, whatever their length
    ([NAN, 0.0, NAN, 1.0], [1.0, 5.0, 9.0, 1.0], [3, 1, 0, 2]),
    # mixed: a positive tie, a tie at 0 (one -0.0), a negative tie, NaN, a length 0 (counted as 1 in the ratio)
    ([1.0, 0.0, 2.0, -1.0, NAN, -0.0, -3.0, 0.5, 0.0, 3.0],
     [4.0, 2.0, 8.0, 3.0, 2.0, 9.0, 9.0, 2.0, 0.0, 1.0], [9, 7, 0, 2, 5, 1, 8, 6, 3, 4]),
    # a reward too small to survive float32 division by its length still ranks above 0
    ([1e-45, 0.0, 0.0, 0.0], [7.0, 1.0, 2.0, 3.0], [0, 3, 2, 1]),
])
def test_token_efficiency_ranking_is_exact(rewards, lengths, want):
    G = len(rewards)
    assert token_efficiency_order_by_loop(rewards, lengths, G) == [want]
    assert _order_of_scores(rewards, lengths, G) == [want]
    for ops in (gfpo_kernels, ref):
        for k in range(1, G):
            scores = token_efficiency.score(FilterInputs(torch.tensor(rewards), torch.tensor(lengths),
                                                         torch.zeros(G), G))
            keep = ops.group_topk_mask(scores, G, k)
            assert sorted(keep.nonzero().squeeze(1).tolist()) == sorted(want[:k]), (ops.__name__, k)


@pytest.mark.parametrize("seed", range(4))
def test_token_efficiency_ranking_equals_the_loop_on_random_batches(seed):
    """Rewards drawn from few values (0/1, [-1, 1] in quarters, a few NaN, -0.0) and short lengths: ties of every
    kind, in many groups at once."""
    g = torch.Generator().manual_seed(seed)
    G, groups = 8, 64
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.25, -0.25, 0.5, -0.5, NAN])
    rewards = values[torch.randint(0, len(values), (G * groups,), generator=g)]
    lengths = torch.randint(0, 6, (G * groups,), generator=g).float()
    assert _order_of_scores(rewards.tolist(), lengths.tolist(), G) == token_efficiency_order_by_loop(
        rewards.tolist(), lengths.tolist(), G)
