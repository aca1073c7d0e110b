"""Whether ``p2pd`` (hivemind 1.1.12's) upgrades a relayed connection between two homes,
each behind its own NAT router, to a direct one (DCUtR hole punching). As root.

    python -m scripts.netem.holepunch [--publics 4] [--watch 60] [--trials 10]

Builds ``--publics`` public hosts on a public-looking bridge (AutoNAT, relay addresses and
hole punching ignore private addresses) and 2 homes, each behind a router of its own
(nftables masquerade; the router drops connections started outside). Each host runs one
hivemind ``P2P`` (``peer``, in its namespace): the public ones with hivemind's defaults
(AutoNAT, hole punching, a relay service); the homes with every public peer as initial
peer, autorelay on the first (trusted, no discovery), so that they learn their public
(router) address from several observers. Once each home has a confirmed public address
(DCUtR runs only then), home A connects to home B at
``PUBLIC0/p2p-circuit/p2p/B`` and, for ``--watch`` seconds, lists its connections to B:
relayed (``/p2p-circuit``) or direct. Prints one JSON line per second and a verdict; every
peer's ``p2pd`` hole-punching log lines (go-libp2p's ``p2p-holepunch`` logger) go to
stderr, as ``{"peer": NAME, "holepunch": MESSAGE}``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

PORT = 4001


async def public_address(p2p, wait_s: float) -> str | None:
    """The first of ``p2p``'s confirmed addresses that is not private (its router's, for
    a home: go-libp2p confirms one once several peers saw it), polled for up to
    ``wait_s``; None if none came."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for maddr in map(str, await p2p.get_visible_maddrs(latest=True)):
            parts = maddr.split("/")
            if parts[1] == "ip4" and not ipaddress.ip_address(parts[2]).is_private:
                return maddr
        await asyncio.sleep(1)
    return None


async def peer(args: argparse.Namespace) -> None:
    """One ``P2P`` in this namespace; prints ``{"peer_id", "maddrs"}``, then (with
    ``--target``) dials it through ``--relay`` and reports how it is linked, else waits."""
    from hivemind.p2p import P2P, P2PDaemonError, PeerID
    from multiaddr import Multiaddr

    from node.rpc.hivemind_compat import connect, p2pd_options

    class HolePunchLines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "holepunch" in str(getattr(record, "caller", "")):
                line = {"peer": args.name, "holepunch": record.getMessage()[:300]}
                print(json.dumps(line), file=sys.stderr, flush=True)

    os.environ["GOLOG_LOG_LEVEL"] = "error,p2p-holepunch=debug"
    daemon_log = logging.getLogger("hivemind.p2p.p2p_daemon")
    daemon_log.setLevel(logging.DEBUG)
    daemon_log.addHandler(HolePunchLines())
    extra = ["-relayDiscovery=false"] if args.trusted else []
    with p2pd_options(extra_args=extra):
        p2p = await P2P.create(
            initial_peers=args.initial or None,
            host_maddrs=[f"/ip4/0.0.0.0/tcp/{PORT}"],
            use_auto_relay=bool(args.trusted),
            trusted_relays=args.trusted or None,
            dht_mode="client" if args.trusted else "server",
        )
    print(json.dumps({"peer_id": p2p.peer_id.to_base58()}), flush=True)
    if args.trusted:  # a home: DCUtR starts once it knows its public (router) address
        print(json.dumps({"public": await public_address(p2p, args.reserve_wait)}), flush=True)
    if not args.target:
        await asyncio.sleep(3600)
        return
    target = PeerID.from_base58(args.target)
    circuit = Multiaddr(f"{args.relay}/p2p-circuit/p2p/{args.target}")
    start = time.monotonic()
    while True:  # B reserves once its AutoNAT finds it private
        try:
            await connect(p2p, target, [circuit])
            break
        except P2PDaemonError as e:
            if time.monotonic() - start > args.reserve_wait:
                print(json.dumps({"error": " ".join(str(e).split())[:300]}), flush=True)
                return
            await asyncio.sleep(2)
    connected = time.monotonic()
    # The home's own addresses as the swarm confirmed them: its router's address with its
    # listening port if the router kept the source port (a predictable mapping).
    visible = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
    print(json.dumps({"visible": visible}), flush=True)
    while time.monotonic() - connected < args.watch:
        addrs = [str(a) for p in await p2p.list_peers() if p.peer_id == target for a in p.addrs]
        direct = any("p2p-circuit" not in a for a in addrs)
        print(json.dumps({"t": round(time.monotonic() - connected, 1), "addrs": addrs,
                          "direct": direct}), flush=True)  # fmt: skip
        await asyncio.sleep(1)


