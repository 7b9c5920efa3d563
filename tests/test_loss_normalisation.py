"""gfpo_kernels.loss_types.trained_rows_normalisation: a trainer that trains a subset of a generation batch's rows
(the kept ones, less skipped zero-gradient rows, padded to equal shares per process and micro-batch) computes the loss
TRL computes over the rows the loss covers, divided evenly."""

import math
import types

import pytest
import torch

from gfpo_kernels.loss_types import LOSS_SPECS, trained_rows_normalisation

T = 5
OPTIONS = types.SimpleNamespace(max_completion_length=None)


def _batch(seed, N=24):
    g = torch.Generator().manual_seed(seed)
    per_token_loss = torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(N, T, generator=g) < 0.7).double()
    mask[:, 0] = 1.0  # every row holds a token
    return g, per_token_loss, mask


def _update_through_shares(spec, per_token_loss, mask, keep, trained, P, spg, rejected_in_loss=False):
    """The update TRL's loss makes (gradient accumulation over spg micro-batches, DDP's mean over P processes) when
    process p holds the trained rows trained[p * share:(p + 1) * share], padded with masked rows to `share`, weighted
    by trained_rows_normalisation."""
    share = math.ceil(math.ceil(max(len(trained), 1) / P) / spg) * spg
    row_tokens = mask.sum(dim=1).long()
    total = torch.zeros((), dtype=torch.float64)
    for p in range(P):
        mine = trained[p * share : (p + 1) * share]
        rows = torch.tensor(mine + [0] * (share - len(mine)), dtype=torch.long)
        real = torch.arange(share) < len(mine)
        normalisation = trained_rows_normalisation(spec, keep, row_tokens, real, P, rejected_in_loss=rejected_in_loss)
        ptl, m = per_token_loss[rows], mask[rows] * real.unsqueeze(1)
        B = share // spg
        for start in range(0, share, B):
            mb = slice(start, start + B)
            if spec.normaliser.token_count:  # TRL: num_items_in_batch / P, times GA / steps_per_generation (GA = spg)
                loss = spec.normaliser.reduce(ptl[mb], m[mb], OPTIONS, normalisation.num_items_in_batch / P)
            else:  # TRL divides by gradient_accumulation_steps
                loss = spec.normaliser.reduce(ptl[mb], m[mb], OPTIONS, None) / spg
            weight = normalisation.row_weights[mb].max() if spec.normaliser.per_sequence else 1.0  # one per micro-batch
            total = total + loss * weight / P
    return total


SPLITS = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)]
SPLIT_LOSSES = [name for name, spec in LOSS_SPECS.items() if not spec.normaliser.micro_batch_tokens]


def _kept_and_skipped(g, N, seed):
    keep = torch.zeros(N, dtype=torch.bool)
    keep[torch.randperm(N, generator=g)[: 5 + seed * 3]] = True
    kept = keep.nonzero().squeeze(1).tolist()
    return keep, kept, set(kept[::3])


@pytest.mark.parametrize("loss_type", SPLIT_LOSSES)
@pytest.mark.parametrize("P, spg", SPLITS)
@pytest.mark.parametrize("seed", range(3))
def test_trained_rows_weigh_as_in_an_even_split_of_the_kept_rows(loss_type, P, spg, seed):
    """Reference: TRL's loss over the kept rows in one micro-batch on one process (= an even split). Skipped rows
    (advantage 0: a zero per-token loss) are not trained but still counted."""
    spec = LOSS_SPECS[loss_type]
    g, per_token_loss, mask = _batch(seed)
    keep, kept, skipped = _kept_and_skipped(g, per_token_loss.size(0), seed)
    per_token_loss[list(skipped)] = 0.0
    trained = [r for r in kept if r not in skipped]
    want = spec.normaliser.reduce(per_token_loss[keep], mask[keep], OPTIONS, mask[keep].sum())
    got = _update_through_shares(spec, per_token_loss, mask, keep, trained, P, spg)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)  # float32 row weights


@pytest.mark.parametrize("loss_type", SPLIT_LOSSES)
@pytest.mark.parametrize("P, spg", SPLITS)
@pytest.mark.parametrize("rejected_trained", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_rejected_rows_in_the_loss_weigh_as_in_trls_loss_over_every_row(loss_type, P, spg, rejected_trained, seed):
    """The second case (rejected_in_loss, the paper's objective). Reference: TRL's loss over every row in one
    micro-batch, the rejected rows at advantage 0. With beta == 0 their per-token loss is 0 and they are skipped
    (counted, not trained), as are the kept rows of advantage 0; with a KL term (here: any per-token loss) they are
    trained."""
    spec = LOSS_SPECS[loss_type]
    g, per_token_loss, mask = _batch(seed)
    N = per_token_loss.size(0)
    keep, kept, skipped = _kept_and_skipped(g, N, seed)
    if rejected_trained:
        trained = list(range(N))
    else:
        skipped |= set(range(N)) - set(kept)
        per_token_loss[list(skipped)] = 0.0
        trained = [r for r in range(N) if r not in skipped]
    want = spec.normaliser.reduce(per_token_loss, mask, OPTIONS, mask.sum())
    got = _update_through_shares(spec, per_token_loss, mask, keep, trained, P, spg, rejected_in_loss=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)  # float32 row weights


def test_normalisation_of_a_micro_batch_token_mean_is_plain():
    """bnpo divides by each micro-batch's tokens: no per-row factor corrects that (the trainer neither pads nor skips
    for it), so its rows weigh 1; the token count is still the kept rows'."""
    keep = torch.tensor([True, False, True, True])
    out = trained_rows_normalisation(LOSS_SPECS["bnpo"], keep, torch.tensor([3, 4, 5, 6]), torch.tensor([True] * 3), 1)
    assert out.row_weights.tolist() == [1.0, 1.0, 1.0] and int(out.num_items_in_batch) == 14


def test_padding_rows_weigh_nothing():
    keep = torch.tensor([True, False, True, False])
    out = trained_rows_normalisation(LOSS_SPECS["grpo"], keep, torch.tensor([3, 4, 5, 6]),
                                     torch.tensor([True, False]), 2)
    assert out.row_weights.tolist() == [2.0, 0.0]  # P * share / K = 2 * 2 / 2
    assert out.row_weights.dtype == torch.float32 and int(out.num_items_in_batch) == 8
