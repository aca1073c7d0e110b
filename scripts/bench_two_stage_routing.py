"""Does routing give a two-stage peer's time to the stage the pipeline waits on?

The assignment simulator assumes it does, perfectly: it divides the time of the peers that
hold two stages by a linear programme that maximises the least stage total. This checks
that assumption against the routing the trainer runs (``protocol.routing.choose_peer``:
each call goes to a peer of the stage drawn in proportion to ``throughput / (load + 1)``),
in a queueing model: every peer serves its calls one at a time from one queue (a
two-stage peer serves both stages from the same queue), each call takes an exponential
time with the peer's mean for that stage, and a trainer keeps ``--in-flight``
micro-batches going, each a call to every stage in turn. Loads are exact (the node
advertises its queue every few seconds and the trainer adds its own calls in flight).

For each swarm it prints, side by side: the pipeline's rate routed as the trainer does
(each two-stage peer offered on each stage at its share of time in the best division,
``second_stage_shares``), routed with such peers offered at full speed on both stages,
the best division's rate (a linear programme over every peer's time: the simulator's
assumption), and the same swarm with one stage per peer, routed and at its optimum. The
figures are routed / best for each way, and what the second stages add to the routed rate.

    python -m scripts.bench_two_stage_routing --swarms 20 --calls 20000
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import deque

import numpy as np
from scipy.optimize import linprog

from protocol.routing import Candidate, choose_peer, second_stage_shares


class Peer:
    def __init__(self, name: str, rates: dict[int, float]) -> None:
        self.name, self.rates = name, rates  # stage -> calls per second
        self.queue: deque[tuple[int, int]] = deque()  # (micro-batch, stage)

    @property
    def load(self) -> int:
        return len(self.queue)


def offered(peers: list[Peer], n_stages: int, scaled: bool) -> dict[str, dict[int, float]]:
    """The throughput routing sees for each peer on each stage it holds: with ``scaled``,
    a two-stage peer's scaled by its share of time there (``second_stage_shares``, as
    ``candidates_by_stage`` does), else its full speed on both."""
    seen = {p.name: dict(p.rates) for p in peers}
    two = [p for p in peers if len(p.rates) == 2]
    if not scaled or not two:
        return seen
    totals = [0.0] * n_stages
    for p in peers:
        if len(p.rates) == 1:
            ((s, rate),) = p.rates.items()
            totals[s] += rate
    rates = [(*p.rates, *p.rates.values()) for p in two]  # first, second, their rates
    shares = second_stage_shares(totals, rates)
    for p, (a, b, on_a, on_b), f in zip(two, rates, shares, strict=True):
        seen[p.name] = {a: on_a * (1.0 - f), b: on_b * f}
    return seen


def routed_rate(
    peers: list[Peer], n_stages: int, in_flight: int, calls: int, seed: int, scaled: bool = True
) -> float:
    """Micro-batches per second through the pipeline with the trainer's routing."""
    rng, draw = random.Random(seed), random.Random(seed + 1)
    by_stage = {s: [p for p in peers if s in p.rates] for s in range(n_stages)}
    seen = offered(peers, n_stages, scaled)
    for p in peers:
        p.queue.clear()  # from an earlier run on the same peers
    events: list[tuple[float, int, Peer]] = []
    done, served, order = 0, 0, 0

    def send(t: float, mb: int, stage: int) -> None:
        nonlocal order
        options = [Candidate(p.name, seen[p.name][stage], p.load) for p in by_stage[stage]]
        name = choose_peer(options, rng)
        peer = next(p for p in by_stage[stage] if p.name == name)
        peer.queue.append((mb, stage))
        if len(peer.queue) == 1:  # idle: start at once
            order += 1
            heapq.heappush(events, (t + draw.expovariate(peer.rates[stage]), order, peer))

    for mb in range(in_flight):
        send(0.0, mb, 0)
    t = 0.0
    while served < calls:
        t, _, peer = heapq.heappop(events)
        mb, stage = peer.queue.popleft()
        served += 1
        if peer.queue:  # the next call in its queue starts
            order += 1
            nxt = peer.queue[0][1]
            heapq.heappush(events, (t + draw.expovariate(peer.rates[nxt]), order, peer))
        if stage + 1 < n_stages:
            send(t, mb, stage + 1)
        else:
            done += 1
            send(t, mb, 0)  # the trainer starts another micro-batch
    return done / t


