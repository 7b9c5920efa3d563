"""What GFPOTrainer trains, in the corners a TRL user runs into: k >= 2, TRL's two-argument filter,
infinite rewards, exact token-efficiency ties, the kept-row metrics and completions table, tool masks, beam
search with the early-stop rule, and the adaptive-difficulty state across a resume."""

import json
import math
import os
import random

import pytest
import torch

pytest.importorskip("trl")

from test_trainer import (  # noqa: E402  (fixtures and helpers of the trainer tests)
    PROMPTS,
    make_config,
    make_trainer,
    model_dir,  # noqa: F401
    real_rows,
    scored_batch,
    tokenizer,  # noqa: F401
)

import gfpo_kernels  # noqa: E402
from gfpo_kernels import reference as ref  # noqa: E402
from gfpo_trainer import GFPOTrainer, selection  # noqa: E402
from gfpo_trainer._compat import TRLSurfaceError, tool_mask_of  # noqa: E402
from gfpo_trainer.adaptive import AdaptiveDifficulty  # noqa: E402
from gfpo_trainer.batch import GenerationBatch  # noqa: E402
from gfpo_trainer.filters import GROUP_FILTER_SPECS, FilterInputs  # noqa: E402
from test_filters import token_efficiency_keep_by_loop  # noqa: E402

token_efficiency = GROUP_FILTER_SPECS["token_efficiency"]


def test_k_of_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"2 <= k < num_generations=8 .*got num_remains_in_group=1"):
        make_config(tmp_path, num_remains_in_group=1)


def test_trl_two_argument_filter_works(model_dir, tokenizer, tmp_path):  # noqa: F811
    calls = []

    def prefer_digits(group_completions, group_rewards):  # TRL's documented form: no **kwargs
        calls.append(len(group_completions))
        return [[float(sum(ch.isdigit() for ch in c)) for c in group] for group in group_completions]

    trainer = make_trainer(model_dir, tokenizer, tmp_path, group_filter=None, group_filter_func=prefer_digits)
    output, seen = scored_batch(trainer)
    assert calls == [1]
    scores = torch.tensor([float(sum(ch.isdigit() for ch in c)) for c in seen["completions"]])
    rows, _ = real_rows(output)
    assert rows == [seen["ids"][i] for i in ref.group_topk_mask(scores, 8, 3).nonzero().squeeze(1).tolist()]


def test_filter_taking_completion_ids_by_name_gets_them(model_dir, tokenizer, tmp_path):  # noqa: F811
    seen_ids = []

    def by_ids(group_completions, group_rewards, group_completion_ids):
        seen_ids.append(group_completion_ids)
        return [[-float(len(ids)) for ids in group] for group in group_completion_ids]

    trainer = make_trainer(model_dir, tokenizer, tmp_path, group_filter=None, group_filter_func=by_ids)
    _, seen = scored_batch(trainer)
    assert seen_ids == [[seen["ids"]]]


@pytest.mark.parametrize("bad_reward", [math.inf, -math.inf])
@pytest.mark.parametrize("use_kernels", [False, True])
def test_infinite_reward_gives_its_group_zero_advantage(model_dir, tokenizer, tmp_path, bad_reward, use_kernels):  # noqa: F811
    def one_infinite(completions, **kwargs):
        return [bad_reward if i == 1 else float(i) for i in range(len(completions))]

    trainer = make_trainer(model_dir, tokenizer, tmp_path, reward=one_infinite, per_device_train_batch_size=16,
                           use_gfpo_kernels=use_kernels, skip_zero_gradient_rows=False)  # keep the 0 rows
    output, seen = scored_batch(trainer)
    real = output["gfpo_real_row"]
    adv = output["advantages"][real]
    assert torch.isfinite(adv).all()
    # prompt 0 holds the infinite reward: its 3 kept rows get 0; prompt 1 is an ordinary group
    assert adv[:3].eq(0).all() and adv[3:].ne(0).any()
    loss = trainer.compute_loss(trainer.model, output)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in trainer.model.parameters()
                                        if p.grad is not None)


