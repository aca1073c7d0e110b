"""Stochastic wiring: which peer of a stage gets the next micro-batch. Pure.

A trainer picks, per micro-batch and per stage, a peer at random with probability
proportional to its throughput over its expected queue (``throughput / (load + 1)``, the
inverse of its expected busy time), as SWARM parallelism does: fast, idle peers get more
work, and no single peer's slowness stalls the pipeline. Peers that failed recently are
banned for a while; a ban that would leave a stage with no peer is ignored.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from protocol.records import PeerInfo


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    throughput: float  # samples/s this peer measured for this stage
    load: int  # requests it has queued (as advertised, plus our own in flight)


def candidates_by_stage(peers: Iterable[PeerInfo], n_stages: int) -> list[list[Candidate]]:
    """The routable peers of each stage (serving, with a stage in range)."""
    by_stage: list[list[Candidate]] = [[] for _ in range(n_stages)]
    for p in peers:
        if p.routable and p.stage < n_stages and p.stage < len(p.throughput):
            by_stage[p.stage].append(Candidate(p.peer_id, p.throughput[p.stage], p.load))
    for stage in by_stage:
        stage.sort(key=lambda c: c.peer_id)  # same view, same draw: reproducible given a seed
    return by_stage


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
class BanList:
    """Peers that failed recently, each until a deadline (times are the caller's clock)."""

    duration_s: float = 15.0
    _until: dict[str, float] = field(default_factory=dict)

    def ban(self, peer_id: str, now: float) -> None:
        self._until[peer_id] = now + self.duration_s

    def banned(self, now: float) -> frozenset[str]:
        self._until = {p: t for p, t in self._until.items() if t > now}
        return frozenset(self._until)
