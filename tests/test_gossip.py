"""Gossip: the pure message filter (``protocol.gossip``), the daemon wrapper
(``node.rpc.gossip``) on real ``p2pd`` daemons, and a third-party py-libp2p client
(``python -m scripts.watch_gossip``) following a swarm's topic.

The unit tests drive ``GossipView`` directly with no network and no clock. The live tests
start hivemind DHT processes on 127.0.0.1 whose daemons run GossipSub, wait on conditions
with deadlines, and re-publish until received (a message sent before the mesh forms can
be lost)."""

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
from pydantic import ValidationError

from protocol.assignment import Claim
from protocol.gossip import (
    MAX_GOSSIP_AGE_S,
    MAX_GOSSIP_BYTES,
    GossipError,
    GossipSigner,
    GossipView,
    Ignored,
    JoinIntent,
    Leaving,
    MoveIntent,
    decode_message,
    encode_message,
    run_topic,
)
from protocol.identity import encode_private_key, peer_id_of
from protocol.records import MAX_CLOCK_SKEW_S, PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parent.parent
RUN = "gossip-test"
NOW = 1_700_000_000.0


def _key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


def _pid(key: Ed25519PrivateKey) -> str:
    return peer_id_of(key.public_key())


def _join(key: Ed25519PrivateKey, seqno: int = 1, **overrides) -> JoinIntent:
    fields = dict(
        peer_id=_pid(key),
        run=RUN,
        version=PROTOCOL_VERSION,
        seqno=seqno,
        timestamp=NOW,
        stage=1,
        throughput=10.0,
    )
    return JoinIntent(**{**fields, **overrides})


def _refused(view: GossipView, raw: bytes, sender: str | None, now: float = NOW) -> GossipError:
    with pytest.raises(GossipError) as caught:
        view.receive(raw, sender, now)
    return caught.value


# ---- protocol.gossip: pure ----


def test_each_kind_round_trips_and_the_view_keeps_the_latest_per_peer():
    a, b = _key(1), _key(2)
    sa, sb = GossipSigner(a, RUN), GossipSigner(b, RUN)
    view = GossipView(RUN, num_stages=3)
    sent = [
        (sa, sa.join(0, 5.0, NOW)),
        (sb, sb.serving(2, 7.0, NOW)),
        (sa, sa.serving(0, 5.0, NOW + 1)),
        (sa, sa.load(0, 5.5, 3, NOW + 2)),
        (sb, sb.move(2, 1, 6.0, NOW + 3)),
    ]
    for signer, raw in sent:
        assert len(raw) < 1024
        message = view.receive(raw, signer.peer_id, NOW + 4)
        assert message.peer_id == signer.peer_id and message.run == RUN
    latest = view.latest
    assert latest[sa.peer_id].kind == "load" and latest[sa.peer_id].load == 3
    assert isinstance(latest[sb.peer_id], MoveIntent)
    assert view.claims() == sorted(
        [Claim(sa.peer_id, 0, 5.5, serving=True), Claim(sb.peer_id, 1, 6.0, serving=False)],
        key=lambda c: c.peer,
    )
    assert view.claims(exclude=[sa.peer_id]) == [Claim(sb.peer_id, 1, 6.0, serving=False)]
    view.receive(sb.leaving(1, NOW + 5), sb.peer_id, NOW + 5)
    assert view.leaving() == {sb.peer_id}
    assert [c.peer for c in view.claims()] == [sa.peer_id]
    assert not view.ignored
    with pytest.raises(TypeError):
        latest["x"] = None  # a read-only view of the view


def test_topic_is_per_run():
    assert run_topic("myrun") == "swarmtrain/myrun/assignment"
    assert run_topic("a") != run_topic("b")
    with pytest.raises(ValueError, match="run name"):
        run_topic("bad/run")