@dataclass
class Outcome:
    """What ``punch`` saw: each home's public address (B's before A starts, A's before it
    dials: DCUtR runs only between peers that know theirs), whether A connected to B
    through the relay at all, A's visible addresses then, and seconds from the relayed
    connection to a direct one (None: it stayed relayed for the whole watch)."""

    relayed: bool = False
    public_a: str | None = None  # each home's public address, once confirmed
    public_b: str | None = None
    visible: list[str] = field(default_factory=list)
    first_direct: float | None = None
    error: str | None = None


def punch(publics: int = 4, watch: float = 60.0, reserve_wait: float = 120.0) -> Outcome:
    """Build the network, start the peers, watch home A's connection to home B (every
    line A prints is echoed); ``NetemUnavailable`` if the network cannot be built."""
    from scripts.netem.network import ROOT, Network
    from scripts.netem.profiles import profile

    procs: list[subprocess.Popen] = []

    def start(where, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
        command = [sys.executable, "-m", "scripts.netem.holepunch", "--peer", "--name", name,
                   *extra]  # fmt: skip
        proc = subprocess.Popen(where.exec(command), stdout=subprocess.PIPE, text=True, cwd=ROOT)
        procs.append(proc)
        return proc, json.loads(proc.stdout.readline())["peer_id"]

    dc, home = profile("datacenter"), profile("home")
    outcome = Outcome()
    with Network([dc] * publics, [home, home], subnet="44.77.0") as net:
        try:
            relays = []
            for i, host in enumerate(net.hosts):
                _, pid = start(host, f"public{i}", "--initial", *relays[:1])
                relays.append(f"/ip4/{host.address}/tcp/{PORT}/p2p/{pid}")
            common = ["--initial", *relays, "--trusted", relays[0],
                      "--reserve-wait", str(reserve_wait)]  # fmt: skip
            home_b, b = start(net.homes[1], "homeB", *common)
            outcome.public_b = json.loads(home_b.stdout.readline())["public"]
            a, _ = start(net.homes[0], "homeA", *common, "--relay", relays[0], "--target", b,
                         "--watch", str(watch))  # fmt: skip
            for line in a.stdout:
                print(line.rstrip(), flush=True)
                got = json.loads(line)
                outcome.relayed = outcome.relayed or "t" in got
                outcome.visible = got.get("visible", outcome.visible)
                outcome.public_a = got.get("public", outcome.public_a)
                outcome.error = got.get("error", outcome.error)
                if got.get("direct") and outcome.first_direct is None:
                    outcome.first_direct = got["t"]
            a.wait()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--publics", type=int, default=4)
    p.add_argument("--trials", type=int, default=1, help="whole runs, each on a new network")
    p.add_argument("--watch", type=float, default=60.0)
    p.add_argument("--reserve-wait", type=float, default=120.0)
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--initial", nargs="*", default=[])
    p.add_argument("--trusted", nargs="*", default=[])
    p.add_argument("--relay")
    p.add_argument("--target")
    p.add_argument("--name", default="")
    args = p.parse_args()
    if args.peer:
        asyncio.run(peer(args))
        return 0

    from scripts.netem.network import NetemUnavailable

    upgraded = 0
    for trial in range(1, args.trials + 1):
        print(f"--- trial {trial} of {args.trials}", flush=True)
        try:
            outcome = punch(args.publics, args.watch, args.reserve_wait)
        except NetemUnavailable as e:
            print(f"SKIPPED: {e}")
            return 2
        if not outcome.relayed:
            print(f"verdict: home A never reached home B through the relay ({outcome.error})")
        elif outcome.first_direct is None:
            print(f"verdict: the relayed connection stayed relayed for {args.watch:.0f} s")
        else:
            upgraded += 1
            print(f"verdict: a direct connection to home B appeared {outcome.first_direct} s "
                  "after the relayed one")  # fmt: skip
    print(f"upgraded to a direct connection in {upgraded} of {args.trials} trials", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
