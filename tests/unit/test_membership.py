"""Invites, membership proofs, bearer claims and revocations (protocol.membership), and the
RPC gate that applies them (node.rpc.membership): pure, no network."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time
from types import SimpleNamespace

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from node.rpc.membership import MembershipGate
from protocol.identity import peer_id_of
from protocol.membership import (
    InviteClaimed,
    MembershipError,
    MembershipPolicy,
    Revocations,
    decode_claim,
    decode_revocations,
    encode_claim,
    issue_invite,
    parse_invite_token,
    sign_revocations,
)
from protocol.ownership import make_run_id
from protocol.records import RecordError

NOW = 1_700_000_000.0


def _key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


OWNER_KEY, STRANGER_KEY = _key(7), _key(8)
OWNER = peer_id_of(OWNER_KEY.public_key())
RUN = make_run_id("lab", OWNER)
ALICE, BOB = peer_id_of(_key(1).public_key()), peer_id_of(_key(2).public_key())
POLICY = MembershipPolicy(RUN, OWNER, private=True)


def _proof(peer_id: str, token: str, owner: str = OWNER, at: float = NOW) -> str:
    return parse_invite_token(token, owner=owner).proof(peer_id, at)


def test_an_invite_for_a_peer_admits_that_peer_only():
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 60, peer_id=ALICE)
    invite = POLICY.check(ALICE, _proof(ALICE, token), NOW)
    assert invite.peer_id == ALICE
    with pytest.raises(MembershipError, match="this invite is for peer"):
        _proof(BOB, token)
    # Bob showing Alice's proof (copied from her records) is not admitted.
    with pytest.raises(MembershipError, match="shows an invite for another peer"):
        POLICY.check(BOB, _proof(ALICE, token), NOW)


def test_a_bearer_invite_binds_to_whoever_uses_it_and_its_proof_cannot_be_reused():
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 60, issued=NOW)
    assert POLICY.check(BOB, _proof(BOB, token), NOW).delegate is not None
    with pytest.raises(MembershipError, match="not bound to itself"):
        POLICY.check(ALICE, _proof(BOB, token), NOW)
    # The proof does not carry the token's secret.
    assert b"secret" not in base64.b64decode(_proof(BOB, token))


def test_expired_revoked_and_missing_invites_are_refused():
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 60, peer_id=ALICE)
    proof = _proof(ALICE, token)
    with pytest.raises(MembershipError, match="expired 40 s ago"):
        POLICY.check(ALICE, proof, NOW + 100)
    with pytest.raises(MembershipError, match="showed no invite"):
        POLICY.check(ALICE, None, NOW)
    invite_id = parse_invite_token(token, owner=OWNER).invite.invite_id
    for revoked in (
        Revocations(run=RUN, owner=OWNER, peers=(ALICE,), issued=NOW),
        Revocations(run=RUN, owner=OWNER, invites=(invite_id,), issued=NOW),
    ):
        policy = MembershipPolicy(RUN, OWNER, True, revoked)
        with pytest.raises(MembershipError, match="revoked peer"):
            policy.check(ALICE, proof, NOW)


def test_invites_not_from_the_owner_or_for_another_run_are_refused():
    stranger = peer_id_of(STRANGER_KEY.public_key())
    with pytest.raises(ValueError, match="does not belong to owner"):
        issue_invite(STRANGER_KEY, RUN, expires=NOW + 60, peer_id=ALICE)
    # A stranger's invite to its own run of the same name does not open ours.
    theirs = issue_invite(STRANGER_KEY, make_run_id("lab", stranger), expires=NOW + 60, issued=NOW)
    with pytest.raises(MembershipError, match="not signed by the owner"):
        parse_invite_token(theirs, owner=OWNER)
    with pytest.raises(MembershipError, match="not signed by the owner"):
        POLICY.check(ALICE, _proof(ALICE, theirs, owner=stranger), NOW)
    other_run = issue_invite(OWNER_KEY, make_run_id("other", OWNER), expires=NOW + 60, issued=NOW)
    with pytest.raises(MembershipError, match="was invited to run"):
        POLICY.check(ALICE, _proof(ALICE, other_run), NOW)


@pytest.mark.parametrize(
    ("mangle", "what"),
    [
        (lambda t: t.replace("swarmtrain-invite:", "invite:"), "starts with"),
        (lambda t: t[:40], "invite token"),
        (lambda t: t[:-3] + ("A" if t[-3] != "A" else "B") + t[-2:], "invite"),
        (lambda t: "swarmtrain-invite:" + "!" * 10, "base64"),
    ],
)
def test_a_mangled_token_is_refused_with_a_reason(mangle, what):
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 60, issued=NOW)
    with pytest.raises(RecordError, match=what):
        parse_invite_token(mangle(token), owner=OWNER)


@pytest.mark.parametrize(
    "proof",
    ["", "%%%", base64.b64encode(b"\x01\x02").decode(), "A" * 5000,
     base64.b64encode(msgpack.packb({"invite": b"{}", "sig": b""})).decode()],
)  # fmt: skip
def test_a_malformed_proof_is_refused(proof):
    with pytest.raises(RecordError):
        POLICY.check(ALICE, proof, NOW)


def test_a_public_run_admits_anyone():
    assert MembershipPolicy(RUN, OWNER, private=False).check(ALICE, None, NOW) is None


def test_revocations_must_come_from_the_runs_owner():
    good = Revocations(run=RUN, owner=OWNER, peers=(ALICE,), issued=NOW)
    assert decode_revocations(sign_revocations(OWNER_KEY, good), run=RUN) == good
    with pytest.raises(RecordError, match="not signed by the run's owner"):
        decode_revocations(sign_revocations(STRANGER_KEY, good), run=RUN)
    with pytest.raises(RecordError, match="is for run"):
        decode_revocations(sign_revocations(OWNER_KEY, good), run=make_run_id("x", OWNER))
    stranger = peer_id_of(STRANGER_KEY.public_key())
    raw = msgpack.unpackb(sign_revocations(STRANGER_KEY, good))
    raw["record"] = raw["record"].replace(OWNER.encode(), stranger.encode())
    with pytest.raises(RecordError, match="does not belong to owner"):
        decode_revocations(msgpack.packb(raw), run=RUN)


# --- bearer invites admit one peer: the first to claim it ---------------------------------

CAROL = peer_id_of(_key(3).public_key())


def _claim(peer_id: str, token: str, at: float):
    return POLICY.verify(peer_id, _proof(peer_id, token, at=at))[1]


def test_a_bearer_invite_admits_only_the_first_peer_to_use_it():
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 600, issued=NOW)
    first, later = _claim(ALICE, token, NOW + 1), _claim(BOB, token, NOW + 2)
    # Whatever order a peer learns the claims in, it keeps the same one.
    for order in ([first, later], [later, first]):
        policy = POLICY.with_claims(order)
        assert policy.check(ALICE, first.proof, NOW + 3).invite_id == first.invite_id
        with pytest.raises(InviteClaimed, match=f"already used by peer {ALICE}"):
            policy.check(BOB, later.proof, NOW + 3)
        # A third identity, later still, is refused too; the first may restart (a new
        # proof, made later, from the same peer id).
        with pytest.raises(InviteClaimed):
            policy.check(CAROL, _proof(CAROL, token, at=NOW + 100), NOW + 100)
        assert policy.check(ALICE, _proof(ALICE, token, at=NOW + 100), NOW + 100)
    # Two at the same moment: the lower peer id holds, everywhere.
    tie = [_claim(p, token, NOW + 5) for p in (ALICE, BOB)]
    low, high = sorted([ALICE, BOB])
    policy = POLICY.with_claims(tie)
    assert policy.check(low, _proof(low, token, at=NOW + 5), NOW + 6)
    with pytest.raises(InviteClaimed):
        policy.check(high, _proof(high, token, at=NOW + 5), NOW + 6)
    # A peer that knows no claim yet admits the peer that shows one (it learns it next).
    assert POLICY.check(BOB, later.proof, NOW + 3)


def test_a_claim_dated_outside_its_invite_is_refused():
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 600, issued=NOW)
    with pytest.raises(MembershipError, match="before the owner issued it"):
        POLICY.verify(ALICE, _proof(ALICE, token, at=NOW - 3600))
    with pytest.raises(MembershipError, match="expired"):
        POLICY.check(ALICE, _proof(ALICE, token, at=NOW + 601), NOW + 601)
    with pytest.raises(MembershipError, match="in the future"):
        POLICY.check(ALICE, _proof(ALICE, token, at=NOW + 500), NOW)
    # The claim time is signed: changing it breaks the binding.
    fields = msgpack.unpackb(base64.b64decode(_proof(ALICE, token, at=NOW + 10)))
    fields["at"] = struct.pack(">d", NOW + 1)
    with pytest.raises(MembershipError, match="not bound to itself"):
        POLICY.check(ALICE, base64.b64encode(msgpack.packb(fields)).decode(), NOW + 20)


def test_claim_records_round_trip_and_refuse_what_is_not_a_claim():
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 600, issued=NOW)
    claim = _claim(ALICE, token, NOW + 1)
    raw = encode_claim(claim, OWNER)
    assert decode_claim(raw, subkey=claim.subkey, run=RUN) == claim
    stranger = peer_id_of(STRANGER_KEY.public_key())
    peer_bound = issue_invite(OWNER_KEY, RUN, expires=NOW + 600, peer_id=ALICE)
    bound_proof = _proof(ALICE, peer_bound)
    for bad_raw, subkey, what in [
        (raw, f"{claim.invite_id}:{BOB}", "not bound to itself"),  # another peer's slot
        (raw, f"{'0' * 16}:{ALICE}", "not a claim on bearer invite"),
        (raw, ALICE, "INVITE_ID:PEER_ID"),
        (raw, 12345, "INVITE_ID:PEER_ID"),
        (raw, f"{claim.invite_id}:x", "malformed invite claim"),
        (encode_claim(claim, stranger), claim.subkey, "does not belong to owner"),
        (msgpack.packb({"proof": bound_proof.encode(), "owner": OWNER.encode()}),
         f"{claim.invite_id}:{ALICE}", "not a claim on bearer invite"),
        (msgpack.packb({"proof": b"A" * 20_000, "owner": OWNER.encode()}), claim.subkey,
         "exceeds the limit"),
        (msgpack.packb({"proof": b"\xff", "owner": OWNER.encode()}), claim.subkey, "malformed"),
        (b"\xc1", claim.subkey, "not valid msgpack"),
        ("text", claim.subkey, "must be bytes"),
    ]:  # fmt: skip
        with pytest.raises(RecordError, match=what):
            decode_claim(bad_raw, subkey=subkey, run=RUN)
    with pytest.raises(RecordError, match="does not belong to owner"):
        decode_claim(raw, subkey=claim.subkey, run=make_run_id("other", stranger))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.one_of(st.text(max_size=120), st.integers(), st.none()))
def test_arbitrary_claim_records_decode_or_raise_record_error(raw, subkey):
    with contextlib.suppress(RecordError):
        decode_claim(raw, subkey=subkey, run=RUN)


def test_the_gate_refuses_a_bearer_peer_once_it_learns_of_an_earlier_claim():
    """Two peers used one token at once and each was admitted before the claims spread:
    once the gate's policy knows the earlier claim, the later peer's calls are refused."""
    now = time.time()
    token = issue_invite(OWNER_KEY, RUN, expires=now + 600, issued=now - 60)
    policy = [POLICY]
    gate = MembershipGate(lambda: policy[0])
    later = _proof(BOB, token, at=now - 5)

    async def present_as(peer_id: str, proof: str) -> None:
        context = SimpleNamespace(remote_id=PeerID.from_base58(peer_id))
        await gate.rpc_present(runtime_pb2.ExpertRequest(metadata=proof.encode()), context)

    asyncio.run(present_as(BOB, later))
    assert gate.refusal(BOB) is None
    policy[0] = POLICY.with_claims([_claim(ALICE, token, now - 10)])
    assert f"already used by peer {ALICE}" in gate.refusal(BOB)
    with pytest.raises(MembershipError, match="already used"):
        asyncio.run(present_as(BOB, later))
    asyncio.run(present_as(ALICE, _proof(ALICE, token, at=now - 10)))
    assert gate.refusal(ALICE) is None
