"""Progress of long work as a person sees it, drawn by tqdm: a live bar on a terminal,
and the same line as plain text every few seconds when the output is a file or a pipe
(CI logs stay readable: no carriage returns, no escape codes)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm


class Progress:
    """``update(done, **figures)`` shows ``label: 20%|##    | 20/100 [00:10<00:40,
    2.00it/s, k=v, ...]``: elapsed time, the time left at the mean pace since the progress
    began (``?`` before the first item is done), and the caller's figures.

    On a terminal the bar is redrawn in place (at most 10 times a second). Elsewhere a
    plain line is written at most every ``every_s`` seconds, always once all ``total``
    items are done, and by ``close`` if the last update was not written yet. ``clock``
    (seconds, monotonic) times the plain lines."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total = label, total
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._clock = clock
        self._started = clock()
        self._last_plain = -float("inf")
        self._unwritten: str | None = None
        # smoothing=0: the mean pace since the start, as the plain lines show it. A terminal
        # that reports no size (some containers' pseudo-terminals) is taken as 80 x 24:
        # tqdm would fit the bar into 0 x 0 and show nothing.
        sized = _has_size(self.stream)
        self._bar = (
            tqdm(
                total=total,
                desc=label,
                file=self.stream,
                smoothing=0,
                dynamic_ncols=sized,
                ncols=None if sized else 80,
                nrows=None if sized else 24,
            )
            if self.tty
            else None
        )

    def update(self, done: int, **figures: float | str) -> None:
        """``done`` items of ``total`` are done; ``figures`` are shown as ``k=v``."""
        postfix = ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(done - self._bar.n)
            if done >= self.total:
                self._bar.refresh()
            return
        now = self._clock()
        line = tqdm.format_meter(
            done, self.total, now - self._started, prefix=self.label, postfix=postfix, ascii=True
        )
        if now - self._last_plain >= self.every_s or done >= self.total:
            self._last_plain = now
            self._write(line)
        else:
            self._unwritten = line

    def close(self) -> None:
        """End the bar (a terminal's line is kept), or write the last plain line."""
        if self._bar is not None:
            self._bar.close()
        elif self._unwritten is not None:
            self._write(self._unwritten)

    def _write(self, line: str) -> None:
        self._unwritten = None
        self.stream.write(line + "\n")
        self.stream.flush()


def _has_size(stream: TextIO) -> bool:
    """Whether the terminal ``stream`` writes to reports its size."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return size.columns > 0 and size.lines > 0


def _fmt(v: float | str) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