def test_forged_signature_is_ignored():
    a, mallory = _key(1), _key(9)
    view = GossipView(RUN)
    # signed by another key, claiming a's identity (the libp2p sender is a here too)
    payload = _join(a).model_dump_json().encode()
    forged = msgpack.packb({"msg": payload, "sig": mallory.sign(b"swarmtrain/gossip\0" + payload)})
    assert _refused(view, forged, _pid(a)).reason is Ignored.FORGED
    # a's genuine message with its content changed after signing
    genuine = msgpack.unpackb(encode_message(_join(a, throughput=1.0), a))
    genuine["msg"] = genuine["msg"].replace(b'"throughput":1.0', b'"throughput":1e6')
    err = _refused(view, msgpack.packb(genuine), _pid(a))
    assert err.reason is Ignored.FORGED and "not signed by that peer's key" in str(err)
    # a signature made for another kind of record (the domain tag differs)
    other_domain = msgpack.packb(
        {"msg": payload, "sig": a.sign(b"swarmtrain/peer-info\0" + payload)}
    )
    assert _refused(view, other_domain, _pid(a)).reason is Ignored.FORGED
    assert view.latest == {} and view.ignored[Ignored.FORGED] == 3


def test_replayed_or_old_sequence_numbers_are_ignored():
    a = _key(1)
    view = GossipView(RUN)
    newer = encode_message(_join(a, seqno=100, stage=2), a)
    older = encode_message(_join(a, seqno=50, stage=0), a)
    assert view.receive(newer, _pid(a), NOW).stage == 2
    err = _refused(view, newer, _pid(a))  # the same message again
    assert (
        err.reason is Ignored.REPLAYED
        and "100 of peer" in str(err)
        and "newer than 100" in str(err)
    )
    assert _refused(view, older, _pid(a)).reason is Ignored.REPLAYED  # reordered or replayed
    assert view.latest[_pid(a)].stage == 2  # never rolled back
    assert view.ignored == {Ignored.REPLAYED: 2}


def test_a_restarted_peer_is_not_taken_for_a_replay():
    """Its counter is lost, but sequence numbers start from the clock in microseconds."""
    a = _key(1)
    view = GossipView(RUN)
    first = GossipSigner(a, RUN)
    for i in range(3):
        view.receive(first.load(0, 5.0, i, NOW + i * 1e-7), _pid(a), NOW)  # same microsecond
    restarted = GossipSigner(a, RUN)
    assert view.receive(restarted.join(1, 5.0, NOW + 2.0), _pid(a), NOW + 2).kind == "join"


def test_other_run_and_other_version_are_ignored():
    a = _key(1)
    view = GossipView(RUN)
    other_run = encode_message(_join(a, run="other-run"), a)
    err = _refused(view, other_run, _pid(a))
    assert err.reason is Ignored.OTHER_RUN and "'other-run'" in str(err)
    other_version = encode_message(_join(a, version=PROTOCOL_VERSION + 1), a)
    assert _refused(view, other_version, _pid(a)).reason is Ignored.OTHER_VERSION
    assert view.latest == {}


def test_stale_and_future_messages_are_ignored():
    a = _key(1)
    view = GossipView(RUN)
    raw = encode_message(_join(a), a)
    err = _refused(view, raw, _pid(a), now=NOW + MAX_GOSSIP_AGE_S + 1)
    assert err.reason is Ignored.STALE and "61 s old" in str(err)
    err = _refused(view, raw, _pid(a), now=NOW - MAX_CLOCK_SKEW_S - 5)
    assert err.reason is Ignored.FUTURE
    assert view.receive(raw, _pid(a), NOW + MAX_GOSSIP_AGE_S - 1).seqno == 1


def test_too_large_and_malformed_messages_are_ignored():
    a = _key(1)
    view = GossipView(RUN)
    big = msgpack.packb({"msg": b"x" * MAX_GOSSIP_BYTES, "sig": b""})
    err = _refused(view, big, _pid(a))
    assert err.reason is Ignored.TOO_LARGE and str(MAX_GOSSIP_BYTES) in str(err)
    good = msgpack.unpackb(encode_message(_join(a), a))
    for raw in [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2]),
        msgpack.packb({"msg": good["msg"]}),  # no signature
        msgpack.packb({**good, "extra": b""}),
        msgpack.packb({"msg": b"{not json", "sig": good["sig"]}),
        msgpack.packb({"msg": good["msg"].replace(b'"join"', b'"teleport"'), "sig": good["sig"]}),
        msgpack.packb(
            {"msg": good["msg"].replace(b'"stage":1', b'"stage":-1'), "sig": good["sig"]}
        ),
    ]:
        assert _refused(view, raw, _pid(a)).reason is Ignored.MALFORMED, raw
    assert not view.latest and view.ignored[Ignored.MALFORMED] == 7


