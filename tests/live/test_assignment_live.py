"""Stage assignment and rebalancing on real local swarms: node processes
with their own ``p2pd`` running GossipSub, real DHT records, real state downloads.

- a wave of joiners spreads over every stage;
- when every peer of a stage is SIGKILLed, a peer of another stage moves to refill it
  (never emptying its own) and a trainer completes micro-batches again;
- gossip with a bad signature, an old sequence number, another run or another peer's
  name is ignored by the nodes: a joiner that believed it would take another stage.

Nodes re-announce every second and check for a move every 3 s on average (60 s by
default), so that each test fits in about a minute and a half on two loaded cores. Each
prints what it measured (seconds to spread, to refill, to train again)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections import Counter
from contextlib import ExitStack

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.files import load_or_create_key
from node.harness.local_swarm import NodeProcess
from protocol.gossip import GossipSigner, JoinIntent, run_topic
from protocol.identity import peer_id_of
from protocol.records import PROTOCOL_VERSION
from tests.swarm import LOCAL, StatusWatch, launch_node, stop_all

REBALANCE_S = 3.0


FAST = ["--rebalance-period", str(REBALANCE_S)]


def _serving(view: dict) -> dict[str, int]:
    """Peer id -> stage, for the peers whose record says they serve (in a status view)."""
    return {p["peer_id"]: p["stage"] for p in view["peers"] if p["state"] == "serving"}


def _moves(node: NodeProcess) -> list[tuple[int, int]]:
    """The node's confirmed moves, (from, to), from its ``placement.moved`` events."""
    return [(int(e["from"]), int(e["to"])) for e in node.events("placement.moved")]


def _moved_at(node: NodeProcess) -> float:
    """When (epoch seconds) the node served the stage of its first move: the first
    ``stage.held`` event after its first ``placement.moved``."""
    moved = node.events("placement.moved")[0]
    held = [e for e in node.events("stage.held") if e["t"] >= moved["t"] and e["role"] == "first"]
    assert held and held[0]["stage"] == moved["to"], (moved, held)
    return float(held[0]["t"])


def _ignored(node: NodeProcess) -> dict[str, int]:
    """The node's last log line of ignored gossip counts, by reason."""
    lines = re.findall(r"ignored gossip so far: (\{.*\})", node.output())
    return json.loads(lines[-1]) if lines else {}


def _train_across_kills(dht, victims: list[NodeProcess], limit_s: float) -> dict[str, float]:
    """A trainer on ``dht`` completes 4 micro-batches; ``victims`` get SIGKILL; it trains
    until 8 more complete, within ``limit_s``. Returns when they were killed (epoch s),
    how long the 8 took from then, and how often the trainer paused (a route to a dead
    or moving peer)."""
    from node.cli.train import open_trainer
    from node.pipeline.trainer import TrainerError, TrainerSettings

    async def main() -> dict[str, float]:
        settings = TrainerSettings(in_flight=2, call_timeout_s=20, stage_wait_s=60)
        trainer = await open_trainer(dht, settings)  # reads the spec while all are alive
        try:
            await asyncio.wait_for(trainer.train(4), 60)
            before = trainer.stats.micro_batches
            for victim in victims:
                victim.stop(signal.SIGKILL)
            killed, killed_at = time.monotonic(), time.time()
            paused = 0
            while trainer.stats.micro_batches < before + 8:
                elapsed = time.monotonic() - killed
                assert elapsed < limit_s, f"training did not resume within {limit_s:.0f} s"
                try:
                    await asyncio.wait_for(trainer.train(4), 60)
                except TrainerError as e:
                    paused += 1
                    print(f"trainer paused: {e}")
                    await asyncio.sleep(1.0)
            return {"killed_at": killed_at, "resumed": time.monotonic() - killed, "paused": paused}
        finally:
            await trainer.p2p.shutdown()

    return asyncio.run(main())


def test_six_nodes_joining_at_once_spread_over_three_stages(tmp_path):
    """Equal declared throughput, 3 stages, 6 nodes: the optimum is 2-2-2. The first node
    starts the run; the other five start together while it is still choosing. They may
    take second stages, as nodes do by default (up to two, here); those never move."""
    nodes: list[NodeProcess] = []
    with ExitStack() as stack:
        stack.callback(stop_all, nodes)
        a = launch_node(tmp_path, "a", "spread", extra=["--stages", "3", *FAST], two_stage=True)
        nodes.append(a)
        run = a.run_id
        started = time.monotonic()
        for name in "bcdef":
            nodes.append(
                launch_node(
                    tmp_path,
                    name,
                    run,
                    initial_peers=[a.maddr],
                    extra=FAST,
                    wait=False,
                    two_stage=True,
                )  # fmt: skip
            )
        # Six nodes starting at once on two loaded cores: a start took over 90 s at load 20.
        a.wait_serving(timeout=180)  # the run's spec is out: status may read it
        watch = stack.enter_context(StatusWatch(run, a.maddr))
        chosen = Counter(n.wait_serving(timeout=180) for n in nodes)  # each one's first stage
        all_serving = time.monotonic() - started

        def every_stage_served(view: dict) -> dict[str, int] | None:
            serving = _serving(view)
            return serving if len(serving) == 6 and set(serving.values()) == {0, 1, 2} else None

        def balanced(view: dict) -> Counter | None:
            counts = Counter(_serving(view).values())
            return counts if sorted(counts.values()) == [2, 2, 2] else None

        watch.wait(every_stage_served, 60, "all six nodes to serve, every stage served")
        covered = time.monotonic() - started
        watch.wait(balanced, 60, "the six nodes to settle at 2-2-2")
        settled = time.monotonic() - started
        moves = sum(len(_moves(n)) for n in nodes)
        two = sum(any(e["role"] == "second" for e in n.events("stage.held")) for n in nodes)
        print(
            f"stages taken at join: {dict(sorted(chosen.items()))}; every node serving after "
            f"{all_serving:.1f} s, every stage served after {covered:.1f} s, 2-2-2 after "
            f"{settled:.1f} s with {moves} moves; {two} nodes took a second stage"
        )
        assert all(n.alive() for n in nodes)


