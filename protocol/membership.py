"""Who may take part in a private run: invites, the proofs peers present, revocations.

An invite is signed by the run's owner and expires. It names either one peer id (an
invite for a machine whose id the owner knows) or a *delegate* key whose private half
travels in the token (a bearer invite: whoever holds the token may join, as one peer).
A peer proves membership with its invite, plus, for a bearer invite, the delegate key's
signature of its own peer id. The proof can be shown to anyone: it names the peer, so a
copy lets nobody else in (records and RPCs are bound to the peer id that signs them or
opened the connection), and it never reveals the token's secret.

The owner revokes invites or peers with a signed ``Revocations`` record; the newest one
(by ``issued``) holds. ``MembershipPolicy.check`` is the one decision every peer applies
to every record, RPC and averaging partner of a private run. Public runs admit anyone.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass
from typing import Annotated

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.identity import peer_id_of, sign, verify
from protocol.ownership import check_owner
from protocol.records import (
    MAX_MEMBERSHIP_CHARS,
    PeerId,
    RecordError,
    RunName,
    first_error,
    unpack_signed,
)

TOKEN_PREFIX = "swarmtrain-invite:"
MAX_REVOKED = 1000  # entries of each kind in one Revocations record
_INVITE_DOMAIN = b"swarmtrain/invite"
_BINDING_DOMAIN = b"swarmtrain/invite-binding"
_REVOCATIONS_DOMAIN = b"swarmtrain/revocations"


class MembershipError(RecordError):
    """Not (or no longer) a member of a private run; the message says why."""


class Invite(BaseModel):
    """The owner's permission for one peer (or one bearer token) to join ``run`` until
    ``expires`` (a Unix time)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunName
    invite_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    peer_id: PeerId | None = None  # bound to this peer
    delegate: PeerId | None = None  # or: a bearer invite, usable with this key
    expires: Annotated[float, Field(ge=0, allow_inf_nan=False)]

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
class InviteToken:
    """A parsed invite token: the signed invite and, for a bearer invite, its secret."""

    invite: Invite
    payload: bytes  # the invite's signed bytes
    signature: bytes  # the owner's
    secret: bytes | None  # the delegate key's seed (bearer invites only)

    def proof(self, peer_id: str) -> str:
        """What peer ``peer_id`` shows others: base64 (it rides in its records). Only a
        peer with that id can use it: records and RPCs are bound to their sender."""
        if self.invite.peer_id is not None and self.invite.peer_id != peer_id:
            raise MembershipError(
                f"this invite is for peer {self.invite.peer_id}, and this node is {peer_id}: "
                "ask the owner for an invite for this node (or a bearer invite)"
            )
        fields = {"invite": self.payload, "sig": self.signature}
        if self.secret is not None:
            delegate = Ed25519PrivateKey.from_private_bytes(self.secret)
            fields["bind"] = sign(delegate, _BINDING_DOMAIN, peer_id.encode())
        return base64.b64encode(msgpack.packb(fields)).decode()


def issue_invite(
    owner_key: Ed25519PrivateKey, run: str, *, expires: float, peer_id: str | None = None
) -> str:
    """A signed invite token for ``run``: bound to ``peer_id``, or a bearer token."""
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
    """Who may take part in a run, as every peer of it decides."""

    run: str
    owner: str
    private: bool
    revocations: Revocations | None = None

    def check(self, peer_id: str, proof: str | None, now: float) -> Invite | None:
        """The peer's invite (None in a public run); ``MembershipError`` saying why a peer
        of a private run is not a member."""
        if not self.private:
            return None
        if proof is None:
            raise MembershipError(
                f"run {self.run!r} is private and peer {peer_id} showed no invite"
            )
        if not isinstance(proof, str) or len(proof) > MAX_MEMBERSHIP_CHARS:
            raise MembershipError(f"membership proof must be at most {MAX_MEMBERSHIP_CHARS} chars")
        try:
            raw = base64.b64decode(proof, validate=True)
        except (binascii.Error, ValueError):
            raise MembershipError("membership proof is not base64") from None
        fields = unpack_signed(raw, ("invite", "sig"), "membership proof", optional=("bind",))
        invite = _signed_invite(fields["invite"], fields["sig"], self.owner)
        if invite.run != self.run:
            raise MembershipError(f"peer {peer_id} was invited to run {invite.run!r}, not this one")
        if invite.peer_id is not None and invite.peer_id != peer_id:
            raise MembershipError(f"peer {peer_id} shows an invite for another peer")
        if invite.delegate is not None and not verify(
            invite.delegate, _BINDING_DOMAIN, peer_id.encode(), fields.get("bind", b"")
        ):
            raise MembershipError(f"peer {peer_id} shows a bearer invite not bound to itself")
        if now > invite.expires:
            raise MembershipError(
                f"the invite of peer {peer_id} expired {now - invite.expires:.0f} s ago"
            )
        revoked = self.revocations
        if revoked is not None and (
            peer_id in revoked.peers or invite.invite_id in revoked.invites
        ):
            raise MembershipError(f"the owner of run {self.run!r} revoked peer {peer_id}")
        return invite
