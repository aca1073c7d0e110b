"""A budget of log lines per kind and time window, so that a flood (a thousand sybil
records, each a distinct peer joining or a distinct record refused) costs a node's log a
few lines and one summary, not a line per record. Pure: times are the caller's clock."""

from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass
class LogBudget:
    """At most ``per_window`` lines logged in each window of ``window_s`` seconds (a window
    starts with its first line); the lines past that are held back and counted, and
    ``flush`` logs how many once their window is over."""

    what: str  # what a held line would have said, for the summary: "peers joined"
    per_window: int = 10
    window_s: float = 60.0
    _start: float | None = None
    _logged: int = 0
    _held: int = 0

    def __post_init__(self) -> None:
        if self.per_window < 1 or self.window_s <= 0:
            raise ValueError(
                f"per_window ({self.per_window}) must be >= 1 and window_s ({self.window_s}) > 0"
            )

    def take(self, now: float, logger: logging.Logger | None = None) -> bool:
        """Whether a line may be logged now (else it is counted); a window that is over is
        flushed first (to ``logger``, if given)."""
        if logger is not None:
            self.flush(now, logger)
        if self._start is None or now - self._start >= self.window_s:
            self._start, self._logged, self._held = now, 0, 0
        if self._logged < self.per_window:
            self._logged += 1
            return True
        self._held += 1
        return False

    def held(self, now: float) -> int:
        """Lines held back in a window that is over and not yet summarized (0 otherwise)."""
        over = self._start is not None and now - self._start >= self.window_s
        return self._held if over else 0

    def flush(self, now: float, logger: logging.Logger, level: int = logging.INFO) -> None:
        """Log one summary of the lines held back in a window that is over, if any."""
        if held := self.held(now):
            logger.log(
                level, "%d more %s in the last %.0f s (not logged one by one)",
                held, self.what, self.window_s,
            )  # fmt: skip
            self._start, self._logged, self._held = None, 0, 0
