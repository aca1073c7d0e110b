"""Gossip on real ``p2pd`` daemons (``node.rpc.gossip``), and a third-party py-libp2p
client (``python -m scripts.watch_gossip``) following a swarm's topic, its forgeries
ignored."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.gossip import (
    GossipError,
    GossipSigner,
    GossipView,
    Ignored,
    encode_message,
    run_topic,
)
from protocol.identity import encode_private_key
from tests.unit.test_gossip import RUN, _join, _key, _pid

ROOT = Path(__file__).resolve().parents[2]


def test_protocol_gossip_does_not_import_hivemind():
    """``scripts.watch_gossip`` runs py-libp2p, which cannot share a process with
    hivemind (their protobuf descriptors collide)."""
    code = (
        "import sys, protocol.gossip; sys.exit(any(m.startswith('hivemind') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


class _Node:
    """A hivemind DHT process whose p2pd runs GossipSub, with the key it signs with."""

    def __init__(self, key: Ed25519PrivateKey, dht) -> None:
        self.key, self.dht = key, dht
        self.peer_id = dht.peer_id
        assert self.peer_id == _pid(key)

    async def gossip(self):
        from node.rpc.gossip import Gossip

        return await Gossip.create((await self.dht.replicate_p2p()).daemon_listen_maddr)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> list[_Node]:
    """Three nodes on 127.0.0.1 (DHT processes with real p2pd daemons), shared by the live
    tests of this module, each test on a run topic of its own."""
    from node.rpc.dht import SwarmDHT

    nodes: list[_Node] = []
    try:
        for seed in (11, 12, 13):
            key = _key(seed)
            path = tmp_path_factory.mktemp("gossip") / "identity.key"
            path.write_bytes(encode_private_key(key))
            initial = nodes[0].dht.visible_maddrs() if nodes else ()
            dht = SwarmDHT.start(
                RUN,
                initial_peers=initial,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                identity_path=path,
                pubsub=True,
            )
            nodes.append(_Node(key, dht))
        yield nodes
    finally:
        for node in nodes:
            node.dht.shutdown()


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll ``check`` until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.02)


def test_a_daemon_without_pubsub_fails_the_self_test_naming_hivemind():
    import hivemind
    from hivemind.p2p import P2P

    from node.rpc.gossip import Gossip, GossipUnavailable

    async def main():
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            with pytest.raises(GossipUnavailable, match="does not run pubsub") as caught:
                await Gossip.create(p2p.daemon_listen_maddr)
            assert f"hivemind {hivemind.__version__}" in str(caught.value)
        finally:
            await p2p.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_gossip_on_a_live_daemon(swarm):
    """Refuses what the daemon would drop silently; topics, topic peers and connect."""
    from node.rpc.gossip import MAX_PUBLISH_BYTES, GossipUnavailable

    async def main():
        async with await swarm[0].gossip() as gossip, await swarm[1].gossip() as other:
            assert gossip.peer_id == swarm[0].peer_id
            with pytest.raises(ValueError, match="silently drops"):
                await gossip.publish("swarmtrain/x/assignment", b"\0" * (MAX_PUBLISH_BYTES + 1))
            with pytest.raises(ValueError, match="topic"):
                await gossip.publish("", b"x")
            await gossip.publish("swarmtrain/x/assignment", b"\0" * MAX_PUBLISH_BYTES)
            assert await gossip.topics() == []
            await other.connect(swarm[0].peer_id)  # known to the daemon through the DHT
            async with await gossip.subscribe("swarmtrain/x/assignment") as subscription:
                assert await gossip.topics() == ["swarmtrain/x/assignment"]
                await other.subscribe("swarmtrain/x/assignment")
                assert swarm[1].peer_id in await gossip.wait_for_peers(subscription.topic)
                for delay in (0.0, 0.0002, 0.0005, 0.001, 0.002):  # cut requests short
                    task = asyncio.create_task(gossip.publish(subscription.topic, b"x"))
                    await asyncio.sleep(delay)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    # the next answer is this request's, not the one cut short
                    assert await gossip.topics() == [subscription.topic]

            async def unsubscribed() -> bool:
                return await gossip.topics() == []

            # the daemon unsubscribes once it sees the subscription's connection closed
            await _eventually(unsubscribed, 5, "closing the subscription unsubscribes")
            with pytest.raises(ConnectionError):
                await other.connect(_pid(_key(77)), timeout_s=2)  # nobody has this identity
        with pytest.raises(GossipUnavailable, match="closed"):
            await gossip.publish("swarmtrain/x/assignment", b"x")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_nodes_exchange_signed_messages_and_ignore_bad_ones(swarm):
    """Three daemons on one run topic, all publishing signed ``Serving`` messages. Node c
    also publishes a message with a bad signature, an old sequence number of its own, one
    for another run, and one of node a's (a genuine signature, but c is the sender): a
    and b accept the valid messages and ignore each of the others, with its reason."""
    from hivemind.utils import get_dht_time

    from node.rpc.gossip import receive_run

    run, lie = "gossip-live", 666.0
    topic = run_topic(run)
    a, b, c = swarm
    signers = {n.peer_id: GossipSigner(n.key, run) for n in swarm}
    # c's first word, a join intent; its serving messages that follow all have larger seqnos
    old = signers[c.peer_id].join(0, 5.0, get_dht_time())

    def bad_messages(now: float, views: dict[str, GossipView]) -> list[bytes]:
        claim = _join(c.key, run=run, seqno=10**16, timestamp=now, throughput=lie)
        payload = claim.model_dump_json().encode()
        # gossipsub keeps no order between paths (direct, relayed, asked for after IHAVE):
        # c's old join is a replay only to a peer that already holds one of c's later messages
        replay = all(c.peer_id in views[n.peer_id].latest for n in (a, b))
        return [
            msgpack.packb({"msg": payload, "sig": _key(99).sign(b"swarmtrain/gossip\0" + payload)}),
            *([old] if replay else []),
            encode_message(claim.model_copy(update={"run": "other-run"}), c.key),
            GossipSigner(a.key, run).load(0, lie, 0, now),
        ]

    def done(views: dict[str, GossipView]) -> bool:
        for n in (a, b):
            latest, ignored = views[n.peer_id].latest, views[n.peer_id].ignored
            if {p for p, m in latest.items() if m.kind == "serving"} != {p.peer_id for p in swarm}:
                return False
            if not all(
                ignored[r] for r in (Ignored.FORGED, Ignored.OTHER_RUN, Ignored.WRONG_SENDER)
            ):
                return False
            if ignored[Ignored.REPLAYED] < 2:
                return False
        return True

    async def main() -> float:
        views = {n.peer_id: GossipView(run, num_stages=3) for n in swarm}
        accepted: dict[str, list] = {n.peer_id: [] for n in swarm}
        gossips = [await n.gossip() for n in swarm]
        try:
            subscriptions = [await g.subscribe(topic) for g in gossips]

            async def follow(node: _Node, subscription) -> None:
                async for message in receive_run(subscription, views[node.peer_id], get_dht_time):
                    accepted[node.peer_id].append(message)

            async with asyncio.TaskGroup() as tasks:
                for node, subscription in zip(swarm, subscriptions, strict=True):
                    tasks.create_task(follow(node, subscription))
                t0 = time.monotonic()
                while not done(views):  # re-publish until received: the mesh takes a heartbeat
                    assert time.monotonic() - t0 < 60, {
                        p[-6:]: (dict(v.ignored), {k[-6:]: m.kind for k, m in v.latest.items()})
                        for p, v in views.items()
                    }
                    now = get_dht_time()
                    for stage, (node, gossip) in enumerate(zip(swarm, gossips, strict=True)):
                        await gossip.publish(topic, signers[node.peer_id].serving(stage, 5.0, now))
                    for raw in bad_messages(now, views):
                        await gossips[2].publish(topic, raw)
                    await asyncio.sleep(0.2)
                elapsed = time.monotonic() - t0
                for subscription in subscriptions:
                    await subscription.close()  # ends the followers
        finally:
            for gossip in gossips:
                await gossip.close()
        for n in (a, b):
            got = accepted[n.peer_id]
            assert all(m.run == run and m.throughput != lie for m in got), got
            assert not [m for m in got if m.peer_id == c.peer_id and m.kind == "join"]
            print(
                n.peer_id[-6:], "ignored", {str(k): v for k, v in views[n.peer_id].ignored.items()}
            )
        return elapsed

    elapsed = asyncio.run(asyncio.wait_for(main(), 120))
    print(f"every valid message arrived and every bad one was ignored within {elapsed:.2f} s")


@pytest.mark.parametrize("security", ["noise", "tls"])
def test_a_py_libp2p_client_follows_the_gossip_and_its_forgeries_are_ignored(swarm, security):
    """``scripts.watch_gossip`` (py-libp2p, another process: it cannot share one with
    hivemind) dials node a over noise or TLS, then yamux, and joins the run's topic over
    /meshsub/1.1.0. It must receive the signed messages of a and of b (relayed by a), and
    the join intents it forges (valid libp2p envelope, garbage swarmtrain signature) must
    reach both nodes and be ignored by them."""
    from hivemind.utils import get_dht_time

    run = f"gossip-interop-{security}"
    topic = run_topic(run)
    a, b = swarm[0], swarm[1]
    signers = {n.peer_id: GossipSigner(n.key, run) for n in (a, b)}

    async def main() -> dict:
        gossips = [await n.gossip() for n in (a, b)]
        views = {n.peer_id: GossipView(run) for n in (a, b)}
        verdicts: dict[str, list[tuple[str, str]]] = {n.peer_id: [] for n in (a, b)}
        watcher: dict = {"ready": None, "connected": None, "accepted": set(), "forged": 0}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "scripts.watch_gossip", "--run", run, "--json", "--forge",
            "--connect", a.dht.visible_maddrs()[0], "--duration", "120", "--security", security,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        try:
            subscriptions = [await g.subscribe(topic) for g in gossips]

            async def follow(node: _Node, subscription) -> None:
                async for d in subscription:
                    try:
                        views[node.peer_id].receive(d.data, d.sender, get_dht_time())
                        verdicts[node.peer_id].append((d.sender, "accepted"))
                    except GossipError as e:
                        verdicts[node.peer_id].append((d.sender, e.reason))

            async def read_watcher() -> None:
                async for line in proc.stdout:
                    event = json.loads(line)
                    if event["event"] == "connected":
                        watcher["connected"] = event
                    elif event["event"] == "ready":
                        watcher["ready"] = event["peer_id"]
                    elif event["event"] == "accepted":
                        watcher["accepted"].add(event["sender"])
                    elif event["event"] == "forged":
                        watcher["forged"] += 1

            def done() -> bool:
                me = watcher["ready"]
                return watcher["accepted"] >= {a.peer_id, b.peer_id} and all(
                    (me, Ignored.FORGED) in verdicts[n.peer_id] for n in (a, b)
                )

            async with asyncio.TaskGroup() as tasks:
                for node, subscription in zip((a, b), subscriptions, strict=True):
                    tasks.create_task(follow(node, subscription))
                reader = tasks.create_task(read_watcher())
                t0 = time.monotonic()
                while not done():
                    if time.monotonic() - t0 > 90 or reader.done():
                        proc.kill()
                        stderr = (await proc.stderr.read()).decode(errors="replace")
                        raise AssertionError(
                            f"watcher {watcher}, nodes {verdicts}\n{stderr[-3000:]}"
                        )
                    now = get_dht_time()
                    for node, gossip in zip((a, b), gossips, strict=True):
                        await gossip.publish(topic, signers[node.peer_id].serving(0, 5.0, now))
                    await asyncio.sleep(0.25)
                watcher["seconds"] = time.monotonic() - t0
                proc.terminate()
                for subscription in subscriptions:
                    await subscription.close()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            for gossip in gossips:
                await gossip.close()
        assert watcher["connected"] == {
            "event": "connected",
            "security": {"noise": "/noise", "tls": "/tls/1.0.0"}[security],
            "peer": a.peer_id,
            "muxer": "Yamux",
            "pubsub": "/meshsub/1.1.0",
        }
        for n in (a, b):  # nothing the watcher sent was accepted
            assert (watcher["ready"], "accepted") not in verdicts[n.peer_id]
        return watcher

    watcher = asyncio.run(asyncio.wait_for(main(), 150))
    print(
        f"py-libp2p client {watcher['ready'][-6:]} ({security}) received a's and b's "
        f"messages, and its {watcher['forged']} forgeries were ignored, "
        f"{watcher['seconds']:.1f} s after start"
    )
