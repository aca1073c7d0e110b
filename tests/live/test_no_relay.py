"""A caller started with ``--no-relay`` in a swarm where a home serves through a relay, as
root: its ``p2pd`` has no circuit transport, so it cannot reach that home, and routing
leaves the home out of its calls (``PeerInfo.routable_by``).

Skipped, saying why, where the emulated network cannot be built
(``scripts.netem.network.NetemUnavailable``)."""

from __future__ import annotations

from node.harness.local_swarm import NodeProcess
from scripts.netem.network import Home, Host, Network
from tests.live import test_relay
from tests.live.test_nat import ANY, _maddr_at, _reachability
from tests.live.test_relay import _served
from tests.swarm import launch_node, stop_all, wait_until

net = test_relay.net  # two public hosts, and two homes each behind a router of its own


def _trained(node: NodeProcess) -> int:
    """Micro-batches ``node``'s trainer has trained, as its latest progress event says."""
    progress = node.events("train.progress")
    return progress[-1]["micro_batches"] if progress else 0


def test_a_no_relay_trainer_trains_through_direct_peers_only(net: Network, tmp_path) -> None:
    """2 public nodes (tiny, 1 stage; the first trains), home h0 serving the stage through
    a relay, and home h1 started with ``--no-relay`` (a trainer only: not reachable, no
    relay). h1 says that h0 is out of its reach (``route.out_of_reach``), trains 20
    micro-batches while h0 serves (the first node's calls reach h0), and not one of its
    calls goes to h0: no ``call.failed`` on h1 names it."""
    nodes: list[NodeProcess] = []
    try:

        def start(name: str, where: Host | Home, peers: list[str], extra=()) -> NodeProcess:
            node = launch_node(tmp_path, name, run, initial_peers=peers, train=True,
                               host_maddr=ANY, wrap=where.exec, wait=False,
                               extra=["--heartbeat", "3", *extra])  # fmt: skip
            nodes.append(node)
            return node

        run = "norelaycaller"
        first = start("p0", net.hosts[0], [], ["--stages", "1"])
        wait_until(lambda: first.events("node.started"), 60, "the first node to start")
        run, seed = first.run_id, [_maddr_at(first, net.hosts[0].address)]
        start("p1", net.hosts[1], seed, ["--no-train"])
        relayed = start("h0", net.homes[0], seed, ["--no-train"])
        caller = start("h1", net.homes[1], seed, ["--no-relay"])

        said = _reachability(caller)
        assert said["reachable"] is False and not said["serves"], said
        said = _reachability(relayed)
        assert said["reachable"] is False and said["serves"], said
        assert said["relay"] == first.peer_id, said
        relayed.wait_serving(150)
        wait_until(lambda: _served(relayed) >= 5, 120, "the first node's calls to reach h0")

        def out_of_reach() -> dict | None:
            if not caller.alive():
                raise RuntimeError(f"h1 exited:\n{caller.output()[-2000:]}")
            found = [e for e in caller.events("route.out_of_reach")
                     if relayed.peer_id in e["peers"]]  # fmt: skip
            return found[0] if found else None

        event = wait_until(out_of_reach, 120, "h1 to leave h0 out of its calls")
        assert "--no-relay" in event["reason"], event
        before = _trained(caller)
        wait_until(lambda: _trained(caller) >= before + 20, 150,
                   "h1 to train 20 micro-batches while h0 serves")  # fmt: skip
        assert relayed.alive() and relayed.events("node.heartbeat")[-1]["stage"] == 0
        said = caller.events("route.out_of_reach")  # when the count changes: h0 only here
        assert all(e["peers"] in ([], [relayed.peer_id]) for e in said), said
        failed_on_relayed = [e for e in caller.events("call.failed")
                             if e["peer"] == relayed.peer_id]  # fmt: skip
        assert failed_on_relayed == []
    finally:
        stop_all(nodes)
