"""Rows: which rows of the global batch each process trains on, and what each weighs in the loss.

One mechanism for both reasons a batch is not divided evenly:
- GFPO keeps k of every group, and the kept rows need not divide by processes x steps_per_generation;
- rows whose advantage is exactly 0 carry no gradient (`skip_zero_gradient_rows`), so they are not trained on.
Every process takes an equal, steps_per_generation-divisible share of the rows to train (TRL's
`split_tensor_dict` would drop a remainder, and its loss gathers per-sequence metrics across processes and hangs on
unequal sizes). Missing rows are copies of a trained row with an all-zero completion mask, advantage 0 and vLLM
ratio 1.

Row weights and the loss's token count: a row must weigh in the loss what it would in an evenly divided batch of all
the rows the loss covers: the kept rows, skipped ones included (with GFPOConfig.loss_includes_rejected every sampled
row, the rejected ones at advantage 0, skipped or trained as such). gfpo_kernels.loss_types.trained_rows_normalisation
computes both from the kept mask, the rows' tokens and this process's share, and `weight_loss` applies the row
weight (one factor per micro-batch, since the rows of one batch share it). bnpo divides by the tokens of its own
micro-batch and by gradient_accumulation_steps: a micro-batch of padding rows only would shrink the step's gradient,
and which rows share a micro-batch changes every row's weight, so GFPOConfig refuses bnpo where the kept rows need
padding, and rows are not skipped for bnpo.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from gfpo_kernels.loss_types import LOSS_SPECS, trained_rows_normalisation

from ._compat import PROMPT_COMPLETION_KEYS, ROW_KEYS, TOKEN_MEAN_METRICS, TRLSurfaceError
from .batch import GenerationBatch, ShuffleReplay

logger = logging.getLogger(__name__)

# Loss types whose value is a mean over the sequences of a micro-batch (or divides by their number): from the loss
# types' table (gfpo_kernels.loss_types, Normaliser.per_sequence)
PER_SEQUENCE_LOSSES = tuple(name for name, spec in LOSS_SPECS.items() if spec.normaliser.per_sequence)
# Loss types whose gradient is exactly 0 for a row of advantage 0 and whose normaliser does not depend on which rows
# share a micro-batch (LossTypeSpec.zero_advantage_rows_skip; bnpo's normaliser does)
_SKIPPABLE_LOSSES = tuple(name for name, spec in LOSS_SPECS.items() if spec.zero_advantage_rows_skip)
REAL_ROW_KEY = "gfpo_real_row"
ROW_WEIGHT_KEY = "gfpo_row_weight"


# Float attributes through which transformers' modules apply dropout inline (`dropout=0.0 if not self.training else
# self.attention_dropout`, `hidden_dropout`, `residual_dropout`, ...), which TRL's disable_dropout (it zeroes
# nn.Dropout modules) misses; layer drop and router jitter also draw random numbers in training
_INLINE_DROPOUT_SUFFIXES = ("dropout", "dropout_p", "dropout_prob", "pdrop", "_drop", "layerdrop", "jitter_noise")


def dropout_active(model) -> bool:
    """Whether the policy's training forward draws random numbers: an nn.Dropout with p > 0, or a rate > 0 that a
    module applies inline (_INLINE_DROPOUT_SUFFIXES). Skipping rows then changes the batch shapes and so each row's
    draws."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for name, rate in module.__dict__.items():  # plain attributes only (submodules live in _modules)
            if isinstance(rate, float) and rate > 0 and name.endswith(_INLINE_DROPOUT_SUFFIXES):
                return True
    return False


def zero_gradient_skip_applies(trainer) -> bool:
    """Whether rows with advantage exactly 0 can leave the batch without changing loss or gradients: their loss
    term is advantage x (something finite) for every loss type in _SKIPPABLE_LOSSES, unless a term that does not
    depend on the advantage is added (the KL with beta != 0, the entropy bonus, an MoE auxiliary loss) or the
    rows take part in a statistic over the micro-batch (the entropy quantile mask), or an optimizer step covers part
    of a generation batch, or dropout draws depend on the batch's shape."""
    args = trainer.args
    return bool(
        args.skip_zero_gradient_rows
        and trainer.beta == 0.0
        and args.top_entropy_quantile == 1.0
        and not getattr(trainer, "_entropy_bonus_enabled", False)
        and not getattr(trainer, "aux_loss_enabled", False)
        and trainer.loss_type in _SKIPPABLE_LOSSES
        # each optimizer step sees whole generation batches: otherwise a generation batch straddles two steps,
        # TRL's shuffle decides which rows land in which, and skipping (a shorter batch) would change that split
        and args.gradient_accumulation_steps % args.steps_per_generation == 0
        and not _dropout_in_the_way(trainer)
    )