def test_a_stage_whose_peers_are_all_killed_is_refilled_and_training_resumes(tmp_path):
    """2 stages: c and d pinned to stage 1, a and b free (so both take stage 0), with
    rebalancing checks only every 10 minutes. A trainer runs micro-batches; c and d get
    SIGKILL. The emptied stage raises an alarm on a and b, which check at once: exactly
    one of them moves to stage 1 (the other may not: it would empty stage 0), downloads
    what it can, and the trainer's next micro-batches complete."""
    from node.rpc.dht import SwarmDHT

    nodes: list[NodeProcess] = []
    dht = None
    try:
        c = launch_node(tmp_path, "c", "refill", extra=["--stages", "2", "--stage", "1"])
        nodes.append(c)
        run = c.run_id
        # d serves before a and b start: a slow start (a loaded machine) must not leave
        # stage 1 looking like it holds one peer when they choose.
        d = launch_node(tmp_path, "d", run, initial_peers=[c.maddr], extra=["--stage", "1"])
        slow = ["--rebalance-period", "600"]  # only an alarm can move them within the test
        a = launch_node(tmp_path, "a", run, initial_peers=[c.maddr], extra=slow, wait=False)
        b = launch_node(tmp_path, "b", run, initial_peers=[c.maddr], extra=slow, wait=False)
        nodes += [d, a, b]
        # the trainer's DHT starts while they load (through a: c and d will be killed)
        dht = SwarmDHT.start(run, initial_peers=[a.wait_started()], host_maddrs=[LOCAL],
                             client_mode=True)  # fmt: skip
        # stage 0 is empty, or holds the other's claim while 1 holds two: both take 0
        assert [n.wait_serving(timeout=90) for n in nodes] == [1, 1, 0, 0]

        result = _train_across_kills(dht, [c, d], limit_s=90)  # both stages served
        moved = {n.name: _moves(n) for n in (a, b)}
        assert sorted(m for ms in moved.values() for m in ms) == [(0, 1)], moved
        mover = next(n for n in (a, b) if _moves(n))
        refill = _moved_at(mover) - result["killed_at"]
        print(
            f"stage 1 lost both peers; {mover.name} moved 0 -> 1 and served it {refill:.1f} s "
            f"after the kill (rebalance period 600 s: moved on the alarm; records live 3 s); the "
            f"trainer completed 8 micro-batches {result['resumed']:.1f} s after the kill "
            f"(paused {result['paused']} times on a stale route)"
        )
        # Its first periodic check came 300-900 s after it served: only an alarm moved it.
        served = mover.events("stage.held")[0]["t"]
        assert mover.events("placement.moved")[0]["t"] < served + 300.0
        assert a.alive() and b.alive()
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(nodes)


def test_a_two_stage_node_keeps_the_pipeline_going_when_the_other_stage_dies(tmp_path):
    """2 stages: c pinned to stage 1; b chooses its stage (0, which nobody holds) and, once
    it serves it, takes stage 1 as a second stage (the swarm has no two-stage peer yet).
    A trainer runs; c gets SIGKILL. Stage 1 is still served, by b, without a move or a
    download: the trainer's next micro-batches complete at once."""
    from node.rpc.dht import SwarmDHT

    nodes: list[NodeProcess] = []
    dht = None
    try:
        c = launch_node(tmp_path, "c", "twostage", extra=["--stages", "2", "--stage", "1"])
        nodes.append(c)
        run = c.run_id
        b = launch_node(tmp_path, "b", run, initial_peers=[c.maddr], two_stage=True)
        nodes.append(b)
        c.wait_serving(timeout=90)  # the run's spec is out: status may read it

        def both_served(view: dict) -> dict | None:
            two = [p for p in view["peers"] if p["second_serving"]]
            return two[0] if two else None

        with StatusWatch(run, c.maddr) as watch:
            assert b.wait_serving(timeout=90) == 0
            two = watch.wait(both_served, 60, "b to serve stage 1 as its second stage")
        assert (two["stage"], two["second_stage"]) == (0, 1), two
        assert [e["stage"] for e in b.events("stage.held") if e["role"] == "second"] == [1]
        dht = SwarmDHT.start(run, initial_peers=[b.maddr], host_maddrs=[LOCAL], client_mode=True)

        result = _train_across_kills(dht, [c], limit_s=30)
        print(
            f"stage 1's only one-stage peer was killed; b served it as its second stage and "
            f"the trainer completed 8 micro-batches {result['resumed']:.1f} s after the kill "
            f"(paused {result['paused']} times)"
        )
        assert _moves(b) == [] and b.alive()
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(nodes)


