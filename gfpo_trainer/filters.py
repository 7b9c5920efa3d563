"""The built-in group filters, one spec each: the table every other place reads.

A filter is its score (from the rewards, the completion lengths and the rows the early-stop rule cut; the k rows of
each group with the largest, or smallest, score are kept) and what the trainer may do with it: stop generating the
completions it will drop, report TRL's metrics over the kept rows, seed vLLM's requests one per completion.

Readers: GFPOConfig (the names, its vLLM checks), selection.select (the score), GFPOTrainer (the generation path,
the metrics), the command line (the names and the paper's words for them, checked before torch is imported: this
module imports torch only inside the score functions). Adding a filter: an entry in GROUP_FILTER_SPECS and a test of
its ranking.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Callable, NamedTuple

from ._names import did_you_mean

if TYPE_CHECKING:
    import torch


class FilterInputs(NamedTuple):
    """What a filter scores, every row of the global batch (N = groups x G, each group's G rows contiguous).

    rewards: (N,) float32, TRL's summed reward; NaN where unscorable (every reward function None, or infinite).
    lengths: (N,) float32, completion lengths in model tokens (a row the early-stop rule cut: as far as it ran).
    stopped: (N,) float32, 1.0 where the early-stop rule cut the row, else 0.0.
    group_size: G.
    """

    rewards: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    group_size: int


@dataclasses.dataclass(frozen=True)
class GroupFilterSpec:
    """One built-in filter.

    name: the value of GFPOConfig.group_filter.
    score: FilterInputs -> (N,) scores for gfpo_filter_advantages (NaN ranks last); the k best of a group are kept.
    largest: the largest scores are kept (else the smallest).
    early_stop: the kept rows are the k shortest of their group, so gfpo_stop_dropped_generations may stop the
        others once k have ended (the score must rank a cut row below every row that ended before the cut).
    trl_metrics_over_kept_rows: TRL's per-batch reward and completion metrics are recomputed over the kept rows
        (where the rule cuts the others short, those metrics over every row would describe cut text).
    vllm_request_seeds: on vLLM every completion is its own request, seeded from the trainer's random stream
        (gfpo_vllm_request_seeds), so the kept completions are the same with the early-stop rule on or off.
    summary: what it keeps, in a few words (error messages, the CLI's help).
    paper_names: what the paper (arXiv 2508.09726) and the length study's arms call it, so that a config saying
        `group_filter: shortest` is told the name to write (never taken silently: one name per filter).
    """

    name: str
    score: Callable[[FilterInputs], torch.Tensor]
    largest: bool
    early_stop: bool
    trl_metrics_over_kept_rows: bool
    vllm_request_seeds: bool
    summary: str
    paper_names: tuple[str, ...] = ()

    @property
    def own_generation(self) -> bool:
        """The trainer runs generation itself (its own random stream; one vLLM request per completion)."""
        return self.early_stop or self.vllm_request_seeds


def length_score(x: FilterInputs) -> torch.Tensor:
    """The completion's length, plus one where the early-stop rule cut it: a cut row would have held at least one
    more token than it holds (on vLLM it is aborted, without EOS, once it holds as many tokens as the k-th shortest
    finished one of its group: vllm_stop.py), so it ranks below those k, ties included. Smallest kept.

    Returns: (N,) float32."""
    return x.lengths + x.stopped


def token_efficiency_score(x: FilterInputs) -> torch.Tensor:
    """Each row's rank inside its group by reward / length, largest kept. Exact ties go to the shorter completion where
    the reward is > 0 and to the longer where it is <= 0 (the limit of reward / length as the reward approaches 0 from
    below: with 0/1 rewards the wrong answers kept, and trained against, are the long ones, as with negative rewards),
    then to the lower index. Unscorable rows (NaN reward) get NaN: they rank last. The ratio is taken in float64,
    where a float32 reward over a token count is neither rounded to a false tie nor to 0.

    Returns: (N,) float64, -(position in the group), NaN for unscorable rows."""
    import torch

    rewards, lengths = x.rewards.double(), x.lengths.double()
    efficiency = rewards / lengths.clamp(min=1.0)
    descending_efficiency = torch.nan_to_num(-efficiency, nan=torch.inf)  # NaN would sort first; it ranks last
    tie_break = torch.where(rewards > 0, lengths, -lengths)  # -0.0 and NaN rewards: <= 0 is not > 0
    position = rank_in_group([descending_efficiency, tie_break], x.group_size)
    return torch.where(torch.isnan(rewards), torch.nan, -position.to(torch.float64))


def rank_in_group(keys: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Each row's position inside its group (rows [g * G, (g + 1) * G)) when the group is sorted by `keys`, each (N,)
    and ascending, the first the most significant, then by index. Returns (N,) int64 in [0, G).

    Stable sorts, least significant key first. -0.0 is folded into 0.0 (a radix sort, as on CUDA, orders their bits
    apart); keys must hold no NaN."""
    import torch

    order = torch.arange(keys[0].numel(), device=keys[0].device)
    for key in reversed(keys):
        key = key + 0.0  # -0.0 + 0.0 = 0.0
        order = order[torch.argsort(key[order], stable=True)]
    order = order[torch.argsort(torch.div(order, group_size, rounding_mode="floor"), stable=True)]
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device) % group_size
    return position


GROUP_FILTER_SPECS: dict[str, GroupFilterSpec] = {spec.name: spec for spec in (
    GroupFilterSpec("length", length_score, largest=False, early_stop=True, trl_metrics_over_kept_rows=True,
                    vllm_request_seeds=True, summary="the k completions with the fewest tokens",
                    paper_names=("shortest", "shortest k/g", "shortest k", "shortest k of g", "short", "length filter",
                                 "response length", "completion length", "min length")),
    GroupFilterSpec("token_efficiency", token_efficiency_score, largest=True, early_stop=False,
                    trl_metrics_over_kept_rows=False, vllm_request_seeds=False,
                    summary="the k completions with the most reward per token",
                    paper_names=("token efficiency", "efficiency", "reward per token", "reward/length",
                                 "reward / length", "token efficient")),
)}
GROUP_FILTERS = tuple(GROUP_FILTER_SPECS)


def group_filter_spec(group_filter) -> GroupFilterSpec | None:
    """The spec of built-in filter `group_filter`, None for None (no built-in filter); ValueError naming the value
    and the choices for anything else."""
    if group_filter is None:
        return None
    spec = GROUP_FILTER_SPECS.get(group_filter) if isinstance(group_filter, str) else None
    if spec is None:
        named = filter_named_in_the_paper(group_filter)
        if named is None or named.name == "_".join(re.split(r"[\s_-]+", group_filter.strip().lower())):
            hint = did_you_mean(group_filter, GROUP_FILTERS) if named is None else f" (did you mean {named.name!r}?)"
        else:
            hint = (f" (did you mean {named.name!r}? the filter the paper calls {group_filter!r}, which keeps "
                    f"{named.summary})")
        raise ValueError(f"group_filter must be None or one of {GROUP_FILTERS}, got group_filter={group_filter!r}"
                         f"{hint}")
    return spec


def filter_named_in_the_paper(name) -> GroupFilterSpec | None:
    """The built-in filter that `name` is another word for (one of its `paper_names`, whatever the case, with `-` or
    `_` for spaces, or a study arm's name such as "shortest-8of16"), None when it is none of them."""
    if not isinstance(name, str):
        return None
    words = " ".join(re.split(r"[\s_-]+", name.strip().lower()))
    for spec in GROUP_FILTER_SPECS.values():
        for paper_name in (spec.name.replace("_", " "), *spec.paper_names):
            if words == paper_name or re.fullmatch(re.escape(paper_name) + r" \d+ ?(of|/) ?\d+", words):
                return spec
    return None
