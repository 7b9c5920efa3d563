"""gfpo_kernels.grpo_loss_math against TRL's own GRPOTrainer._compute_loss (the pinned TRL), called on a
stand-in trainer whose forward returns given log-probabilities: same loss, same gradient, same metrics.
If TRL renames or reshapes what `_compute_loss` reads, this test fails naming that attribute."""

import types
from collections import defaultdict

import pytest
import torch

from gfpo_kernels.grpo_loss_math import LOSS_TYPES, GRPOLossOptions, grpo_loss_from_logps

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
            steps_per_generation=1,
        ),
    )
    stand_in.get_off_policy_mask = grpo_trainer.GRPOTrainer.get_off_policy_mask
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
    is_ratio = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
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
]


@pytest.mark.parametrize("config", CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CONFIGS])
@pytest.mark.parametrize("with_old, with_vllm, with_num_items", [(True, False, False), (False, True, True)])
def test_matches_trl_compute_loss(config, with_old, with_vllm, with_num_items):
    opts = GRPOLossOptions(**config)
    logps, mask, old, ref, adv, is_ratio = _case(sum(map(ord, str(config))))
    num_items = torch.tensor(37.0, dtype=torch.float64) if with_num_items else None
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "num_items_in_batch": num_items if with_num_items else mask.sum(),
    }
    if with_old:
        inputs["old_per_token_logps"] = old
    if opts.beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    if with_vllm:
        inputs["importance_sampling_ratio"] = is_ratio

    trl_logps = logps.clone().requires_grad_()
    trl_loss, trl_metrics = _trl_loss(trl_logps, torch.zeros(B, T, dtype=torch.float64), inputs, opts, with_vllm)
    (trl_grad,) = torch.autograd.grad(trl_loss, trl_logps)

    our_logps = logps.clone().requires_grad_()
    loss, stats = grpo_loss_from_logps(
        our_logps, mask, adv, opts,
        old_logps=old if with_old else None,
        ref_logps=ref if opts.beta != 0.0 else None,
        vllm_is_ratio=is_ratio if with_vllm else None,
        num_items_in_batch=num_items,
    )
    (grad,) = torch.autograd.grad(loss, our_logps)

    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(loss)
    scalars = {name: value for name, value in stats.items() if not name.startswith("per_token/")}
    for name, value in scalars.items():
        assert trl_metrics[name] == [pytest.approx(value.item(), rel=1e-9, abs=1e-12)], name
        assert stats["per_token/" + name].shape[0] == logps.shape[0]  # the per-token values the trainer reduces
    expected_names = {"kl"} if opts.beta != 0.0 else set()
    if opts.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        expected_names |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    elif opts.loss_type == "cispo":
        expected_names |= {"cispo_clip_ratio"}
    assert set(scalars) == expected_names


def test_token_local_gradient():
    """token_local promises d(loss)/d(logp[t]) does not depend on other tokens' log-probabilities: the
    fused kernel relies on it to take the gradient of one chunk of tokens at a time."""
    logps, mask, old, ref, adv, _ = _case(3)
    for loss_type in LOSS_TYPES:
        opts = GRPOLossOptions(loss_type=loss_type, beta=0.05, use_bias_correction_kl=True)
        assert opts.token_local

        def grad_at(x):
            x = x.clone().requires_grad_()
            loss, _ = grpo_loss_from_logps(x, mask, adv, opts, old_logps=old, ref_logps=ref)
            return torch.autograd.grad(loss, x)[0]

        changed = logps.clone()
        changed[:, 3:] -= 1.0  # other tokens move
        torch.testing.assert_close(grad_at(logps)[:, :3], grad_at(changed)[:, :3], rtol=1e-12, atol=1e-12)
    assert not GRPOLossOptions(importance_sampling_level="sequence").token_local
