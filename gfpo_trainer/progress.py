"""Progress bars that stay small in a file: the package's own tqdm bars, and the training bar of `train`.

A tqdm bar redraws up to ten times a second. On a terminal each redraw overwrites the last; sent to a file or a CI
log every redraw stays, and a long run leaves tens of kilobytes of bars there. Where the bar's stream is not a
terminal, these bars redraw at most every NON_TERMINAL_REFRESH_S seconds (and at the end), so a log holds a few
lines per bar.
"""

from __future__ import annotations

import sys

# seconds between two redraws of a bar whose stream is not a terminal (a file, a pipe, a CI log)
NON_TERMINAL_REFRESH_S = 30.0


def refresh_interval(stream=None) -> float | None:
    """NON_TERMINAL_REFRESH_S where `stream` (default sys.stderr, tqdm's) is not a terminal, None (tqdm's own
    0.1 s) where it is."""
    stream = sys.stderr if stream is None else stream
    try:
        return None if stream.isatty() else NON_TERMINAL_REFRESH_S
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return NON_TERMINAL_REFRESH_S


def progress_bar(iterable=None, **kwargs):
    """tqdm.auto.tqdm(iterable, **kwargs), redrawn rarely where its stream is not a terminal (refresh_interval). A
    `mininterval` given is kept.

    Args:
        iterable: what the bar iterates over (or None, with `total=` and update()).
        **kwargs: tqdm's (desc, total, unit, leave, file, ...).

    Returns:
        The tqdm bar.
    """
    from tqdm.auto import tqdm

    interval = refresh_interval(kwargs.get("file"))
    if interval is not None:
        kwargs.setdefault("mininterval", interval)
    return tqdm(iterable, **kwargs)


def progress_callback():
    """A transformers ProgressCallback whose training bar is a progress_bar: for a Trainer's callbacks, in place of
    ProgressCallback (trainer.pop_callback(ProgressCallback); trainer.add_callback(progress_callback()))."""
    from transformers.trainer_callback import ProgressCallback

    class QuietProgressCallback(ProgressCallback):
        """ProgressCallback with its training bar redrawn rarely off a terminal (the metrics lines are unchanged).
        It sets what ProgressCallback.on_train_begin sets, the bar and the step count its on_step_end reads."""

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.training_bar = progress_bar(total=state.max_steps, dynamic_ncols=True)
            self.current_step = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            # ProgressCallback prints the metrics through the bar's write(), which also redraws the bar: in a file
            # that is one more bar per logged step, so off a terminal the line is printed alone
            bar = self.training_bar
            if bar is not None and refresh_interval() is not None:
                self.training_bar = _LinePrinter
            try:
                super().on_log(args, state, control, logs=logs, **kwargs)
            finally:
                self.training_bar = bar

    return QuietProgressCallback()


class _LinePrinter:
    """What ProgressCallback.on_log calls on its bar, write(text), as tqdm.write prints it (to stdout), without
    redrawing the bar."""

    @staticmethod
    def write(text: str) -> None:
        print(text, flush=True)
