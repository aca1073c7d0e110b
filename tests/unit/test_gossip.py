"""The pure gossip message filter (``protocol.gossip``): signatures, senders, replays,
staleness, sizes and validators."""

from __future__ import annotations

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
from protocol.identity import peer_id_of
from protocol.records import MAX_CLOCK_SKEW_S, PROTOCOL_VERSION

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
