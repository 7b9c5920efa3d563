"""The fused-loss model adapter (gfpo_trainer/fused_head.py): `use_gfpo_kernels=True` computes the loss of the
model's own logits, adds an MoE model's router auxiliary loss as TRL does, and refuses a model whose logits it
cannot reproduce, naming its class (issue 11, point 1)."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
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


def _trainer(path, tokenizer, tmp_path, use_kernels, **overrides):
    options = dict(output_dir=str(tmp_path / f"out{int(use_kernels)}"), per_device_train_batch_size=8,
                   num_generations=8, num_remains_in_group=3, group_filter="length", max_completion_length=6,
                   max_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                   loss_type="dapo", use_gfpo_kernels=use_kernels, skip_zero_gradient_rows=False)
    options.update(overrides)
    return GFPOTrainer(model=path, reward_funcs=_reward, args=GFPOConfig(**options), processing_class=tokenizer,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _kernels_on_equals_off(path, tokenizer, tmp_path, **overrides):
    off = _trainer(path, tokenizer, tmp_path, False, **overrides)
    on = _trainer(path, tokenizer, tmp_path, True, **overrides)
    off.model.train()
    torch.manual_seed(0)
    inputs = off._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(8)])
    loss_off, grads_off = _loss_and_grads(off, inputs)
    loss_on, grads_on = _loss_and_grads(on, inputs)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-4, atol=1e-6, msg=name)
    return on, off, loss_on


def test_gemma2_softcap_is_refused_naming_the_class(tmp_path):
    tokenizer = make_tokenizer()
    config = Gemma2Config(**_small(tokenizer, head_dim=8), final_logit_softcapping=30.0)
    path = _save(Gemma2ForCausalLM(config), tokenizer, tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"cannot train Gemma2ForCausalLM: .*final_logit_softcapping=30.0"):
        _trainer(path, tokenizer, tmp_path, True)
    _trainer(path, tokenizer, tmp_path, False)  # TRL's own loss applies the cap: fine


def test_moe_router_aux_loss_is_added_as_trl_adds_it(tmp_path):
    tokenizer = make_tokenizer()
    config = Qwen2MoeConfig(**_small(tokenizer), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, router_aux_loss_coef=0.5, output_router_logits=True)
    path = _save(Qwen2MoeForCausalLM(config), tokenizer, tmp_path / "moe")
    on, off, loss = _kernels_on_equals_off(path, tokenizer, tmp_path)
    assert on.aux_loss_enabled and on._metrics["train"]["aux_loss"] and on._metrics["train"]["aux_loss"][0] > 0


def test_logit_scale_is_applied(tmp_path):
    tokenizer = make_tokenizer()
    config = GraniteConfig(**_small(tokenizer), logits_scaling=4.0)  # Granite divides its logits by 4
    path = _save(GraniteForCausalLM(config), tokenizer, tmp_path / "granite")
    _kernels_on_equals_off(path, tokenizer, tmp_path)


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