def lp_rate(peers: list[Peer], n_stages: int, split: bool = True) -> float:
    """The best pipeline rate: each peer's time divided among the stages it holds (with
    ``split``; else all of it on its first stage), maximising the least stage total."""
    if not split:
        peers = one_stage(peers)
    pairs = [(i, s) for i, p in enumerate(peers) for s in p.rates]
    n = len(pairs)
    a_ub = np.zeros((n_stages + len(peers), n + 1))
    for k, (i, s) in enumerate(pairs):
        a_ub[s, k] = -peers[i].rates[s]  # B - sum(rate * share) <= 0
        a_ub[n_stages + i, k] = 1.0  # each peer's shares sum to at most 1
    a_ub[:n_stages, n] = 1.0
    b_ub = np.r_[np.zeros(n_stages), np.ones(len(peers))]
    c = np.r_[np.zeros(n), -1.0]
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=[(0, 1)] * n + [(0, None)], method="highs")
    return -res.fun


def one_stage(peers: list[Peer]) -> list[Peer]:
    """The same peers, each holding only its first stage."""
    return [Peer(p.name, dict([next(iter(p.rates.items()))])) for p in peers]


def swarm(rng: random.Random, n_stages: int, n_peers: int, two: int) -> list[Peer]:
    """Lognormal speeds (sigma 1); every stage gets a peer; ``two`` of them (the first
    ones) also hold the stage after theirs. A peer is listed under its first stage first."""
    peers = []
    for k in range(n_peers):
        first = k % n_stages
        speed = rng.lognormvariate(0.0, 1.0)
        rates = {first: speed}
        if k < two:
            rates[(first + 1) % n_stages] = speed
        peers.append(Peer(f"p{k}", dict(sorted(rates.items(), key=lambda kv: kv[0] != first))))
    return peers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--swarms", type=int, default=20)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--peers", type=int, default=9)
    p.add_argument("--two", type=int, default=2, help="peers that hold a second stage")
    p.add_argument("--in-flight", type=int, default=32, help="micro-batches the trainer keeps")
    p.add_argument("--calls", type=int, default=20000, help="calls simulated per swarm")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    print(
        "micro-batches/s: with second stages, routed as the trainer does (scaled by the "
        "shares), routed at full speed on both, and the best division (LP); one stage each, "
        "routed and LP"
    )
    print(f"{'swarm':>5} {'scaled':>7} {'full':>7} {'LP':>7} {'one':>7} {'LP':>7}")
    figures: dict[str, list[float]] = {k: [] for k in ("scaled", "full", "one", "gain")}
    for k in range(a.swarms):
        peers = swarm(rng, a.stages, a.peers, a.two)
        run = (a.stages, a.in_flight, a.calls, a.seed + k)
        scaled, full = routed_rate(peers, *run), routed_rate(peers, *run, scaled=False)
        alone = routed_rate(one_stage(peers), *run)
        best, one = lp_rate(peers, a.stages), lp_rate(peers, a.stages, split=False)
        figures["scaled"].append(scaled / best)
        figures["full"].append(full / best)
        figures["one"].append(alone / one)
        figures["gain"].append(scaled / alone)
        print(f"{k:>5} {scaled:>7.3f} {full:>7.3f} {best:>7.3f} {alone:>7.3f} {one:>7.3f}")

    def spread(x: list[float]) -> str:
        return f"median {np.median(x):.3f} [{min(x):.3f}, {max(x):.3f}]"

    print(f"routed / LP, second stages, scaled by the shares: {spread(figures['scaled'])}")
    print(f"routed / LP, second stages, at full speed:        {spread(figures['full'])}")
    print(f"routed / LP, one stage each:                      {spread(figures['one'])}")
    print(f"routed, scaled: with / without second stages:     {spread(figures['gain'])}")


if __name__ == "__main__":
    main()
