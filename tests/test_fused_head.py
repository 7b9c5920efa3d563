"""The fused-loss model adapter (gfpo_trainer/fused_head.py): `use_gfpo_kernels=True` computes the loss of the
model's own logits, adds an MoE model's router auxiliary loss as TRL does, and refuses a model whose logits it
cannot reproduce, naming its class."""

import collections
import threading
import types

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402

PROMPTS = ["1+2=", "3*4=", "5-1=", "9+9="]


def _reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


def _small(tokenizer, **extra):
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id, **extra)


def _save(model, tokenizer, path):
    torch.manual_seed(0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _trainer(path, tokenizer, tmp_path, use_kernels, peft_config=None, **overrides):
    options = dict(output_dir=str(tmp_path / f"out{int(use_kernels)}"), per_device_train_batch_size=8,
                   num_generations=8, num_remains_in_group=3, group_filter="length", max_completion_length=6,
                   max_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                   loss_type="dapo", use_gfpo_kernels=use_kernels, skip_zero_gradient_rows=False)
    options.update(overrides)
    return GFPOTrainer(model=path, reward_funcs=_reward, args=GFPOConfig(**options), processing_class=tokenizer,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), peft_config=peft_config)


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _kernels_on_equals_off(path, tokenizer, tmp_path, prepare=None, bf16_rounding=False, **overrides):
    off = _trainer(path, tokenizer, tmp_path, False, **overrides)
    on = _trainer(path, tokenizer, tmp_path, True, **overrides)
    for trainer in (off, on) if prepare is not None else ():
        prepare(trainer.model)
    off.model.train()
    torch.manual_seed(0)
    # transformers 5.17's MoE generate fails with router logits on (its load-balancing loss pairs one new token's
    # router logits with the whole attention mask; 5.23 generates fine): the router loss is this test's subject,
    # not generation, so the completions are generated without it.
    router_logits = getattr(off.model.config, "output_router_logits", None)
    if router_logits:
        off.model.config.output_router_logits = False
    try:
        inputs = off._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(8)])
    finally:
        if router_logits:
            off.model.config.output_router_logits = router_logits
    loss_off, grads_off = _loss_and_grads(off, inputs)
    loss_on, grads_on = _loss_and_grads(on, inputs)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        # bf16_rounding: one path rounds to bf16 where the other does not; 2% of the gradient's largest entry
        tolerance = dict(rtol=2e-2, atol=2e-2 * grads_off[name].abs().max().item()) if bf16_rounding else dict(
            rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grads_on[name], grads_off[name], **tolerance, msg=name)
    return on, off, loss_on


def test_gemma2_softcap_is_applied(tmp_path):
    """Gemma 2 soft-caps its logits (final_logit_softcapping); with a cap of 0.5 against logits of a few units the
    cap bends every logit, and kernels on must equal TRL's loss (which runs the model's own head) and gradients."""
    tokenizer = make_tokenizer()
    config = Gemma2Config(**_small(tokenizer, head_dim=8), final_logit_softcapping=0.5)
    path = _save(Gemma2ForCausalLM(config), tokenizer, tmp_path / "gemma2")
    _kernels_on_equals_off(path, tokenizer, tmp_path, loss_type="grpo", beta=0.0)


def test_moe_router_aux_loss_is_added_as_trl_adds_it(tmp_path):
    tokenizer = make_tokenizer()
    config = Qwen2MoeConfig(**_small(tokenizer), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, router_aux_loss_coef=0.5, output_router_logits=True)
    path = _save(Qwen2MoeForCausalLM(config), tokenizer, tmp_path / "moe")
    on, off, loss = _kernels_on_equals_off(path, tokenizer, tmp_path)
    assert on.aux_loss_enabled and on._metrics["train"]["aux_loss"] and on._metrics["train"]["aux_loss"][0] > 0


@pytest.mark.parametrize("mode", ["train", "train-accumulating", "eval"])
@pytest.mark.parametrize("use_kernels", [False, True])
def test_router_aux_loss_keeps_its_value_under_row_weights(tmp_path, use_kernels, mode):
    """GFPO weights a per-sequence loss by the rows it would have in an evenly divided batch; TRL's router auxiliary
    loss is one value per micro-batch, not a sum over rows, and must not take that weight. With advantages 0 (and
    beta 0) the rows' loss is exactly 0, so the micro-batch loss is the aux term alone, weight or none (TRL divides
    it by the accumulation steps in training, not in eval)."""
    from gfpo_trainer.rows import ROW_WEIGHT_KEY

    tokenizer = make_tokenizer()
    config = Qwen2MoeConfig(**_small(tokenizer), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, router_aux_loss_coef=0.5, output_router_logits=False)
    path = _save(Qwen2MoeForCausalLM(config), tokenizer, tmp_path / "moe")
    trainer = _trainer(path, tokenizer, tmp_path, use_kernels, loss_type="grpo")
    assert trainer.aux_loss_enabled
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(8)])
    inputs = {k: v for k, v in inputs.items() if k != ROW_WEIGHT_KEY}
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    trainer.model.train(mode != "eval")
    trainer.current_gradient_accumulation_steps = 2 if mode != "train" else 1
    losses = []
    for weights in (None, torch.full_like(inputs["advantages"], 4 / 3)):
        batch = inputs if weights is None else {**inputs, ROW_WEIGHT_KEY: weights}
        losses.append(trainer.compute_loss(trainer.model, batch).detach())
    assert losses[0] > 0
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)


