"""Stochastic wiring: which peer of a stage gets the next micro-batch. Pure.

A trainer picks, per micro-batch and per stage, a peer at random with probability
proportional to its throughput over its expected queue (``throughput / (load + 1)``, the
inverse of its expected busy time), as SWARM parallelism does: fast, idle peers get more
work, and no single peer's slowness stalls the pipeline. Peers that failed recently are
banned for a while; a ban that would leave a stage with no peer is ignored. A server bans
callers whose requests it keeps refusing with the same ``BanList``. A record's claims are
not trusted before calls have shown them: a new peer gets probes, then a share that grows
with each call it serves (``Probation``, ``route``).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.records import PeerInfo

# Micro-batches a trainer keeps in the pipeline at once, by default. A larger window hides
# more of a slow link's latency and holds more micro-batches one step stale at the stages
# (BENCHMARKS.md, "small on emulated links", measures both at 4 to 8).
WINDOW = 5


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    throughput: float  # samples/s this peer measured for this stage
    load: int  # requests it has queued (as advertised, plus our own in flight)


def candidates_by_stage(
    peers: Iterable[PeerInfo], n_stages: int, *, dials_relays: bool = True
) -> list[list[Candidate]]:
    """The routable peers of each stage (serving, with a stage in range; for a caller
    that cannot dial through a circuit relay, ``dials_relays`` False, not those reachable
    only through one: ``PeerInfo.routable_by``). A peer that serves a second stage is
    offered on both, its throughput on each scaled by its share of time there in the
    best division (:func:`second_stage_shares`). Offered at full speed
    on both, such peers took calls for a stage with time to spare away from the stage the
    pipeline waits on: ``scripts/bench_two_stage_routing.py`` measures what each way
    reaches of the best division's rate."""
    routable = [p for p in peers if p.routable_by(dials_relays) and p.stage < n_stages]
    two = [p for p in routable if p.second_serving and p.second_stage < n_stages]
    rates = [(p.stage, p.second_stage, p.throughput[p.stage], p.throughput[p.second_stage])
             for p in two]  # fmt: skip
    two_ids = {p.peer_id for p in two}
    totals = [0.0] * n_stages  # of the one-stage peers: where the division starts
    for p in routable:
        if p.peer_id not in two_ids:
            totals[p.stage] += p.throughput[p.stage]
    shares = dict(zip([p.peer_id for p in two], second_stage_shares(totals, rates), strict=True))
    by_stage: list[list[Candidate]] = [[] for _ in range(n_stages)]
    for p in routable:
        f = shares.get(p.peer_id, 0.0)
        by_stage[p.stage].append(Candidate(p.peer_id, p.throughput[p.stage] * (1 - f), p.load))
        if p.peer_id in shares:
            b = p.second_stage
            by_stage[b].append(Candidate(p.peer_id, p.throughput[b] * f, p.load))
    for stage in by_stage:
        stage.sort(key=lambda c: c.peer_id)  # same view, same draw: reproducible given a seed
    return by_stage


def out_of_reach(peers: Iterable[PeerInfo], dials_relays: bool) -> list[str]:
    """The peers that others may route to but a caller with ``dials_relays`` may not
    (reachable only through a circuit relay, for a caller without one), sorted: what
    such a caller tells its operator it leaves out."""
    return sorted(p.peer_id for p in peers if p.routable and not p.routable_by(dials_relays))


def second_stage_shares(
    totals: Sequence[float], two: Sequence[tuple[int, int, float, float]]
) -> list[float]:
    """The share of its time each two-stage peer gives its second stage, in the division
    that raises the least stage total most; among the best, each gives as little as it can
    (its first stage is where the assignment placed it). ``totals``: each stage's summed
    throughput without the two-stage peers; ``two``: each one's (first stage, second stage,
    throughput on the first, throughput on the second). A linear programme, solved exactly."""
    if not two:
        return []
    from scipy.optimize import linprog  # hivemind depends on scipy; imported when needed

    n, k = len(totals), len(two)
    gives = np.zeros((n, k))  # what all of peer j's time on its second stage moves
    base = np.array(totals, dtype=float)
    for j, (a, b, on_a, on_b) in enumerate(two):
        base[a] += on_a
        gives[a, j] -= on_a
        gives[b, j] += on_b
    tie = 1e-6 * max(float(base.max()), 1e-12) / k  # all shares: a millionth of a total
    res = linprog(
        np.r_[np.full(k, tie), -1.0],
        A_ub=np.hstack([-gives, np.ones((n, 1))]),
        b_ub=base,
        bounds=[(0.0, 1.0)] * k + [(None, None)],
        method="highs",
    )
    if res.status != 0:  # cannot happen: shares of 0 are feasible and the least is bounded
        raise ValueError(f"dividing two-stage peers' time failed: {res.message}")
    return [float(min(max(f, 0.0), 1.0)) for f in res.x[:k]]


