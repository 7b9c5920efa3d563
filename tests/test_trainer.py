"""GFPOTrainer on a tiny Qwen2-style model and a character tokenizer made in code (no downloads), on CPU."""

import math
import re

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

import gfpo_kernels  # noqa: E402
from gfpo_kernels import reference as ref  # noqa: E402
from gfpo_trainer import GROUP_FILTERS, GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer._compat import TRLSurfaceError, check_output, check_trl_surfaces  # noqa: E402
from gfpo_trainer.config import GFPO_SWITCHES  # noqa: E402
from gfpo_trainer.adaptive import AdaptiveDifficulty  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402
from gfpo_test_utils import kept_rows  # noqa: E402

PROMPTS = ["1+2=", "3*4=", "5-1=", "9+9=", "2*3=", "7-4=", "8+1=", "6*2="]


def digit_reward(completions, **kwargs):
    """Rewards with ties and a spread: digits count, a little credit for brevity."""
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_config(tmp_path, **overrides):
    options = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8, num_remains_in_group=3,
        group_filter="length", max_completion_length=8, max_steps=1, report_to="none", use_cpu=True, bf16=False,
        logging_steps=1, save_strategy="no", seed=0, loss_type="grpo", temperature=1.0,
    )
    options.update(overrides)
    return GFPOConfig(**options)


def make_trainer(model_dir, tokenizer, tmp_path, group_filter_func=None, reward=digit_reward, **overrides):
    args = make_config(tmp_path, **overrides)
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    return GFPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                       processing_class=tokenizer, group_filter_func=group_filter_func)


def generation_batch(trainer, num_prompts=None):
    G = trainer.num_generations
    n = num_prompts or trainer.args.generation_batch_size // G
    return [{"prompt": p} for p in PROMPTS[:n] for _ in range(G)]


class Spy:
    """Records what GRPOTrainer._calculate_rewards saw and returned."""

    def __init__(self, trainer):
        self.calls = []
        original = trainer._calculate_rewards

        def spy(inputs, prompts, completions, completion_ids_list):
            out = original(inputs, prompts, completions, completion_ids_list)
            self.calls.append(dict(completions=completions, ids=[list(x) for x in completion_ids_list], rewards=out))
            return out

        trainer._calculate_rewards = spy


def scored_batch(trainer, seed=0):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the tests call compute_loss directly
    spy = Spy(trainer)
    torch.manual_seed(seed)
    output = trainer._generate_and_score_completions(generation_batch(trainer))
    return output, spy.calls[-1]


def real_rows(output):
    return kept_rows(output), output["advantages"][output["gfpo_real_row"]]