def test_logit_scale_is_applied(tmp_path):
    tokenizer = make_tokenizer()
    config = GraniteConfig(**_small(tokenizer), logits_scaling=4.0)  # Granite divides its logits by 4
    path = _save(GraniteForCausalLM(config), tokenizer, tmp_path / "granite")
    _kernels_on_equals_off(path, tokenizer, tmp_path)


def test_cast_lm_head_to_fp32_runs_the_fused_head_in_fp32(tmp_path):
    """TRL's cast_lm_head_to_fp32 runs the head in fp32 outside bf16 autocast; the fused path must too (it ran its
    GEMMs in the autocast dtype, bf16: gradients off by bf16 rounding)."""
    tokenizer = make_tokenizer()
    path = _save(Qwen2ForCausalLM(Qwen2Config(**_small(tokenizer))), tokenizer, tmp_path / "qwen2")
    # TRL 1.14 casts the head to fp32 but calls it under autocast, which runs that GEMM in bf16 (TRL 1.15 turned
    # autocast off there); the fused path runs the fp32 head the option asks for, so on 1.14 the two agree to bf16
    # rounding only (gradients ~0.5% apart), as docs/limitations.md says.
    trl_runs_bf16_head = Version(trl.__version__) < Version("1.15")
    on, off, _ = _kernels_on_equals_off(path, tokenizer, tmp_path, bf16=True, cast_lm_head_to_fp32=True,
                                        bf16_rounding=trl_runs_bf16_head)
    assert on.model.lm_head.weight.dtype == torch.float32


def test_a_multimodal_batch_is_refused(tmp_path):
    """The fused path passes token ids only; a batch with images would be trained as text without them."""
    tokenizer = make_tokenizer()
    path = _save(Qwen2ForCausalLM(Qwen2Config(**_small(tokenizer))), tokenizer, tmp_path / "qwen2")
    on = _trainer(path, tokenizer, tmp_path, True)
    on.model.train()
    torch.manual_seed(0)
    inputs = on._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(8)])
    inputs.update(pixel_values=torch.randn(3, 8), image_grid_thw=torch.tensor([[1, 1, 3]]))
    with pytest.raises(ValueError, match=r"cannot train Qwen2ForCausalLM on a multimodal batch \(it carries "
                                         r"pixel_values, image_grid_thw,"):
        on.compute_loss(on.model, inputs)


class ScaledLogitsQwen2(Qwen2ForCausalLM):
    """A model whose forward transforms its logits with nothing in its config saying so."""

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        outputs.logits = outputs.logits * 3.0
        return outputs


def test_a_model_with_unknown_logit_transform_is_refused(tmp_path):
    tokenizer = make_tokenizer()
    model = ScaledLogitsQwen2(make_tiny_model(tokenizer).config)
    with pytest.raises(ValueError, match=r"cannot train ScaledLogitsQwen2: on a probe of 8 tokens .* differ"):
        GFPOTrainer(model=model, reward_funcs=_reward, processing_class=tokenizer,
                    args=GFPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                                    use_cpu=True, report_to="none", use_gfpo_kernels=True),
                    train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))


