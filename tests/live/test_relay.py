"""Home nodes behind NAT serve a stage through a circuit relay (``node.rpc.relay``), as root.

The bridge has a public-looking subnet (inside the namespaces only): libp2p's AutoNAT, on
which autorelay acts, ignores private addresses. Skipped, saying why, where the emulated
network cannot be built (``scripts.netem.network.NetemUnavailable``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from node.harness.local_swarm import NodeProcess
from scripts.netem.network import Home, Host, NetemUnavailable, Network
from scripts.netem.profiles import profile
from tests.live.test_nat import ANY, _maddr_at, _reachability
from tests.swarm import launch_node, status, stop_all, wait_until

PUBLIC_SUBNET = "44.77.0"  # not a private range: only inside the namespaces


@pytest.fixture
def net() -> Iterator[Network]:
    """Two public hosts, and two homes each behind a router of its own."""
    public, home = [profile("datacenter")] * 2, [profile("home")] * 2
    try:
        with Network(public, home, subnet=PUBLIC_SUBNET) as n:
            yield n
    except NetemUnavailable as e:
        pytest.skip(f"cannot build the emulated network here: {e}")


def test_home_nodes_serve_through_a_relay(net: Network, tmp_path) -> None:
    """2 public and 2 home nodes (tiny, 2 stages, training on): each home finds it is not
    reachable and serves through the first node's relay (event and record); peers connect
    to it through the relay, it serves micro-batches, takes part in averaging rounds with
    its stage's other peer, and the swarm trains."""
    nodes: list[NodeProcess] = []
    try:

        def start(name: str, where: Host | Home, peers: list[str]) -> NodeProcess:
            node = launch_node(tmp_path, name, run, initial_peers=peers, train=True,
                               host_maddr=ANY, wrap=where.exec, wait=False,
                               extra=["--heartbeat", "3"])  # fmt: skip
            nodes.append(node)
            return node

        run = "relay"
        first = start("p0", net.hosts[0], [])
        wait_until(lambda: first.events("node.started"), 60, "the first node to start")
        run, seed = first.run_id, [_maddr_at(first, net.hosts[0].address)]
        public = start("p1", net.hosts[1], seed)
        homes = [start(f"h{i}", home, seed) for i, home in enumerate(net.homes)]

        for home in homes:
            said = _reachability(home)
            assert said["reachable"] is False and said["serves"], said
            assert said["relay"] == first.peer_id, said
        for node in nodes:
            node.wait_serving(120)

        def served(node: NodeProcess) -> int:
            beats = node.events("node.heartbeat")
            return beats[-1]["served"] if beats else 0

        def averaged(node: NodeProcess) -> bool:
            return any(e["ok"] and e["peers"] >= 2 for e in node.events("averaging.round"))

        for home in homes:  # calls reach it through the relay; it averages with its peer
            wait_until(lambda h=home: served(h) >= 10, 120, f"home {home.name} to serve")
            wait_until(lambda h=home: averaged(h), 120, f"home {home.name} to average")
        relayed = {e["peer"] for n in nodes for e in n.events("relay.link")}
        assert {h.peer_id for h in homes} <= relayed, relayed

        def trained(node: NodeProcess) -> bool:
            return any(e["micro_batches"] >= 20 for e in node.events("train.progress"))

        for node in nodes:
            wait_until(lambda n=node: trained(n), 120, f"node {node.name} to train")

        view = status(run, seed[0], host_maddr=ANY, wrap=net.hosts[0].exec)
        records = {p["peer_id"]: p for p in view["peers"]}
        for home in homes:
            record = records[home.peer_id]
            assert record["reachable"] is False and record["stage"] is not None, record
            assert record["relay"] == first.peer_id, record
        assert records[public.peer_id]["reachable"] is True
        assert records[public.peer_id]["relay"] is None
    finally:
        stop_all(nodes)
