"""``swarmtrain status``: the swarm's view of a run, as a table or JSON, once or every few
seconds (``--watch``).

A call costs importing hivemind (and with it torch: seconds on a loaded machine), the
DHT's start (``p2pd``, about a second) and three lookups, run at once (milliseconds when
every peer answers; a dead peer still in the DHT's tables costs hivemind's request
timeout, 3 s). ``--watch`` keeps one DHT open: each refresh costs only the lookups.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from hivemind.utils import get_dht_time

from node.cli.client import client_dht
from node.daemon.join import find_spec
from node.rpc.dht import SwarmDHT
from protocol.identity import short_peer_ids
from protocol.membership import MembershipError, Revocations
from protocol.ownership import check_run_id
from protocol.reachability import relay_peer_id
from protocol.records import PeerInfo, PeerState
from protocol.routing import candidates_by_stage

# A run that exists answers at once; one the reached peers do not know is given this long.
SPEC_GRACE_S = 2.0
SPEC_TIMEOUT_S = 15.0  # while no peer is reached at all


def summarize(peers: list[PeerInfo], n_stages: int | None, now: float) -> dict:
    """Peers (all but those leaving, and with ``n_stages`` known, all but those whose
    records name another number of stages) and per-stage totals.

    A stage's ``serving`` counts the peers that serve it, as their first stage or (the
    number is also in ``also_served_by``) their second; its ``throughput`` is what
    routing offers on it: one-stage peers' full throughput, and each two-stage peer's at
    the share of its time routing gives that stage (``protocol.routing.candidates_by_stage``).
    The bottleneck is the stage with the least throughput, the pace of the whole pipeline."""
    present = sorted(
        (
            p
            for p in peers
            if p.state is not PeerState.LEAVING
            and (n_stages is None or len(p.throughput) == n_stages)
        ),
        key=lambda p: (p.stage if p.stage is not None else -1, p.peer_id),
    )
    n = n_stages or max((len(p.throughput) for p in present), default=0)
    offered = candidates_by_stage(present, n)
    totals = [sum(c.throughput for c in stage) for stage in offered]
    routable = [p for p in present if p.routable and p.stage < n]
    stages = [
        {
            "stage": s,
            "peers": sum(1 for p in present if p.stage == s),
            "serving": len(offered[s]),
            # peers that serve it as their second stage (their time goes where it is needed)
            "also_served_by": sum(1 for p in routable if p.second_serving and p.second_stage == s),
            "throughput": round(totals[s], 3),
        }
        for s in range(n)
    ]
    bottleneck = min(range(n), key=lambda s: totals[s]) if n else None
    short = short_peer_ids([p.peer_id for p in present])
    return {
        "peers": [
            {
                "peer_id": p.peer_id,
                "short_id": short[p.peer_id],
                "stage": p.stage,
                "second_stage": p.second_stage,
                "second_serving": p.second_serving,
                "state": p.state.value,
                "device": p.device,
                "throughput": p.throughput[p.stage] if p.stage is not None else None,
                "throughput_source": p.throughput_source,
                "bandwidth_up_mbps": p.bandwidth_up_mbps,
                "bandwidth_down_mbps": p.bandwidth_down_mbps,
                "bandwidth_source": p.bandwidth_source,
                "load": p.load,
                "samples_served": p.samples_served,
                "reachable": p.reachable,
                "relay": p.relay and relay_peer_id(p.relay),  # the peer id it serves through
                "uptime_s": None if p.started is None else round(max(0.0, now - p.started), 1),
                "age_s": round(max(0.0, now - p.timestamp), 1),
            }
            for p in present
        ],
        "stages": stages,
        "bottleneck_stage": bottleneck,
    }


def render(view: dict) -> str:
    width = max([len(p["short_id"]) for p in view["peers"]] + [4])
    lines = [
        f"{'peer':<{width}} {'stage':>5} {'state':<8} {'device':<18} {'samples/s':>10} "
        f"{'up/down Mbit/s':>16} {'served':>9} {'uptime':>8} {'age s':>6} reachable"
    ]
    for p in view["peers"]:
        stage = "-" if p["stage"] is None else str(p["stage"])
        if p["second_stage"] is not None:  # "0+1": serves both; "0+1?": loading the second
            stage += f"+{p['second_stage']}" + ("" if p["second_serving"] else "?")
        tput = "-" if p["throughput"] is None else f"{p['throughput']:.1f}"
        bw = (
            f"{p['bandwidth_up_mbps']:.0f}/{p['bandwidth_down_mbps']:.0f}"
            if p["bandwidth_source"] != "unknown"
            else "?"
        )
        up = "?" if p["uptime_s"] is None else duration(p["uptime_s"])
        reach = {True: "yes", False: "no", None: "?"}[p["reachable"]]
        if p["relay"] is not None:
            reach += f" (via relay {p['relay'][-8:]})"
        elif p["reachable"] is False and p["stage"] is None:
            reach += " (trainer only)"
        lines.append(
            f"{p['short_id']:<{width}} {stage:>5} {p['state']:<8} "
            f"{p['device'][:18]:<18} {tput:>10} {bw:>16} {p['samples_served']:>9} {up:>8} "
            f"{p['age_s']:>6.1f} {reach}"
        )
    lines.append("")
    for s in view["stages"]:
        mark = "  <- bottleneck" if s["stage"] == view["bottleneck_stage"] else ""
        also = f" ({s['also_served_by']} of them as a second stage)" if s["also_served_by"] else ""
        lines.append(
            f"stage {s['stage']}: {s['serving']} serving{also}, {s['peers']} holding it first, "
            f"{s['throughput']:.1f} samples/s{mark}"
        )
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """``1h05m``, or ``4m02s`` under an hour."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


