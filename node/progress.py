"""Progress of long work as a person sees it: one updating line on a terminal, periodic
plain lines when the output is a file or a pipe (CI logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(done, **figures)`` redraws ``label [####....] done/total  k=v ...``."""

    def __init__(self, label: str, total: int, stream: TextIO = sys.stderr, every_s: float = 5.0):
        self.label, self.total, self.stream = label, total, stream
        self.tty = stream.isatty()
        self.every_s = every_s
        self._last_plain = -float("inf")

    def update(self, done: int, **figures: float | str) -> None:
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
