"""The did-you-mean rule for names a user types, without torch: the command line checks a config with it before
the training stack is imported (gfpo_kernels._validation holds the same rule for the kernels, which import torch;
tests/test_validation.py checks that the two agree)."""

from __future__ import annotations

import difflib


def closest_name(value, choices) -> str | None:
    """The one of `choices` closest to `value` (as text), None when none is close: difflib's similarity ratio >= 0.6."""
    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1)
    return close[0] if close else None


def did_you_mean(value, choices) -> str:
    """The end of an unknown-name error: " (did you mean 'x'?)" with closest_name(value, choices), "" when none."""
    close = closest_name(value, choices)
    return f" (did you mean {close!r}?)" if close is not None else ""
