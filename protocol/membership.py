"""Who may take part in a private run: invites, the proofs peers present, revocations.

An invite is signed by the run's owner and expires. It names either one peer id (an
invite for a machine whose id the owner knows) or a *delegate* key whose private half
travels in the token (a bearer invite). A peer proves membership with its invite, plus,
for a bearer invite, the delegate key's signature of its own peer id and of the time it
first used the token (its *claim*). The proof can be shown to anyone: it names the peer,
so a copy lets nobody else in (records and RPCs are bound to the peer id that signs them
or opened the connection), and it never reveals the token's secret.

A bearer invite admits one peer: the first to use it. Its claim travels in its proof (so
in its records) and in a claim record in the DHT, which members keep storing until the
invite expires. Of the claims on one invite a peer knows, the lowest ``(time, peer id)``
holds, the same choice everywhere: a peer whose claim is beaten is refused ("this bearer
invite was already used by peer ..."), also when two used the token at the same moment.
A claim's time is the claimer's word, so a token is a secret: whoever else holds it
could claim it (with an earlier time, even); the owner then revokes the invite.

The owner revokes invites or peers with a signed ``Revocations`` record; the newest one
(by ``issued``) holds. ``MembershipPolicy.check`` is the one decision every peer applies
to every record, RPC and averaging partner of a private run. Public runs admit anyone.
"""

from __future__ import annotations

import base64
import binascii
import math
import secrets
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.identity import peer_id_of, sign, verify
from protocol.ownership import check_owner
from protocol.records import (
    MAX_CLOCK_SKEW_S,
    MAX_MEMBERSHIP_CHARS,
    PeerId,
    RecordError,
    RunName,
    check_peer_id,
    check_run_name,
    first_error,
    unpack_signed,
)

TOKEN_PREFIX = "swarmtrain-invite:"
MAX_REVOKED = 1000  # entries of each kind in one Revocations record
MAX_CLAIMED = 10_000  # bearer invites whose claims a peer tracks at once
_INVITE_DOMAIN = b"swarmtrain/invite"
_BINDING_DOMAIN = b"swarmtrain/invite-claim"  # the delegate signs (peer id, claim time)
_REVOCATIONS_DOMAIN = b"swarmtrain/revocations"


class MembershipError(RecordError):
    """Not (or no longer) a member of a private run; the message says why."""


class InviteClaimed(MembershipError):
    """A bearer invite shown by a peer that is not the one its winning claim binds."""

    def __init__(self, winner: str, loser: str) -> None:
        super().__init__(
            f"this bearer invite was already used by peer {winner} (not {loser}): a bearer "
            "invite admits one peer; ask the run's owner for another invite"
        )
        self.winner = winner


def claims_key(run: str) -> str:
    """Where the claims on a run's bearer invites live: subkeys ``INVITE_ID:PEER_ID``."""
    return f"swarmtrain/{check_run_name(run)}/claims"


class Invite(BaseModel):
    """The owner's permission for one peer (or one bearer token) to join ``run`` until
    ``expires`` (a Unix time)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunName
    invite_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    peer_id: PeerId | None = None  # bound to this peer
    delegate: PeerId | None = None  # or: a bearer invite, usable with this key
    expires: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    # When the owner issued it: a bearer invite cannot be claimed before (0: unknown).
    issued: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0

    def model_post_init(self, _context) -> None:
        if (self.peer_id is None) == (self.delegate is None):
            raise ValueError("an invite names exactly one of peer_id and delegate")


class Revocations(BaseModel):
    """The owner's list of revoked peers and invites; a newer record replaces an older."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunName
    owner: PeerId
    peers: Annotated[tuple[PeerId, ...], Field(max_length=MAX_REVOKED)] = ()
    invites: Annotated[tuple[str, ...], Field(max_length=MAX_REVOKED)] = ()
    issued: Annotated[float, Field(ge=0, allow_inf_nan=False)]

    def model_post_init(self, _context) -> None:
        check_owner(self.run, self.owner)


@dataclass(frozen=True)
class Claim:
    """Peer ``peer_id`` used bearer invite ``invite_id`` at ``at`` (its word, signed with the
    token's delegate key). Of the claims on one invite, the lowest ``order`` holds."""

    invite_id: str
    at: float
    peer_id: str
    expires: float  # the invite's
    proof: str  # the claimer's proof, which a claim record carries

    @property
    def order(self) -> tuple[float, str]:
        return (self.at, self.peer_id)

    @property
    def subkey(self) -> str:
        return f"{self.invite_id}:{self.peer_id}"


def encode_claim(claim: Claim, owner: str) -> bytes:
    """A claim record: the claimer's proof, and the owner (whose key checks the invite)."""
    return msgpack.packb({"proof": claim.proof.encode(), "owner": owner.encode()})