def _dropout_in_the_way(trainer) -> bool:
    """dropout_active, with a one-time warning: TRL's disable_dropout defaults to False, so a model with dropout
    (GPT-2, LoRA's lora_dropout) loses the skip unless the user turns it on."""
    if not dropout_active(trainer.model):
        return False
    trainer._warn_once("dropout", "gfpo: skip_zero_gradient_rows is not applied while dropout is active in the "
                       "policy (a shorter batch would draw other dropout masks, changing the update); every row is "
                       "trained. disable_dropout=True turns nn.Dropout off, and with it this fallback, where the "
                       "model has no inline attention dropout")
    return True


@dataclass
class TrainedRows:
    """Which rows of the global batch this process trains: `rows`, global indices, the first `n_real` real and the
    rest padding (copies of a row in the loss). Every process holds `share` rows, an equal, steps_per_generation-
    divisible share of the `trained` rows (the `in_loss` ones, less those of advantage 0 where skipped). The loss
    covers the kept rows, or every sampled row where `rejected_in_loss` (GFPOConfig.loss_includes_rejected)."""

    rows: torch.Tensor
    n_real: int
    share: int
    in_loss: int
    trained: int
    unskipped_share: int  # the share had no row been skipped
    rejected_in_loss: bool = False

    @property
    def skipped_fraction(self) -> float:
        return 1.0 - self.trained / max(self.in_loss, 1)


def plan_trained_rows(keep: torch.Tensor, advantages: torch.Tensor, skip_zero: bool, num_processes: int,
                      process_index: int, steps_per_generation: int, rejected_in_loss: bool = False) -> TrainedRows:
    """The rows process `process_index` of `num_processes` trains: the rows in the loss (`keep`, the global batch's,
    or every row where `rejected_in_loss`), less those of advantage exactly 0 when `skip_zero`, divided evenly in
    global order, padded to the share."""
    in_loss = (torch.ones_like(keep) if rejected_in_loss else keep).nonzero().squeeze(1)
    trained = in_loss[advantages[in_loss] != 0] if skip_zero else in_loss
    share = _share_per_process(trained.numel(), num_processes, steps_per_generation)
    mine = trained[process_index * share : (process_index + 1) * share]
    # padding rows copy a row in the loss (a valid forward) and are masked out by take_trained_rows
    rows = torch.cat([mine, in_loss[:1].expand(share - mine.numel())])
    return TrainedRows(rows=rows, n_real=mine.numel(), share=share, in_loss=in_loss.numel(), trained=trained.numel(),
                       unskipped_share=_share_per_process(in_loss.numel(), num_processes, steps_per_generation),
                       rejected_in_loss=rejected_in_loss)


def take_trained_rows(trainer, output: dict, keep: torch.Tensor, advantages: torch.Tensor, plan: TrainedRows) -> None:
    """Replaces the per-row tensors of `output` (TRL's dict of this process's rows) by the rows of `plan`, their
    padding masked out, with their loss weights and the loss's token count over the rows in the loss (the `keep`
    rows of the global batch, or all of them where plan.rejected_in_loss; `advantages` are the global batch's),
    cropped to the longest trained completion."""
    row_tokens = _global_row_tokens(trainer, output)  # before the exchange: every process's rows, in global order
    _exchange_rows(trainer, output, advantages, plan.rows)
    real = torch.arange(plan.share, device=plan.rows.device) < plan.n_real
    _mask_padding_rows(output, real)
    normalisation = trained_rows_normalisation(LOSS_SPECS[trainer.loss_type], keep, row_tokens, real,
                                               trainer.accelerator.num_processes,
                                               rejected_in_loss=plan.rejected_in_loss)
    output[REAL_ROW_KEY] = real
    output[ROW_WEIGHT_KEY] = normalisation.row_weights
    output["num_items_in_batch"] = normalisation.num_items_in_batch
    # less work in the old/reference passes and the loss, and the batch no longer depends on how long the dropped
    # completions ran (see gfpo_stop_dropped_generations); compute_loss crops each micro-batch further
    output.update(crop_to_longest_completion(trainer, output))