def choose_peer(
    candidates: Sequence[Candidate], rng: random.Random, banned: frozenset[str] = frozenset()
) -> str:
    """A peer drawn in proportion to ``throughput / (load + 1)``; banned peers are skipped
    unless every candidate is banned."""
    if not candidates:
        raise ValueError("no peer serves this stage")
    pool = [c for c in candidates if c.peer_id not in banned] or list(candidates)
    weights = [max(c.throughput, 1e-9) / (c.load + 1) for c in pool]
    return rng.choices(pool, weights=weights)[0].peer_id


@dataclass
class Probation:
    """What calls to each peer have shown, and the share of traffic it has earned by them.

    A record's claims (that it serves, how fast) cost nothing to forge, and a flood of
    forged records would otherwise draw most calls to peers that answer none. So a peer
    starts *unproven*: it gets probes only (:func:`route`). Its first success proves it, at
    ``start_share`` of the weight its throughput claims; each further success doubles
    that, up to 1 (a peer earns its claimed share in a handful of calls), and a failure
    halves it. An unproven peer whose call fails is a *suspect*: not probed again for
    ``suspect_s``, doubled at each further failure (at most 64 times). At most
    ``max_peers`` peers are remembered, the oldest forgotten first. Times are the
    caller's clock; pure."""

    start_share: float = 1.0 / 16
    probe_share: float = 0.1  # of calls probe unproven peers, while proven ones exist
    suspect_s: float = 30.0
    max_peers: int = 10_000
    _shares: dict[str, float] = field(default_factory=dict)
    _suspects: dict[str, tuple[float, int]] = field(default_factory=dict)  # (until, failures)

    def __post_init__(self) -> None:
        if not (0.0 < self.start_share <= 1.0 and 0.0 <= self.probe_share <= 1.0):
            raise ValueError(
                f"start_share ({self.start_share}) must be in (0, 1], probe_share "
                f"({self.probe_share}) in [0, 1]"
            )
        if self.suspect_s <= 0 or self.max_peers < 1:
            raise ValueError(
                f"suspect_s ({self.suspect_s}) must be > 0 and max_peers ({self.max_peers}) >= 1"
            )

    def succeeded(self, peer_id: str) -> None:
        """A call to ``peer_id`` succeeded."""
        share = self._shares.pop(peer_id, None)
        self._suspects.pop(peer_id, None)
        self._shares[peer_id] = self.start_share if share is None else min(1.0, 2.0 * share)
        _forget_oldest(self._shares, self.max_peers)

    def trust(self, peer_id: str) -> None:
        """Take ``peer_id`` as proven at its full share (the caller's own peer)."""
        self._suspects.pop(peer_id, None)
        self._shares[peer_id] = 1.0

    def failed(self, peer_id: str, now: float) -> None:
        """A call to ``peer_id`` failed (it did not serve it: gone, unreachable, timed out)."""
        share = self._shares.get(peer_id)
        if share is not None:
            self._shares[peer_id] = max(self.start_share, share / 2.0)
            return
        failures = self._suspects.pop(peer_id, (0.0, 0))[1] + 1
        self._suspects[peer_id] = (now + self.suspect_s * 2.0 ** min(failures - 1, 6), failures)
        _forget_oldest(self._suspects, self.max_peers)

    def proven(self, peer_id: str) -> bool:
        return peer_id in self._shares

    def share(self, peer_id: str) -> float:
        """The share of its claimed weight ``peer_id`` has earned (0: unproven)."""
        return self._shares.get(peer_id, 0.0)

    def suspect(self, peer_id: str, now: float) -> bool:
        """Unproven, and failed recently."""
        found = self._suspects.get(peer_id)
        return found is not None and found[0] > now