def test_bad_gossip_is_ignored_by_the_nodes(tmp_path):
    """a serves stage 0 and b stage 1 (pinned) of 3 stages. A peer of the test's own (a
    DHT whose p2pd runs GossipSub) publishes, again and again, claims that stage 2 holds
    a peer of 1e6 samples/s: with a bad signature, with an old sequence number of its own,
    signed for another run, and node a's genuine message sent under the test peer's name.
    Node c then joins: had it believed any of them it would not take the empty stage 2.
    Every node's log counts each kind as ignored."""
    from hivemind.utils import get_dht_time

    from node.rpc.dht import SwarmDHT
    from node.rpc.gossip import Gossip

    nodes: list[NodeProcess] = []
    dht = None
    try:
        a = launch_node(tmp_path, "a", "badgossip", extra=["--stages", "3", "--stage", "0"])
        nodes.append(a)
        run = a.run_id
        b = launch_node(tmp_path, "b", run, initial_peers=[a.maddr], extra=["--stage", "1"])
        nodes.append(b)
        a.wait_serving(timeout=90)
        b.wait_serving(timeout=90)
        key_path = tmp_path / "mallory.key"
        key = load_or_create_key(key_path)
        dht = SwarmDHT.start(
            run, initial_peers=[a.maddr], host_maddrs=[LOCAL], identity_path=key_path, pubsub=True
        )
        signer = GossipSigner(key, run)
        a_signer = GossipSigner(load_or_create_key(tmp_path / "a.key"), run)  # a's own key
        other_run = GossipSigner(key, "other-run")
        lie = 1e6
        reasons = (
            "bad signature",
            "old or repeated sequence number",
            "other run",
            "claimed peer is not the libp2p sender",
        )

        def forged(now: float) -> bytes:
            claim = JoinIntent(
                peer_id=peer_id_of(key.public_key()), run=run, version=PROTOCOL_VERSION,
                seqno=10**16, timestamp=now, stage=2, throughput=lie,
            )  # fmt: skip
            payload = claim.model_dump_json().encode()
            signature = Ed25519PrivateKey.generate().sign(b"swarmtrain/gossip\0" + payload)
            return msgpack.packb({"msg": payload, "sig": signature})

        async def main(c_box: list[NodeProcess]) -> float:
            gossip = await Gossip.create((await dht.replicate_p2p()).daemon_listen_maddr)
            topic = run_topic(run)
            try:
                for n in (a, b):
                    await gossip.connect(n.peer_id, [n.maddr.rsplit("/p2p/", 1)[0]])
                t0 = time.monotonic()
                while True:
                    c = c_box[0] if c_box else None
                    if c is not None and not c.alive():
                        raise AssertionError(f"node c exited:\n{c.output()[-3000:]}")
                    ready = c is not None and c.stage() is not None
                    if ready and all(_ignored(n).get(r) for n in (a, b, c) for r in reasons):
                        return time.monotonic() - t0
                    assert time.monotonic() - t0 < 90, {n.name: _ignored(n) for n in nodes}
                    now = get_dht_time()
                    replayed = signer.join(2, lie, now)  # older than the next one
                    # our genuine newest word first (a harmless claim), then the bad ones
                    await gossip.publish(topic, signer.load(0, 1.0, 0, now))
                    for raw in (
                        forged(now),
                        replayed,
                        other_run.join(2, lie, now),
                        a_signer.join(2, lie, now),
                    ):
                        await gossip.publish(topic, raw)
                    if not c_box and time.monotonic() - t0 > 2.0:  # a heartbeat: mesh formed
                        c_box.append(
                            launch_node(tmp_path, "c", run, initial_peers=[a.maddr], wait=False)
                        )
                        nodes.append(c_box[0])
                    await asyncio.sleep(0.2)
            finally:
                await gossip.close()

        c_box: list[NodeProcess] = []
        elapsed = asyncio.run(main(c_box))
        c = c_box[0]
        assert c.stage() == 2, c.output()[-3000:]
        print(
            f"c took the empty stage 2 despite {lie:.0e} samples/s of bad claims on it; "
            f"ignored counts after {elapsed:.1f} s: " + "; ".join(
                f"{n.name} {_ignored(n)}" for n in (a, b, c)
            )
        )  # fmt: skip
        assert all(n.alive() for n in nodes)
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(nodes)
