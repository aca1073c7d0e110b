"""Progress of long work as a person sees it: one updating line on a terminal, periodic
plain lines when the output is a file or a pipe (CI logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(done, **figures)`` redraws ``label [####....] done/total  k=v ...  eta=M:SS``:
    the time left at the mean pace since the progress began (``eta=?`` before the first
    item is done; none once all are)."""

    def __init__(self, label: str, total: int, stream: TextIO = sys.stderr, every_s: float = 5.0):
        self.label, self.total, self.stream = label, total, stream
        self.tty = stream.isatty()
        self.every_s = every_s
        self._last_plain = -float("inf")
        self._started = time.monotonic()

    def eta_s(self, done: int, now: float | None = None) -> float | None:
        """Seconds left at the mean pace so far; None while nothing is done."""
        if done <= 0:
            return None
        elapsed = (time.monotonic() if now is None else now) - self._started
        return max(0, self.total - done) * elapsed / done

    def update(self, done: int, **figures: float | str) -> None:
        if done < self.total:
            eta = self.eta_s(done)
            figures = {**figures, "eta": "?" if eta is None else format_duration(eta)}
        shown = "  ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        width = 24
        filled = width * done // max(self.total, 1)
        line = f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  {shown}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
        elif time.monotonic() - self._last_plain >= self.every_s or done >= self.total:
            self._last_plain = time.monotonic()
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(v: float | str) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_duration(seconds: float) -> str:
    """``M:SS``, or ``H:MM:SS`` from an hour on."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
