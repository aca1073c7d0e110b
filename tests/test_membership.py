"""Invites, membership proofs and revocations (protocol.membership): pure, no network."""

from __future__ import annotations

import base64

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.identity import peer_id_of
from protocol.membership import (
    MembershipError,
    MembershipPolicy,
    Revocations,
    decode_revocations,
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


def _proof(peer_id: str, token: str, owner: str = OWNER) -> str:
    return parse_invite_token(token, owner=owner).proof(peer_id)


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
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 60)
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
    theirs = issue_invite(STRANGER_KEY, make_run_id("lab", stranger), expires=NOW + 60)
    with pytest.raises(MembershipError, match="not signed by the owner"):
        parse_invite_token(theirs, owner=OWNER)
    with pytest.raises(MembershipError, match="not signed by the owner"):
        POLICY.check(ALICE, _proof(ALICE, theirs, owner=stranger), NOW)
    other_run = issue_invite(OWNER_KEY, make_run_id("other", OWNER), expires=NOW + 60)
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
    token = issue_invite(OWNER_KEY, RUN, expires=NOW + 60)
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
