"""gfpo_kernels.grpo_loss_math against TRL's own GRPOTrainer._compute_loss (the pinned TRL), called on a
stand-in trainer whose forward returns given log-probabilities: same loss, same gradient, same metrics.
If TRL renames or reshapes what `_compute_loss` reads, this test fails naming that attribute."""

import types
from collections import defaultdict

import pytest
import torch

from gfpo_kernels.grpo_loss_math import (LOSS_TYPES, GRPOLossOptions, grpo_loss_from_logps, token_grad_inputs,
                                          token_loss_gradient)

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

B, T = 4, 7


class _Accelerator:
    """One process: gather/reduce are the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(logps, entropies, inputs, opts: GRPOLossOptions, use_vllm: bool):
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    stand_in = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=opts.importance_sampling_level,
        beta=opts.beta,
        loss_type=opts.loss_type,
        epsilon_low=opts.epsilon_low,
        epsilon_high=opts.eps_high,
        use_vllm=use_vllm,
        vllm_importance_sampling_correction=use_vllm,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=opts.max_completion_length or T,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        _metrics=metrics,
        args=types.SimpleNamespace(
            use_bias_correction_kl=opts.use_bias_correction_kl,
            delta=opts.delta,
            sapo_temperature_pos=opts.sapo_temperature_pos,
            sapo_temperature_neg=opts.sapo_temperature_neg,
            vespo_k_pos=opts.vespo_k_pos,
            vespo_lambda_pos=opts.vespo_lambda_pos,
            vespo_k_neg=opts.vespo_k_neg,
            vespo_lambda_neg=opts.vespo_lambda_neg,
            steps_per_generation=1,
        ),
    )
    stand_in.get_off_policy_mask = grpo_trainer.GRPOTrainer.get_off_policy_mask
    stand_in.get_gamma_weights = grpo_trainer.GRPOTrainer.get_gamma_weights
    loss = grpo_trainer.GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, metrics["train"]


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[0] = 0.0  # an all-masked row
    mask[1, 0] = 1.0
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    ref = logps + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # TRL's vLLM ratio is exp((old - sampling) * mask): 1 at masked positions (vespo's phi sums its log everywhere)
    is_ratio = torch.where(mask != 0, 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64), 1.0)
    return logps, mask, old, ref, adv, is_ratio


CONFIGS = [
    dict(loss_type=lt, importance_sampling_level=level)
    for lt in LOSS_TYPES
    for level in ("token", "sequence")
] + [
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True),
    dict(loss_type="bnpo", delta=1.1, epsilon_high=0.28),
    dict(loss_type="dr_grpo", max_completion_length=12),
    dict(loss_type="cispo", epsilon_high=1.2),
    dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.3, beta=0.02),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.05),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0, vespo_lambda_neg=-1.0),
    dict(loss_type="vespo", beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
]


def _assert_matches_trl(opts, mask, adv, num_items, ours: dict, trl: dict):
    """grpo_loss_from_logps on `ours` (logps, old, ref, is_ratio: None where not given) against TRL's _compute_loss on
    `trl`: the same loss, gradient and metrics; returns our gradient."""
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "num_items_in_batch": num_items if num_items is not None else mask.sum(),
    }
    for key, name in (("old", "old_per_token_logps"), ("ref", "ref_per_token_logps"),
                      ("is_ratio", "importance_sampling_ratio")):
        if trl[key] is not None:
            inputs[name] = trl[key]
    use_vllm = trl["is_ratio"] is not None
    trl_logps = trl["logps"].clone().requires_grad_()
    trl_loss, trl_metrics = _trl_loss(trl_logps, torch.zeros(B, T, dtype=torch.float64), inputs, opts, use_vllm)
    (trl_grad,) = torch.autograd.grad(trl_loss, trl_logps)

    our_logps = ours["logps"].clone().requires_grad_()
    loss, stats = grpo_loss_from_logps(our_logps, mask, adv, opts, old_logps=ours["old"], ref_logps=ours["ref"],
                                       vllm_is_ratio=ours["is_ratio"], num_items_in_batch=num_items)
    (grad,) = torch.autograd.grad(loss, our_logps)

    assert torch.isfinite(trl_loss)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-12, atol=1e-12)
    scalars = {name: value for name, value in stats.items() if not name.startswith("per_token/")}
    for name, value in scalars.items():
        assert trl_metrics[name] == [pytest.approx(value.item(), rel=1e-9, abs=1e-12)], name
        assert stats["per_token/" + name].shape[0] == B  # the per-token values the trainer reduces
    expected_names = {"kl"} if opts.beta != 0.0 else set()
    if opts.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        expected_names |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    elif opts.loss_type == "cispo":
        expected_names |= {"cispo_clip_ratio"}
    elif opts.loss_type == "vespo":
        expected_names |= {"vespo/phi_seq_mean"}
    assert set(scalars) == expected_names
    return grad


@pytest.mark.parametrize("config", CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CONFIGS])
@pytest.mark.parametrize("with_old, with_vllm, with_num_items", [(True, False, False), (False, True, True)])
def test_matches_trl_compute_loss(config, with_old, with_vllm, with_num_items):
    opts = GRPOLossOptions(**config)
    logps, mask, old, ref, adv, is_ratio = _case(sum(map(ord, str(config))))
    num_items = torch.tensor(37.0, dtype=torch.float64) if with_num_items else None
    given = dict(logps=logps, old=old if with_old else None, ref=ref if opts.beta != 0.0 else None,
                 is_ratio=is_ratio if with_vllm else None)
    _assert_matches_trl(opts, mask, adv, num_items, given, given)


MASKED_CONFIGS = [dict(loss_type=lt, importance_sampling_level=level) for lt in LOSS_TYPES
                  for level in ("token", "sequence")]


@pytest.mark.parametrize("config", MASKED_CONFIGS, ids=lambda c: f"{c['loss_type']}-{c['importance_sampling_level']}")
@pytest.mark.parametrize("ratio_shape", ["(B,T)", "(B,1)", "(B,)"])
@pytest.mark.parametrize("garbage", ["-1e4", "non-finite"])
def test_masked_positions_take_no_part(config, ratio_shape, garbage):
    """Masked positions (padding, tool output) of old_logps, ref_logps and vllm_is_ratio hold anything
    (-1e4, where exp(0 - (-1e4)) = inf and inf x mask 0 = NaN; or +-inf, NaN), and our
    log-probabilities there are 0 (the fused loss does not score them): the loss, gradient and metrics are TRL's,
    whose log-probabilities there are real values (the old policy's own, near ours) and whose vLLM ratio there is
    exp(0) = 1. The gradient at masked positions is exactly 0."""
    beta = 0.0 if garbage == "-1e4" else 0.04  # -1e4 without KL, then every input at once
    opts = GRPOLossOptions(**config, beta=beta, use_bias_correction_kl=beta != 0.0)
    logps, mask, old, ref, adv, is_ratio = _case(sum(map(ord, str(config) + ratio_shape)))
    adv[1:3] = torch.tensor([-1.3, 0.7], dtype=torch.float64)  # a negative advantage turned inf into -inf
    masked = mask == 0
    tool_logps = -150.0 - torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    trl = dict(logps=torch.where(masked, tool_logps, logps), old=torch.where(masked, tool_logps + 0.1, old),
               ref=torch.where(masked, tool_logps - 0.2, ref) if beta else None)
    if garbage == "-1e4":
        bad = torch.full((B, T), -1e4, dtype=torch.float64)
    else:
        bad = torch.tensor([-1e4, float("inf"), float("-inf"), float("nan")], dtype=torch.float64).repeat(B * T)
        bad = bad[: B * T].view(B, T)
    ours = dict(logps=torch.where(masked, 0.0, logps), old=torch.where(masked, bad, old),
                ref=torch.where(masked, bad, ref) if beta else None)
    if ratio_shape == "(B,T)":
        trl["is_ratio"] = torch.where(masked, 1.0, is_ratio)
        ours["is_ratio"] = torch.where(masked, bad.exp() if garbage == "-1e4" else bad, is_ratio)
    else:  # one ratio a sequence; row 0 has no scored token: TRL's ratio there is 1, ours anything
        per_sequence = is_ratio[:, :1].clone()
        trl["is_ratio"] = torch.where(masked.all(-1, keepdim=True), 1.0, per_sequence)
        ours["is_ratio"] = torch.where(masked.all(-1, keepdim=True), float("nan"), per_sequence)
        if ratio_shape == "(B,)":
            ours["is_ratio"] = ours["is_ratio"].squeeze(1)
    assert masked.any() and masked.all(-1).any()

    grad = _assert_matches_trl(opts, mask, adv, None, ours, trl)
    assert torch.all(grad[masked] == 0)
    # without a vLLM ratio too (the trainer's common case), and old log-probs of -1e4 at sequence level as well
    trl["is_ratio"] = ours["is_ratio"] = None
    _assert_matches_trl(opts, mask, adv, None, ours, trl)


def test_token_local_gradient():
    """is_token_local promises d(loss)/d(logp[t]) does not depend on other tokens' log-probabilities: the fused kernel
    relies on it to take the gradient of one chunk of tokens at a time. vespo given old log-probabilities breaks it
    (its phi sums the sequence's log-ratios), so it must say so."""
    logps, mask, old, ref, adv, is_ratio = _case(3)

    def grad_at(x, opts, old_logps):
        x = x.clone().requires_grad_()
        loss, _ = grpo_loss_from_logps(x, mask, adv, opts, old_logps=old_logps, ref_logps=ref, vllm_is_ratio=is_ratio)
        return torch.autograd.grad(loss, x)[0]

    changed = logps.clone()
    changed[:, 3:] -= 1.0  # other tokens move
    for loss_type in LOSS_TYPES:
        opts = GRPOLossOptions(loss_type=loss_type, beta=0.05, use_bias_correction_kl=True)
        for old_logps in (old, None):
            local = opts.is_token_local(with_old_logps=old_logps is not None)
            assert local == (loss_type != "vespo" or old_logps is None)
            same = torch.allclose(grad_at(logps, opts, old_logps)[:, :3], grad_at(changed, opts, old_logps)[:, :3],
                                  rtol=1e-12, atol=1e-12)
            assert same == local, (loss_type, old_logps is None)
    for with_old in (True, False):
        assert not GRPOLossOptions(importance_sampling_level="sequence").is_token_local(with_old_logps=with_old)


TOKEN_LOCAL_CONFIGS = [c for c in CONFIGS if c.get("importance_sampling_level", "token") == "token"] + [
    dict(loss_type="grpo", delta=1.05, beta=0.07, use_bias_correction_kl=True, epsilon_low=0.1, epsilon_high=0.05),
    dict(loss_type="luspo", beta=0.03),
    dict(loss_type="sapo", beta=0.05, use_bias_correction_kl=True),
]


def _closed_form_and_autograd(logps, mask, adv, opts, **kwargs):
    """The loss gradient at the scored tokens two ways: token_loss_gradient (the closed form) and autograd through
    grpo_loss_from_logps; also the closed form's inputs and the tokens' flat positions."""
    x = logps.clone().requires_grad_()
    loss, _ = grpo_loss_from_logps(x, mask, adv, opts, **kwargs)
    (want,) = torch.autograd.grad(loss, x)
    positions = torch.nonzero(mask.reshape(-1) != 0).squeeze(1)
    inputs = token_grad_inputs(mask, positions, adv, opts, **kwargs)
    got = token_loss_gradient(logps.reshape(-1)[positions], inputs, opts)
    return got, want.reshape(-1)[positions], inputs, positions


@pytest.mark.parametrize("config", TOKEN_LOCAL_CONFIGS,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in TOKEN_LOCAL_CONFIGS])
@pytest.mark.parametrize("with_old", [True, False])
@pytest.mark.parametrize("ratio_shape", [None, "(B,T)", "(B,1)", "(B,)"])
def test_closed_form_loss_gradient_is_autograds(config, with_old, ratio_shape):
    """token_loss_gradient (the fused loss's d(loss)/d(logp) per stage, without autograd; the Triton log-prob pass
    computes the same) equals autograd through grpo_loss_from_logps at every scored token, for every token-local
    configuration: each loss type, KL with and without bias correction, delta, the vLLM ratio in each shape, a
    normaliser given or not, mask weights other than 1, fp32 as the fused loss computes it."""
    opts = GRPOLossOptions(**config)
    if not opts.is_token_local(with_old_logps=with_old):
        pytest.skip("vespo given old log-probs is not token-local: the fused loss takes autograd's two sweeps")
    logps, mask, old, ref, adv, is_ratio = (x.float() for x in _case(sum(map(ord, str(config))) + with_old))
    mask[2, 1:3] *= 0.5  # weights other than 1 scale a token's loss
    ratio = {None: None, "(B,T)": is_ratio, "(B,1)": is_ratio[:, :1], "(B,)": is_ratio[:, 0]}[ratio_shape]
    num_items = torch.tensor(23.0) if ratio_shape == "(B,1)" else None
    kwargs = dict(old_logps=old if with_old else None, ref_logps=ref if opts.beta != 0.0 else None,
                  vllm_is_ratio=ratio, num_items_in_batch=num_items)
    got, want, inputs, positions = _closed_form_and_autograd(logps, mask, adv, opts, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # a stage's rows alone give the same values (what the fused loss asks, stage by stage)
    lo, hi = 3, 7
    part = token_loss_gradient(logps.reshape(-1)[positions[lo:hi]], inputs.rows(lo, hi), opts)
    torch.testing.assert_close(part, got[lo:hi], rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_closed_form_weight_is_the_reductions_gradient(loss_type):
    """Each token's weight d(loss)/d(per-token loss) is taken from the loss's own reduction (the loss type's
    Normaliser.reduce in loss_types, where each normaliser lives once), so the closed form carries the very bits
    autograd does: at ratio 1 and advantage 1, where d(per-token loss)/d(logp) is exactly -1 for every loss type, token_loss_gradient equals
    autograd through grpo_loss_from_logps bit for bit, sequence lengths and normalisers of every kind (a weight
    written apart, 1 / (count * B), rounds otherwise than autograd's (1 / B) / count)."""
    opts = GRPOLossOptions(loss_type=loss_type, epsilon_high=4.0)  # cispo's clamp max(1, 4): the ratio 1 itself
    g = torch.Generator().manual_seed(9)
    B, T = 7, 13
    logps = -torch.rand(B, T, generator=g) * 3
    mask = (torch.arange(T) < torch.tensor([13, 11, 9, 7, 6, 5, 3]).unsqueeze(1)).float()
    adv = torch.ones(B)
    for num_items in (None, 41.0):
        got, want, _, _ = _closed_form_and_autograd(logps, mask, adv, opts, num_items_in_batch=num_items)
        assert torch.equal(got, want), (num_items, (got - want).abs().max())


def test_closed_form_follows_autograd_at_ties():
    """Inside the clip range the two sides of TRL's min are equal: autograd passes half the gradient to each, and
    the closed form does too (equal halves, so the full gradient); at a ratio above delta the first side passes
    nothing. Old log-probs equal to the policy's make every ratio exactly 1."""
    logps, mask, old, ref, adv, _ = (x.float() for x in _case(5))
    for opts, old_logps in ((GRPOLossOptions(loss_type="dapo"), logps.clone()),
                            (GRPOLossOptions(loss_type="bnpo", delta=1.0, epsilon_high=0.5), logps - 0.2)):
        got, want, _, _ = _closed_form_and_autograd(logps, mask, adv, opts, old_logps=old_logps)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vespo_weight_at_zero_advantage(level):
    """TRL's get_gamma_weights takes (k_pos, lambda_pos) where advantage >= 0, so a row of advantage exactly 0 (or
    -0.0) with moved log-probabilities gets the positive-side phi: its loss term is 0 either way, but phi enters
    vespo/phi_seq_mean (logged whenever such rows are trained: skip_zero_gradient_rows off, or beta != 0)."""
    opts = GRPOLossOptions(loss_type="vespo", importance_sampling_level=level, vespo_k_pos=1.5, vespo_lambda_pos=2.5,
                           vespo_k_neg=4.0, vespo_lambda_neg=0.5)
    logps, mask, old, ref, adv, is_ratio = _case(5)
    adv = torch.tensor([0.7, 0.0, -0.0, -1.2], dtype=torch.float64)
    assert mask[1:3].sum(-1).min() > 1  # the zero-advantage rows have moved ratios (phi != 1)
    for ratio in (None, is_ratio):
        given = dict(logps=logps, old=old, ref=None, is_ratio=ratio)
        _assert_matches_trl(opts, mask, adv, None, given, given)


def test_vespo_weight_clamps_match_trl():
    """vespo's phi in TRL's log space, on extreme but legal values at scored positions, where each of TRL's clamps
    decides: a token log-ratio past -20 (clamped per token), a sequence log-ratio below log(1e-8), a vLLM ratio of 0
    at a scored position (token_mask mode zeroes ratios outside its range: log 0 is clamped to log(1e-8)), and an
    old log-probability of NaN at a scored position (phi NaN, which TRL turns into 0: a finite loss). Small k and
    lambda keep phi far from 0 there, so a missing or moved clamp changes the loss, not only the last bits."""
    opts = GRPOLossOptions(loss_type="vespo", vespo_k_pos=0.1, vespo_lambda_pos=0.5, vespo_k_neg=0.1,
                           vespo_lambda_neg=0.5)
    logps = -2.0 - 0.1 * torch.arange(B * T, dtype=torch.float64).view(B, T)
    log_ratio = torch.zeros(B, T, dtype=torch.float64)
    log_ratio[0, :3] = torch.tensor([-25.0, 4.0, 4.0])  # per-token clamp: -20 + 8, not -17
    log_ratio[1, :2] = -10.0  # the sequence's -20 is clamped to log(1e-8)
    log_ratio[2, 0] = 5.0  # with the vLLM ratio 0 at position 1: 5 + log(1e-8)
    old = logps - log_ratio
    old[3, 2] = float("nan")
    mask = torch.ones(B, T, dtype=torch.float64)
    adv = torch.tensor([0.8, -0.6, 0.5, 0.3], dtype=torch.float64)
    is_ratio = torch.ones(B, T, dtype=torch.float64)
    is_ratio[2, 1] = 0.0
    for ratio in (None, is_ratio):
        given = dict(logps=logps, old=old, ref=None, is_ratio=ratio)
        _assert_matches_trl(opts, mask, adv, None, given, given)


NON_FINITE_CONFIGS = [
    dict(loss_type="grpo", delta=1.1),
    dict(loss_type="dapo", delta=1.5, beta=0.04, use_bias_correction_kl=True),
    dict(loss_type="bnpo"),
    dict(loss_type="sapo"),
    dict(loss_type="cispo"),
    dict(loss_type="luspo", beta=0.04),
]


@pytest.mark.parametrize("config", NON_FINITE_CONFIGS,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in NON_FINITE_CONFIGS])
def test_closed_form_follows_autograd_at_non_finite_ratios(config):
    """Old log-probabilities that make the fp32 ratio exp(logp - old) overflow (-100, -inf) or NaN at scored tokens:
    autograd multiplies what reaches the ratio by the ratio itself (exp's backward), so a clipped token gets
    0 * inf = NaN (TRL's fp32 loss does the same), and a NaN old log-prob gives NaN; the closed form must be
    non-finite at the same tokens (inf or NaN: the order of the terms decides which) and equal elsewhere, not a
    finite 0 where delta or the clip range cut the ratio off."""
    opts = GRPOLossOptions(**config)
    logps, mask, old, ref, adv, _ = (x.float() for x in _case(17))
    mask[1:] = 1.0
    adv[1], adv[2] = 1.0, -1.0
    old[1, :4] = torch.tensor([-100.0, float("-inf"), float("nan"), float("inf")])
    old[2, :4] = torch.tensor([-100.0, float("-inf"), float("nan"), float("inf")])
    kwargs = dict(old_logps=old, ref_logps=ref if opts.beta != 0.0 else None)
    got, want, _, _ = _closed_form_and_autograd(logps, mask, adv, opts, **kwargs)
    finite = torch.isfinite(want)
    assert not finite.all()
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-7)


def test_one_row_per_loss_type():
    """loss_types.LOSS_SPECS holds every TRL 1.16 loss type once, with the policy term and normaliser the lists it
    replaces gave them (clipped: grpo, bnpo, dr_grpo, dapo, luspo; num_items_in_batch: dapo, cispo, vespo), each term
    a Triton branch of its own; the trainer's row weights and skipping read it (gfpo_trainer/rows.py)."""
    from gfpo_kernels.loss_types import LOSS_SPECS, POLICY_TERMS

    rows = pytest.importorskip("gfpo_trainer.rows")
    assert tuple(LOSS_SPECS) == LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    terms = {name: spec.term.name for name, spec in LOSS_SPECS.items()}
    assert [name for name, term in terms.items() if term == "clipped"] == ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]
    assert (terms["cispo"], terms["sapo"], terms["vespo"]) == ("cispo", "sapo", "vespo")
    assert [n for n, s in LOSS_SPECS.items() if s.normaliser.token_count] == ["dapo", "cispo", "vespo"]
    assert [n for n, s in LOSS_SPECS.items() if s.normaliser.micro_batch_tokens] == ["bnpo"]
    assert sorted(t.triton_branch for t in POLICY_TERMS) == [1, 2, 3, 4]
    assert set(rows.PER_SEQUENCE_LOSSES) == {"grpo", "sapo", "luspo", "dr_grpo"}
    assert set(rows._SKIPPABLE_LOSSES) == set(LOSS_TYPES) - {"bnpo"}
