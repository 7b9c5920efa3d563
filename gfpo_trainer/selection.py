"""Selection: which rows of the generation batch GFPO trains on, and their advantages.

Scores every completion of the global batch (a built-in filter on device, or the user's `group_filter_func`),
chooses k (fixed, or per group with Adaptive Difficulty), and computes the kept mask and the advantages over the
kept rows in one call of `gfpo_filter_advantages` (the fused kernel, or the reference with use_gfpo_kernels=False).
"""

from __future__ import annotations

import inspect
import logging

import torch
from accelerate.utils import broadcast_object_list, gather_object
from trl.trainer.utils import nanstd

import gfpo_kernels
from gfpo_kernels import reference as gfpo_reference

from ._compat import TRLSurfaceError, batch_metric_names
from .batch import GenerationBatch, Selection
from .filters import FilterInputs, group_filter_spec
from .rewards import nonfinite_rows, summed_rewards, warn_nonfinite_rewards

logger = logging.getLogger(__name__)


def select(trainer, batch: GenerationBatch, rewards_per_func, completions, completion_ids_list,
           prompts=None) -> Selection:
    """Kept mask and advantages of the global batch (every process computes the same), from this process's rows
    and what `batch` knows of them: their tool masks (the length filters count the model's tokens only) and the rows
    the early-stop rule cut. `prompts` (this process's, one per row) name the prompt in the non-finite reward
    warning (rewards.py)."""
    G = trainer.num_generations
    args = trainer.args
    device = rewards_per_func.device
    # an unscorable row (every reward function returned None) ranks last under the reward-based filters and gets
    # advantage 0
    rewards = summed_rewards(trainer, rewards_per_func)
    counts = batch.model_token_counts() or [len(ids) for ids in completion_ids_list]
    # TRL's test of a clipped completion: it does not end in EOS or padding
    ends = {*trainer.eos_token_ids, trainer._tokenizer.pad_token_id}
    truncated = [float(ids[-1] not in ends) for ids in completion_ids_list]
    stopped = [0.0] * len(counts) if batch.stopped_rows is None else batch.stopped_rows.float().tolist()
    local = torch.tensor([counts, truncated, stopped], device=device, dtype=torch.float32).T  # (rows, 3): one gather
    lengths, truncated, stopped = trainer.accelerator.gather(local.contiguous()).unbind(dim=1)
    if lengths.numel() != rewards.numel():
        raise TRLSurfaceError(
            f"GRPOTrainer._calculate_rewards returned {rewards.numel()} rows, the batch holds {lengths.numel()}"
        )
    # A non-finite reward makes its row unscorable, and its whole group takes no part in the advantages, the batch
    # statistics or the digest (rewards.py): the other groups get what they would without it
    nonfinite = nonfinite_rows(rewards, rewards_per_func)
    dropped_groups = nonfinite.view(-1, G).any(dim=1)
    if dropped_groups.any():
        warn_nonfinite_rewards(trainer, rewards_per_func, nonfinite, prompts)
    rewards[nonfinite] = torch.nan
    advantage_rewards = rewards.masked_fill(dropped_groups.repeat_interleave(G), torch.nan)
    spec = group_filter_spec(args.group_filter)
    if spec is not None:
        scores, largest = spec.score(FilterInputs(rewards, lengths, stopped, G)), spec.largest
    else:
        scores, largest = _scores_from_func(trainer, completions, completion_ids_list, rewards), True

    quartile = None
    if trainer.adaptive_difficulty is not None:
        group_means = torch.nanmean(advantage_rewards.view(-1, G), dim=1)
        quartile, k = trainer.adaptive_difficulty.update_and_assign(group_means)
    else:
        k = args.num_remains_in_group
    ops = gfpo_kernels if args.use_gfpo_kernels else gfpo_reference
    keep, advantages = ops.gfpo_filter_advantages(advantage_rewards, scores, G, k, largest=largest,
                                                  scale=trainer.scale_rewards)
    return Selection(keep=keep, advantages=advantages, lengths=lengths, truncated=truncated.bool(), rewards=rewards,
                     rewards_per_func=rewards_per_func, k=k, quartile=quartile,
                     nonfinite_groups=int(dropped_groups.sum()))


