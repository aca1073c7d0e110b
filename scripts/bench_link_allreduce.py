"""A stage's all-reduce between two peers on an emulated link, against the link's bound.

Two hosts with the ``--link`` profile (``scripts.netem``), each running a hivemind DHT
and a stage averager (``StageAveragerProcess`` with the round settings of a default run,
``node.averaging.transport.process_settings``) behind its latency relay, as a node runs
there. Both call ``step`` on a ``--mb`` MB float32 tensor at the same scheduled times,
``--rounds`` times after one warm-up round; each prints, per round, the seconds from
``step`` to the average (``round``) and from the all-reduce's start to the average
(``all-reduce``). With two peers each one uploads half the tensor (its part of the
other's half) and the other half's means, so the link's bound is ``--mb`` MB at raw
TCP's rate (``scripts.netem.probe``, through the same relay, measured in the same run).
Needs root (network namespaces).

    python -m scripts.bench_link_allreduce --link home --mb 15 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.netem.network import NODE_PORT, RELAY_PORT, Network
from scripts.netem.profiles import PROFILES, profile

START_S = 40.0  # from launching the peers to the first round: imports, DHT, averager
LINGER_S = 5.0  # after its last round a peer stays, so that its groupmate's round ends
SPAN_FACTOR = 3.0  # rounds start this many link-bound times apart (at least 8 s)


def _peer(a: argparse.Namespace) -> None:
    """Inside a host's namespace: a DHT and an averager; ``--rounds`` + 1 scheduled rounds;
    one JSON line of their times."""
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.averaging.control import AveragingStage

    from node.averaging.process import StageAveragerProcess
    from node.averaging.transport import process_settings
    from node.files import load_or_create_key
    from node.rpc.dht import SwarmDHT
    from protocol.identity import peer_id_of
    from protocol.run_spec import make_run_spec

    key_path = Path(tempfile.mkdtemp()) / "peer.key"
    load_or_create_key(key_path)
    dht = SwarmDHT.start(
        "bench",
        host_maddrs=[f"/ip4/127.0.0.1/tcp/{NODE_PORT}"],
        announce_maddrs=[f"/ip4/{a.address}/tcp/{RELAY_PORT}"],
        initial_peers=a.initial,
        identity_path=key_path,
    )
    print(f"/ip4/{a.address}/tcp/{RELAY_PORT}/p2p/{dht.peer_id}", flush=True)
    owner = peer_id_of(Ed25519PrivateKey.generate().public_key())
    spec = make_run_spec("link", "tiny", 2, owner=owner)
    tensor = torch.randn(a.mb * 10**6 // 4, generator=torch.Generator().manual_seed(1))
    averager = StageAveragerProcess(
        [tensor],
        dht.dht,
        start=False,
        state_source=lambda: ({}, []),
        prefix="bench-link-allreduce",
        allow_state_sharing=False,
        **process_settings(spec.averaging),
    )
    averager.start()
    averager.wait_until_ready(60)
    rounds = []
    for r in range(a.rounds + 1):
        while time.time() < a.t0 + r * a.span:
            time.sleep(0.005)
        averager.set_round(r, 2)
        started, began = time.perf_counter(), None
        control = averager.step(weight=1.0, allow_retries=False, wait=False)
        while not control.done():
            if began is None and control.stage in (
                AveragingStage.RUNNING_ALLREDUCE,
                AveragingStage.FINISHED,
            ):
                began = time.perf_counter()
            time.sleep(0.002)
        ended = time.perf_counter()
        try:
            error = None if len(control.result() or ()) == 2 else "a group of one"
        except Exception as e:  # reported, not raised: the next round is independent
            error = f"{type(e).__name__}: {e}"[:200]
        rounds.append(
            {"round": ended - started, "allreduce": ended - (began or ended), "error": error}
        )
    time.sleep(LINGER_S)
    print(json.dumps(rounds), flush=True)
    averager.shutdown()
    averager.join(10)
    os._exit(0)  # the DHT's process and p2pd go with the namespace


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="home", choices=sorted(PROFILES))
    p.add_argument("--mb", type=int, default=15, help="MB of float32 each peer averages")
    p.add_argument("--rounds", type=int, default=5, help="measured, after one warm-up")
    sub = p.add_subparsers(dest="role")
    peer = sub.add_parser("peer")  # inside a namespace: what the benchmark runs
    peer.add_argument("address")
    peer.add_argument("t0", type=float)
    peer.add_argument("span", type=float)
    peer.add_argument("initial", nargs="*")
    a = p.parse_args()
    if a.role == "peer":
        _peer(a)
        return

    link = profile(a.link)
    me = [sys.executable, "-m", "scripts.bench_link_allreduce", "--mb", str(a.mb),
          "--rounds", str(a.rounds)]  # fmt: skip
    with Network([link] * 2) as net:
        hosts = net.hosts
        for host in hosts:
            net.start_relay(host)
        raw = net.probe(hosts[1], hosts[0])["up_mbit"] / 8
        bound = a.mb / raw  # seconds: each peer uploads --mb MB (parts out, means back)
        span = max(8.0, SPAN_FACTOR * bound)
        t0 = time.time() + START_S
        peers, initial = [], []
        for host in hosts:
            command = [*me, "peer", host.address, str(t0), str(span), *initial]
            peers.append(subprocess.Popen(host.exec(command), stdout=subprocess.PIPE, text=True))
            initial = [peers[-1].stdout.readline().strip()]
        timeout = START_S + (a.rounds + 2) * span + LINGER_S + 60
        results = [json.loads(proc.stdout.readline()) for proc in peers]
        for proc in peers:
            proc.wait(timeout)
    print(f"{a.mb} MB of float32, 2 peers on '{a.link}', {a.rounds} rounds after a warm-up; "
          f"raw TCP {raw:.2f} MB/s, so the link's bound is {bound:.2f} s a round")  # fmt: skip
    measured = [r for rounds in results for r in rounds[1:]]
    ok = [r for r in measured if r["error"] is None]
    for r in measured:
        if r["error"] is not None:
            print(f"  a failed round: {r['error']}")
    if not ok:
        print("  no round averaged")
        return
    allreduce = [r["allreduce"] for r in ok]
    print(f"  peer-rounds averaged: {len(ok)} of {len(measured)}")
    print(f"  step -> average: {_spread([r['round'] for r in ok])} s")
    median = statistics.median(allreduce)
    print(f"  all-reduce: {_spread(allreduce)} s, {a.mb / median:.2f} MB/s of tensor, "
          f"{bound / median:.2f} of the link's bound")  # fmt: skip


if __name__ == "__main__":
    main()
