"""Home nodes behind NAT serve a stage through a circuit relay (``node.rpc.relay``), as root.

The bridge has a public-looking subnet (inside the namespaces only): libp2p's AutoNAT, on
which autorelay acts, ignores private addresses. Skipped, saying why, where the emulated
network cannot be built (``scripts.netem.network.NetemUnavailable``)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from node.daemon.relay_keeper import CHOOSE_WAIT_S
from node.harness.local_swarm import NodeProcess
from protocol.reachability import offers_no_relay
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


# A home whose download of a tiny stage's state (about 3 MB) outlasts several steps of
# two public peers training it.
SLOW_HOME = replace(profile("home"), name="slow-home", down_mbit=16)


@pytest.fixture
def one_home() -> Iterator[Network]:
    """Two public hosts, and one home behind a router, with a slow download."""
    try:
        with Network([profile("datacenter")] * 2, [SLOW_HOME], subnet=PUBLIC_SUBNET) as n:
            yield n
    except NetemUnavailable as e:
        pytest.skip(f"cannot build the emulated network here: {e}")


def _served(node: NodeProcess) -> int:
    """Micro-batches ``node`` served, as its latest heartbeat says."""
    beats = node.events("node.heartbeat")
    return beats[-1]["served"] if beats else 0


def _until_averaged_with(node: NodeProcess, peers: int) -> list[dict] | None:
    """``node``'s ``averaging.round`` events up to its first round averaged among
    ``peers`` peers (itself included); None before that round."""
    rounds = node.events("averaging.round")
    for i, e in enumerate(rounds):
        if e["how"] == "averaged" and e["peers"] >= peers:
            return rounds[: i + 1]
    return None


def _start(
    nodes: list[NodeProcess], tmp_path, run: str, name: str, where: Host | Home,
    peers: list[str], extra: Sequence[str] = (),
) -> NodeProcess:  # fmt: skip
    """A training node of ``run`` in ``where``'s namespace, kept in ``nodes`` to stop."""
    node = launch_node(tmp_path, name, run, initial_peers=peers, train=True,
                       host_maddr=ANY, wrap=where.exec, wait=False,
                       extra=["--heartbeat", "3", *extra])  # fmt: skip
    nodes.append(node)
    return node


def test_a_home_whose_relay_dies_serves_through_another(one_home: Network, tmp_path) -> None:
    """2 public nodes (both training, both usable as relays: the home's initial peers) and
    1 home behind NAT (tiny, 1 stage, so that every node serves it and no stage empties
    when one dies). The home joins the public pair's averaging rounds after a few state
    downloads: the pair holds a step for a download in flight (``averaging.held``) rather
    than step past it, where the home otherwise chased their epochs. The home announces a
    relay that it checked holds its reservation; SIGKILL that relay: within a bounded time
    the home emits ``relay.changed`` to the other, its record says so, and the surviving
    trainer's micro-batches reach it again."""
    net, nodes = one_home, []
    try:

        def start(name: str, where: Host | Home, peers: list[str], extra=()) -> NodeProcess:
            return _start(nodes, tmp_path, run, name, where, peers, extra)

        run = "rechoose"
        first = start("p0", net.hosts[0], [], ["--stages", "1"])
        first.wait_started(60)
        run = first.run_id
        second = start("p1", net.hosts[1], [_maddr_at(first, net.hosts[0].address)])
        second.wait_started(90)
        wait_until(lambda: _until_averaged_with(second, 2), 120, "the public pair to average")
        publics = {first.peer_id: first, second.peer_id: second}
        seeds = [_maddr_at(first, net.hosts[0].address), _maddr_at(second, net.hosts[1].address)]
        home = launch_node(tmp_path, "h0", run, initial_peers=seeds, host_maddr=ANY,
                           wrap=net.homes[0].exec, wait=False,
                           extra=["--heartbeat", "3"])  # fmt: skip
        nodes.append(home)

        said = _reachability(home)
        assert said["reachable"] is False and said["serves"], said
        assert said["relay"] in publics, said
        relay, other = publics[said["relay"]], next(n for p, n in publics.items()
                                                    if p != said["relay"])  # fmt: skip
        home.wait_serving(150)
        wait_until(lambda: _served(home) >= 5, 120, "the home to serve through its relay")
        rounds = wait_until(lambda: _until_averaged_with(home, 3), 120,
                            "the home to average with both public peers")  # fmt: skip
        caught_up = [e["epoch"] for e in rounds if e["how"] == "caught_up"]
        assert len(caught_up) <= 3, f"the home chased the pair's epochs: {caught_up}"
        held = [e for n in (first, second) for e in n.events("averaging.held")
                if home.peer_id in e["peers"]]  # fmt: skip
        assert held and all(e["seconds"] > 0 for e in held), held

        relay.stop(signal.SIGKILL)
        killed = time.monotonic()

        def changed() -> dict | None:
            if not home.alive():
                raise RuntimeError(f"the home exited:\n{home.output()[-2000:]}")
            found = [e for e in home.events("relay.changed") if e["relay"] == other.peer_id]
            return found[0] if found else None

        event = wait_until(changed, 150, "the home to serve through the other relay")
        took = time.monotonic() - killed
        assert event["previous"] == relay.peer_id, event
        before = _served(home)
        wait_until(lambda: _served(home) >= before + 5, 150,
                   "the survivor's micro-batches to reach the home again")  # fmt: skip
        view = status(run, seeds[1 - list(publics).index(relay.peer_id)], host_maddr=ANY,
                      wrap=net.hosts[1 - list(publics).index(relay.peer_id)].exec)  # fmt: skip
        record = next(p for p in view["peers"] if p["peer_id"] == home.peer_id)
        assert record["relay"] == other.peer_id and record["reachable"] is False, record
        print(f"relay re-chosen {took:.0f} s after the kill")
    finally:
        stop_all(nodes)


