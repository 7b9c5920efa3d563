"""Rows (gfpo_trainer/rows.py): every trained row weighs what it would in an evenly divided batch, and rows with
advantage exactly 0 are skipped without changing the update."""

import math
import types

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from test_trainer import PROMPTS, make_trainer, model_dir, scored_batch, tokenizer  # noqa: E402,F401
from transformers import TrainerCallback  # noqa: E402

from gfpo_trainer import GFPOConfig, GFPOTrainer, rows  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model  # noqa: E402


class _FakeAccelerator:
    """Process `rank` of `P`, whose gather returns the rows of every process (given in full)."""

    def __init__(self, P, rank, global_rows):
        self.num_processes, self.process_index, self._global = P, rank, global_rows

    def gather(self, tensor):
        for full in self._global.values():
            if full.shape[1:] == tensor.shape[1:] and full.dtype == tensor.dtype:
                return full
        raise AssertionError(f"no global tensor like {tuple(tensor.shape)}")

    def pad_across_processes(self, tensor, **kwargs):
        return tensor


@pytest.mark.parametrize("P, kept_rows, spg", [(3, 4, 1), (1, 3, 2), (2, 9, 1), (2, 5, 2)])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_row_weights_equal_an_even_split(P, kept_rows, spg, loss_type, monkeypatch):
    """Weight of a row in the update = (1/P) (1/GA) (its micro-batch's TRL normaliser) x GFPO's row weight; for the
    per-sequence losses it must be 1/K for every kept row, wherever the padding lands (today: 0.25/0.25/0.5 for
    K=3, spg=2; a process holding only padding shrank the gradient to 2/3 for P=3, K=4)."""
    N = 8 * P
    keep = torch.zeros(N, dtype=torch.bool)
    keep[torch.randperm(N, generator=torch.Generator().manual_seed(kept_rows))[:kept_rows]] = True
    advantages = torch.where(keep, torch.linspace(1, 2, N), 0.0)
    completion_mask = torch.ones(N, 4, dtype=torch.int32)  # a dtype of its own: the fake gather matches by it
    weight_of_row = {}
    global_rows = {"completion_mask": completion_mask, "completion_ids": torch.arange(N * 4).view(N, 4)}
    # the row exchange between processes (tested on real processes in test_row_exchange.py): the global rows
    monkeypatch.setattr(rows, "RowExchangePlan", lambda wanted, num_local_rows: None)
    monkeypatch.setattr(rows, "take_global_rows",
                        lambda trainer, key, tensor, wanted, exchange: global_rows[key][wanted])
    for rank in range(P):
        trainer = types.SimpleNamespace(
            accelerator=_FakeAccelerator(P, rank, {"mask": completion_mask, "tokens": completion_mask.sum(1),
                                                   "ids": torch.arange(N * 4).view(N, 4)}),
            args=types.SimpleNamespace(steps_per_generation=spg), loss_type=loss_type, _metrics={"train": {}},
            _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        )
        local = slice(rank * 8, (rank + 1) * 8)
        output = {"completion_mask": completion_mask[local], "completion_ids": torch.arange(N * 4).view(N, 4)[local]}
        plan = rows.plan_trained_rows(keep, advantages, False, P, rank, spg)
        rows.take_trained_rows(trainer, output, keep, advantages, plan)
        B = output["completion_ids"].shape[0] // spg  # rows per micro-batch
        for i, row in enumerate((output["completion_ids"][:, 0] // 4).tolist()):
            if output[rows.REAL_ROW_KEY][i]:
                trl_weight = 1 / B if loss_type in rows.PER_SEQUENCE_LOSSES else 1.0
                # spg micro-batches of one optimizer step (GA = spg), averaged over P processes by DDP
                weight_of_row[row] = trl_weight * float(output[rows.ROW_WEIGHT_KEY][i]) / (P * spg)
        assert float(output["num_items_in_batch"]) == 4 * kept_rows  # the tokens of every kept row
    assert sorted(weight_of_row) == keep.nonzero().squeeze(1).tolist()
    if loss_type in rows.PER_SEQUENCE_LOSSES:
        assert weight_of_row == pytest.approx({r: 1 / kept_rows for r in weight_of_row})


def test_trained_rows_keep_two_columns_when_every_completion_is_one_token(monkeypatch):
    """Cropped to the longest trained completion, but never to one column: TRL's metrics and the fused path read a
    (B, 1) tensor as one value per sequence, so one-token completions cropped to width 1 logged an entropy of 2.94
    where the real tokens' was 3.93 (the padding rows counted as zeros)."""
    completion_mask = torch.zeros(8, 5, dtype=torch.int32)
    completion_mask[:, 0] = 1  # every completion is one token (an EOS)
    ids = torch.arange(40).view(8, 5)
    global_rows = {"completion_mask": completion_mask, "completion_ids": ids}
    monkeypatch.setattr(rows, "take_global_rows", lambda trainer, key, tensor, wanted, exchange: global_rows[key][wanted])
    trainer = types.SimpleNamespace(
        accelerator=_FakeAccelerator(1, 0, {"mask": completion_mask, "tokens": completion_mask.sum(1), "ids": ids}),
        args=types.SimpleNamespace(steps_per_generation=2), loss_type="dapo", _metrics={"train": {}},
        _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
    )
    keep = torch.tensor([True, True, True, False] * 2)
    output = {"completion_mask": completion_mask, "completion_ids": ids}
    advantages = torch.where(keep, 1.0, 0.0)
    rows.take_trained_rows(trainer, output, keep, advantages, rows.plan_trained_rows(keep, advantages, False, 1, 0, 2))
    assert output["completion_ids"].shape == output["completion_mask"].shape == (6, 2)
    assert output["completion_mask"][:, 1].sum() == 0 and output["completion_mask"][:, 0].tolist() == [1] * 6
    # generated one token wide (max_completion_length=1, or the early-stop rule ending every group at its first
    # token): a padding column (pad id, mask 0) is added, so the batch is the same as with the rule off
    narrow_mask, narrow_ids = completion_mask[:, :1], ids[:, :1]
    global_rows.update(completion_mask=narrow_mask, completion_ids=narrow_ids)
    trainer.accelerator = _FakeAccelerator(1, 0, {"mask": narrow_mask, "tokens": narrow_mask.sum(1), "ids": narrow_ids})
    trainer._tokenizer.pad_token_id = 99
    output = {"completion_mask": narrow_mask, "completion_ids": narrow_ids}
    advantages = torch.where(keep, 1.0, 0.0)
    rows.take_trained_rows(trainer, output, keep, advantages, rows.plan_trained_rows(keep, advantages, False, 1, 0, 2))
    assert output["completion_ids"].shape == output["completion_mask"].shape == (6, 2)
    assert output["completion_ids"][:, 1].tolist() == [99] * 6 and output["completion_mask"][:, 1].sum() == 0


def _constant_for_some_prompts(prompts, completions, **kwargs):
    """Half the prompts get one reward for every completion: zero-variance groups (advantage exactly 0)."""
    return [1.0 if p in PROMPTS[::2] else sum(ch.isdigit() for ch in c) - 0.05 * len(c)
            for p, c in zip(prompts, completions)]


def _train(model_dir, tokenizer, tmp_path, skip, count_rows=False, **overrides):  # noqa: F811
    options = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-2,
                   reward=_constant_for_some_prompts, skip_zero_gradient_rows=skip, beta=0.0)
    options.update(overrides)
    max_steps = options.pop("max_steps") * options.get("num_iterations", 1)
    trainer = make_trainer(model_dir, tokenizer, tmp_path / f"skip{int(skip)}", max_steps=max_steps, **options)
    seen = []
    if count_rows:  # rows through the training forward of the policy
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]) if module.training else None,
            with_kwargs=True)
    trainer.train()
    return trainer, seen