# --------------------------------------------------------------------------- config and construction


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_remains_in_group=8), r"2 <= k < num_generations=8 \(with k = 1 every advantage is 0\), got num_remains_in_group=8"),
        (dict(num_remains_in_group=0), r"got num_remains_in_group=0"),
        (dict(num_remains_in_group=1), r"2 <= k < num_generations=8 .*got num_remains_in_group=1"),
        (dict(adaptive_difficulty=True, adaptive_num_remains=[4, 3, 2, 1]), r"2 <= k <= num_generations=8, got adaptive_num_remains=\[4, 3, 2, 1\]"),
        (dict(group_filter="shortest"), re.escape(f"group_filter must be None or one of {GROUP_FILTERS}, got "
                                                  "group_filter='shortest'")),
        (dict(adaptive_difficulty=True), r"adaptive_num_remains must be 4 ints"),
        (dict(adaptive_difficulty=True, adaptive_num_remains=[8, 6, 4]), r"got adaptive_num_remains=\[8, 6, 4\]"),
        (dict(adaptive_difficulty=True, adaptive_num_remains=[9, 6, 4, 2]), r"2 <= k <= num_generations=8"),
        (dict(adaptive_num_remains=[4, 4, 4, 4]), r"adaptive_difficulty=False"),
        (dict(adaptive_difficulty=True, adaptive_num_remains=[4] * 4, num_remains_in_group=None), r"needs num_remains_in_group"),
        (dict(multi_objective_aggregation="normalize_then_sum"), r"multi_objective_aggregation='normalize_then_sum'"),
        (dict(scale_rewards="groupp"),
         r"scale_rewards must be one of \('group', 'batch', 'none'\), True or False, got scale_rewards='groupp' "
         r"\(did you mean 'group'\?\)$"),
        (dict(scale_rewards="true"), r"got scale_rewards='true'"),
        (dict(scale_rewards=2), r"got scale_rewards=2"),
        (dict(scale_rewards=["group"]), r"got scale_rewards=\['group'\]"),
        # micro-batches of 4 completions, 3 of every 8 kept: 1.5 kept rows a micro-batch, so padding rows
        (dict(entropy_coef=0.1, per_device_train_batch_size=4, gradient_accumulation_steps=2),
         r"entropy bonus \(entropy_coef=0.1, use_adaptive_entropy=False\) needs .* \(got 4 \* 3 and 8\)"),
        (dict(entropy_coef=0.1, per_device_train_batch_size=4, gradient_accumulation_steps=2, loss_type="dapo"),
         r"entropy bonus"),
        # bnpo divides each micro-batch's token mean by gradient_accumulation_steps: padding-only micro-batches
        # would shrink the step's gradient (to 1/2 with two of four micro-batches padding)
        (dict(loss_type="bnpo", per_device_train_batch_size=4, gradient_accumulation_steps=2),
         r"loss_type='bnpo' .* needs the kept rows to divide evenly .* \(got 4 \* 3 and 8\)"),
        (dict(loss_type="bnpo", adaptive_difficulty=True, adaptive_num_remains=[4, 4, 4, 4]),
         r"loss_type='bnpo'.*adaptive_difficulty \(got True\)"),
        (dict(use_adaptive_entropy=True, num_remains_in_group=4, adaptive_difficulty=True,
              adaptive_num_remains=[4, 4, 4, 4]), r"adaptive_difficulty \(got True\)"),
        (dict(loss_includes_rejected="yes"),
         re.escape("loss_includes_rejected must be one of (True, False), got loss_includes_rejected='yes'")),
        (dict(loss_includes_rejected=1), r"got loss_includes_rejected=1$"),
        *[(dict([(name, "false")]), re.escape(f"{name} must be one of (True, False), got {name}='false'"))
          for name in GFPO_SWITCHES],
    ],
)
def test_config_rejects_bad_values(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config(tmp_path, **overrides)


@pytest.mark.parametrize("value, stored", [("group", "group"), ("batch", "batch"), ("none", "none"), (True, "group"),
                                           (False, "none"), (1, "group"), (0, "none")])
def test_config_accepts_trl_scale_rewards(tmp_path, value, stored):
    """Every value TRL's advantage code accepts passes the check (True/False, and 1/0, as TRL maps them)."""
    assert make_config(tmp_path, scale_rewards=value).scale_rewards == stored


def test_entropy_bonus_with_evenly_dividing_kept_rows_is_accepted(tmp_path):
    """8 * 4 / 8 = 4 kept rows per micro-batch: no padding, no weight other than 1: TRL's bonus as it is."""
    assert make_config(tmp_path, entropy_coef=0.1, num_remains_in_group=4).entropy_coef == 0.1
    assert make_config(tmp_path, loss_type="bnpo", num_remains_in_group=4).loss_type == "bnpo"
    plain_grpo = dict(num_remains_in_group=None, group_filter=None)  # nothing padded
    assert make_config(tmp_path, loss_type="bnpo", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       **plain_grpo).loss_type == "bnpo"


def test_rejected_rows_in_the_loss_need_no_even_split(tmp_path):
    """With loss_includes_rejected every row is trained where the entropy bonus or bnpo is on (no row is skipped for
    them), so the kept rows need not divide evenly into micro-batches."""
    uneven = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, loss_includes_rejected=True)
    assert make_config(tmp_path, entropy_coef=0.1, **uneven).entropy_coef == 0.1
    assert make_config(tmp_path, loss_type="bnpo", **uneven).loss_type == "bnpo"