def decode_claim(raw: bytes, *, subkey: object, run: str) -> Claim:
    """Validate a claim record read from the network under ``subkey``; ``RecordError``
    unless it is a bearer claim of ``run``'s owner's invite by the peer the subkey names."""
    if not isinstance(subkey, str) or len(subkey) > 100 or subkey.count(":") != 1:
        raise RecordError("a claim's subkey is INVITE_ID:PEER_ID")
    invite_id, _, peer_id = subkey.partition(":")
    fields = unpack_signed(raw, ("proof", "owner"), "invite claim")
    try:
        owner, proof = fields["owner"].decode("ascii"), fields["proof"].decode("ascii")
        check_peer_id(owner)
        check_peer_id(peer_id)
    except ValueError as e:
        raise RecordError(f"malformed invite claim: {e}") from None
    check_owner(run, owner)
    _, claim = MembershipPolicy(run, owner, private=True).verify(peer_id, proof)
    if claim is None or claim.invite_id != invite_id:
        raise RecordError(f"the claim under {subkey!r} is not a claim on bearer invite {invite_id}")
    return claim


@dataclass(frozen=True)
class InviteToken:
    """A parsed invite token: the signed invite and, for a bearer invite, its secret."""

    invite: Invite
    payload: bytes  # the invite's signed bytes
    signature: bytes  # the owner's
    secret: bytes | None  # the delegate key's seed (bearer invites only)

    def proof(self, peer_id: str, at: float | None = None) -> str:
        """What peer ``peer_id`` shows others: base64 (it rides in its records). Only a
        peer with that id can use it: records and RPCs are bound to their sender. For a
        bearer invite it is also the peer's claim on the token, made ``at`` (default now)."""
        if self.invite.peer_id is not None and self.invite.peer_id != peer_id:
            raise MembershipError(
                f"this invite is for peer {self.invite.peer_id}, and this node is {peer_id}: "
                "ask the owner for an invite for this node (or a bearer invite)"
            )
        fields = {"invite": self.payload, "sig": self.signature}
        if self.secret is not None:
            when = struct.pack(">d", time.time() if at is None else at)
            delegate = Ed25519PrivateKey.from_private_bytes(self.secret)
            fields["bind"] = sign(delegate, _BINDING_DOMAIN, _claim_payload(peer_id, when))
            fields["at"] = when
        return base64.b64encode(msgpack.packb(fields)).decode()


def _claim_payload(peer_id: str, when: bytes) -> bytes:
    return peer_id.encode() + b"\n" + when


def issue_invite(
    owner_key: Ed25519PrivateKey,
    run: str,
    *,
    expires: float,
    peer_id: str | None = None,
    issued: float | None = None,
) -> str:
    """A signed invite token for ``run``: bound to ``peer_id``, or a bearer token; issued
    ``issued`` (default now)."""
    check_owner(run, owner_key.public_key())
    secret, delegate = None, None
    if peer_id is None:
        delegate_key = Ed25519PrivateKey.generate()
        secret = delegate_key.private_bytes_raw()
        delegate = peer_id_of(delegate_key.public_key())
    invite = Invite(
        run=run,
        invite_id=secrets.token_hex(8),
        peer_id=peer_id,
        delegate=delegate,
        expires=expires,
        issued=time.time() if issued is None else issued,
    )
    payload = invite.model_dump_json().encode()
    fields = {"invite": payload, "sig": sign(owner_key, _INVITE_DOMAIN, payload)}
    if secret is not None:
        fields["secret"] = secret
    return TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb(fields)).decode().rstrip("=")