async def fetch(dht: SwarmDHT, n_stages: int | None = None) -> dict:
    """The run's view as ``summarize`` returns it. Its lookups (the spec, unless
    ``n_stages`` is given and ``dht.use_spec`` was called; the revocations; the peers) run
    at once: each may wait on a dead peer still in the DHT's tables."""
    if n_stages is None:
        signed, revocations, peers = await asyncio.gather(
            dht.spec(), dht.revocations(), dht.peers()
        )
        if signed is not None:
            dht.use_spec(signed.spec)
            n_stages = signed.spec.n_stages
    else:
        revocations, peers = await asyncio.gather(dht.revocations(), dht.peers())
    return summarize(_members(dht, peers, revocations), n_stages, get_dht_time())


def _members(
    dht: SwarmDHT, peers: list[PeerInfo], revocations: tuple[Revocations, bytes] | None
) -> list[PeerInfo]:
    """``peers`` that ``dht.policy``, updated with ``revocations``, takes for members (a
    read that ran before the policy was known let everyone through)."""
    if dht.policy is None:
        return peers
    current = dht.policy.revocations
    if revocations is not None and (current is None or revocations[0].issued > current.issued):
        dht.policy = dataclasses.replace(dht.policy, revocations=revocations[0])
    now, kept = get_dht_time(), []
    for p in peers:
        try:
            dht.policy.check(p.peer_id, p.membership, now)
        except MembershipError:
            continue
        kept.append(p)
    return kept


async def _status(dht: SwarmDHT, args: argparse.Namespace) -> int:
    """Print the view once, or every ``--watch`` seconds. ``NodeError`` (exit 2) if the
    run has no spec there (``node.daemon.join.find_spec``)."""
    signed, revocations, peers = await asyncio.gather(
        find_spec(dht, SPEC_TIMEOUT_S, SPEC_GRACE_S), dht.revocations(), dht.peers()
    )
    dht.use_spec(signed.spec)
    n_stages = signed.spec.n_stages
    view = summarize(_members(dht, peers, revocations), n_stages, get_dht_time())
    tty = sys.stdout.isatty()
    while True:
        if args.json:
            print(json.dumps(view, indent=None if args.watch is not None else 1), flush=True)
        else:
            if args.watch is not None and tty:
                print("\x1b[H\x1b[2J", end="")  # clear the screen: one table at a time
            print(render(view), flush=True)
            if args.watch is not None and not tty:
                print(flush=True)
        if args.watch is None:
            return 0
        await asyncio.sleep(max(args.watch, 0.1))
        view = await fetch(dht, n_stages)


def run(args: argparse.Namespace) -> int:
    with client_dht(args, check_run_id(args.run)) as dht:
        try:
            return asyncio.run(_status(dht, args))
        except KeyboardInterrupt:
            if args.watch is None:
                raise
            return 0  # how one stops watching
