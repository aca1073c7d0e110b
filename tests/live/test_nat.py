"""Home nodes behind NAT (``scripts.netem`` homes behind masquerading routers), as root.

Skipped, saying why, where network namespaces, veth pairs, bridges, ``tbf`` or nftables
cannot be used (``scripts.netem.network.NetemUnavailable``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from node.harness.local_swarm import NodeProcess
from scripts.netem.network import ROOT, Home, Host, NetemUnavailable, Network
from scripts.netem.profiles import profile
from tests.swarm import launch_node, status, stop_all, wait_until

PROBE_PORT = 5000
ANY = "/ip4/0.0.0.0/tcp/0"  # what a node listens on by default


def _network(homes: int, shared_router: bool) -> Iterator[Network]:
    """Two public hosts and ``homes`` homes behind NAT, or a skip saying what is missing."""
    public, home = [profile("datacenter")] * 2, [profile("home")] * homes
    try:
        with Network(public, home, shared_router=shared_router) as n:
            yield n
    except NetemUnavailable as e:
        pytest.skip(f"cannot build the emulated network here: {e}")


@pytest.fixture
def net() -> Iterator[Network]:
    """Two public hosts, and two homes behind one router (a home LAN)."""
    yield from _network(2, shared_router=True)


@pytest.fixture
def homes_net() -> Iterator[Network]:
    """Two public hosts, and two homes each behind a router of its own."""
    yield from _network(2, shared_router=False)


def _listen(host: Host | Home) -> subprocess.Popen:
    args = [sys.executable, "-m", "scripts.netem.probe", "serve", "--host", "0.0.0.0",
            "--port", str(PROBE_PORT)]  # fmt: skip
    proc = subprocess.Popen(host.exec(args), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert "listening" in proc.stdout.readline()
    return proc


def _connect(src: Host | Home, address: str) -> dict:
    args = [sys.executable, "-m", "scripts.netem.probe", "connect",
            "--to", f"{address}:{PROBE_PORT}", "--timeout", "2"]  # fmt: skip
    out = subprocess.run(src.exec(args), capture_output=True, text=True, cwd=ROOT, timeout=30)
    return json.loads(out.stdout)


def test_home_dials_out_and_nothing_dials_in(net: Network) -> None:
    public, home, neighbour = net.hosts[0], net.homes[0], net.homes[1]
    router = home.router
    servers = [_listen(h) for h in (public, home, neighbour)]
    try:
        assert _connect(home, public.address) == {"ok": True}, "a home dials out"
        assert _connect(home, neighbour.address) == {"ok": True}, "homes on one LAN talk"
        assert not _connect(public, home.address)["ok"], "no route to a home's LAN"
        assert not _connect(public, router.address)["ok"], "no port is forwarded"
        # Even with a route to the LAN (as an ISP could add one), the router drops
        # connections that start on its public side.
        route = ["route", "add", f"{home.address}/32", "via", router.address]
        subprocess.run(public.exec(["ip", *route]), check=True)
        blocked = _connect(public, home.address)
        assert not blocked["ok"] and "TimeoutError" in blocked["error"], blocked
    finally:
        for s in servers:
            s.kill()
            s.wait()


def _maddr_at(node: NodeProcess, address: str) -> str:
    """The multiaddr ``node`` announces on ``address`` (it also announces 127.0.0.1)."""
    return next(m for m in node.maddrs_file.read_text().split() if f"/{address}/" in m)


def _reachability(node: NodeProcess, definite: bool = False) -> dict:
    """``node``'s latest ``node.reachability`` event (with ``definite``: its first that
    is not unknown)."""

    def said() -> dict | None:
        if not node.alive():
            raise RuntimeError(f"node {node.name} exited:\n{node.output()[-2000:]}")
        found = [e for e in node.events("node.reachability")
                 if not definite or e["reachable"] is not None]  # fmt: skip
        return found[-1] if found else None

    # A home serving through a relay reports once a relay holds its reservation.
    return wait_until(said, 150, f"node {node.name} to find out whether it is reachable")


def test_home_nodes_behind_nat_train_and_are_never_routed_to(homes_net, tmp_path):
    """2 public nodes and 2 home nodes (tiny, 2 stages, training on), relaying off
    (``--no-relay``): each home finds it is not reachable (event and record), holds no
    stage, is never called (no call fails on it) and trains through the public nodes; a
    joining public node finds it is reachable, and so does the first node (which had
    nobody to ask at start) once peers joined. (``test_relay.py``: relaying on.)"""
    net, nodes = homes_net, []
    try:

        def start(name: str, where: Host | Home, peers: list[str]) -> NodeProcess:
            node = launch_node(tmp_path, name, run, initial_peers=peers, train=True,
                               host_maddr=ANY, wrap=where.exec, wait=False,
                               extra=["--no-relay"])  # fmt: skip
            nodes.append(node)
            return node

        run = "nat"
        first = start("p0", net.hosts[0], [])
        wait_until(lambda: first.events("node.started"), 60, "the first node to start")
        run, seed = first.run_id, [_maddr_at(first, net.hosts[0].address)]
        public = start("p1", net.hosts[1], seed)
        homes = [start(f"h{i}", home, seed) for i, home in enumerate(net.homes)]

        said = _reachability(public)
        assert said["reachable"] is True and said["serves"], said
        assert f"/{net.hosts[1].address}/" in said["address"], said
        for home in homes:
            said = _reachability(home)
            assert said["reachable"] is False and not said["serves"], said
            assert said["no"] >= 1 and said["yes"] == 0 and said["relay"] is None, said
            assert said["observed"] == net.homes[homes.index(home)].router.address, said
        first.wait_serving(90)
        public.wait_serving(90)
        assert first.events("node.reachability")[0]["reachable"] is None
        said = _reachability(first, definite=True)
        assert said["reachable"] is True and said["serves"], said
        assert f"/{net.hosts[0].address}/" in said["address"], said

        def trained(node: NodeProcess) -> bool:
            return any(e["micro_batches"] >= 20 for e in node.events("train.progress"))

        for node in nodes:  # every trainer makes progress, the homes' through the public
            wait_until(lambda n=node: trained(n), 90, f"node {node.name} to train")

        view = status(run, seed[0], host_maddr=ANY, wrap=net.hosts[0].exec)
        records = {p["peer_id"]: p for p in view["peers"]}
        for home in homes:
            record = records[home.peer_id]
            assert record["reachable"] is False and record["stage"] is None, record
            assert record["relay"] is None, record
            assert not home.events("stage.held"), "an unreachable node holds no stage"
        assert records[public.peer_id]["reachable"] is True
        assert records[first.peer_id]["reachable"] is True
        failed_on_homes = [e for n in nodes for e in n.events("call.failed")
                           if e["peer"] in {h.peer_id for h in homes}]  # fmt: skip
        assert failed_on_homes == []
    finally:
        stop_all(nodes)
