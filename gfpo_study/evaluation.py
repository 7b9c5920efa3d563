"""The held-out evaluation: sampled answers to held-out prompts, scored by the config's correctness function.

Every answer is sampled from a seeded generator (the same prompts, order, batches and seed for every arm of a seed),
and every random generator is left as it was, so evaluating during training changes none of the training's draws.
Two generation paths, the one training uses: the model's own generate (sample_answers), or the trainer's colocated
vLLM engine (sample_answers_vllm: one request per answer, each with its own seed).
"""

from __future__ import annotations

import math

import torch

__all__ = ["is_conversational", "sample_answers", "sample_answers_vllm", "score_answers"]


def is_conversational(prompt) -> bool:
    """Whether a prompt is a list of chat messages (TRL's conversational form) rather than text."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _prompt_text(tokenizer, prompt) -> str:
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def _eos_ids(model, tokenizer) -> list:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


@torch.no_grad()
def sample_answers(model, tokenizer, prompts, *, samples: int, temperature: float, max_tokens: int, seed: int,
                   batch_size: int = 64, progress=None) -> tuple[list[str], list[int]]:
    """`samples` answers to each prompt (text or chat messages), sampled at `temperature` from `seed` with the
    model's own generate, in batches of `batch_size` (prompt i's answers are at i * samples ...).

    Returns:
        (texts without special tokens, lengths in tokens: up to and including the first end-of-sequence token, or
        every generated token where none came).
    """
    model.eval()
    device = torch.device(getattr(model, "device", None) or next(model.parameters()).device)
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    texts = [_prompt_text(tokenizer, p) for p in prompts for _ in range(samples)]
    devices = [device] if device.type == "cuda" else []
    answers, lengths = [], []
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # answers follow their prompts in the batch
    try:
        with torch.random.fork_rng(devices=devices):
            torch.random.default_generator.manual_seed(seed)
            for cuda_device in devices:
                torch.cuda.default_generators[cuda_device.index or 0].manual_seed(seed)
            for start in range(0, len(texts), batch_size):
                chunk = texts[start : start + batch_size]
                enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=True, temperature=temperature,
                                     top_k=0, top_p=1.0, pad_token_id=pad,
                                     eos_token_id=eos if len(eos) > 1 else eos[0])
                for ids in out[:, enc.input_ids.shape[1] :].tolist():
                    # generate pads a row only after its EOS: a row without one holds every token it sampled
                    end = next((i for i, t in enumerate(ids) if t in eos), None)
                    ids = ids[: end + 1] if end is not None else ids
                    answers.append(tokenizer.decode(ids, skip_special_tokens=True))
                    lengths.append(len(ids))
                if progress is not None:
                    progress(len(chunk))
    finally:
        tokenizer.padding_side = side
    return answers, lengths


def sample_answers_vllm(llm, tokenizer, prompts, *, samples: int, temperature: float, max_tokens: int, seed: int,
                        eos_token_ids: list, device: torch.device) -> tuple[list[str], list[int]]:
    """`samples` answers to each prompt (text or chat messages) from the vLLM engine `llm` (a `vllm.LLM`, the weights
    it holds as they are), at `temperature`, top-k and top-p off, as sample_answers samples. Answer j of prompt i is
    one request with its own seed, row i * samples + j of `request_seeds(seed, ...)`: the same seeds on every process
    and for every arm of a seed, and (vLLM drawing a seeded request's noise from its own generator) the same answers
    for the same weights. The CPU generator and `device`'s are restored after (the engine draws unseeded requests'
    noise from them); every request is finished or aborted when this returns, so the engine holds none of them when
    training generates again.

    Returns:
        (texts without special tokens, lengths in tokens: up to and including the first of `eos_token_ids`, or every
        generated token where none came), as sample_answers.
    Raises:
        RuntimeError: the engine holds unfinished requests before the call (another generation under way).
    """
    from vllm import SamplingParams

    from gfpo_trainer.generation_paths import own_random_stream
    from gfpo_trainer.vllm_stop import request_seeds

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the vLLM engine holds unfinished requests: the held-out evaluation runs only between "
                           "generation calls")
    eos = list(eos_token_ids)
    ids = [tokenizer(_prompt_text(tokenizer, p), add_special_tokens=False).input_ids for p in prompts]
    requests = [{"prompt_token_ids": list(i)} for i in ids for _ in range(samples)]
    seeds = request_seeds(seed, 0, len(requests), len(requests))
    params = [SamplingParams(n=1, temperature=temperature, max_tokens=max_tokens, seed=int(s), stop_token_ids=eos,
                             detokenize=False) for s in seeds]
    try:
        with own_random_stream(seed, device):
            outputs = llm.generate(requests, sampling_params=params, use_tqdm=False)
    except BaseException:
        left = list(engine.output_processor.request_states)
        if left:
            engine.abort_request(left, internal=True)
        raise
    if len(outputs) != len(requests):
        raise RuntimeError(f"LLM.generate returned {len(outputs)} outputs for {len(requests)} requests")
    answers, lengths = [], []
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        end = next((i for i, t in enumerate(tokens) if t in eos), None)
        tokens = tokens[: end + 1] if end is not None else tokens
        answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
        lengths.append(len(tokens))
    return answers, lengths


def score_answers(correct, rows: list, answers: list, samples: int, threshold: float | None = None) -> list:
    """The correctness of each answer: `correct(prompts=..., completions=..., **the rows' other columns)`, called as
    TRL calls a reward function (chat prompts get chat completions), one value per answer (a bool or a number, as
    the trainer takes a reward: NumPy and one-element torch scalars too); with `threshold`, 1.0 where the value is
    >= threshold, else 0.0.

    Raises:
        ValueError: a function that returns another number of values, or values that are not bools or finite numbers
            (naming the function, the first bad value and its position).
    """
    name = getattr(correct, "__name__", None) or getattr(getattr(correct, "func", None), "__name__", repr(correct))
    prompts = [r["prompt"] for r in rows for _ in range(samples)]
    completions = [[{"role": "assistant", "content": a}] if is_conversational(p) else a
                   for p, a in zip(prompts, answers, strict=True)]
    columns = {key: [r.get(key) for r in rows for _ in range(samples)] for key in rows[0] if key != "prompt"}
    values = correct(prompts=prompts, completions=completions, **columns)
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"eval.correct {name}: returned {type(values).__name__}, not a list of one bool or number "
                         f"per completion") from None
    if len(values) != len(answers):
        raise ValueError(f"eval.correct {name}: returned {len(values)} values for {len(answers)} completions; it "
                         "must return one bool or number per completion")
    out = []
    for i, value in enumerate(values):
        # what the trainer takes as a reward (anything float() takes: bool, int, float, a NumPy or one-element torch
        # scalar), so that one function serves as both; None, text and NaN are not a correctness
        try:
            number = float(value) if value is not None and hasattr(type(value), "__float__") else math.nan
        except (TypeError, ValueError, RuntimeError):  # a tensor of several values
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"eval.correct {name}: value {value!r} for completion {i} is not a bool or a finite "
                             "number")
        out.append(number if threshold is None else float(number >= threshold))
    return out


def figures(correct: list, lengths: list) -> dict:
    """Accuracy (the mean correctness: the paper's pass@1 over sampled answers) and mean length in tokens."""
    n = max(len(correct), 1)
    return {"accuracy": sum(correct) / n, "mean_length": sum(lengths) / n}