def test_construction_errors(model_dir, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="give exactly one of GFPOConfig.group_filter"):
        make_trainer(model_dir, tokenizer, tmp_path, group_filter_func=lambda **k: None)
    with pytest.raises(ValueError, match="give exactly one of GFPOConfig.group_filter"):
        make_trainer(model_dir, tokenizer, tmp_path, group_filter=None)
    with pytest.raises(ValueError, match="a group filter is given but num_remains_in_group is None"):
        make_trainer(model_dir, tokenizer, tmp_path, num_remains_in_group=None)
    with pytest.raises(TypeError, match="group_filter_func must be callable"):
        make_trainer(model_dir, tokenizer, tmp_path, group_filter=None, group_filter_func="shortest")
    with pytest.raises(ValueError, match="use_gfpo_kernels=True does not support top_entropy_quantile=0.5"):
        make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=True, top_entropy_quantile=0.5)
    # the loss options are checked when the trainer is built, not at the first loss after a generation
    with pytest.raises(ValueError, match="vespo_k_pos must be a finite float, got vespo_k_pos=nan"):
        make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=True, loss_type="vespo",
                     vespo_k_pos=float("nan"))
    # Liger's fused linear cross-entropy would replace the forward the fused loss patches (TRL 1.14 applied it)
    with pytest.raises(ValueError, match=r'use_gfpo_kernels=True does not support liger_kernel_config='
                                         r'\{"fused_linear_cross_entropy": True\}'):
        make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=True, use_liger_kernel=True,
                     liger_kernel_config={"fused_linear_cross_entropy": True})
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="args must be a GFPOConfig, got GRPOConfig"):
        GFPOTrainer(model=model_dir, reward_funcs=digit_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none"))


# --------------------------------------------------------------------------- what reaches the loss


@pytest.mark.parametrize("use_kernels", [False, True])
@pytest.mark.parametrize("group_filter, largest", [("length", False), ("token_efficiency", True)])
def test_exactly_the_top_k_rows_with_their_advantages(model_dir, tokenizer, tmp_path, use_kernels, group_filter, largest):
    trainer = make_trainer(model_dir, tokenizer, tmp_path, per_device_train_batch_size=16, group_filter=group_filter,
                           use_gfpo_kernels=use_kernels)
    output, seen = scored_batch(trainer)
    G, k = 8, 3
    lengths = torch.tensor([len(ids) for ids in seen["ids"]], dtype=torch.float32)
    rewards = seen["rewards"].sum(dim=1)
    scores = lengths if group_filter == "length" else rewards / lengths
    want_keep, want_adv = ref.gfpo_filter_advantages(rewards, scores, G, k, largest=largest)
    rows, adv = real_rows(output)
    want_rows = [seen["ids"][i] for i in want_keep.nonzero().squeeze(1).tolist()]
    assert rows == want_rows  # the kept rows, in batch order, nothing else
    torch.testing.assert_close(adv, want_adv[want_keep], rtol=1e-5, atol=1e-6)
    assert output["gfpo_real_row"].all()  # 2 groups x 3 kept: no padding needed
    assert output["num_items_in_batch"].item() == sum(len(r) for r in want_rows)


def test_kernels_on_and_off_agree(model_dir, tokenizer, tmp_path):
    """Same kept rows and advantages; losses and gradients equal within fp32 tolerance."""
    results = []
    for use_kernels in (False, True):
        trainer = make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=use_kernels, beta=0.04,
                               loss_type="dapo", per_device_train_batch_size=16)
        output, _ = scored_batch(trainer, seed=3)
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, output)
        loss.backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
        results.append((output, loss.detach(), grads))
    (out_a, loss_a, grads_a), (out_b, loss_b, grads_b) = results
    for key in ("completion_ids", "completion_mask", "advantages", "ref_per_token_logps"):
        torch.testing.assert_close(out_a[key], out_b[key], msg=key)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert len(grads_a) == len(grads_b) > 0
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


VESPO = dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)


def _older_policy(output, seed):
    """Old log-probabilities of a policy a few updates back: the batch's own, moved at the scored positions (TRL's
    old-policy pass ran on the same parameters, so the ratios would all be 1)."""
    g = torch.Generator().manual_seed(seed)
    old = output["old_per_token_logps"]
    noise = 0.1 * torch.randn(old.shape, generator=g)
    output["old_per_token_logps"] = torch.where(output["completion_mask"].bool(), old + noise, old)


def test_vespo_kernels_on_and_off_agree(model_dir, tokenizer, tmp_path):
    """loss_type="vespo" with use_gfpo_kernels=True: with old log-probabilities (steps_per_generation
    > gradient_accumulation_steps), padding rows (6 kept rows in 8) and TRL's dapo-like normaliser, the loss,
    every gradient and the logged vespo/phi_seq_mean equal TRL's own loss's (kernels off)."""
    results = []
    for use_kernels in (False, True):
        trainer = make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=use_kernels, **VESPO,
                               per_device_train_batch_size=4, steps_per_generation=4, skip_zero_gradient_rows=False)
        output, _ = scored_batch(trainer, seed=3)
        assert not output["gfpo_real_row"].all()
        _older_policy(output, seed=1)
        trainer._metrics["train"].clear()
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, output)
        loss.backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
        results.append((loss.detach(), grads, trainer._metrics["train"]["vespo/phi_seq_mean"]))
    (loss_off, grads_off, phi_off), (loss_on, grads_on, phi_on) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-6)
    assert len(grads_on) == len(grads_off) > 0
    for got, want in zip(grads_on, grads_off):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert len(phi_on) == len(phi_off) == 1 and phi_on[0] == pytest.approx(phi_off[0], rel=1e-5)
    assert abs(phi_off[0] - 1.0) > 1e-3  # phi is not trivially 1: the ratios moved