SKIP_CASES = [
    dict(loss_type="grpo"), dict(loss_type="dr_grpo"), dict(loss_type="dapo"), dict(loss_type="cispo"),
    dict(loss_type="sapo"), dict(loss_type="luspo"), dict(loss_type="vespo"),
    dict(loss_type="grpo", num_iterations=2), dict(loss_type="dapo", num_iterations=2),
    dict(loss_type="vespo", num_iterations=2, use_gfpo_kernels=True),
    dict(loss_type="grpo", num_remains_in_group=None, group_filter=None),  # plain GRPO: GFPOTrainer as a faster GRPO
    dict(loss_type="dapo", use_gfpo_kernels=True),
    # three generation batches: after a batch with skipped rows the next one samples as with the skip off
    dict(loss_type="grpo", max_steps=3),
]


@pytest.mark.parametrize("case", SKIP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_skipping_zero_gradient_rows_changes_no_parameter(model_dir, tokenizer, tmp_path, case):  # noqa: F811
    on, rows_on = _train(model_dir, tokenizer, tmp_path, True, count_rows=True, **case)
    off, rows_off = _train(model_dir, tokenizer, tmp_path, False, count_rows=True, **case)
    for (name, a), b in zip(on.model.named_parameters(), off.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    skipped = [h["gfpo/skipped_zero_gradient_fraction"] for h in on.state.log_history
               if "gfpo/skipped_zero_gradient_fraction" in h]
    assert skipped and skipped[0] > 0
    assert sum(rows_on) < sum(rows_off)  # fewer rows went through the training forward


def test_skipped_rows_refuse_to_replay_draws_trl_no_longer_makes(model_dir, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """Replaying the unskipped batch's shuffle assumes TRL's only CPU draw between a generation batch and its loss is
    one torch.randperm over its rows. A TRL that draws anything else there fails loudly, instead of silently
    repeating or skipping random numbers."""
    from trl.trainer import grpo_trainer

    from gfpo_trainer._compat import TRLSurfaceError

    shuffle = grpo_trainer.shuffle_sequence_dict

    def shuffle_and_draw(batch):
        torch.rand(1)  # a draw the replay does not know of
        return shuffle(batch)

    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", shuffle_and_draw)
    with pytest.raises(TRLSurfaceError, match="no longer one torch.randperm over the batch's rows"):
        _train(model_dir, tokenizer, tmp_path, True, loss_type="grpo")


@pytest.mark.parametrize("case", [dict(loss_type="bnpo"), dict(loss_type="grpo", beta=0.04),
                                  dict(loss_type="grpo", steps_per_generation=4),
                                  # a generation batch of 3 micro-batches straddles optimizer steps of 4
                                  dict(loss_type="grpo", steps_per_generation=3, gradient_accumulation_steps=4)],
                         ids=["bnpo", "beta", "spg>ga", "ga%spg"])
def test_no_skip_where_it_would_change_the_update(model_dir, tokenizer, tmp_path, case):  # noqa: F811
    on, rows_on = _train(model_dir, tokenizer, tmp_path, True, count_rows=True, **case)
    off, rows_off = _train(model_dir, tokenizer, tmp_path, False, count_rows=True, **case)
    assert rows_on == rows_off
    for a, b in zip(on.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)
    assert not any("gfpo/skipped_zero_gradient_fraction" in h for h in on.state.log_history)


def test_no_skip_with_dropout_active(tokenizer, tmp_path):  # noqa: F811
    """Qwen2 applies attention dropout inline (TRL's disable_dropout does not reach it): the draws depend on the
    batch's shape, so skipping rows would change the update; rows are trained as usual, and the update equals the
    one with skipping off."""
    config = make_tiny_model(tokenizer).config
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    model = type(make_tiny_model(tokenizer))(config)
    model.save_pretrained(tmp_path / "dropout-model")
    tokenizer.save_pretrained(tmp_path / "dropout-model")
    assert rows.dropout_active(model) and not rows.dropout_active(make_tiny_model(tokenizer))
    path = str(tmp_path / "dropout-model")
    on, rows_on = _train(path, tokenizer, tmp_path, True, count_rows=True, loss_type="grpo")
    off, rows_off = _train(path, tokenizer, tmp_path, False, count_rows=True, loss_type="grpo")
    assert rows_on == rows_off
    for a, b in zip(on.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)


def test_inline_dropout_rates_are_found_by_name():
    """Rates applied inline (hidden, residual, layer drop, router jitter) count; zero rates and other floats do not."""
    for name in ("attention_dropout", "hidden_dropout", "residual_dropout", "attn_pdrop", "attn_drop", "layerdrop",
                 "jitter_noise", "dropout_p"):
        module = torch.nn.Module()
        setattr(module, name, 0.1)
        assert rows.dropout_active(module), name
        setattr(module, name, 0.0)
        assert not rows.dropout_active(module), name
    module = torch.nn.Module()
    module.scaling, module.rope_theta, module.dropout = 0.125, 10000.0, 0
    assert not rows.dropout_active(module)


def test_dropout_modules_count_until_disabled(tokenizer):  # noqa: F811
    """nn.Dropout modules with p > 0 count as active dropout; TRL's disable_dropout (p = 0) turns them off."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl.trainer.utils import disable_dropout_in_model

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    assert rows.dropout_active(model)
    disable_dropout_in_model(model)
    assert not rows.dropout_active(model)


def test_batch_of_only_zero_advantages_trains_nothing(model_dir, tokenizer, tmp_path):  # noqa: F811
    trainer = make_trainer(model_dir, tokenizer, tmp_path, reward=lambda completions, **k: [1.0] * len(completions))
    output, _ = scored_batch(trainer)
    assert not output[rows.REAL_ROW_KEY].any() and output["completion_mask"].sum() == 0
    loss = trainer.compute_loss(trainer.model, output)
    assert loss.item() == 0.0


@pytest.mark.parametrize("use_kernels", [False, True])
def test_token_metrics_of_a_padding_only_micro_batch_are_left_out(model_dir, tokenizer, tmp_path,  # noqa: F811
                                                                  use_kernels):
    """Every row skipped: only padding reaches the loss, whose entropy (a mean over no token) TRL would log as 0 and
    average into the step; it is logged as NaN, which TRL's log leaves out (the step then logs None, not 0)."""
    constant = lambda completions, **k: [1.0] * len(completions)  # noqa: E731
    trainer = make_trainer(model_dir, tokenizer, tmp_path, reward=constant, use_gfpo_kernels=use_kernels)
    output, _ = scored_batch(trainer)
    trainer._metrics["train"].clear()
    trainer.compute_loss(trainer.model, output)
    assert trainer._metrics["train"]["entropy"] and all(math.isnan(v) for v in trainer._metrics["train"]["entropy"])
    # a micro-batch with real rows keeps its value
    trainer = make_trainer(model_dir, tokenizer, tmp_path / "real", use_gfpo_kernels=use_kernels)
    output, _ = scored_batch(trainer)
    trainer._metrics["train"].clear()
    trainer.compute_loss(trainer.model, output)
    assert trainer._metrics["train"]["entropy"][-1] > 0


class _GradientsBeforeStep(TrainerCallback):
    """Keeps the accumulated gradient of every parameter at each optimizer step (before the step)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


@pytest.mark.filterwarnings("ignore:`use_liger_kernel=True` is deprecated:FutureWarning")  # the field under test
def test_liger_kernel_trains_what_the_reference_path_trains(model_dir, tokenizer, tmp_path,  # noqa: F811
                                                            monkeypatch):
    """use_liger_kernel=True (TRL 1.14.2 to 1.16 have no Liger GRPO loss: TRL 1.15+ applies Liger's layer kernels,
    1.14 also computes the log-probabilities in chunks; the loss stays TRL's _compute_loss) with kept rows that do
    not divide into micro-batches (3 of 8 over 2 accumulation steps: a padding row, grpo's row weights): the logged
    loss and every parameter's accumulated gradient equal those of the reference path (use_liger_kernel=False), and
    of use_gfpo_kernels=True with Liger. On CPU only Liger's RoPE kernel runs (Triton's interpreter); its RMSNorm and
    SwiGLU kernels fail there (a Python float where they call .to()) and are left to the GPU run."""
    from transformers.models.qwen2 import modeling_qwen2

    # Liger patches the module's RoPE function for every later Qwen2 model: undone after this test
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", modeling_qwen2.apply_rotary_pos_emb)
    # short completions: each forward runs Liger's RoPE kernel under Triton's interpreter (0.5 s a call)
    options = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-2,
                   max_grad_norm=0.0, loss_type="grpo", skip_zero_gradient_rows=False, max_completion_length=4)
    runs = {}
    for liger, kernels in ((False, False), (True, False), (True, True)):
        liger_options = dict(use_liger_kernel=True, liger_kernel_config={"rms_norm": False, "swiglu": False}) \
            if liger else {}
        trainer = make_trainer(model_dir, tokenizer, tmp_path / f"liger{int(liger)}{int(kernels)}",
                               use_gfpo_kernels=kernels, **liger_options, **options)
        recorder = _GradientsBeforeStep()
        trainer.add_callback(recorder)
        trainer.train()
        assert len(recorder.steps) == 1
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[liger, kernels] = losses, recorder.steps[0]
    assert modeling_qwen2.apply_rotary_pos_emb.__name__ == "liger_rotary_pos_emb"  # Liger's kernel did run
    want_losses, want_grads = runs[False, False]
    assert any(g.abs().max() > 0 for g in want_grads.values())
    for key in ((True, False), (True, True)):
        losses, grads = runs[key]
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-7), key
        assert grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=f"{key} {name}")


CROP_CASES = [
    dict(loss_type="grpo"), dict(loss_type="dapo", use_gfpo_kernels=True),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),  # (B, 1) ratios, the ref log-probs
    dict(loss_type="bnpo", pad_to_multiple_of=4),
]


@pytest.mark.parametrize("case", CROP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_micro_batch_cropped_to_its_longest_completion_trains_the_same(model_dir, tokenizer, tmp_path,  # noqa: F811
                                                                      case, monkeypatch):
    """compute_loss drops the padding columns past the micro-batch's longest completion (TRL pads every micro-batch to
    the generation batch's longest): the loss and every gradient are those of the full-width micro-batch."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path, per_device_train_batch_size=16,
                           skip_zero_gradient_rows=False, **case)
    output, _ = scored_batch(trainer)
    T = output["completion_ids"].size(1)
    # a micro-batch of completions at most 3 tokens long, in a batch generated T wide
    output["completion_mask"][:, 3:] = 0
    output["completion_ids"][:, 3:] = tokenizer.pad_token_id
    widths = []
    forward = trainer.model.forward

    def recording_forward(*args, **kwargs):
        widths.append(kwargs["input_ids"].size(1))
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.model, "forward", recording_forward)

    def loss_and_grads():
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, output)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]

    cropped_loss, cropped_grads = loss_and_grads()
    with monkeypatch.context() as patch:
        patch.setattr("gfpo_trainer.trainer.crop_to_longest_completion", lambda trainer, batch: dict(batch))
        full_loss, full_grads = loss_and_grads()
    prompt_width = output["prompt_ids"].size(1)
    width = 4 if case.get("pad_to_multiple_of") else 3
    assert T > width and widths == [prompt_width + width, prompt_width + T]
    torch.testing.assert_close(cropped_loss, full_loss, rtol=1e-5, atol=1e-7)
    for cropped, full in zip(cropped_grads, full_grads):
        torch.testing.assert_close(cropped, full, rtol=1e-4, atol=1e-7)


