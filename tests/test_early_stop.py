"""gfpo_stop_dropped_generations: completions the length filter is certain to drop stop early, and nothing that
reaches the loss changes."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer._compat import batch_metric_names  # noqa: E402
from gfpo_study.demo import correctness_reward  # noqa: E402
from gfpo_trainer.tiny import warm_up_on_pair_sums  # noqa: E402
from gfpo_trainer.early_stop import StopDroppedCompletions  # noqa: E402
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer  # noqa: E402

EOS = 1


def test_processor_forces_eos_once_k_rows_of_a_group_ended():
    stopper = StopDroppedCompletions([EOS], group_size=4, k=2, first_row=0)
    prompt = torch.full((8, 2), 5)
    scores = torch.zeros(8, 6)
    assert torch.equal(stopper(prompt, scores), scores)  # nothing generated yet
    # group 0 (rows 0-3): rows 0 and 2 ended -> rows 1 and 3 are stopped; group 1 (rows 4-7): one ended
    generated = torch.tensor([[EOS], [3], [EOS], [4], [EOS], [3], [3], [3]])
    out = stopper(torch.cat([prompt, generated], dim=1), scores)
    stopped = torch.tensor([False, True, False, True, False, False, False, False])
    assert torch.equal(stopper.stopped, stopped)
    assert torch.all(out[stopped].argmax(dim=1) == EOS) and torch.all(torch.isinf(out[stopped][:, 2:]))
    assert torch.equal(out[~stopped], scores[~stopped])


def test_processor_reads_nothing_back_to_the_host(monkeypatch):
    """No .item(), bool() or int() of a tensor in a decoding step: on a GPU each would wait for the step's kernels.
    Ended rows are tracked from each step's last token (not a scan of everything generated)."""
    stopper = StopDroppedCompletions([EOS, 2], group_size=4, k=2, first_row=0)
    prompt = torch.full((8, 2), 5)
    stopper(prompt, torch.zeros(8, 6))
    steps = [torch.tensor([[EOS], [3], [3], [4], [2], [3], [3], [3]]),  # rows 0 and 4 end (4 on the second EOS id)
             torch.tensor([[0], [3], [EOS], [4], [0], [EOS], [3], [3]])]  # rows 2 and 5 end: groups 0 and 1 reach k
    for name in ("item", "__bool__", "__int__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("a host read in a decoding step"))
    generated = prompt
    for step in steps:
        generated = torch.cat([generated, step], dim=1)
        out = stopper(generated, torch.zeros(8, 6))
    monkeypatch.undo()
    assert stopper.stopped.tolist() == [False, True, False, True, False, False, True, True]
    assert out[1].argmax().item() == EOS and torch.isinf(out[1, 2:]).all() and torch.equal(out[0], torch.zeros(6))
    with pytest.raises(RuntimeError, match="saw 2 new tokens at once; it must be called at every decoding step"):
        stopper(torch.cat([generated, torch.zeros(8, 2, dtype=torch.long)], dim=1), torch.zeros(8, 6))


def test_processor_counts_only_this_process_rows_of_a_straddling_group():
    """Rows 6..9 globally on this process (first_row=6, group_size=4): rows 6, 7 close group 1, 8, 9 open group 2."""
    stopper = StopDroppedCompletions([EOS], group_size=4, k=2, first_row=6)
    prompt = torch.full((4, 1), 5)
    stopper(prompt, torch.zeros(4, 3))
    out = stopper(torch.cat([prompt, torch.tensor([[EOS], [3], [EOS], [EOS]])], dim=1), torch.zeros(4, 3))
    # group 1 has only one local finished row here (its other rows live on another process): not stopped
    assert stopper.stopped.tolist() == [False, False, False, False]
    assert torch.equal(out, torch.zeros(4, 3))


def test_length_filter_ranks_a_stopped_completion_below_a_finished_one_of_its_length():
    """On vLLM the rule aborts a request once it holds as many tokens as the k-th shortest finished completion of its
    group (gfpo_trainer/vllm_stop.py), so a stopped row ties with that completion in length; the filter keeps the
    finished one, the stopped row being one token longer at least, whatever its last token (here the pad token in
    row 0: a model can sample it). Group of 4, k=2: rows 0 and 1 stopped holding 5 tokens, rows 2 and 3 ended at 5
    and 3 tokens; by length alone, ties to the lower index, row 0 would be kept."""
    from types import SimpleNamespace

    from gfpo_trainer.batch import GenerationBatch
    from gfpo_trainer.selection import select

    pad = 0
    trainer = SimpleNamespace(
        num_generations=4, args=SimpleNamespace(group_filter="length", num_remains_in_group=2, use_gfpo_kernels=False),
        reward_weights=torch.ones(1), accelerator=SimpleNamespace(gather=lambda tensor: tensor), eos_token_ids=[EOS],
        _tokenizer=SimpleNamespace(pad_token_id=pad), adaptive_difficulty=None, scale_rewards="group")
    batch = GenerationBatch(filtering=True, skip_zero=False, stopped_rows=torch.tensor([True, True, False, False]))
    ids = [[3, 3, 3, 3, pad], [3, 3, 3, 3, 4], [3, 3, 3, 3, EOS], [3, 3, EOS]]
    selection = select(trainer, batch, torch.tensor([[0.0], [1.0], [1.0], [0.0]]), ["x"] * 4, ids)
    assert selection.keep.tolist() == [False, False, True, True]
    assert selection.lengths.tolist() == [5, 5, 5, 3]  # the metrics see the lengths as generated


@pytest.fixture(scope="module")
def warm_model_dir(tmp_path_factory):
    """A tiny model warmed up on pair sums with filler, so completions end at varied lengths (the rule has work to do)."""
    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, hidden_size=32)
    warm_up_on_pair_sums(model, tokenizer, [(a, b) for a in range(10) for b in range(10)], 80, "cpu")
    path = tmp_path_factory.mktemp("warm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _run(model_dir, tokenizer, tmp_path, stop, k, use_kernels=False):
    args = GFPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=32, num_generations=16,
                      num_remains_in_group=k, group_filter="length", max_completion_length=24, report_to="none",
                      use_cpu=True, bf16=False, save_strategy="no", seed=0, beta=0.02, loss_type="grpo",
                      gfpo_stop_dropped_generations=stop, use_gfpo_kernels=use_kernels)
    trainer = GFPOTrainer(model=model_dir, reward_funcs=correctness_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": "1+2="}]))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        out = original(inputs, prompts, completions, completion_ids_list)
        seen["ids"], seen["rewards"] = [list(x) for x in completion_ids_list], out.sum(dim=1)
        return out

    trainer._calculate_rewards = spy
    torch.manual_seed(7)
    batch = [{"prompt": p} for p in ("3+4=", "2+5=") for _ in range(16)]
    output = trainer._generate_and_score_completions(batch)
    loss = trainer.compute_loss(trainer.model, output)
    return trainer, output, seen, loss


@pytest.mark.parametrize("k", [4, 8])
def test_results_identical_with_rule_on_and_off(warm_model_dir, tmp_path, k):
    model_dir, tokenizer = warm_model_dir
    _, off, seen_off, loss_off = _run(model_dir, tokenizer, tmp_path, stop=False, k=k)
    trainer, on, seen_on, loss_on = _run(model_dir, tokenizer, tmp_path, stop=True, k=k)
    # the batch is cut at its longest kept completion either way, so everything is bitwise identical
    for key in ("completion_ids", "completion_mask", "prompt_ids", "advantages", "ref_per_token_logps"):
        assert torch.equal(on[key], off[key]), key
    assert torch.equal(loss_on, loss_off)
    # the rule did stop rows, and generated fewer tokens
    metrics = trainer._metrics["train"]
    assert metrics["gfpo/stopped_early_fraction"][-1] > 0
    assert sum(map(len, seen_on["ids"])) < sum(map(len, seen_off["ids"]))
    assert "gfpo/dropped_completion_length_truncated" in metrics
    # kept rows' rewards are the same (they are the same completions)
    lengths_off = torch.tensor([len(x) for x in seen_off["ids"]], dtype=torch.float32)
    from gfpo_kernels import reference as ref

    keep = ref.group_topk_mask(lengths_off, 16, k, largest=False)
    lengths_on = torch.tensor([len(x) for x in seen_on["ids"]], dtype=torch.float32)
    assert torch.equal(ref.group_topk_mask(lengths_on, 16, k, largest=False), keep)
    assert torch.equal(seen_on["rewards"][keep], seen_off["rewards"][keep])


def test_rule_is_off_for_other_filters_and_when_disabled(warm_model_dir, tmp_path):
    model_dir, tokenizer = warm_model_dir
    trainer, *_ = _run(model_dir, tokenizer, tmp_path, stop=False, k=4)
    assert "gfpo/stopped_early_fraction" not in trainer._metrics["train"]
    assert "gfpo/dropped_completion_length" in trainer._metrics["train"]


def _logged_metrics(model_dir, tokenizer, tmp_path, stop):
    """4 training steps at learning rate 0 (the policy never changes) with a digit-counting reward, as a user
    would watch them: the logged history."""

    def digits(completions, **kwargs):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    args = GFPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=16,
                      num_remains_in_group=4, group_filter="length", max_completion_length=16, learning_rate=0.0,
                      max_steps=4, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                      seed=0, gfpo_stop_dropped_generations=stop, disable_tqdm=True)
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = GFPOTrainer(model=model_dir, reward_funcs=digits, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    trainer.train()
    return [h for h in trainer.state.log_history if "reward" in h], batch_metric_names(trainer)


def test_watched_metrics_are_the_same_with_the_rule_on_and_off(warm_model_dir, tmp_path):
    """TRL's reward and completion metrics never describe completions the rule cut short: with the length filter
    they describe the kept rows, the same completions with the rule on and off."""
    model_dir, tokenizer = warm_model_dir
    on, names = _logged_metrics(model_dir, tokenizer, tmp_path / "on", stop=True)
    off, _ = _logged_metrics(model_dir, tokenizer, tmp_path / "off", stop=False)
    assert len(on) == len(off) == 4
    assert "completions/clipped_ratio" in names and "rewards/digits/mean" in names
    for step_on, step_off in zip(on, off):
        assert {name: step_on[name] for name in names} == {name: step_off[name] for name in names}
        assert step_on["reward"] == step_on["gfpo/kept_reward_mean"]  # the kept rows
    assert max(step["gfpo/stopped_early_fraction"] for step in on) > 0  # the rule did cut completions short


def test_generation_that_bypasses_the_rule_is_an_error(warm_model_dir, tmp_path, monkeypatch):
    """If TRL generates with another object than the unwrapped model, the processor never runs and the rule would be
    off without a word: a TRLSurfaceError instead."""
    from trl import GRPOTrainer

    from gfpo_trainer._compat import TRLSurfaceError

    def generate_elsewhere(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [[5, EOS] for _ in prompt_ids], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", generate_elsewhere)
    model_dir, tokenizer = warm_model_dir
    with pytest.raises(TRLSurfaceError, match="did not generate with accelerator.unwrap_model"):
        _run(model_dir, tokenizer, tmp_path, stop=True, k=4)