@pytest.mark.parametrize("use_kernels", [False, True])
def test_token_efficiency_ties_follow_the_sign_rule(use_kernels):
    """0/1 rewards with many exact ties: the kept rows are the plain-Python ranking's (tests/test_filters.py), with the
    fused kernel and the reference alike."""
    torch.manual_seed(0)
    G, k = 8, 3
    rewards = torch.randint(0, 2, (32 * G,)).float()  # 0/1 rewards: every wrong answer scores 0 per token
    rewards[: 2 * G] = 0.0  # whole groups wrong
    lengths = torch.randint(1, 6, (32 * G,)).float()  # many exact ties in length too
    scores = token_efficiency.score(FilterInputs(rewards, lengths, torch.zeros_like(lengths), G))
    ops = gfpo_kernels if use_kernels else ref
    keep, _ = ops.gfpo_filter_advantages(rewards, scores, G, k, largest=True)
    assert torch.equal(keep, token_efficiency_keep_by_loop(rewards.tolist(), lengths.tolist(), G, k))
    # the all-wrong groups keep their longest completions, not their first ones
    assert lengths[:G][keep[:G]].min() >= lengths[:G][~keep[:G]].max()


def test_token_efficiency_rank_puts_unscorable_rows_last():
    rewards = torch.tensor([float("nan"), 0.0, 1.0, float("nan")])
    lengths = torch.tensor([1.0, 5.0, 9.0, 1.0])
    scores = token_efficiency.score(FilterInputs(rewards, lengths, torch.zeros_like(lengths), 4))
    assert torch.isnan(scores[[0, 3]]).all()
    assert torch.equal(ref.group_topk_mask(scores, 4, 3), torch.tensor([True, True, True, False]))


def test_kept_reward_metrics_and_completions_table(model_dir, tokenizer, tmp_path):  # noqa: F811
    trainer = make_trainer(model_dir, tokenizer, tmp_path, per_device_train_batch_size=16)
    output, seen = scored_batch(trainer)
    rewards = seen["rewards"].sum(dim=1)
    lengths = torch.tensor([float(len(ids)) for ids in seen["ids"]])
    keep = ref.group_topk_mask(lengths, 8, 3, largest=False)
    kept = rewards[keep].double()
    metrics = trainer._metrics["train"]
    assert metrics["gfpo/kept_reward_mean"] == [pytest.approx(kept.mean().item(), rel=1e-5)]
    assert metrics["gfpo/kept_reward_std"] == [pytest.approx(kept.std().item(), rel=1e-5)]
    group_std = rewards.double().where(keep, torch.nan).view(2, 8)
    zero = [torch.isclose(r[~torch.isnan(r)].std(), torch.tensor(0.0, dtype=torch.float64)).item() for r in group_std]
    assert metrics["gfpo/kept_frac_reward_zero_std"] == [pytest.approx(sum(zero) / 2)]
    # with the length filter TRL's per-batch reward and completion metrics describe the kept rows too (the early-stop
    # rule cuts the others short), computed as TRL computes them
    assert metrics["reward"] == [pytest.approx(kept.mean().item(), rel=1e-5)]
    assert metrics["reward_std"] == [pytest.approx(kept.std().item(), rel=1e-5)]
    assert metrics["frac_reward_zero_std"] == [pytest.approx(sum(zero) / 2)]
    assert metrics["rewards/digit_reward/mean"] == metrics["reward"]
    assert metrics["rewards/digit_reward/std"] == metrics["reward_std"]
    ends = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    truncated = torch.tensor([ids[-1] not in ends for ids in seen["ids"]])[keep]
    terminated = lengths[keep][~truncated] if (~truncated).any() else torch.zeros(1)
    assert truncated.any() and (~truncated).any()  # both kinds among the kept rows (a random-weight model)
    assert metrics["completions/mean_length"] == [pytest.approx(lengths[keep].mean().item())]
    assert metrics["completions/min_length"] == [lengths[keep].min().item()]
    assert metrics["completions/max_length"] == [lengths[keep].max().item()]
    assert metrics["completions/clipped_ratio"] == [pytest.approx(truncated.float().mean().item())]
    assert metrics["completions/mean_terminated_length"] == [pytest.approx(terminated.mean().item())]
    assert metrics["completions/min_terminated_length"] == [terminated.min().item()]
    assert metrics["completions/max_terminated_length"] == [terminated.max().item()]
    # the completions table: GFPO's advantages, 0 for dropped rows
    want = ref.group_advantages(rewards, 8, keep=keep)
    assert list(trainer._logs["advantages"]) == pytest.approx(want.tolist(), abs=1e-6)
    assert all(a == 0 for a, kept in zip(trainer._logs["advantages"], keep) if not kept)


@pytest.mark.parametrize("group_filter", [name for name, spec in GROUP_FILTER_SPECS.items()
                                          if not spec.trl_metrics_over_kept_rows])