def _perturb_trainable(model):
    """PEFT adapters start as a no-op (LoRA's B = 0, a modules_to_save copy equal to the original), where the
    adapted and the bare model agree; moved off that point, leaving the adapter out would change loss and gradients."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.requires_grad:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))


def test_lora_on_the_backbone_kernels_on_equals_off(tmp_path):
    """LoRA on the attention projections (TRL's usual PEFT setup), the reference model being the adapter-disabled
    policy (beta > 0), zero-gradient rows skipped: kernels on gives TRL's loss and every adapter gradient."""
    peft = pytest.importorskip("peft")
    tokenizer = make_tokenizer()
    path = _save(Qwen2ForCausalLM(Qwen2Config(**_small(tokenizer))), tokenizer, tmp_path / "model")
    on, _, _ = _kernels_on_equals_off(
        path, tokenizer, tmp_path, prepare=_perturb_trainable, beta=0.04, skip_zero_gradient_rows=True,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    grads = {n: p.grad for n, p in on.model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads), sorted(grads)  # the base model stays frozen
    assert all(g.abs().max() > 0 for n, g in grads.items() if "lora_B" in n)


def test_lora_modules_to_save_head_is_the_one_trained(tmp_path):
    """modules_to_save=["lm_head"] trains a copy of the head: the fused loss must read the copy (moved away from the
    frozen original here), not the original, and give it TRL's gradient."""
    peft = pytest.importorskip("peft")
    tokenizer = make_tokenizer()
    path = _save(Qwen2ForCausalLM(Qwen2Config(**_small(tokenizer))), tokenizer, tmp_path / "model")
    on, _, _ = _kernels_on_equals_off(
        path, tokenizer, tmp_path, prepare=_perturb_trainable, beta=0.04,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    head = on.model.get_base_model().get_output_embeddings()
    copy = head.modules_to_save["default"].weight
    assert copy.grad is not None and copy.grad.abs().max() > 0 and head.original_module.weight.grad is None


def test_an_adapter_on_the_lm_head_is_refused():
    """LoRA on lm_head adds B A h in the head's forward, which the fused loss (reading the head's weight) would
    leave out, untrained and undetected by the probe (B starts at 0). TRL >= 1.15 refuses it in GRPOTrainer;
    the adapter refuses it on every TRL, naming the model class and the head's type."""
    peft = pytest.importorskip("peft")
    from gfpo_trainer.fused_head import install_fused_loss_forward

    model = peft.get_peft_model(make_tiny_model(make_tokenizer()),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"cannot train Qwen2ForCausalLM: its LM head is a peft\.tuners\.lora\..*Linear"):
        install_fused_loss_forward(model.get_base_model())


def test_trainer_logs_the_metrics_trl_logs(tmp_path):
    """On the same batch, use_gfpo_kernels=True logs TRL's loss metrics (kl, entropy, the clip ratios, low_min and
    high_max among them) with the values TRL's own path logs."""
    from test_trainer import make_trainer, scored_batch

    tokenizer = make_tokenizer()
    model_dir = str(tmp_path / "model")
    make_tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    logged = []
    for use_kernels in (False, True):
        trainer = make_trainer(model_dir, tokenizer, tmp_path, use_gfpo_kernels=use_kernels, beta=0.04,
                               loss_type="grpo", per_device_train_batch_size=16)
        output, _ = scored_batch(trainer, seed=5)
        g = torch.Generator().manual_seed(1)
        output["old_per_token_logps"] = output["ref_per_token_logps"] + 0.5 * torch.randn(
            output["ref_per_token_logps"].shape, generator=g)
        trainer._metrics["train"].clear()
        trainer.compute_loss(trainer.model, output)
        logged.append({k: v[-1] for k, v in trainer._metrics["train"].items()})
    trl_metrics, ours = logged
    names = ["kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "clip_ratio/low_min", "clip_ratio/high_max"]
    for name in names:
        assert name in ours, name
        assert ours[name] == pytest.approx(trl_metrics[name], rel=1e-4, abs=1e-6), name
    assert trl_metrics["clip_ratio/region_mean"] > 0  # the perturbed old log-probs clip some tokens


class _TwoProcesses:
    """Two fake processes in two threads: reduce sums and gather concatenates what both pass."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots = [None, None]

    def accelerator(self, rank):
        def collective(x, combine):
            self.slots[rank] = x
            self.barrier.wait()
            out = combine(self.slots)
            self.barrier.wait()
            return out

        return types.SimpleNamespace(
            num_processes=2,
            reduce=lambda x, reduction="sum": collective(x, lambda xs: xs[0] + xs[1]),
            gather=lambda x: collective(x, torch.cat),
        )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_metrics_over_two_processes_weigh_tokens_as_trl(level):
    """Two processes with very different token counts: the fused path's metrics equal TRL's `_compute_loss` metrics
    on the whole batch (token-weighted over every process; extremes over every process's sequences), not the
    average of each process's own mean."""
    from test_grpo_loss_math import _trl_loss

    from gfpo_kernels.grpo_loss_math import GRPOLossOptions, grpo_loss_from_logps
    from gfpo_trainer.fused_head import _log_loss_stats

    opts = GRPOLossOptions(loss_type="grpo", beta=0.04, importance_sampling_level=level)
    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[3:, 2:] = 0.0  # process 1 holds few tokens
    mask[5] = 0.0  # and a sequence without any
    old = logps + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 1.2, 0.3], dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * mask

    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": mask.sum(), "old_per_token_logps": old, "ref_per_token_logps": ref}
    _, trl_metrics = _trl_loss(logps, entropy, inputs, opts, use_vllm=False)

    world = _TwoProcesses()
    logged = [None, None]

    def process(rank):
        rows = slice(3 * rank, 3 * rank + 3)
        _, stats = grpo_loss_from_logps(logps[rows], mask[rows], adv[rows], opts, old_logps=old[rows],
                                        ref_logps=ref[rows])
        stats["entropy"] = entropy[rows]
        trainer = types.SimpleNamespace(accelerator=world.accelerator(rank),
                                        _metrics={"train": collections.defaultdict(list)})
        _log_loss_stats(trainer, "train", stats, mask[rows])
        logged[rank] = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert logged[0] == logged[1]
    assert set(logged[0]) == {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                              "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"}
    for name, value in logged[0].items():
        assert value == pytest.approx(trl_metrics[name][-1], rel=1e-6, abs=1e-9), name  # logged in fp32
    assert logged[0]["clip_ratio/region_mean"] > 0
