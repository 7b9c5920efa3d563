"""Reward functions for GSM8K-style problems (examples/gsm8k/, or the real openai/gsm8k), in TRL's signature: each
takes the batch's completions, and the data set's other columns as keyword arguments (`answer` here), and returns one
float per completion.

A completion is a string (a data set of plain-text prompts) or a list of messages, [{"role": "assistant",
"content": "..."}] (a conversational data set, as TRL passes it); both are read as the text of the last assistant
message. Numbers are read as written in GSM8K: "1,250", "-3", "2.50" and "$18" are the numbers 1250, -3, 2.5 and 18.

    reward_funcs: [rewards:correctness, rewards:format_reward]   # in a config beside this file
"""

from __future__ import annotations

import re
from decimal import Decimal

# a number as GSM8K writes one: thousands commas only in groups of three ("3,4" is two numbers), a decimal part only
# after digits (the full stop ending "72 clips." is not one)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
# the last line of a well-formatted answer: "#### 72"
_FINAL_LINE = re.compile(r"####\s*(" + _NUMBER.pattern + r")")


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or, for a list of messages, the content of the last one whose
    role is "assistant" (its text parts joined, where the content is a list of {"type": "text", "text"} parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):  # one message
        completion = [completion]
    if not isinstance(completion, list) or not all(isinstance(m, dict) for m in completion):
        raise TypeError(f"a completion must be a string or a list of {{'role', 'content'}} messages, got "
                        f"{type(completion).__name__}: {completion!r:.80}")
    replies = [m for m in completion if m.get("role") == "assistant"]
    if not replies:
        return ""
    content = replies[-1].get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _value(number: str) -> Decimal:
    return Decimal(number.replace(",", ""))


def final_number(text: str) -> Decimal | None:
    """The number a completion answers: the one after its last "####", or else its last number; None if it has
    none."""
    head, marker, tail = text.rpartition("####")
    if marker:
        found = _NUMBER.search(tail)
        if found:
            return _value(found.group())
    numbers = _NUMBER.findall(text)
    return _value(numbers[-1]) if numbers else None


def reference_number(answer: str, row: int = 0) -> Decimal:
    """The number after "####" in a GSM8K `answer`; a ValueError naming the row when there is none (the `answer`
    column is not GSM8K's)."""
    head, marker, tail = str(answer).rpartition("####")
    found = _NUMBER.search(tail) if marker else None
    if found is None:
        raise ValueError(f"answer of row {row} has no '#### <number>' line, as GSM8K's answers end: {answer!r:.120}")
    return _value(found.group())


def correctness(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final number (the number after its last "####", or else its last number) equals the
    number after "####" in the row's `answer`, as numbers ("1,250" = "1250.0"); 0.0 otherwise, and for a completion
    with no number.

    Args:
        completions: the batch's completions, strings or lists of messages.
        answer: the `answer` column of the same rows, GSM8K's worked solutions ending "#### <number>".
        **kwargs: the other columns and TRL's extras (prompts, completion_ids, trainer_state, ...), unused.

    Returns:
        One float per completion."""
    if len(answer) != len(completions):
        raise ValueError(f"correctness: {len(completions)} completions but {len(answer)} answers; TRL passes one "
                         "answer per completion (the `answer` column of each row)")
    rewards = []
    for row, (completion, reference) in enumerate(zip(completions, answer)):
        expected = reference_number(reference, row)
        rewards.append(1.0 if final_number(completion_text(completion)) == expected else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion ends as GSM8K's answers end, with a last line "#### <number>" (trailing spaces and
    newlines allowed, nothing else after the number), whatever the number; 0.0 otherwise. It teaches the answer's form,
    which correctness then reads; it says nothing of whether the number is right.

    Args:
        completions: the batch's completions, strings or lists of messages.
        **kwargs: the data set's columns and TRL's extras, unused.

    Returns:
        One float per completion."""
    rewards = []
    for completion in completions:
        lines = completion_text(completion).strip().splitlines()
        rewards.append(1.0 if lines and _FINAL_LINE.fullmatch(lines[-1].strip()) else 0.0)
    return rewards