def route(
    candidates: Sequence[Candidate],
    rng: random.Random,
    probation: Probation,
    now: float,
    *,
    banned: frozenset[str] = frozenset(),
    probing: bool = False,
    preferred: Collection[str] = frozenset(),
) -> tuple[str, bool]:
    """The peer for the next call of a stage, and whether the call is a probe.

    Proven peers (``probation``) are drawn in proportion to ``throughput * share / (load
    + 1)``. A call probes an unproven peer (not a suspect) with chance
    ``probation.probe_share``, and only while no probe of the stage is in flight
    (``probing``); with no proven candidate, every call probes. A probe goes to a peer in
    ``preferred`` (e.g. one the caller's transport is connected to: it runs a real host)
    if there is one, else to any, drawn uniformly: a throughput claim counts for nothing
    before calls have shown it. Banned peers are skipped unless every candidate is banned;
    suspects are probed only when no other candidate is left. When every proven
    candidate is banned (busy for a moment, or failed and not yet out of the view), a
    call goes to one of them all the same unless a ``preferred`` peer can be probed: a
    flood's records must not take every call a proven peer sheds."""
    if not candidates:
        raise ValueError("no peer serves this stage")
    pool = [c for c in candidates if c.peer_id not in banned] or list(candidates)
    proven = [c for c in pool if probation.proven(c.peer_id)]
    if not proven and not any(c.peer_id in preferred for c in pool):
        proven = [c for c in candidates if probation.proven(c.peer_id)]
    fresh = [
        c for c in pool if not probation.proven(c.peer_id) and not probation.suspect(c.peer_id, now)
    ]
    if proven and (not fresh or probing or rng.random() >= probation.probe_share):
        weights = [
            max(c.throughput, 1e-9) * probation.share(c.peer_id) / (c.load + 1) for c in proven
        ]
        return rng.choices(proven, weights=weights)[0].peer_id, False
    if not fresh:  # only suspects left: try them again rather than nothing
        fresh = [c for c in pool if not probation.proven(c.peer_id)]
    first = [c for c in fresh if c.peer_id in preferred] or fresh
    return rng.choice(first).peer_id, True


def refresh_period(base_s: float, listed: int, per: int = 64, most: float = 8.0) -> float:
    """How long a reader of a run's peers waits between reads: ``base_s``, times
    ``listed / per`` once more than ``per`` peers are listed, at most ``most`` times.
    Each read brings every record again, so a flood of records would set a reader's work;
    a large run's view changes little in one ``base_s`` (failed calls leave it at once,
    and a newcomer waits a little longer for its first calls)."""
    return base_s * min(max(listed / per, 1.0), most)


def keep_unproven(
    peer_ids: Iterable[str],
    probation: Probation,
    now: float,
    limit: int,
    rng: random.Random,
    preferred: Collection[str] = frozenset(),
) -> list[str]:
    """At most ``limit`` of the unproven ``peer_ids`` to keep in a stage's view: those in
    ``preferred`` first, then the others not suspect, then suspects, each group in a
    random order (so that a flood's peers are gone through over successive views). A
    reader that kept every unproven peer would let a flood of records set its work."""
    unproven = sorted(p for p in set(peer_ids) if not probation.proven(p))
    first = [p for p in unproven if p in preferred and not probation.suspect(p, now)]
    rest = [p for p in unproven if p not in preferred and not probation.suspect(p, now)]
    last = [p for p in unproven if probation.suspect(p, now)]
    kept: list[str] = []
    for group in (first, rest, last):
        if len(kept) >= limit:
            break
        kept += rng.sample(group, min(len(group), limit - len(kept)))
    return kept