def test_home_nodes_serve_through_a_relay(net: Network, tmp_path) -> None:
    """2 public and 2 home nodes (tiny, 2 stages, training on): each home finds it is not
    reachable and serves through the first node's relay (event and record); peers connect
    to it through the relay, it serves micro-batches, takes part in averaging rounds with
    its stage's other peer, and the swarm trains. The relay resets each relayed connection
    after 1 MiB (``--relay-data-limit-mib 1``): a call that fails mid-call on a home is
    rerouted to another peer of its stage."""
    nodes: list[NodeProcess] = []
    try:

        def start(name: str, where: Host | Home, peers: list[str], extra=()) -> NodeProcess:
            return _start(nodes, tmp_path, run, name, where, peers, extra)

        run = "relay"
        first = start("p0", net.hosts[0], [], ["--relay-data-limit-mib", "1"])
        first.wait_started(60)
        run, seed = first.run_id, [_maddr_at(first, net.hosts[0].address)]
        public = start("p1", net.hosts[1], seed)
        homes = [start(f"h{i}", home, seed) for i, home in enumerate(net.homes)]

        for home in homes:
            said = _reachability(home)
            assert said["reachable"] is False and said["serves"], said
            assert said["relay"] == first.peer_id, said
        for node in nodes:
            node.wait_serving(120)

        def averaged(node: NodeProcess) -> bool:
            return any(e["ok"] and e["peers"] >= 2 for e in node.events("averaging.round"))

        for home in homes:  # calls reach it through the relay; it averages with its peer
            wait_until(lambda h=home: _served(h) >= 10, 120, f"home {home.name} to serve")
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
        for node in nodes:  # a call cut mid-call (a relay reset) is sent again elsewhere
            rerouted = node.events("call.rerouted")
            for failed in node.events("call.failed"):
                if failed["peer"] in {h.peer_id for h in homes}:
                    assert any(r["stage"] == failed["stage"] and r["t"] >= failed["t"]
                               for r in rerouted), (node.name, failed)  # fmt: skip
    finally:
        stop_all(nodes)


def test_public_nodes_with_no_relay_leave_a_home_without_one(one_home, tmp_path) -> None:
    """2 public nodes started with ``--no-relay`` (tiny, 1 stage, both training) and 1 home
    behind NAT that would serve through a relay: neither public node's ``p2pd`` offers one
    (not even go-libp2p's default relay, which ``-relayService=false`` alone left on), so
    the home finds no reservation on either and, as both refuse the relay protocol, says
    at once (not after ``CHOOSE_WAIT_S``) that it runs as a trainer only
    (``node.reachability``: ``serves`` false, why for each relay tried), holds no stage,
    trains through the public nodes, and no call is routed to it."""
    net, nodes = one_home, []
    try:

        def start(name: str, where: Host | Home, peers: list[str], extra=()) -> NodeProcess:
            return _start(nodes, tmp_path, run, name, where, peers, extra)

        run = "norelay"
        first = start("p0", net.hosts[0], [], ["--stages", "1", "--no-relay"])
        first.wait_started(90)
        run = first.run_id
        second = start("p1", net.hosts[1], [_maddr_at(first, net.hosts[0].address)],
                       ["--no-relay"])  # fmt: skip
        second.wait_started(90)
        seeds = [_maddr_at(first, net.hosts[0].address), _maddr_at(second, net.hosts[1].address)]
        home = start("h0", net.homes[0], seeds)

        def said() -> dict | None:
            if not home.alive():
                raise RuntimeError(f"the home exited:\n{home.output()[-2000:]}")
            found = [e for e in home.events("node.reachability") if e["reachable"] is not None]
            return found[-1] if found else None

        # Neither public node runs a relay service: the home stops looking for a
        # reservation at its first refusals, not after CHOOSE_WAIT_S (90 s).
        started = time.monotonic()
        event = wait_until(said, 300, "the home to say whether it serves")
        assert time.monotonic() - started < CHOOSE_WAIT_S / 2, "the home waited for no relay"
        assert event["reachable"] is False and not event["serves"], f"{event}"
        assert event["relay"] is None, event
        assert set(event["relays_tried"]) == {first.peer_id, second.peer_id}, event
        assert all(offers_no_relay(why) for why in event["relays_tried"].values()), event

        def trained(node: NodeProcess) -> bool:
            return any(e["micro_batches"] >= 20 for e in node.events("train.progress"))

        for node in nodes:  # the home trains through the public nodes
            wait_until(lambda n=node: trained(n), 150, f"node {node.name} to train")
        view = status(run, seeds[0], host_maddr=ANY, wrap=net.hosts[0].exec)
        record = next(p for p in view["peers"] if p["peer_id"] == home.peer_id)
        assert record["reachable"] is False and record["relay"] is None, record
        assert record["stage"] is None, record
        assert not home.events("stage.held"), "a home with no relay holds no stage"
        assert _served(home) == 0
        failed_on_home = [e for n in nodes for e in n.events("call.failed")
                          if e["peer"] == home.peer_id]  # fmt: skip
        assert failed_on_home == []
    finally:
        stop_all(nodes)