def _accepts_completion_ids(func) -> bool:
    """Whether group_filter_func takes `group_completion_ids` (by name or through **kwargs); TRL's documented
    form `f(group_completions, group_rewards)` does not."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: pass only TRL's arguments
        return False
    return any(p.kind is p.VAR_KEYWORD or p.name == "group_completion_ids" for p in parameters)


def _scores_from_func(trainer, completions, completion_ids_list, rewards) -> torch.Tensor:
    """The user's scores, computed once on the main process and broadcast: a non-deterministic function (a sampling
    judge, a random tie-break) then still gives every process the same selection."""
    G = trainer.num_generations
    all_completions = gather_object(completions)
    all_ids = gather_object(list(completion_ids_list))
    num_groups = len(all_completions) // G
    message = [None]  # [("scores", list)] or [("error", text)] from the main process
    if trainer.accelerator.is_main_process:
        kwargs = dict(
            group_completions=[all_completions[g * G : (g + 1) * G] for g in range(num_groups)],
            group_rewards=rewards.view(-1, G).tolist(),
        )
        if _accepts_completion_ids(trainer.group_filter_func):
            kwargs["group_completion_ids"] = [all_ids[g * G : (g + 1) * G] for g in range(num_groups)]
        try:
            message = [("scores", _check_scores(trainer.group_filter_func(**kwargs), num_groups, G).tolist())]
        except Exception as error:  # every process must raise, not wait forever for the broadcast
            if trainer.accelerator.num_processes == 1:
                raise
            message = [("error", f"{type(error).__name__}: {error}")]
    if trainer.accelerator.num_processes > 1:
        message = broadcast_object_list(message, from_process=0)
    kind, value = message[0]
    if kind == "error":
        raise ValueError(f"group_filter_func failed on the main process: {value}")
    return torch.tensor(value, dtype=torch.float64).flatten().to(rewards.device)


def _check_scores(scores, num_groups: int, G: int) -> torch.Tensor:
    try:
        scores = torch.as_tensor(scores, dtype=torch.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"group_filter_func must return {num_groups} lists of {G} numbers (one score per completion), "
            f"got something that is not a rectangular list of numbers: {error}"
        ) from None
    if tuple(scores.shape) != (num_groups, G):
        raise ValueError(
            f"group_filter_func must return {num_groups} lists of {G} scores (groups x num_generations), "
            f"got shape {tuple(scores.shape)}"
        )
    bad = ~torch.isfinite(scores)
    if bad.any():
        g, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"group_filter_func returned a non-finite score {scores[g, i].item()} (group {g}, completion {i})")
    return scores


def log_selection(trainer, selection: Selection, stopped: torch.Tensor | None) -> None:
    """GFPO's selection metrics: kept fraction, kept vs dropped lengths, the rewards of the kept rows (TRL's reward
    metrics cover every completion, but with the length filter: log_trl_metrics_of_kept_rows), the groups dropped for
    a non-finite reward, the per-quartile k when adaptive."""
    metrics = trainer._metrics["train"]
    keep, lengths = selection.keep, selection.lengths
    metrics["gfpo/kept_fraction"].append(keep.float().mean().item())
    # the completion tokens generated for this batch (every process's; early-stopped ones as far as they ran, which
    # on a vLLM server is as far as the trainer received them: the server may run a cut stream a token or so on
    # before it sees the stream close)
    metrics["gfpo/generated_tokens"].append(lengths.sum().item())
    metrics["gfpo/kept_completion_length"].append(lengths[keep].mean().item() if keep.any() else float("nan"))
    dropped = ~keep
    dropped_length = lengths[dropped].mean().item() if dropped.any() else float("nan")
    if stopped is None:
        metrics["gfpo/dropped_completion_length"].append(dropped_length)
    else:
        # early-stopped completions were cut short: their lengths (here and in TRL's completions/*) are truncated
        metrics["gfpo/dropped_completion_length_truncated"].append(dropped_length)
        metrics["gfpo/stopped_early_fraction"].append(stopped.float().mean().item())
    # as TRL's reward, reward_std and frac_reward_zero_std, over the kept rows: the statistics the advantages used
    kept_rewards = torch.where(keep, selection.rewards.float(), torch.nan)
    group_std = nanstd(kept_rewards.view(-1, trainer.num_generations), dim=1)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    kept_per_group = keep.view(-1, trainer.num_generations).sum(dim=1)
    metrics["gfpo/kept_reward_mean"].append(torch.nanmean(kept_rewards).item())
    metrics["gfpo/kept_reward_std"].append(nanstd(kept_rewards).item())
    metrics["gfpo/kept_frac_reward_zero_std"].append(
        ((zero_std * kept_per_group).sum() / kept_per_group.sum().clamp(min=1)).item()
    )
    # groups that train nothing for a non-finite reward: this batch's, and the run's so far (saved with checkpoints;
    # one value, so the log shows the total at that step however many batches it spans)
    trainer.gfpo_nonfinite_reward_groups_total += selection.nonfinite_groups
    metrics["gfpo/nonfinite_reward_groups"].append(float(selection.nonfinite_groups))
    metrics["gfpo/nonfinite_reward_groups_total"] = [float(trainer.gfpo_nonfinite_reward_groups_total)]
    if selection.quartile is not None:
        quartile, k = selection.quartile, selection.k
        for q, k_q in enumerate(trainer.args.adaptive_num_remains):
            metrics[f"gfpo/k_quartile_{q}"].append(float(k_q))
            metrics[f"gfpo/groups_quartile_{q}"].append((quartile == q).float().mean().item())
        metrics["gfpo/mean_k"].append(k.float().mean().item())


def logged_metric_counts(trainer) -> dict[str, int]:
    """How many values each of TRL's per-batch metrics holds (before TRL logs a batch)."""
    metrics = trainer._metrics["train"]
    return {name: len(metrics.get(name, ())) for name in batch_metric_names(trainer)}


