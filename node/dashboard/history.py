"""The dashboard's time series: a bounded ring of points, one every few seconds, each the
rates and mean loss between two readings of the node's counters (``Totals``).

Pure: the caller reads the totals (``Totals.of`` a ``NodeSnapshot``) and says when; the
ring holds ``capacity`` points (an hour at the default 720 points of 5 s), the oldest
dropped first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from node.dashboard.snapshot import NodeSnapshot

CAPACITY = 720
PERIOD_S = 5.0


@dataclass(frozen=True)
class Totals:
    """The node's counters at ``time`` (Unix seconds), and each peer's announced samples
    served with its record's timestamp."""

    time: float
    trained_samples: int = 0
    trained_micro_batches: int = 0
    loss_sum: float = 0.0
    samples_served: int = 0
    peers_served: dict[str, tuple[float, int]] = field(default_factory=dict)
    n_stages: int = 0

    @classmethod
    def of(cls, snapshot: NodeSnapshot) -> Totals:
        return cls(
            time=snapshot.time,
            trained_samples=snapshot.trained_samples,
            trained_micro_batches=snapshot.trained_micro_batches,
            loss_sum=snapshot.loss_sum,
            samples_served=snapshot.samples_served,
            peers_served={p.peer_id: (p.timestamp, p.samples_served) for p in snapshot.peers},
            n_stages=0 if snapshot.spec is None else snapshot.spec.n_stages,
        )


@dataclass(frozen=True)
class Point:
    """What happened between the previous reading and the one at ``t``; None where it
    cannot be said (no micro-batch trained: no loss; a counter went back)."""

    t: float
    loss: float | None  # mean training loss of the micro-batches trained meanwhile
    train_samples_per_s: float | None  # this node's trainer
    served_samples_per_s: float | None  # this node's stage servers (forward passes)
    # The swarm's: every peer's announced samples served, per second between its last two
    # records, summed and divided by the stage count (a sample passes every stage once).
    swarm_samples_per_s: float | None


class History:
    """The last ``capacity`` points; ``record`` a reading every period."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be 1 or more, got {capacity}")
        self._points: deque[Point] = deque(maxlen=capacity)
        self._last: Totals | None = None
        self._peer_rates: dict[str, float] = {}

    def record(self, now: Totals) -> Point | None:
        """Add the point from the last reading to ``now`` (the first reading adds none).
        A reading not later than the last is ignored."""
        last, self._last = self._last, now
        swarm = self._swarm_rate(last, now)
        if last is None:
            return None
        dt = now.time - last.time
        if dt <= 0:
            self._last = last
            return None
        batches = now.trained_micro_batches - last.trained_micro_batches
        point = Point(
            t=now.time,
            loss=(now.loss_sum - last.loss_sum) / batches if batches > 0 else None,
            train_samples_per_s=_rate(now.trained_samples - last.trained_samples, dt),
            served_samples_per_s=_rate(now.samples_served - last.samples_served, dt),
            swarm_samples_per_s=swarm,
        )
        self._points.append(point)
        return point

    def _swarm_rate(self, last: Totals | None, now: Totals) -> float | None:
        """Update each peer's rate from its records; their sum over the stage count."""
        before = {} if last is None else last.peers_served
        rates = {}
        for peer, (stamp, served) in now.peers_served.items():
            rates[peer] = self._peer_rates.get(peer, 0.0)
            if peer in before:
                old_stamp, old_served = before[peer]
                if stamp > old_stamp and served >= old_served:
                    rates[peer] = (served - old_served) / (stamp - old_stamp)
        self._peer_rates = rates  # peers gone from the read are forgotten
        if last is None or now.n_stages < 1:
            return None
        return sum(rates.values()) / now.n_stages

    def points(self) -> list[Point]:
        """Oldest first."""
        return list(self._points)

    def last(self) -> Point | None:
        return self._points[-1] if self._points else None


def _rate(delta: float, dt: float) -> float | None:
    return delta / dt if delta >= 0 else None
