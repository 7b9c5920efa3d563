"""Worker of tests/test_vllm.py's tensor-parallel test, run by torchrun with 2 CPU processes (gloo): one TP group of
two ranks (vllm_tensor_parallel_size=2), as TRL's colocate mode runs it: vLLM's external launcher, so each process is
an engine rank with its own scheduler, and both generate the group's gathered prompts. Prefix caching on, KV blocks
of 32 tokens and a cache of BLOCKS of them (fewer than the batch needs: requests are preempted and cached blocks
evicted), the early-stop rule on. Trains STEPS steps at learning rate 0 (each step syncs the weights into the engine,
and they stay the ones a one-rank engine loads) and dumps, per generation call on this rank: the prompts, the
request seeds and sampling parameters, the completions with their log-probabilities, the rows cut, the abort calls,
the engine's preemptions and evictions, and the KV blocks its scheduler freed, in order. With `batched` (the test's
control run) the cuts of a step are aborted in one call, as with one rank, instead of one call a request."""

import json
import os
import sys

from datasets import Dataset

from gfpo_test_utils import end_worker_process, run_vllm_engines_eagerly
from gfpo_trainer import GFPOConfig, GFPOTrainer
from gfpo_trainer.tiny import make_tokenizer
from gfpo_trainer.vllm_cpu import keep_linear_weights
from gfpo_trainer.vllm_stop import VLLMGroupGeneration

G, K, STEPS, BLOCK, BLOCKS = 8, 3, 3, 32, 12
# a shared first block (prefix-cache hits), then the pair
PREFIX = "Add the two numbers and give the sum in digits: "
PAIRS = [(a, b) for a in range(10) for b in range(10)]
ENGINE_OPTIONS = dict(enable_prefix_caching=True, block_size=BLOCK, num_gpu_blocks_override=BLOCKS)


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


def sampling_fields(params) -> dict:
    """The SamplingParams fields a one-rank engine needs to generate the same requests."""
    names = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs", "repetition_penalty", "stop")
    return {name: getattr(params, name) for name in names}


def abort_in_one_call(plan, engine_ids):
    """VLLMGroupGeneration._abort as with one rank: a step's cuts in one call (the test's control run)."""
    if engine_ids:
        plan.engine.abort_request(engine_ids, internal=True)


def main(out_dir, model_dir, batched=False):
    import vllm

    keep_linear_weights()
    calls, engines = [], []
    build, generate = vllm.LLM.__init__, VLLMGroupGeneration.generate

    def build_small(self, *args, **kwargs):  # TRL's colocate mode passes none of these
        build(self, *args, **{**kwargs, **ENGINE_OPTIONS})
        engines.append(self)

    def recorded(plan, prompts, sampling_params=None, **kwargs):
        engine = plan.engine
        scheduler = engine.engine_core.engine_core.scheduler
        counts = {"aborts": [], "preemptions": 0, "evictions": 0, "freed": []}
        abort, preempt = engine.abort_request, scheduler._preempt_request
        pool = scheduler.kv_cache_manager.block_pool
        evict, free = pool._maybe_evict_cached_block, pool.free_blocks

        def counted_abort(request_ids, internal=False):
            counts["aborts"].append(len(request_ids))
            return abort(request_ids, internal=internal)

        def counted_preempt(*args, **kw):
            counts["preemptions"] += 1
            return preempt(*args, **kw)

        def counted_evict(block):
            evicted = evict(block)
            counts["evictions"] += bool(evicted)
            return evicted

        def recorded_free(ordered_blocks):
            blocks = list(ordered_blocks)
            counts["freed"] += [block.block_id for block in blocks]
            return free(blocks)

        engine.abort_request, scheduler._preempt_request = counted_abort, counted_preempt
        pool._maybe_evict_cached_block, pool.free_blocks = counted_evict, recorded_free
        try:
            outputs = generate(plan, prompts, sampling_params, **kwargs)
        finally:
            del engine.abort_request, scheduler._preempt_request, pool._maybe_evict_cached_block, pool.free_blocks
        calls.append(dict(
            prompts=[p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts], seeds=plan.seeds,
            params=sampling_fields(sampling_params), stopped=plan.stopped, engine_steps=plan.engine_steps,
            discarded=plan.discarded_tokens, ids=[list(o.outputs[0].token_ids) for o in outputs],
            logps=[[next(iter(entry.values())).logprob for entry in o.outputs[0].logprobs] for o in outputs],
            **counts))
        return outputs

    vllm.LLM.__init__, VLLMGroupGeneration.generate = build_small, recorded
    if batched:
        VLLMGroupGeneration._abort = abort_in_one_call
    with run_vllm_engines_eagerly():
        args = GFPOConfig(
            output_dir=out_dir, per_device_train_batch_size=16, num_generations=G, num_remains_in_group=K,
            group_filter="length", max_completion_length=40, max_steps=STEPS, report_to="none", use_cpu=True,
            bf16=False, logging_steps=1, save_strategy="no", seed=0, loss_type="grpo", learning_rate=0.0,
            disable_tqdm=True, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
            vllm_max_model_length=128, vllm_tensor_parallel_size=2,
        )
        trainer = GFPOTrainer(model=model_dir, reward_funcs=digit_reward, args=args, processing_class=make_tokenizer(),
                              train_dataset=Dataset.from_list([{"prompt": f"{PREFIX}{a}+{b}="} for a, b in PAIRS]))
        trainer.train()
    # vLLM's CPU TP communicator maps shared-memory segments named after the group ("/dev/shm/-tp:0-[0-1]-cpushm_R")
    # and does not remove them (end_worker_process exits without finalization either): one left behind stops the next
    # engine of that group ("create shm in SHMManager failed. errno: 17"), so each rank removes those it mapped
    with open("/proc/self/maps") as maps:
        segments = sorted({line.split(maxsplit=5)[5].strip().removesuffix(" (deleted)") for line in maps
                           if "cpushm" in line})
    for segment in segments:
        try:
            os.unlink(segment)
        except FileNotFoundError:  # the other rank's, removed there
            pass
    cache = engines[0].llm_engine.vllm_config.cache_config
    result = dict(rank=trainer.accelerator.process_index, calls=calls, steps=trainer.state.global_step,
                  prefix_caching=cache.enable_prefix_caching, block_size=cache.block_size,
                  blocks=cache.num_gpu_blocks, shm=[os.path.basename(s) for s in segments])
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], batched=sys.argv[3:] == ["batched"])
    end_worker_process()