def test_vespo_padding_rows_hold_a_neutral_vllm_ratio(model_dir, tokenizer, tmp_path, monkeypatch):
    """With vLLM's token-level ratio (vespo needs token_truncate or token_mask), a padding row (a copy of a kept row,
    completion mask 0) must hold ratio 1: TRL's vespo sums log(ratio) over every position, masked or not, so with the
    copied row's ratios the kernels-off path logged vespo/phi_seq_mean 1.076 where the fused path (masked positions
    out of phi) logged 1.017 on this batch. The loss is the same either way; with ratio 1 so is the metric."""
    from trl import GRPOTrainer

    generate_and_score = GRPOTrainer._generate_and_score_completions

    def with_vllm_ratio(self, inputs):  # what TRL's output holds with use_vllm and token-level IS correction
        output = generate_and_score(self, inputs)
        g = torch.Generator().manual_seed(0)
        mask = output["completion_mask"].bool()
        output["importance_sampling_ratio"] = torch.where(mask, 0.6 + 0.8 * torch.rand(mask.shape, generator=g), 1.0)
        return output

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", with_vllm_ratio)
    results = []
    for use_kernels in (False, True):
        trainer = make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=use_kernels, **VESPO,
                               per_device_train_batch_size=4, steps_per_generation=4, skip_zero_gradient_rows=False)
        output, _ = scored_batch(trainer, seed=3)
        padding = ~output["gfpo_real_row"]
        assert padding.any() and torch.all(output["importance_sampling_ratio"][padding] == 1.0)
        _older_policy(output, seed=1)
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # scored without vLLM, trained as with
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(trainer.model, output)
        results.append((loss.item(), trainer._metrics["train"]["vespo/phi_seq_mean"]))
    (loss_off, phi_off), (loss_on, phi_on) = results
    assert loss_on == pytest.approx(loss_off, rel=1e-5)
    assert len(phi_on) == len(phi_off) == 1 and phi_on[0] == pytest.approx(phi_off[0], rel=1e-5)


def test_vespo_kernels_equal_trl_grpo_trainer(model_dir, tokenizer, tmp_path):
    """The fused vespo loss through GFPOTrainer (plain GRPO, use_gfpo_kernels=True) on a batch TRL's own GRPOTrainer
    made (old log-probabilities, a vLLM-free run) equals GRPOTrainer's loss, gradients and vespo/phi_seq_mean."""
    from trl import GRPOConfig, GRPOTrainer

    options = dict(per_device_train_batch_size=8, num_generations=8, max_completion_length=8, max_steps=1,
                   report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0, steps_per_generation=2,
                   **VESPO)
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trl_trainer = GRPOTrainer(model=model_dir, reward_funcs=digit_reward, processing_class=tokenizer,
                              args=GRPOConfig(output_dir=str(tmp_path / "trl"), **options), train_dataset=dataset)
    gfpo = GFPOTrainer(model=model_dir, reward_funcs=digit_reward, processing_class=tokenizer,
                       args=GFPOConfig(output_dir=str(tmp_path / "gfpo"), use_gfpo_kernels=True, **options),
                       train_dataset=dataset)
    results = []
    trl_trainer.model.train()
    torch.manual_seed(0)
    output = trl_trainer._generate_and_score_completions(generation_batch(trl_trainer, num_prompts=2))
    _older_policy(output, seed=2)
    for trainer in (trl_trainer, gfpo):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(output))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, trainer._metrics["train"]["vespo/phi_seq_mean"]))
    (want, want_grads, want_phi), (got, got_grads, got_phi) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert got_phi == pytest.approx(want_phi, rel=1e-5) and abs(want_phi[0] - 1.0) > 1e-3


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_kernels_on_and_off_agree_when_the_normaliser_is_below_one(model_dir, tokenizer, tmp_path, loss_type):
    """TRL divides dapo/cispo by max(num_items_in_batch, 1) / processes * accumulation / steps_per_generation, which
    can be below 1 (here 1 token over steps_per_generation=2: 0.5). The fused path clamps the count only, not the
    scaled normaliser a second time (it gave half of TRL's loss)."""
    losses = []
    for use_kernels in (False, True):
        trainer = make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=use_kernels, loss_type=loss_type,
                               per_device_train_batch_size=4, steps_per_generation=2, num_remains_in_group=4)
        output, _ = scored_batch(trainer, seed=5)
        output["num_items_in_batch"] = torch.tensor(1.0)
        with torch.no_grad():
            losses.append(trainer.compute_loss(trainer.model, output))
    assert losses[0].abs() > 0
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)