def parse_invite_token(token: str, *, owner: str) -> InviteToken:
    """Check a token's form and the owner's signature (not its expiry: ``check`` does)."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise MembershipError(f"an invite token starts with {TOKEN_PREFIX!r}")
    body = token.removeprefix(TOKEN_PREFIX)
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise MembershipError("the invite token is not valid base64 (cut short?)") from None
    fields = unpack_signed(raw, ("invite", "sig"), "invite token", optional=("secret",))
    invite = _signed_invite(fields["invite"], fields["sig"], owner)
    secret = fields.get("secret")
    if (secret is None) != (invite.delegate is None):
        raise MembershipError("the invite token is incomplete: its secret does not match it")
    if secret is not None:
        try:
            delegate = Ed25519PrivateKey.from_private_bytes(secret)
        except ValueError:
            raise MembershipError("the invite token's secret is not a key") from None
        if peer_id_of(delegate.public_key()) != invite.delegate:
            raise MembershipError("the invite token's secret does not match its invite")
    return InviteToken(invite, fields["invite"], fields["sig"], secret)


def _signed_invite(payload: bytes, signature: bytes, owner: str) -> Invite:
    try:
        invite = Invite.model_validate_json(payload)
    except ValidationError as e:
        raise MembershipError(f"malformed invite: {first_error(e, 'invite')}") from None
    if not verify(owner, _INVITE_DOMAIN, payload, signature):
        raise MembershipError(f"the invite is not signed by the owner of run {invite.run!r}")
    return invite


def sign_revocations(owner_key: Ed25519PrivateKey, revocations: Revocations) -> bytes:
    payload = revocations.model_dump_json().encode()
    return msgpack.packb({"record": payload, "sig": sign(owner_key, _REVOCATIONS_DOMAIN, payload)})


def decode_revocations(raw: bytes, *, run: str) -> Revocations:
    """Validate a revocation record read from the network (its owner must own ``run``)."""
    fields = unpack_signed(raw, ("record", "sig"), "revocation record")
    try:
        revocations = Revocations.model_validate_json(fields["record"])
    except ValidationError as e:
        raise RecordError(f"malformed revocation record: {first_error(e)}") from None
    except RecordError as e:
        raise RecordError(f"revocation record: {e}") from None
    if revocations.run != run:
        raise RecordError(f"revocation record is for run {revocations.run!r}, not {run!r}")
    if not verify(revocations.owner, _REVOCATIONS_DOMAIN, fields["record"], fields["sig"]):
        raise RecordError("revocation record is not signed by the run's owner")
    return revocations


@dataclass(frozen=True)
class MembershipPolicy:
    """Who may take part in a run, as every peer of it decides. ``claims`` holds, for each
    bearer invite, the winning claim this peer knows of (``with_claims`` adds more)."""

    run: str
    owner: str
    private: bool
    revocations: Revocations | None = None
    # Never mutated: ``with_claims`` returns a new policy (a plain dict: policies travel
    # to the averager's process).
    claims: Mapping[str, Claim] = field(default_factory=dict, hash=False, compare=False)

    def check(self, peer_id: str, proof: str | None, now: float) -> Invite | None:
        """The peer's invite (None in a public run); ``MembershipError`` saying why a peer
        of a private run is not a member."""
        return self.admit(peer_id, proof, now)[0]

    def admit(
        self, peer_id: str, proof: str | None, now: float
    ) -> tuple[Invite | None, Claim | None]:
        """``check``, also returning the peer's claim if it shows a bearer invite (for
        re-checking later, as other claims become known: ``beaten``)."""
        if not self.private:
            return None, None
        if proof is None:
            raise MembershipError(
                f"run {self.run!r} is private and peer {peer_id} showed no invite"
            )
        invite, claim = self.verify(peer_id, proof)
        if now > invite.expires:
            raise MembershipError(
                f"the invite of peer {peer_id} expired {now - invite.expires:.0f} s ago"
            )
        revoked = self.revocations
        if revoked is not None and (
            peer_id in revoked.peers or invite.invite_id in revoked.invites
        ):
            raise MembershipError(f"the owner of run {self.run!r} revoked peer {peer_id}")
        if claim is not None:
            if claim.at > now + MAX_CLOCK_SKEW_S:
                raise MembershipError(f"peer {peer_id} claims its bearer invite in the future")
            winner = self.beaten(claim)
            if winner is not None:
                raise InviteClaimed(winner.peer_id, peer_id)
        return invite, claim

    def verify(self, peer_id: str, proof: str) -> tuple[Invite, Claim | None]:
        """The invite in ``proof`` if it is the owner's, for this run, and for ``peer_id``
        (and, for a bearer invite, the peer's claim on it); ``MembershipError`` if not.
        Neither time nor revocations nor other claims count here."""
        if not isinstance(proof, str) or len(proof) > MAX_MEMBERSHIP_CHARS:
            raise MembershipError(f"membership proof must be at most {MAX_MEMBERSHIP_CHARS} chars")
        try:
            raw = base64.b64decode(proof, validate=True)
        except (binascii.Error, ValueError):
            raise MembershipError("membership proof is not base64") from None
        fields = unpack_signed(raw, ("invite", "sig"), "membership proof", optional=("bind", "at"))
        invite = _signed_invite(fields["invite"], fields["sig"], self.owner)
        if invite.run != self.run:
            raise MembershipError(f"peer {peer_id} was invited to run {invite.run!r}, not this one")
        if invite.peer_id is not None:
            if invite.peer_id != peer_id:
                raise MembershipError(f"peer {peer_id} shows an invite for another peer")
            return invite, None
        when = fields.get("at", b"")
        at = struct.unpack(">d", when)[0] if len(when) == 8 else math.nan
        if not verify(
            invite.delegate, _BINDING_DOMAIN, _claim_payload(peer_id, when), fields.get("bind", b"")
        ):
            raise MembershipError(f"peer {peer_id} shows a bearer invite not bound to itself")
        if not (math.isfinite(at) and at >= invite.issued - MAX_CLOCK_SKEW_S):
            raise MembershipError(
                f"peer {peer_id} claims its bearer invite before the owner issued it"
            )
        return invite, Claim(invite.invite_id, at, peer_id, invite.expires, proof)

    def beaten(self, claim: Claim) -> Claim | None:
        """The known claim that holds instead of ``claim`` (another peer's, earlier), or
        None if ``claim``'s peer holds its invite as far as this peer knows."""
        winner = self.claims.get(claim.invite_id)
        if winner is None or winner.peer_id == claim.peer_id or winner.order > claim.order:
            return None
        return winner

    def with_claims(self, claims: Iterable[Claim]) -> MembershipPolicy:
        """This policy knowing ``claims`` (verified ones) too; itself if nothing changes."""
        known = dict(self.claims)
        for claim in claims:
            held = known.get(claim.invite_id)
            if held is None and len(known) >= MAX_CLAIMED:
                continue
            if held is None or claim.order < held.order:
                known[claim.invite_id] = claim
        if known == self.claims:
            return self
        return replace(self, claims=known)