@dataclass
class BanList:
    """Peers banned until a deadline (times are the caller's clock): at once (``ban``), or
    once ``strikes`` strikes fall within ``window_s`` (``strike``), so that one honest
    mistake does not ban. At most ``max_peers`` peers are remembered (the oldest are
    forgotten first): a caller with endless fresh identities cannot exhaust memory."""

    duration_s: float = 15.0
    strikes: int = 1
    window_s: float = 60.0
    max_peers: int = 10_000
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # (time, cause)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.strikes < 1 or self.window_s <= 0 or self.max_peers < 1:
            raise ValueError(
                f"duration_s ({self.duration_s}) and window_s ({self.window_s}) must be > 0, "
                f"strikes ({self.strikes}) and max_peers ({self.max_peers}) >= 1"
            )

    def ban(self, peer_id: str, now: float, duration_s: float | None = None) -> float:
        """Ban ``peer_id`` from ``now`` for ``duration_s`` (default ``self.duration_s``;
        shorter for a peer that is only busy); returns the deadline."""
        self._strikes.pop(peer_id, None)
        self._until.pop(peer_id, None)  # re-inserted last: the newest ban is forgotten last
        self._until[peer_id] = until = now + (self.duration_s if duration_s is None else duration_s)
        _forget_oldest(self._until, self.max_peers)
        return until

    def strike(self, peer_id: str, now: float, cause: str = "") -> float | None:
        """Count a strike against ``peer_id``; the deadline if this one bans it, else None
        (also while it is banned already: a ban is not extended by what it was for)."""
        if self.until(peer_id, now) is not None:
            return None
        recent = [s for s in self._strikes.pop(peer_id, ()) if s[0] > now - self.window_s]
        recent.append((now, cause))
        if len(recent) >= self.strikes:
            return self.ban(peer_id, now)
        self._strikes[peer_id] = recent
        _forget_oldest(self._strikes, self.max_peers)
        return None

    def forgive(self, peer_id: str, cause: str) -> None:
        """Drop ``peer_id``'s strikes for ``cause`` (it has fixed what they were for)."""
        if recent := [s for s in self._strikes.pop(peer_id, ()) if s[1] != cause]:
            self._strikes[peer_id] = recent

    def until(self, peer_id: str, now: float) -> float | None:
        """When ``peer_id``'s ban ends, or None if it is not banned."""
        until = self._until.get(peer_id)
        if until is not None and until <= now:
            del self._until[peer_id]
            return None
        return until

    def banned(self, now: float) -> frozenset[str]:
        self._until = {p: t for p, t in self._until.items() if t > now}
        return frozenset(self._until)


@dataclass
class CallTimer:
    """How long a caller waits for a stage's answer before it tries another peer.

    A peer cut off mid-call (its link dropped, its machine asleep) neither answers nor
    closes the connection, so only a timeout ends the call; with one fixed timeout the
    pipeline waits all of it. Here the timeout follows the stage's recent successful
    calls, much as TCP's retransmission timer does (RFC 6298): twice the smoothed duration
    plus four times its smoothed deviation (twice: a stage whose calls are steady still
    gets room for a slow one), kept within [``floor_s``, ``ceiling_s``] and doubled
    after each timeout until a call succeeds again (a stage that slowed down for all is
    not abandoned call after call). Before its first success a stage gets ``ceiling_s``.
    Times are the caller's; pure, no clock."""

    floor_s: float = 5.0
    ceiling_s: float = 30.0
    _mean: dict[int, float] = field(default_factory=dict)
    _deviation: dict[int, float] = field(default_factory=dict)
    _backoff: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.floor_s <= self.ceiling_s:
            raise ValueError(
                f"need 0 < floor_s <= ceiling_s, got {self.floor_s} and {self.ceiling_s}"
            )

    def timeout(self, stage: int) -> float:
        mean = self._mean.get(stage)
        if mean is None:
            return self.ceiling_s
        wait = (2.0 * mean + 4.0 * self._deviation[stage]) * 2.0 ** self._backoff.get(stage, 0)
        return min(self.ceiling_s, max(self.floor_s, wait))

    def succeeded(self, stage: int, seconds: float) -> None:
        """A call to ``stage`` answered after ``seconds``."""
        mean = self._mean.get(stage)
        if mean is None:
            self._mean[stage], self._deviation[stage] = seconds, seconds / 2.0
        else:
            self._deviation[stage] = 0.75 * self._deviation[stage] + 0.25 * abs(mean - seconds)
            self._mean[stage] = 0.875 * mean + 0.125 * seconds
        self._backoff.pop(stage, None)

    def timed_out(self, stage: int) -> None:
        """A call to ``stage`` got no answer within ``timeout(stage)``."""
        self._backoff[stage] = min(self._backoff.get(stage, 0) + 1, 16)


def _forget_oldest(entries: dict, limit: int) -> None:
    while len(entries) > limit:
        del entries[next(iter(entries))]
