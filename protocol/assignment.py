"""Which stage a joining peer takes. Pure: a function of the swarm view and a seed.

The rule for now: the stage with the least announced throughput, counting every peer
that holds or is loading a stage; ties broken by a draw seeded with the joiner's id, so
that peers joining at once spread out instead of piling onto one stage.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from protocol.records import PeerInfo, PeerState


def stage_throughput(peers: Iterable[PeerInfo], n_stages: int) -> list[float]:
    """Summed throughput per stage of the peers that hold (or are loading) it."""
    totals = [0.0] * n_stages
    for p in peers:
        if p.state is not PeerState.LEAVING and p.stage is not None and p.stage < n_stages:
            totals[p.stage] += p.throughput[p.stage] if p.stage < len(p.throughput) else 0.0
    return totals


def least_served_stage(peers: Iterable[PeerInfo], n_stages: int, seed: str) -> int:
    """The stage with the least throughput; a seeded draw among near-ties (within 1%)."""
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    totals = stage_throughput(peers, n_stages)
    low = min(totals)
    tied = [s for s, t in enumerate(totals) if t <= low * 1.01 + 1e-9]
    return random.Random(seed).choice(tied)