def _global_row_tokens(trainer, output: dict) -> torch.Tensor:
    """(N,) the loss tokens (completion mask x tool mask) of every row of the global batch."""
    loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
    return trainer.accelerator.gather(loss_mask.sum(dim=1))


def _exchange_rows(trainer, output: dict, advantages: torch.Tensor, rows: torch.Tensor) -> None:
    """`output`'s per-row tensors become the global rows `rows`: the advantages from the global ones every process
    holds, the others through one exchange plan across processes."""
    output["advantages"] = advantages[rows]
    row_keys = [k for k in output if k in ROW_KEYS and k != "advantages" and isinstance(output[k], torch.Tensor)]
    P = trainer.accelerator.num_processes
    exchange = RowExchangePlan(rows, output["completion_ids"].size(0)) if P > 1 and row_keys else None
    for key in row_keys:
        output[key] = take_global_rows(trainer, key, output[key], rows, exchange)


def _mask_padding_rows(output: dict, real: torch.Tensor) -> None:
    """Padding rows (`real` False) train nothing: completion mask 0, advantage 0, and vLLM's ratio 1 (no correction,
    not the copied row's: TRL's vespo sums log(ratio) over every position, masked or not, into its logged weight
    phi; the fused loss keeps masked positions out)."""
    output["completion_mask"] = output["completion_mask"] * real.unsqueeze(1).to(output["completion_mask"].dtype)
    output["advantages"] = torch.where(real, output["advantages"], 0.0)
    if "importance_sampling_ratio" in output:
        is_ratio = output["importance_sampling_ratio"]
        output["importance_sampling_ratio"] = torch.where(real.view(-1, *[1] * (is_ratio.dim() - 1)), is_ratio, 1.0)


def shuffle_replay_after_skipping(plan: TrainedRows) -> ShuffleReplay | None:
    """Where skipped rows shorten the batch: TRL's shuffle draws a permutation of this process's rows from the CPU
    generator, and a shorter one leaves another state, so the next generation would sample differently than with the
    skip off. The states restore_shuffle_rng needs to put back the one the unskipped batch's shuffle leaves, after
    checking that TRL drew exactly the one permutation of the trained rows (a TRL that draws otherwise is an error
    there). Called as the batch is handed to TRL."""
    if plan.unskipped_share == plan.share:
        return None
    return ShuffleReplay(handed_over=torch.get_rng_state(), after_trained_shuffle=rng_state_after_shuffle(plan.share),
                         after_unskipped_shuffle=rng_state_after_shuffle(plan.unskipped_share))


