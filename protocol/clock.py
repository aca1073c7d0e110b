"""How far this peer's clock is from its stage peers', from the records they push.

Averaging needs the peers' clocks to agree to well under a second: hivemind's matchmaking
orders and expires a round's declarations by clock time, over a window of
``AveragingSpec.matchmaking_s`` (2 s by default). With one of a stage's two peers' clocks
shifted by libfaketime (``scripts/bench_clock.py``, BENCHMARKS.md "Clocks"), peers 2 s
apart averaged in no round in five runs of 45-60 s (either way), peers 1 s apart in four
runs of five (none in the fifth). The node cannot set the clock; it can say that it is
off, and by how much.

A pushed progress record carries its signer's clock at signing; received at once, its
timestamp less our clock at receipt is the signer's clock offset from ours less the
record's delay in transit, which is never negative. So the largest such difference a
peer's records showed over ``WINDOW_S`` is the closest estimate of its offset (the
least-delayed record), and the median over the peers is the swarm's offset from us: one
peer that lies about its time moves the median of three or more by nothing. ``ClockCheck``
takes observations and says when to warn (events in, a verdict out; no clock of its own).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

WARN_S = 0.5  # an offset from the peers' median at least this large is warned about
WINDOW_S = 60.0  # how long an observation counts
REPEAT_S = 600.0  # a warning still true is repeated this often
CHECK_S = 5.0  # ``verdict`` looks at the observations at most this often


@dataclass(frozen=True)
class Skew:
    """The stage peers' clocks are ``offset_s`` ahead of ours (negative: behind), as the
    median over ``peers`` of their estimates."""

    offset_s: float
    peers: int

    def line(self) -> str:
        """The warning, in one line."""
        way = "ahead of" if self.offset_s > 0 else "behind"
        return (
            f"the clocks of this stage's peers ({self.peers}) are {abs(self.offset_s):.1f} s "
            f"{way} this machine's: averaging needs them within {WARN_S} s (further apart, "
            "rounds fail and copies step alone); make sure time synchronization is on here "
            "(timedatectl set-ntp true), or tell the peers' owners"
        )


@dataclass
class ClockCheck:
    """Per peer, the timestamps of its pushed records less our clock at receipt, over the
    last ``WINDOW_S`` seconds; ``verdict`` says when to warn."""

    _seen: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    _warned_at: float = -math.inf
    _checked_at: float = -math.inf

    def observe(self, peer: str, sent: float, received: float) -> None:
        """A record of ``peer`` signed at ``sent`` (its clock) came in at ``received``
        (ours). Non-finite times are ignored."""
        if not (math.isfinite(sent) and math.isfinite(received)):
            return
        kept = [(at, d) for at, d in self._seen.get(peer, []) if received - at <= WINDOW_S]
        self._seen[peer] = [*kept[-63:], (received, sent - received)]

    def skew(self, now: float) -> Skew | None:
        """The peers' median offset from our clock (the largest difference each showed in
        the window); None without a peer observed in it. Peers not observed in the window
        are forgotten."""
        self._seen = {
            peer: recent
            for peer, seen in self._seen.items()
            if (recent := [(at, d) for at, d in seen if now - at <= WINDOW_S])
        }
        estimates = [max(d for _, d in seen) for seen in self._seen.values()]
        if not estimates:
            return None
        return Skew(statistics.median(estimates), len(estimates))

    def verdict(self, now: float) -> Skew | None:
        """The skew to warn about now: at least ``WARN_S`` off, and not warned about in the
        last ``REPEAT_S`` seconds; else None. It is called at every pushed record, so it
        looks at the observations at most every ``CHECK_S`` seconds."""
        if now - self._warned_at < REPEAT_S or now - self._checked_at < CHECK_S:
            return None
        self._checked_at = now
        skew = self.skew(now)
        if skew is None or abs(skew.offset_s) < WARN_S:
            return None
        self._warned_at = now
        return skew