def log_trl_metrics_of_kept_rows(trainer, selection: Selection, counts_before: dict[str, int]) -> None:
    """With the length filter, TRL's per-batch reward and completion metrics (batch_metric_names) describe the kept
    rows: the early-stop rule cuts the other completions short, so over every completion they would report the
    lengths and rewards of cut text (and no truncation where there was some), and differ with the rule on and off.
    The kept rows all ended on their own (or ran to max_completion_length) and are the same completions with the rule
    on or off. The values are computed as GRPOTrainer computes them, and replace the ones it logged for this batch."""
    keep = selection.keep
    device = keep.device
    lengths, truncated = selection.lengths[keep], selection.truncated[keep]
    terminated = lengths[~truncated]
    if terminated.numel() == 0:  # TRL logs 0 when no completion ended
        terminated = torch.zeros(1, device=device)
    values = {
        "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.float().mean(),
        "completions/mean_terminated_length": terminated.mean(), "completions/min_terminated_length": terminated.min(),
        "completions/max_terminated_length": terminated.max(),
    }
    per_func = selection.rewards_per_func
    for i, name in enumerate(trainer.reward_func_names):
        values[f"rewards/{name}/mean"] = torch.nanmean(per_func[keep, i])
        values[f"rewards/{name}/std"] = nanstd(per_func[keep, i])
    rewards = summed_rewards(trainer, per_func)  # infinite rewards stay as they are here, as in TRL's metric
    kept_rewards = torch.where(keep, rewards, torch.nan)
    values["reward"], values["reward_std"] = torch.nanmean(kept_rewards), nanstd(kept_rewards)
    # frac_reward_zero_std: the share of rows whose advantage was scaled by a zero std (the group's, or the batch's
    # with scale_rewards="batch")
    G = trainer.num_generations
    if trainer.scale_rewards == "batch":
        std = nanstd(kept_rewards).expand(int(keep.sum()))
    else:
        std = nanstd(kept_rewards.view(-1, G), dim=1).repeat_interleave(G)[keep]
    values["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    metrics = trainer._metrics["train"]
    names = batch_metric_names(trainer)
    for name, value in zip(names, torch.stack([values[name].float() for name in names]).tolist()):  # one host read
        logged = metrics.get(name, [])
        if len(logged) != counts_before.get(name, 0) + 1:
            raise TRLSurfaceError(f"GRPOTrainer logged the metric {name!r} {len(logged) - counts_before.get(name, 0)} "
                                  "times for one generation batch; GFPO replaces its one value per batch")
        logged[-1] = value
