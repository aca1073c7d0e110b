"""``swarmtrain status``: the swarm's view of a run, as a table or JSON."""

from __future__ import annotations

import argparse
import asyncio
import json

from hivemind.utils import get_dht_time

from node.dht import SwarmDHT
from protocol.assignment import stage_throughput
from protocol.ownership import check_run_id
from protocol.records import PeerInfo, PeerState


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="the run's id (NAME@FINGERPRINT)")
    p.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="multiaddrs of nodes of the run (/ip4/HOST/tcp/PORT/p2p/PEER_ID)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="where to listen",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def summarize(peers: list[PeerInfo], n_stages: int | None, now: float) -> dict:
    """Peers (all but those leaving) and per-stage totals; the bottleneck is the stage with
    the least throughput, the pace of the whole pipeline."""
    present = sorted(
        (p for p in peers if p.state is not PeerState.LEAVING),
        key=lambda p: (p.stage if p.stage is not None else -1, p.peer_id),
    )
    n = n_stages or max((len(p.throughput) for p in present), default=0)
    serving = [p for p in present if p.state is PeerState.SERVING]
    totals = stage_throughput(serving, n)
    stages = [
        {
            "stage": s,
            "peers": sum(1 for p in present if p.stage == s),
            "serving": sum(1 for p in serving if p.stage == s),
            # peers that serve it as their second stage (their time goes where it is needed)
            "also_served_by": sum(1 for p in serving if p.second_serving and p.second_stage == s),
            "throughput": round(totals[s], 3),
        }
        for s in range(n)
    ]
    bottleneck = min(range(n), key=lambda s: totals[s]) if n else None
    return {
        "peers": [
            {
                "peer_id": p.peer_id,
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
                "age_s": round(max(0.0, now - p.timestamp), 1),
            }
            for p in present
        ],
        "stages": stages,
        "bottleneck_stage": bottleneck,
    }


def render(view: dict) -> str:
    lines = [
        f"{'peer':<14} {'stage':>5} {'state':<8} {'device':<18} {'samples/s':>10} "
        f"{'up/down Mbit/s':>16} {'age s':>6}"
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
        lines.append(
            f"{'…' + p['peer_id'][-12:]:<14} {stage:>5} {p['state']:<8} "
            f"{p['device'][:18]:<18} {tput:>10} {bw:>16} {p['age_s']:>6.1f}"
        )
    lines.append("")
    for s in view["stages"]:
        mark = "  <- bottleneck" if s["stage"] == view["bottleneck_stage"] else ""
        also = f" (and {s['also_served_by']} as a second stage)" if s["also_served_by"] else ""
        lines.append(
            f"stage {s['stage']}: {s['serving']} serving of {s['peers']} peers{also}, "
            f"{s['throughput']:.1f} samples/s{mark}"
        )
    return "\n".join(lines)


async def fetch(dht: SwarmDHT) -> dict:
    """The run's view as ``summarize`` returns it."""
    signed = await dht.spec()
    if signed is not None:  # a private run's non-members are not listed
        dht.use_spec(signed.spec)
        await dht.refresh_revocations()
    n_stages = signed.spec.n_stages if signed else None
    return summarize(await dht.peers(), n_stages, get_dht_time())


def run(args: argparse.Namespace) -> int:
    dht = SwarmDHT.start(
        check_run_id(args.run),
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        client_mode=True,
    )
    try:
        view = asyncio.run(fetch(dht))
    finally:
        dht.shutdown()
    print(json.dumps(view, indent=1) if args.json else render(view))
    return 0
