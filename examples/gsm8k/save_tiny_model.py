"""Saves the tiny model and its tokenizer (gfpo_trainer/tiny.py) as a model folder, for tiny.yaml: the example then
runs on a CPU in seconds, with no download. The tokenizer's vocabulary is every printable character and the
newline, so the GSM8K text reaches the model whole; its chat template renders a conversational prompt as
"system: ... user: ... assistant: ". The model is randomly initialised: it writes noise, and its rewards stay near 0
(the run shows that everything is wired, not that GFPO learns; docs/gsm8k-example.md).

    python examples/gsm8k/save_tiny_model.py       # writes examples/gsm8k/tiny-model/
    python examples/gsm8k/save_tiny_model.py DIR   # writes DIR
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

# printable ASCII less the whitespace a problem never holds (tab, carriage return, vertical tab, form feed)
TEXT_CHARACTERS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


def save_tiny_model(path) -> str:
    """The tiny model and tokenizer saved into `path` (created if missing); returns the path as a string."""
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(TEXT_CHARACTERS)
    model = make_tiny_model(tokenizer, max_positions=1024)  # a system message, a question and a completion
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent / "tiny-model"
    print(f"saved the tiny model and tokenizer to {save_tiny_model(target)}")
