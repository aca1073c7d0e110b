"""Counts of a node's structured events (``node.events``), kept as the events are emitted:
what the node's counters do not hold (failed and rerouted calls, bans, averaging rounds by
outcome and their durations, moves, checkpoints), and the last few events themselves.

``EventTally`` is an ``events.listen`` listener: it is called on whichever thread emits,
so it takes a lock, and readers get a consistent copy (``TallyCounts``).
"""

from __future__ import annotations

import json
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

# Upper bounds (seconds) of the averaging-round duration histogram: a tiny stage's round
# on one machine takes tenths of a second, a big stage's over a home link minutes.
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECENT = 50  # events kept for the page


@dataclass
class Durations:
    """A histogram of durations over ``ROUND_BUCKETS``: ``counts[i]`` are those at most
    ``ROUND_BUCKETS[i]`` (not cumulative; the last entry counts those above them all)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ROUND_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(ROUND_BUCKETS) if seconds <= b), len(ROUND_BUCKETS))
        self.counts[i] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Durations:
        return Durations(list(self.counts), self.total)


@dataclass(frozen=True)
class TallyCounts:
    """A copy of the tally at one moment; every count only grows."""

    calls_failed: dict[int, int]  # stage -> this node's trainer calls that failed
    calls_rerouted: dict[int, int]  # stage -> failed calls sent again
    bans: dict[str, int]  # service -> callers banned
    rounds: dict[tuple[int, str], int]  # (stage, how) -> averaging.round events
    round_seconds: dict[str, Durations]  # how -> durations of the rounds that carry one
    peers_joined: int
    peers_left: int
    moves: int
    checkpoints: int
    recent: tuple[dict[str, Any], ...]  # the last ``RECENT`` events, oldest first


class EventTally:
    """Counts events as they come (call it with each event record)."""

    def __init__(self, recent: int = RECENT) -> None:
        self._lock = threading.Lock()
        self._failed: Counter[int] = Counter()
        self._rerouted: Counter[int] = Counter()
        self._bans: Counter[str] = Counter()
        self._rounds: Counter[tuple[int, str]] = Counter()
        self._seconds: dict[str, Durations] = {}
        self._joined = self._left = self._moves = self._checkpoints = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=recent)

    def __call__(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        # A JSON-safe copy: paths and the like become strings (as in the log), NaN and
        # infinities None (a parameter digest's norm may be NaN; JSON has no NaN).
        kept = json.loads(json.dumps(record, default=str), parse_constant=lambda _: None)
        with self._lock:
            self._recent.append(kept)
            if kind == "call.failed":
                self._failed[_stage(record)] += 1
            elif kind == "call.rerouted":
                self._rerouted[_stage(record)] += 1
            elif kind == "peer.banned":
                self._bans[str(record.get("service", "?"))] += 1
            elif kind == "averaging.round":
                how = str(record.get("how", "?"))
                self._rounds[(_stage(record), how)] += 1
                seconds = record.get("seconds")
                if isinstance(seconds, int | float) and seconds >= 0:
                    self._seconds.setdefault(how, Durations()).observe(float(seconds))
            elif kind == "peer.joined":
                self._joined += 1
            elif kind == "peer.left":
                self._left += 1
            elif kind == "placement.moved":
                self._moves += 1
            elif kind == "checkpoint.written":
                self._checkpoints += 1

    def counts(self) -> TallyCounts:
        with self._lock:
            return TallyCounts(
                calls_failed=dict(self._failed),
                calls_rerouted=dict(self._rerouted),
                bans=dict(self._bans),
                rounds=dict(self._rounds),
                round_seconds={how: d.copy() for how, d in self._seconds.items()},
                peers_joined=self._joined,
                peers_left=self._left,
                moves=self._moves,
                checkpoints=self._checkpoints,
                recent=tuple(self._recent),
            )


def _stage(record: dict[str, Any]) -> int:
    stage = record.get("stage")
    return stage if isinstance(stage, int) else -1