def test_claimed_peer_must_be_the_libp2p_sender():
    """A peer relaying (or replaying) another peer's genuine message under its own libp2p
    identity is ignored: the sender the router authenticated must be the peer named."""
    a, b = _key(1), _key(2)
    view = GossipView(RUN)
    raw = encode_message(_join(a), a)
    err = _refused(view, raw, _pid(b))
    assert err.reason is Ignored.WRONG_SENDER and _pid(b) in str(err)
    assert view.receive(raw, _pid(a), NOW).peer_id == _pid(a)


def test_stage_out_of_range_and_pluggable_validators():
    a, b = _key(1), _key(2)

    def members_only(message) -> None:
        if message.peer_id != _pid(a):
            raise ValueError(f"peer {message.peer_id} holds no invite")

    view = GossipView(RUN, num_stages=2, validators=[members_only])
    assert _refused(view, encode_message(_join(a, stage=2), a), _pid(a)).reason is (
        Ignored.OUT_OF_RANGE
    )
    err = _refused(view, encode_message(_join(b), b), _pid(b))
    assert err.reason is Ignored.REFUSED and "no invite" in str(err)
    assert view.receive(encode_message(_join(a), a), _pid(a), NOW).stage == 1


def test_expire_forgets_silent_peers():
    a, b = _key(1), _key(2)
    view = GossipView(RUN)
    view.receive(encode_message(_join(a), a), _pid(a), NOW)
    view.receive(encode_message(_join(b, timestamp=NOW + 30), b), _pid(b), NOW + 30)
    assert view.expire(NOW + MAX_GOSSIP_AGE_S + 1) == [_pid(a)]
    assert list(view.latest) == [_pid(b)]


def test_messages_validate_when_built():
    a = _key(1)
    with pytest.raises(ValidationError, match="must change stage"):
        MoveIntent(
            peer_id=_pid(a), run=RUN, version=1, seqno=1, timestamp=NOW,
            from_stage=1, to_stage=1, throughput=1.0,
        )  # fmt: skip
    with pytest.raises(ValidationError, match="Ed25519"):
        _join(a, peer_id="QmNotAnEd25519Peer")
    with pytest.raises(ValidationError):
        _join(a, throughput=float("nan"))
    with pytest.raises(ValidationError):
        _join(a, seqno=0)
    with pytest.raises(ValueError, match="another key"):
        encode_message(_join(a), _key(2))
    assert (
        Leaving(
            peer_id=_pid(a), run=RUN, version=1, seqno=1, timestamp=NOW, stage=None
        ).claimed_stage
        is None
    )
    assert decode_message(encode_message(_join(a), a), run=RUN, sender=None, now=NOW) == _join(a)


def test_protocol_gossip_does_not_import_hivemind():
    """``scripts.watch_gossip`` runs py-libp2p, which cannot share a process with
    hivemind (their protobuf descriptors collide)."""
    code = (
        "import sys, protocol.gossip; sys.exit(any(m.startswith('hivemind') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_daemon_pubsub_is_undone_on_exit():
    from hivemind.p2p import P2P

    from node.rpc.gossip import PUBSUB_FLAGS, daemon_pubsub

    before = P2P._make_process_args("p2pd", tls=True)
    with daemon_pubsub():
        assert P2P._make_process_args("p2pd", tls=True) == before + list(PUBSUB_FLAGS)
    assert P2P._make_process_args("p2pd", tls=True) == before
    with daemon_pubsub(enabled=False):
        assert P2P._make_process_args("p2pd", tls=True) == before


# ---- node.rpc.gossip on real daemons ----


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

    def bad_messages(now: float) -> list[bytes]:
        claim = _join(c.key, run=run, seqno=10**16, timestamp=now, throughput=lie)
        payload = claim.model_dump_json().encode()
        return [
            msgpack.packb({"msg": payload, "sig": _key(99).sign(b"swarmtrain/gossip\0" + payload)}),
            old,
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
                    for raw in bad_messages(now):
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

    from protocol.gossip import GossipError

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