def test_multimodal_micro_batch_cropped_with_its_token_types(tmp_path, tokenizer, monkeypatch):  # noqa: F811
    """A vision-language batch (GFPOTrainer without a filter trains TRL's GRPO on it): mm_token_type_ids spans prompt
    and completion, and Qwen2-VL's M-RoPE reads it beside the input ids, so the micro-batch crop must drop the same
    completion columns from it (it did not: IndexError in get_rope_index). Loss and gradients as at full width."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    image, vision_start = len(tokenizer), len(tokenizer) + 2  # token ids past the text tokenizer's
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, mlp_ratio=2),
        image_token_id=image, video_token_id=image + 1, vision_start_token_id=vision_start,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    args = GFPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                      skip_zero_gradient_rows=False)
    trainer = GFPOTrainer(model=Qwen2VLForConditionalGeneration(config), args=args, processing_class=tokenizer,
                          reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                          train_dataset=Dataset.from_list([{"prompt": "1+2="}]))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    B, P, T, longest = 4, 6, 8, 3
    prompt_ids = torch.randint(11, len(tokenizer), (B, P))
    prompt_ids[:, 1], prompt_ids[:, 2] = vision_start, image  # one image of 2x2 patches: one token after merging
    completion_mask = (torch.arange(T) < torch.tensor([[longest], [2], [1], [longest]])).long()
    completion_ids = torch.randint(11, len(tokenizer), (B, T)).masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    token_types = torch.zeros(B, P + T, dtype=torch.long)
    token_types[:, 2] = 1
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.tensor([1.0, -0.5, 0.25, -2.0]),
                  num_items_in_batch=completion_mask.sum(), pixel_values=torch.randn(4 * B, 3 * 2 * 2 * 2),
                  image_grid_thw=torch.tensor([[1, 2, 2]] * B), num_images=[1] * B, mm_token_type_ids=token_types)
    assert rows.crop_to_longest_completion(trainer, inputs)["mm_token_type_ids"].shape == (B, P + longest)

    def loss_and_grads():
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    cropped_loss, cropped_grads = loss_and_grads()
    with monkeypatch.context() as patch:
        patch.setattr("gfpo_trainer.trainer.crop_to_longest_completion", lambda trainer, batch: dict(batch))
        full_loss, full_grads = loss_and_grads()
    assert full_loss != 0 and len(cropped_grads) == len(full_grads) > 0
    torch.testing.assert_close(cropped_loss, full_loss, rtol=1e-5, atol=1e-7)
    for cropped, full in zip(cropped_grads, full_grads):
        torch.testing.assert_close(cropped, full, rtol=1e-4, atol=1e-7)