def test_trl_metrics_cover_every_completion_with_other_filters(model_dir, tokenizer, tmp_path, group_filter):  # noqa: F811
    """Only a filter whose spec says so (the length filter: its early-stop rule cuts completions short) moves TRL's
    metrics to the kept rows."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path, per_device_train_batch_size=16, group_filter=group_filter)
    _, seen = scored_batch(trainer)
    rewards = seen["rewards"].sum(dim=1)
    lengths = torch.tensor([float(len(ids)) for ids in seen["ids"]])
    metrics = trainer._metrics["train"]
    assert metrics["reward"] == [pytest.approx(rewards.mean().item(), rel=1e-5)]
    assert metrics["completions/mean_length"] == [pytest.approx(lengths.mean().item())]
    assert metrics["gfpo/kept_reward_mean"] != metrics["reward"]


def test_trl_logging_a_batch_metric_twice_is_a_surface_error(model_dir, tokenizer, tmp_path):  # noqa: F811
    """GFPO replaces the one value per batch TRL logs; if TRL ever logs another number of them, it says so."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path)
    generate = trainer._generate

    def generate_logging_twice(prompts):
        result = generate(prompts)
        trainer._metrics["train"]["completions/mean_length"].append(0.0)
        return result

    trainer._generate = generate_logging_twice
    with pytest.raises(TRLSurfaceError, match="'completions/mean_length' 2 times"):
        scored_batch(trainer)


def test_trl_logging_another_number_of_advantages_is_a_surface_error(model_dir, tokenizer, tmp_path):  # noqa: F811
    """The completions table's advantages: GFPO replaces the ones TRL logs for the batch, one a completion; if TRL
    logs another number, replacing them would misalign the table, and GFPO says so."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path)
    generate = trainer._generate

    def generate_logging_an_extra_advantage(prompts):
        result = generate(prompts)
        trainer._logs["advantages"].append(0.5)
        return result

    trainer._generate = generate_logging_an_extra_advantage
    with pytest.raises(TRLSurfaceError, match="logged 9 advantages for a generation batch of 8 completions"):
        scored_batch(trainer)


def test_length_filters_count_model_tokens_only(model_dir, tokenizer, tmp_path):  # noqa: F811
    """With tool calling, tool-output tokens (tool_mask 0) are not the model's length."""
    trainer = make_trainer(model_dir, tokenizer, tmp_path)
    G = 8
    completion_ids = [[5] * (3 + i) for i in range(G)]  # row i has 3 + i tokens ...
    tool_masks = [[1] * 2 + [0] * (1 + i) for i in range(G)]  # ... of which only 2 are the model's, for every row
    tool_masks[7] = [1] * len(completion_ids[7])  # but the longest row is all model tokens (10)
    tool_masks[6] = [1] + [0] * (len(completion_ids[6]) - 1)  # and row 6 has a single model token
    model_tokens = [sum(m) for m in tool_masks]
    rewards_per_func = torch.ones(G, 1)
    batch = GenerationBatch(filtering=True, skip_zero=False, tool_mask=tool_masks)
    picked = selection.select(trainer, batch, rewards_per_func, ["x"] * G, completion_ids)
    assert picked.lengths.tolist() == [float(n) for n in model_tokens]
    # the 3 shortest by model tokens: row 6 (1 token), then rows 0 and 1 (2 tokens, lower index first)
    assert picked.keep.nonzero().squeeze(1).tolist() == [0, 1, 6]


def test_tool_mask_is_read_from_generate_output():
    ids = [[1, 2, 3], [4]]
    assert tool_mask_of((None, ids, [[1, 0, 1], [1]], None)) == [[1, 0, 1], [1]]
    assert tool_mask_of((None, ids, None, None)) is None
    with pytest.raises(TRLSurfaceError, match="one tool mask per completion"):
        tool_mask_of((None, ids, [[1, 0]], None))


def test_early_stop_is_switched_off_with_beam_search(model_dir, tokenizer, tmp_path, caplog):  # noqa: F811
    trainer = make_trainer(model_dir, tokenizer, tmp_path, generation_kwargs={"num_beams": 2}, temperature=1.0)
    with caplog.at_level("WARNING"):
        output, seen = scored_batch(trainer)
        scored_batch(trainer, seed=1)
    warnings = [r for r in caplog.records if "not applied with beam search" in r.getMessage()]
    assert len(warnings) == 1  # once
    lengths = torch.tensor([float(len(ids)) for ids in seen["ids"]])
    rows, _ = real_rows(output)
    assert rows == [seen["ids"][i] for i in ref.group_topk_mask(lengths, 8, 3, largest=False).nonzero().squeeze(1).tolist()]