def test_deferred_logprob_passes_see_only_kept_rows(model_dir, tokenizer, tmp_path):
    """beta > 0 (reference model) and steps_per_generation=2 with gradient_accumulation_steps=1 (old policy):
    both no-grad passes run on the k/G kept rows, and give what TRL's own pass gives on those rows."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path, beta=0.04, per_device_train_batch_size=8,
                           steps_per_generation=2, num_remains_in_group=2)
    output, seen = scored_batch(trainer)
    n_generated = len(seen["ids"])  # 16 = 2 groups of 8
    n_kept = int(output["gfpo_real_row"].sum())
    assert n_kept == n_generated * 2 // 8
    assert "old_per_token_logps" in output and "ref_per_token_logps" in output
    assert trainer.gfpo_logp_rows_seen == 2 * n_kept  # two passes, kept rows only
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad():
        want, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, output["completion_ids"].size(1))
    torch.testing.assert_close(output["ref_per_token_logps"], want)


@pytest.mark.parametrize("lockstep", [False, True])
def test_deferred_passes_run_every_row_where_forwards_are_collective(model_dir, tokenizer, tmp_path, monkeypatch,
                                                                      lockstep):
    """Under FSDP or ZeRO-3 each forward gathers parameters with the other processes, so every process must run as
    many: the deferred passes then run on all of this process's rows, padding included (the same count on every
    process; with the real rows only, 2 processes holding 2 and 0 real rows hung), and the padding rows' values are
    dropped: the same log-probabilities either way."""
    monkeypatch.setattr(GFPOTrainer, "_forwards_in_lockstep", lambda self: lockstep)
    trainer = make_trainer(model_dir, tokenizer, tmp_path, beta=0.04, per_device_train_batch_size=4,
                           steps_per_generation=2, num_remains_in_group=3)
    output, _ = scored_batch(trainer)
    real = output["gfpo_real_row"]
    n_rows, n_real = real.numel(), int(real.sum())
    assert (n_rows, n_real) == (4, 3)  # 3 kept rows in 2 micro-batches of 2: one padding row
    assert trainer.gfpo_logp_rows_seen == 2 * (n_rows if lockstep else n_real)  # old-policy and reference passes
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)[:n_real]
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)[:n_real]
    with torch.no_grad():
        want, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, output["completion_ids"].size(1))
    torch.testing.assert_close(output["ref_per_token_logps"][:n_real], want)
    assert torch.all(output["ref_per_token_logps"][n_real:] == 0)


@pytest.mark.parametrize("multiple", [None, 8, 32])  # 32: wider than any completion (at most 20)
def test_trained_rows_keep_trls_pad_to_multiple_of(model_dir, tokenizer, tmp_path, multiple):
    """The trained rows are cropped to their longest completion, but no narrower than TRL's pad_to_multiple_of
    asks (Neuron, torch.compile: one shape per multiple); the crop keeps every trained token."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path, pad_to_multiple_of=multiple, max_completion_length=20)
    output, _ = scored_batch(trainer)
    longest = int(output["completion_mask"].sum(dim=1).max())
    width = output["completion_ids"].size(1)
    assert output["completion_mask"].size(1) == width
    if multiple is None:
        assert width == max(2, longest)  # never one column (tests/test_rows.py)
    else:
        assert width % multiple == 0 and width - multiple < longest <= width, (width, longest)