def crop_to_longest_completion(trainer, batch: dict) -> dict:
    """`batch` (a dict of rows, TRL's layout) with the padding columns past its longest completion dropped from every
    right-padded row tensor (completion_ids, completion_mask, old/ref log-probs, ...): a causal model computes the same
    values for the tokens before them, and every loss and metric counts masked positions out, so only the work on
    padding goes. The width keeps TRL's pad_to_multiple_of (Neuron and torch.compile compile once per shape), and at
    least 2 columns: TRL's metrics (and the fused path's) read a (B, 1) tensor as one value per sequence
    (sequence-level sampling), so a width of 1 would count the padding rows' entropy and clip ratios as real ones; a
    batch generated 1 token wide (max_completion_length=1, or the early-stop rule ending every group at its first
    token) gets a padding column. Prompts keep their width: with absolute position embeddings their left padding
    sets the positions. The multimodal token types spanning prompt and completion (PROMPT_COMPLETION_KEYS) lose the
    same completion columns. Returns a new dict (the tensors it does not crop are shared)."""
    T = batch["completion_ids"].size(1)
    width = max(2, int(batch["completion_mask"].sum(dim=1).max()))
    if trainer.pad_to_multiple_of:
        width = -(-width // trainer.pad_to_multiple_of) * trainer.pad_to_multiple_of
    width = min(max(T, 2), width)
    cropped = dict(batch)
    if width == T:
        return cropped
    for key, value in batch.items():
        if key in ROW_KEYS and isinstance(value, torch.Tensor) and value.dim() > 1 and value.size(1) == T:
            pad_value, pad_left = row_padding(trainer, key)
            if not pad_left:
                cropped[key] = pad_to_width(value[:, :width], width, pad_value, pad_left=False)
        elif key in PROMPT_COMPLETION_KEYS and isinstance(value, torch.Tensor):
            P = batch["prompt_ids"].size(1)  # the completion's columns are the last T (0 there: text tokens)
            if value.dim() != 2 or value.size(1) != P + T:
                raise TRLSurfaceError(f"the batch's {key!r} has shape {tuple(value.shape)}, not (rows, prompt + "
                                      f"completion width) = (rows, {P + T})")
            cropped[key] = pad_to_width(value[:, : P + width], P + width, 0, pad_left=False)
    return cropped


def _share_per_process(num_rows: int, P: int, spg: int) -> int:
    """Rows each of P processes trains for `num_rows` rows in all: an equal share, a multiple of spg, at least spg."""
    return math.ceil(math.ceil(max(num_rows, 1) / P) / spg) * spg


def rng_state_after_shuffle(num_rows: int) -> torch.Tensor:
    """The CPU random state once TRL's `shuffle_sequence_dict` has drawn its permutation of `num_rows` rows from
    the current state (which is left as it was)."""
    state = torch.get_rng_state()
    torch.randperm(num_rows)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    return after


def restore_shuffle_rng(batch: GenerationBatch | None) -> None:
    """Called before the loss of a batch: after a batch with skipped rows (its shuffle_replay), the CPU random state
    becomes the one an unskipped batch's shuffle leaves, so every later draw is what it would be with the skip off.
    The state found must be the one TRL's shuffle of the trained rows leaves (one torch.randperm of their number, from
    the state the batch was handed over in), or that state itself (the loss called on the batch directly, outside
    TRL's training step: nothing was drawn, nothing to replay). Anything else means TRL draws otherwise now, and
    replaying would silently repeat or skip random numbers."""
    replay = None if batch is None else batch.shuffle_replay
    if replay is None:
        return
    batch.shuffle_replay = None
    current = torch.get_rng_state()
    if torch.equal(current, replay.after_trained_shuffle):  # (first: a permutation of 0 or 1 rows may draw nothing)
        torch.set_rng_state(replay.after_unskipped_shuffle)
        return
    if not torch.equal(current, replay.handed_over):
        raise TRLSurfaceError(
            "GRPOTrainer's CPU random draws between a generation batch and its first loss are no longer one "
            "torch.randperm over the batch's rows (trl.trainer.utils.shuffle_sequence_dict), which "
            "skip_zero_gradient_rows replays to keep later draws as without skipping; set skip_zero_gradient_rows=False"
        )


def row_padding(trainer, key: str) -> tuple:
    """(pad value, pads on the left) of row key `key` (ROW_KEYS; None there is the tokenizer's pad id)."""
    pad_value, pad_left = ROW_KEYS[key]
    return (trainer._tokenizer.pad_token_id if pad_value is None else pad_value), pad_left


def take_global_rows(trainer, key: str, tensor: torch.Tensor, rows: torch.Tensor,
                     exchange: RowExchangePlan | None = None) -> torch.Tensor:
    """tensor's rows at global indices `rows` (local rows of every process, in process order).

    Only the requested rows travel (an all-to-all), so a process receives its own rows, not the global batch;
    tensors of different widths are padded to the widest process's width first (on the left for prompts).
    `exchange`: the plan for `rows` (built here when not given), shared by every tensor of a batch."""
    if trainer.accelerator.num_processes == 1:
        return tensor[rows]
    if exchange is None:
        exchange = RowExchangePlan(rows, tensor.size(0))
    pad_value, pad_left = row_padding(trainer, key)
    return exchange.exchange(tensor, pad_value, pad_left)


class RowExchangePlan:
    """Who sends which local rows to whom, so that this process receives the global rows `rows`; built once per
    batch from two tiny collectives (the local row counts, the requested indices), reused for every tensor."""

    def __init__(self, rows: torch.Tensor, num_local_rows: int):
        import torch.distributed as dist

        self.rows = rows
        world = dist.get_world_size()
        device = rows.device
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([num_local_rows], dtype=torch.long, device=device))
        ends = torch.cat(counts).cumsum(0)
        if rows.numel() and int(rows.max()) >= int(ends[-1]):
            raise ValueError(f"rows asks for global row {int(rows.max())}; the processes hold {int(ends[-1])} rows")
        owner = torch.searchsorted(ends, rows.long(), right=True)
        local = rows.long() - (ends - torch.cat(counts))[owner]
        # requests grouped by owning process; `order` puts the received rows back in the order of `rows`
        self.order = torch.argsort(owner, stable=True)
        self.recv_splits = torch.bincount(owner, minlength=world).tolist()
        send_counts = torch.empty(world, dtype=torch.long, device=device)
        dist.all_to_all_single(send_counts, torch.tensor(self.recv_splits, dtype=torch.long, device=device))
        self.send_splits = send_counts.tolist()
        self.send_index = torch.empty(sum(self.send_splits), dtype=torch.long, device=device)
        dist.all_to_all_single(self.send_index, local[self.order].contiguous(), output_split_sizes=self.send_splits,
                               input_split_sizes=self.recv_splits)

    def exchange(self, tensor: torch.Tensor, pad_value, pad_left: bool) -> torch.Tensor:
        """This process's rows of `tensor` (its local rows on every process), padded to the widest width."""
        import torch.distributed as dist

        if tensor.dim() > 1:
            width = torch.tensor([tensor.size(1)], dtype=torch.long, device=tensor.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            tensor = pad_to_width(tensor, int(width), pad_value, pad_left)
        dtype = tensor.dtype
        if dtype == torch.bool:  # not every backend reduces or moves bool: move bytes
            tensor = tensor.to(torch.uint8)
        received = tensor.new_empty((len(self.rows),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(received, tensor[self.send_index].contiguous(), output_split_sizes=self.recv_splits,
                               input_split_sizes=self.send_splits)
        out = torch.empty_like(received)
        out[self.order] = received
        return out.to(dtype)


def pad_to_width(tensor: torch.Tensor, width: int, pad_value, pad_left: bool) -> torch.Tensor:
    """`tensor` padded along dim 1 to `width` with `pad_value`, on the left or the right."""
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    pad = tensor.new_full((tensor.size(0), missing) + tuple(tensor.shape[2:]), pad_value)
    return torch.cat([pad, tensor] if pad_left else [tensor, pad], dim=1)


def weight_loss(loss: torch.Tensor, inputs: dict, loss_type: str, unweighted: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The micro-batch loss with its rows weighted as in an evenly divided batch (see the module docstring). All
    real rows of a generation batch share one weight, so it is one factor; the rows of a micro-batch of padding
    rows only have a zero loss either way. `unweighted`: the part of `loss` that is not made of rows (an MoE
    model's router auxiliary loss, one value per micro-batch in TRL), which keeps its value (in a padding-only
    micro-batch too: TRL adds one per micro-batch)."""
    weights = inputs.get(ROW_WEIGHT_KEY)
    if weights is None or loss_type not in PER_SEQUENCE_LOSSES:
        return loss
    if unweighted is None:
        return loss * weights.max()
    return (loss - unweighted) * weights.max() + unweighted


@contextlib.contextmanager
def no_metrics_from_padding_only(trainer, inputs: dict):
    """Around a micro-batch's loss: when it holds padding rows only, on every process, its token means (entropy,
    kl, clip ratios) average no token, and TRL logs them as 0, which the step's mean would count (an unfiltered batch
    has no such micro-batch). They are logged as NaN instead, which TRL's log leaves out of the mean (real rows
    without a scored token keep TRL's 0). One all-reduce of a row count and one host read per micro-batch of a
    batch whose rows were filtered or skipped (REAL_ROW_KEY: the same on every process)."""
    if REAL_ROW_KEY not in inputs:
        yield
        return
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    logged_before = {name: len(metrics[name]) for name in TOKEN_MEAN_METRICS if name in metrics}
    yield
    if trainer.accelerator.reduce(inputs[REAL_ROW_KEY].sum().float(), reduction="sum").item() == 0:
        for name in TOKEN_MEAN_METRICS:
            values = metrics.get(name, [])
            for i in range(logged_before.get(name, 0), len(values)):
                values[i] = float("nan")