def test_adaptive_digest_round_trips_exactly():
    adaptive = AdaptiveDifficulty([6, 4, 3, 2])
    torch.manual_seed(0)
    for _ in range(40):  # 1600 means: more than the digest's 1000 centroids, so it has merged some
        adaptive.update_and_assign(torch.rand(40))
    assert len(adaptive.digest) < adaptive.digest.n_values == 1600
    restored = AdaptiveDifficulty([6, 4, 3, 2])
    restored.load_state_dict(json.loads(json.dumps(adaptive.state_dict(), allow_nan=False)))
    assert restored.digest.n_values == adaptive.digest.n_values
    assert restored.digest.centroids == adaptive.digest.centroids
    means = torch.rand(16)
    assert torch.equal(restored.update_and_assign(means)[1], adaptive.update_and_assign(means)[1])
    with pytest.raises(ValueError, match=r"adaptive_num_remains=\[6, 4, 3, 2\] differs from this run's \[8, 4, 3, 2\]"):
        AdaptiveDifficulty([8, 4, 3, 2]).load_state_dict(adaptive.state_dict())


def test_adaptive_digest_ignores_the_global_random_state():
    """Processes fed the same group means must hold the same digest and choose the same k whatever their random
    states: TRL seeds Python's `random` per process (set_seed(device_specific=True)) and other code draws from it
    between steps (a digest that drew from it would let processes choose different k, then hang or crash in a
    collective); the caller's random stream is left as it was."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.rand(64, generator=g) for _ in range(200)]  # 12800 means: the digest merges
    processes = [AdaptiveDifficulty([6, 4, 3, 2]) for _ in range(2)]
    for rank, adaptive in enumerate(processes):
        random.seed(1000 + rank)  # a per-process seed
        torch.manual_seed(1000 + rank)
        for step, means in enumerate(batches):
            random.random() if (step + rank) % 3 == 0 else None  # other code drawing on some steps only
            before = random.getstate()
            adaptive.update_and_assign(means)
            assert random.getstate() == before
    a, b = processes
    assert len(a.digest) < a.digest.n_values
    assert a.digest.centroids == b.digest.centroids
    for means in batches[:5]:
        assert torch.equal(a.update_and_assign(means)[1], b.update_and_assign(means)[1])


def test_gfpo_state_is_written_where_the_trainer_saves(tmp_path):
    """gfpo_state.json goes into the checkpoint folder of the trial's output dir, on the processes that save
    (args.should_save: every node's main process with save_on_each_node), not on the others."""
    import types

    from gfpo_trainer.state import STATE_FILE, save_gfpo_state

    adaptive = AdaptiveDifficulty([6, 4, 3, 2])
    adaptive.update_and_assign(torch.rand(8))
    for should_save in (True, False):
        trainer = types.SimpleNamespace(
            args=types.SimpleNamespace(should_save=should_save, output_dir=str(tmp_path / "out")),
            state=types.SimpleNamespace(global_step=7), adaptive_difficulty=adaptive, gfpo_nonfinite_reward_groups_total=5,
            _get_output_dir=lambda trial: str(tmp_path / f"run-{trial}"),
        )
        save_gfpo_state(trainer, trial="t1")
        path = tmp_path / "run-t1" / "checkpoint-7" / STATE_FILE
        assert path.is_file() == should_save
        if should_save:
            assert json.loads(path.read_text()) == json.loads(json.dumps({"nonfinite_reward_groups_total": 5,
                                                                          "adaptive_difficulty": adaptive.state_dict()}))
            path.unlink()
    assert not (tmp_path / "out").exists()


def test_resume_restores_the_adaptive_digest(model_dir, tokenizer, tmp_path):  # noqa: F811
    options = dict(adaptive_difficulty=True, adaptive_num_remains=[6, 4, 3, 2], num_remains_in_group=3,
                   per_device_train_batch_size=16, save_strategy="steps", save_steps=2, max_steps=3)
    straight = make_trainer(model_dir, tokenizer, tmp_path / "straight", **options)
    straight.train()
    checkpoint = os.path.join(tmp_path / "straight", "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, "gfpo_state.json"))

    resumed = make_trainer(model_dir, tokenizer, tmp_path / "straight", **options)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.adaptive_difficulty.digest.n_values == straight.adaptive_difficulty.digest.n_values == 3 * 2
    assert resumed.adaptive_difficulty.digest.centroids == straight.adaptive_difficulty.digest.centroids


@pytest.mark.parametrize("saved", [None, {}], ids=["no-file", "saved-without-adaptive"])
def test_resume_without_saved_gfpo_state_is_refused_with_adaptive(model_dir, tokenizer, tmp_path, saved):  # noqa: F811
    """A checkpoint without the digest (no gfpo_state.json, or one from a run without adaptive difficulty) is a
    ValueError naming the folder, not a KeyError."""
    (tmp_path / "checkpoint-1").mkdir()
    if saved is not None:
        (tmp_path / "checkpoint-1" / "gfpo_state.json").write_text(json.dumps(saved))
    trainer = make_trainer(model_dir, tokenizer, tmp_path, adaptive_difficulty=True,
                           adaptive_num_remains=[6, 4, 3, 2], num_remains_in_group=3)
    with pytest.raises(ValueError, match="checkpoint-1' holds no adaptive-difficulty state in gfpo_state.json"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))



# --------------------------------------------------------------------------- tool calling, through TRL's own loop

def f(a: int) -> int:
    """Doubles.

    Args:
        a: a number
    """
    return 2 * a


@pytest.fixture(scope="module")
def tool_calling_model(tmp_path_factory):
    """A character tokenizer with Qwen2.5's chat template (TRL parses its tool calls) and a tiny model whose LM head is
    scaled so that text it did not write, the tool's output, has log-probabilities far below -88.7 (exp(88.7)
    overflows float32)."""
    import string

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.chat_template_utils import qwen2_5_chat_template

    from gfpo_trainer.tiny import CHARACTERS, make_tokenizer

    tokenizer = make_tokenizer(CHARACTERS + string.ascii_uppercase + '{}"_\n<>/|[],\'!')
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = qwen2_5_chat_template
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(300.0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tool-calling-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _force_tool_calls(model, tokenizer):
    """The even rows of a first turn (no tool response in their input yet) call the tool: a tiny random model never
    writes a tool call by itself, so generation is made to write this one; everything after it (TRL parsing the
    call, running the tool, appending its output, generating on, the tool mask) is TRL's own."""
    from transformers import LogitsProcessor, LogitsProcessorList

    call = tokenizer('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
                     add_special_tokens=False)["input_ids"]
    response = tokenizer.convert_tokens_to_ids("<tool_response>")

    class ForceToolCall(LogitsProcessor):
        def __init__(self, input_ids):
            self.start = input_ids.shape[1]
            self.rows = [i for i in range(0, input_ids.shape[0], 2) if response not in input_ids[i].tolist()]

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.start
            if step < len(call):
                scores[self.rows] = float("-inf")
                scores[self.rows, call[step]] = 0.0
            return scores

    generate = model.generate

    def forced(*args, **kwargs):
        return generate(*args, logits_processor=LogitsProcessorList([ForceToolCall(kwargs["input_ids"])]), **kwargs)

    model.generate = forced


def test_tool_output_with_very_negative_old_logps_trains_as_trl(tool_calling_model, tmp_path):
    """With tool calling (TRL's tool loop; tool output masked by tool_mask) and old log-probabilities
    (num_iterations=2), the tool output's old log-probabilities are far below -88.7, where the fused loss, which
    holds 0 there, must not compute exp(0 - old) = inf. Kernels on and off log finite, equal losses and loss
    metrics."""
    from datasets import Dataset

    path, tokenizer = tool_calling_model
    logs, tool_old_logps = {}, []
    for use_kernels in (False, True):
        args = make_config(tmp_path / f"kernels{int(use_kernels)}", use_gfpo_kernels=use_kernels, num_iterations=2,
                           num_generations=4, num_remains_in_group=3, per_device_train_batch_size=4,
                           max_completion_length=72, loss_type="dapo", skip_zero_gradient_rows=False,
                           logging_nan_inf_filter=False)  # a NaN loss is logged as such, not as the previous mean
        trainer = GFPOTrainer(model=path, reward_funcs=lambda completions, **k: [len(str(c)) % 7 for c in completions],
                              args=args, processing_class=tokenizer, tools=[f],
                              train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "1+2="}]}]))
        _force_tool_calls(trainer.model, tokenizer)
        compute_loss = trainer.compute_loss

        def recording(model, inputs, *args, **kwargs):
            tool_output = (inputs["tool_mask"] == 0) & (inputs["completion_mask"] == 1)
            tool_old_logps.append(inputs["old_per_token_logps"][tool_output])
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = recording
        trainer.train()
        logs[use_kernels] = [h for h in trainer.state.log_history if "loss" in h]
    assert all(old.numel() and old.min() < -88.7 for old in tool_old_logps)  # tool output was trained on, masked
    off, on = logs[False], logs[True]
    assert len(off) == len(on) == 1 and off[0]["tools/call_frequency"] > 0 and off[0]["loss"] != 0
    assert math.isfinite(on[0]["loss"])
    for name in ("loss", "entropy", "clip_ratio/region_mean"):
        assert on[0][name] == pytest.approx(off[0][name], rel=1e-4, abs=1e-7), name