def test_remainder_rows_are_padded_not_dropped(model_dir, tokenizer, tmp_path):
    """1 group of 8, k=3, steps_per_generation=2: 3 kept rows do not split in 2; TRL's split_tensor_dict would drop
    one. GFPO pads to 4 with a masked copy, and every real row weighs 1/3, as in an evenly divided batch (the old
    per-micro-batch fix-up gave 0.25/0.25/0.5)."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path, per_device_train_batch_size=4, steps_per_generation=2,
                           num_remains_in_group=3)
    output, seen = scored_batch(trainer)
    assert output["completion_ids"].shape[0] == 4
    assert output["gfpo_real_row"].tolist() == [True, True, True, False]
    assert output["completion_mask"][3].sum() == 0 and output["advantages"][3] == 0
    rows, _ = real_rows(output)
    assert len(rows) == 3
    from trl.trainer.utils import split_tensor_dict

    halves = split_tensor_dict(output, 2)
    assert sum(int(h["gfpo_real_row"].sum()) for h in halves) == 3
    # one optimizer step of the two micro-batches (gradient_accumulation_steps=2) = the mean of the 3 rows' losses
    trainer.current_gradient_accumulation_steps = 2
    with torch.no_grad():
        step_loss = sum(trainer.compute_loss(trainer.model, h) for h in halves)
        trainer.current_gradient_accumulation_steps = 1
        per_row = []
        for r in range(3):  # each real row alone, as TRL computes a one-row micro-batch (no GFPO weight)
            one = {k: (v[r : r + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in output.items()
                   if not k.startswith("gfpo_")}
            per_row.append(trainer.compute_loss(trainer.model, one))
    torch.testing.assert_close(step_loss, sum(per_row) / 3)


def test_group_filter_func_with_trl_signature(model_dir, tokenizer, tmp_path):
    calls = []

    def prefer_digits(group_completions, group_rewards, **kwargs):
        calls.append((len(group_completions), [len(g) for g in group_completions], kwargs.keys()))
        return [[float(sum(ch.isdigit() for ch in c)) for c in group] for group in group_completions]

    trainer = make_trainer(model_dir, tokenizer, tmp_path, group_filter=None, group_filter_func=prefer_digits)
    output, seen = scored_batch(trainer)
    assert calls[0][:2] == (1, [8]) and "group_completion_ids" in calls[0][2]
    scores = torch.tensor([float(sum(ch.isdigit() for ch in c)) for c in seen["completions"]])
    want_keep = ref.group_topk_mask(scores, 8, 3)
    rows, _ = real_rows(output)
    assert rows == [seen["ids"][i] for i in want_keep.nonzero().squeeze(1).tolist()]


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda groups: [[1.0] * 7 for _ in groups], r"must return 1 lists of 8 scores .* got shape \(1, 7\)"),
        (lambda groups: [[float("nan")] + [1.0] * 7 for _ in groups], r"non-finite score nan \(group 0, completion 0\)"),
        (lambda groups: [["a"] * 8 for _ in groups], r"not a rectangular list of numbers"),
    ],
)
def test_bad_group_filter_func_output(model_dir, tokenizer, tmp_path, bad, match):
    trainer = make_trainer(model_dir, tokenizer, tmp_path, group_filter=None,
                           group_filter_func=lambda group_completions, group_rewards, **kw: bad(group_completions))
    with pytest.raises(ValueError, match=match):
        scored_batch(trainer)


def test_unscorable_rows_rank_last_and_get_zero_advantage(model_dir, tokenizer, tmp_path):
    def some_none(completions, **kwargs):
        return [None if i % 4 == 0 else float(i % 3) for i in range(len(completions))]

    trainer = make_trainer(model_dir, tokenizer, tmp_path, group_filter="token_efficiency", reward=some_none,
                           num_remains_in_group=7, skip_zero_gradient_rows=False)  # keep the 0-advantage row
    output, seen = scored_batch(trainer)
    rows, adv = real_rows(output)
    # rows 0 and 4 are unscorable: NaN ranks last, and of the two the lower index wins, so row 4 is dropped
    assert rows == [seen["ids"][i] for i in range(8) if i != 4]
    assert adv[0] == 0 and torch.isfinite(adv).all()


def test_eval_mode_does_not_filter(model_dir, tokenizer, tmp_path):
    trainer = make_trainer(model_dir, tokenizer, tmp_path)
    trainer.model.eval()
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(generation_batch(trainer))
    assert output["completion_ids"].shape[0] == 8 and "gfpo_real_row" not in output


def test_training_logs_gfpo_metrics(model_dir, tokenizer, tmp_path):
    trainer = make_trainer(model_dir, tokenizer, tmp_path, max_steps=2, use_gfpo_kernels=True)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        assert log["gfpo/kept_fraction"] == pytest.approx(3 / 8)
        # the length filter stops dropped completions early by default: their logged length says it is truncated
        assert log["gfpo/kept_completion_length"] <= log["gfpo/dropped_completion_length_truncated"]
        assert 0.0 <= log["gfpo/stopped_early_fraction"] <= 5 / 8
        assert math.isfinite(log["loss"]) and "entropy" in log and "clip_ratio/region_mean" in log


def test_adaptive_difficulty_in_training(model_dir, tokenizer, tmp_path):
    trainer = make_trainer(model_dir, tokenizer, tmp_path, per_device_train_batch_size=32, adaptive_difficulty=True,
                           adaptive_num_remains=[6, 4, 3, 2], num_remains_in_group=3)
    output, seen = scored_batch(trainer)
    rewards = seen["rewards"].sum(dim=1).view(-1, 8).mean(dim=1)
    quartile, k = AdaptiveDifficulty([6, 4, 3, 2]).update_and_assign(rewards)
    assert int(output["gfpo_real_row"].sum()) == int(k.sum())
    metrics = trainer._metrics["train"]
    assert metrics["gfpo/k_quartile_0"] == [6.0] and metrics["gfpo/k_quartile_3"] == [2.0]
    assert metrics["gfpo/mean_k"] == [pytest.approx(k.float().mean().item())]


def test_adaptive_difficulty_quartiles():
    """On fewer means than the digest has centroids, its quartiles are the exact ones (torch.quantile's linear
    interpolation); hardest (lowest mean) keeps most."""
    adaptive = AdaptiveDifficulty([8, 6, 4, 2])
    means = torch.arange(8, dtype=torch.float32) / 8  # 0, 0.125, ..., 0.875
    quartile, k = adaptive.update_and_assign(means)
    q25, q50, q75 = adaptive.quartile_thresholds()
    assert (q25, q50, q75) == pytest.approx(torch.quantile(means.double(), torch.tensor([0.25, 0.5, 0.75]).double()).tolist(),
                                            abs=1e-12)
    for value, got in zip(means.tolist(), quartile.tolist()):
        assert got == sum(value > t for t in (q25, q50, q75))
    assert quartile.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and k.tolist() == [8, 8, 6, 6, 4, 4, 2, 2]
    nan_q, nan_k = adaptive.update_and_assign(torch.tensor([float("nan")]))
    assert nan_q.item() == 0 and nan_k.item() == 8  # no scorable completion: treated as hardest
    assert adaptive.digest.n_values == 8  # NaN not added


# --------------------------------------------------------------------------- TRL surfaces


def test_trl_surfaces_are_where_gfpo_expects_them():
    check_trl_surfaces()  # the pinned TRL


def test_surface_check_names_what_changed():
    from trl import GRPOTrainer

    class Renamed(GRPOTrainer):
        _calculate_rewards = None

    with pytest.raises(TRLSurfaceError, match=r"GRPOTrainer._calculate_rewards no longer exists"):
        check_trl_surfaces(Renamed)

    class Reshaped(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, logits_to_keep):
            pass

    with pytest.raises(TRLSurfaceError, match=r"_get_per_token_logps_and_entropies takes"):
        check_trl_surfaces(Reshaped)
    row = torch.zeros(4, 3)
    good = dict(prompt_ids=row, prompt_mask=row, completion_ids=row, completion_mask=row, advantages=row[:, 0],
                num_items_in_batch=torch.tensor(3))
    check_output(good, 4)
    with pytest.raises(TRLSurfaceError, match=r"returns a per-row 'pixel_values'"):
        check_output({**good, "pixel_values": torch.zeros(4, 3, 8, 8)}, 4)
    with pytest.raises(TRLSurfaceError, match=r"no longer returns 'advantages'"):
        check_output({k: v for k, v in good.items() if k != "advantages"}, 4)


# --------------------------------------------------------------------------- the paper's objective


def _loss_and_grads(trainer, batch, micro_batches):
    """The loss of one optimizer step over `batch` split into `micro_batches` in order (TRL's gradient accumulation),
    and the gradients by parameter name."""
    from trl.trainer.utils import split_tensor_dict

    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = micro_batches
    total = 0.0
    for part in split_tensor_dict(batch, micro_batches):
        loss = trainer.compute_loss(trainer.model, part)
        loss.backward()
        total = total + loss.detach()
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_kernels, overrides, rejected_trained", [
    (False, dict(loss_type="dapo"), False),  # beta 0: the rejected rows are counted, not trained
    (True, dict(loss_type="dapo"), False),
    (False, dict(loss_type="grpo", per_device_train_batch_size=4, gradient_accumulation_steps=2), False),
    (True, dict(loss_type="grpo", beta=0.04), True),  # the KL term reaches the rejected rows: trained at advantage 0
    (False, dict(loss_type="dapo", beta=0.04, per_device_train_batch_size=4, gradient_accumulation_steps=2), True),
    (True, dict(loss_type="dapo", skip_zero_gradient_rows=False), True),
    (False, dict(loss_type="dapo", entropy_coef=0.1, per_device_train_batch_size=4, gradient_accumulation_steps=2),
     True),
])
def test_loss_includes_rejected_equals_trls_loss_over_every_row(model_dir, tokenizer, tmp_path, monkeypatch,
                                                                 use_kernels, overrides, rejected_trained):
    """loss_includes_rejected=True: loss and gradients equal TRL's own GRPOTrainer's over every sampled completion of
    the same batch, with GFPO's advantages (0 for the rejected rows): the token normaliser counts every completion,
    the per-sequence losses every row, and the KL and entropy terms reach the rejected rows."""
    from trl import GRPOConfig, GRPOTrainer

    generate_and_score = GRPOTrainer._generate_and_score_completions
    trl_outputs = []

    def keeping_trls_output(self, inputs):
        output = generate_and_score(self, inputs)
        trl_outputs.append(dict(output))  # GFPO's post-processing replaces the dict's rows
        return output

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", keeping_trls_output)
    options = {"per_device_train_batch_size": 16, **overrides}
    gfpo = make_trainer(model_dir, tokenizer, tmp_path / "gfpo", use_gfpo_kernels=use_kernels,
                        loss_includes_rejected=True, **options)
    output, seen = scored_batch(gfpo)
    selection = gfpo._gfpo_batch.selection
    n_rows = len(seen["ids"])
    trained_rows = int(output["gfpo_real_row"].sum())
    if rejected_trained:
        assert trained_rows == n_rows and torch.equal(output["advantages"], selection.advantages)
    else:
        assert trained_rows == int((selection.advantages != 0).sum()) < n_rows
    assert int(output["num_items_in_batch"]) == sum(map(len, seen["ids"]))  # every sampled completion's tokens
    steps = gfpo.args.steps_per_generation
    got, got_grads = _loss_and_grads(gfpo, output, steps)  # first: nothing may draw from the CPU generator before

    trl_options = dict(num_generations=8, max_completion_length=8, max_steps=1, report_to="none", use_cpu=True,
                       bf16=False, logging_steps=1, save_strategy="no", seed=0, temperature=1.0)  # make_config's
    trl = GRPOTrainer(model=model_dir, reward_funcs=digit_reward, processing_class=tokenizer,
                      args=GRPOConfig(output_dir=str(tmp_path / "trl"), **trl_options,
                                      **{k: v for k, v in options.items() if k != "skip_zero_gradient_rows"}),
                      train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    trl.model.train()
    reference = dict(trl_outputs[0], advantages=selection.advantages)
    if "ref_per_token_logps" in reference:  # deferred by GFPO while TRL built the batch: TRL's pass, on every row
        ids = torch.cat([reference["prompt_ids"], reference["completion_ids"]], dim=1)
        mask = torch.cat([reference["prompt_mask"], reference["completion_mask"]], dim=1)
        with torch.no_grad():
            reference["ref_per_token_logps"], _, _ = trl._get_per_token_logps_and_entropies(
                trl.ref_model, ids, mask, reference["completion_ids"].size(1))
    want, want_grads = _loss_and_grads(trl, reference, steps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_loss_includes_rejected_turns_the_early_stop_rule_off_with_one_warning(model_dir, tokenizer, tmp_path,
                                                                               caplog):
    """The rule cuts the rejected completions short, and the loss would then count cut lengths and train on cut
    text: with loss_includes_rejected it is off (gfpo_stop_dropped_generations left at its default, True), and one
    warning says why; every completion is generated to its end."""
    with caplog.at_level("WARNING", logger="gfpo_trainer.trainer"):
        trainer = make_trainer(model_dir, tokenizer, tmp_path, loss_includes_rejected=True,
                               per_device_train_batch_size=16)
        scored_batch(trainer)
        scored_batch(trainer, seed=1)
    warnings = [r.getMessage() for r in caplog.records if "gfpo_stop_dropped_generations" in r.getMessage()]
    assert warnings == ["gfpo_stop_dropped_generations is not applied with loss_includes_rejected=True: the rule cuts "
                        "the completions the filter rejects short, and the loss then covers them, so it would train "
                        "on cut text and count cut lengths; every completion is generated to its end"]
    assert trainer.args.gfpo_stop_dropped_generations and trainer._gfpo_batch.stopped_rows is None
    metrics = trainer._metrics["train"]
    assert "gfpo/stopped_early_fraction" not in metrics and len(metrics["gfpo/dropped_completion_length"]) == 2
