"""A tiny causal LM and a character-level tokenizer built in code: tests and the demo run without downloads."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHARACTERS = string.digits + string.ascii_lowercase + " +-*=?.,:;()"
# conversational prompts for the tiny tokenizer: "system: ... user: ... assistant: ", written in CHARACTERS alone (no
# newline, which the default vocabulary lacks); an assistant turn ends with <eos>, as the model's completions do
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ ' ' }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' assistant: ' }}{% endif %}"
)


def make_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer, so that examples and tests need no download.

    Args:
        characters: the vocabulary besides the special tokens (default: digits, lower-case letters, " +-*=?.,:;()").

    Returns:
        A PreTrainedTokenizerFast with one token per character, plus <pad>, <eos> and <bos>; pads on the left. Its
        chat template (CHAT_TEMPLATE) renders [{"role": "system", ...}, {"role": "user", ...}] as
        "system: ... user: ... assistant: ", so that data sets of conversational prompts run on the tiny model.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + sorted(set(characters)))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(tokenizer, hidden_size: int = 32, num_layers: int = 2, seed: int | None = 0,
                    num_heads: int = 4, max_positions: int = 256) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-style causal LM sized for CPU tests and examples.

    Args:
        tokenizer: gives the vocabulary size and the pad, EOS and BOS ids (make_tokenizer's).
        hidden_size, num_layers, num_heads: the model's sizes; head dimension hidden_size / num_heads (vLLM's CPU
            attention needs one it supports: 64 works, e.g. hidden_size=128, num_heads=2).
        seed: torch's seed for the initial weights (None: the current random state).
        max_positions: the longest prompt + completion the model declares (its max_position_embeddings; the
            weights do not depend on it).

    Returns:
        A float32 Qwen2ForCausalLM on the CPU, untied LM head.
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=min(2, num_heads),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def supervised_warm_up(model, tokenizer, draw_example, steps: int, device, batch_size: int = 64, seed: int = 0,
                       learning_rate: float = 3e-3, desc: str | None = None) -> list[float]:
    """Supervised training of `model` on prompt -> completion + <eos>, the loss on the completion only.

    Args:
        draw_example: `draw_example(rng) -> (prompt, completion)`, with `rng` a `random.Random` seeded with `seed`.
        steps, batch_size: optimizer steps (AdamW at `learning_rate`) and examples per step.
        desc: a progress bar's label; None shows none.

    Returns:
        The loss of every step."""
    import random

    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    if desc is None:
        step_range = range(steps)
    else:
        from .progress import progress_bar

        step_range = progress_bar(range(steps), desc=desc)
    losses = []
    for _ in step_range:
        ids, labels = [], []
        for _ in range(batch_size):
            prompt, completion = draw_example(rng)
            p = tokenizer(prompt, add_special_tokens=False).input_ids
            c = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            ids.append(p + c)
            labels.append([-100] * len(p) + c)
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids], device=device)
        label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels], device=device)
        lengths = torch.tensor([len(x) for x in ids], device=device)
        attention = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def warm_up_on_pair_sums(model, tokenizer, pairs, steps: int, device, batch_size: int = 64, seed: int = 0) -> None:
    """Supervised warm-up of `model` on "a+b=" prompts over `pairs`, answered " 17" or with 1-3 filler words
    (" ok ok so 17"), half each: a model whose completions end at varied lengths, for tests and benchmarks of the
    length filter and its early stop (the demo's task is gfpo_study/sums_task.py)."""

    def draw_example(rng):
        a, b = rng.choice(pairs)
        filler = "" if rng.random() < 0.5 else " ok" * rng.randint(1, 3) + " so"
        return f"{a}+{b}=", f"{filler} {a + b}"

    supervised_warm_up(model, tokenizer, draw_example, steps, device, batch_size=batch_size, seed=seed)
