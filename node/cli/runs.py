"""``swarmtrain runs``: the public runs announced in the run directory, and how to join one.

Runs as a DHT client (it enters nobody's routing table) for at most ``--timeout`` seconds:
one read of the run directory, then one lookup of each announced run's peers, a few at a
time, in a random order (``protocol.announce`` says what a flood of announcements can and
cannot do to the list). Only runs with a live peer found are listed, with the figures
counted from their peers' records: largest first (most live peers, then most samples/s at
the bottleneck stage), then newest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from node.cli.client import client_dht
from node.cli.status import duration
from node.daemon.join import NodeError
from node.rpc.dht import SwarmDHT
from protocol.announce import (
    VOUCH_CONCURRENCY,
    Listed,
    RunAnnouncement,
    listing,
    vouch_order,
)
from protocol.records import PeerInfo

READ_GRACE_S = 2.0  # once a peer is reached, how long an empty directory is read again


@dataclass(frozen=True)
class Found:
    """One listing: the runs listed, and how many announced runs were not, and why."""

    listed: list[Listed]
    announced: int  # valid announcements read
    no_live_peers: int  # looked up: no live peer record found
    not_checked: int  # not looked up before the deadline (or the lookup failed)


async def _read_directory(dht: SwarmDHT, deadline: float) -> list[RunAnnouncement]:
    """The directory's valid announcements. Read again while no DHT peer is reached (until
    ``deadline``: then ``NodeError``), and for ``READ_GRACE_S`` once one is, while empty."""
    loop = asyncio.get_running_loop()
    settled = None
    while True:
        found = await dht.announcements()
        now = loop.time()
        if found:
            return found
        if settled is None and await dht.known_peers() > 0:
            settled = now + READ_GRACE_S
        if settled is not None and now >= settled:
            return []
        if now >= deadline:
            raise NodeError(
                "no peer reached to read the run directory: give --initial-peers of a node "
                "of a public run (/ip4/HOST/tcp/PORT/p2p/PEER_ID)"
            )
        await asyncio.sleep(0.5)


async def find_runs(dht: SwarmDHT, timeout_s: float, seed: int) -> Found:
    """Read the directory and look up each announced run's peers (``VOUCH_CONCURRENCY`` at
    a time, in ``vouch_order(..., seed)``) until ``timeout_s`` has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    announced = await _read_directory(dht, deadline)
    live: dict[str, list[PeerInfo]] = {}
    slots = asyncio.Semaphore(VOUCH_CONCURRENCY)  # FIFO: lookups start in the order made

    async def look_up(run: str) -> None:
        async with slots:
            live[run] = await dht.of_run(run).peers()

    lookups = [asyncio.ensure_future(look_up(run)) for run in vouch_order(announced, seed)]
    if lookups:
        _, pending = await asyncio.wait(lookups, timeout=max(0.0, deadline - loop.time()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*lookups, return_exceptions=True)  # a failed lookup: not checked
    listed = listing(announced, live)
    return Found(
        listed=listed,
        announced=len(announced),
        no_live_peers=len(live) - len(listed),
        not_checked=len(announced) - len(live),
    )


def view(found: Found, initial_peers: list[str], now: float) -> dict:
    """``--json``: the runs listed (their figures as counted from their live peers, and as
    announced by their owner; ``throughput`` is the samples/s of the bottleneck stage, the
    pipeline's pace), how many announced runs were not listed and why, and the command
    that joins a run."""
    runs = []
    for r in found.listed:
        a = r.announcement
        runs.append(
            {
                "run": a.run,
                "owner": a.owner,
                "model": a.preset,
                "n_layer": a.n_layer,
                "n_embd": a.n_embd,
                "stages": a.stages,
                "data": a.data,
                "peers": r.peers,
                "throughput": r.throughput,
                "bottleneck_stage": r.bottleneck_stage,
                "stage_throughput": list(r.stage_throughput),
                "created": a.created,
                "age_s": round(max(0.0, now - a.created), 1),
                "announced": {
                    "peers": a.peers,
                    "stage_throughput": list(a.stage_throughput),
                    "age_s": round(max(0.0, now - a.timestamp), 1),
                },
            }
        )
    return {
        "runs": runs,
        "announced": found.announced,
        "no_live_peers": found.no_live_peers,
        "not_checked": found.not_checked,
        "join": f"swarmtrain node --run RUN_ID --initial-peers {' '.join(initial_peers)}",
    }


def render(v: dict) -> str:
    if not v["runs"]:
        lines = ["no public run listed"]
    else:
        width = max(len(r["run"]) for r in v["runs"])
        lines = [f"{'run':<{width}} {'model':<14} {'stages':>6} {'peers':>5} {'samples/s':>9} "
                 f"{'age':>7}  data"]  # fmt: skip
        for r in v["runs"]:
            model = f"{r['model']} {r['n_layer']}x{r['n_embd']}"
            lines.append(
                f"{r['run']:<{width}} {model:<14} {r['stages']:>6} {r['peers']:>5} "
                f"{r['throughput']:>9.1f} {duration(r['age_s']):>7}  {r['data']}"
            )
        lines += ["", f"join one: {v['join']}"]
    if v["no_live_peers"]:
        lines.append(f"{v['no_live_peers']} announced runs not listed: no live peer found")
    if v["not_checked"]:
        lines.append(
            f"{v['not_checked']} announced runs not checked within --timeout (a slow DHT, "
            "or a flood of announcements): try again, or with a longer --timeout"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    with client_dht(args, None, startup_timeout_s=args.timeout) as dht:
        found = asyncio.run(find_runs(dht, args.timeout, secrets.randbits(64)))
    v = view(found, args.initial_peers, get_dht_time())
    print(json.dumps(v, indent=1) if args.json else render(v), flush=True)
    return 0
