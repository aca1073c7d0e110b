"""Peer identities: Ed25519 keys in libp2p's encoding, and the peer ids derived from them.

One key per node is both its libp2p identity (the ``p2pd`` daemon loads it) and the key
that signs its records. An Ed25519 peer id embeds the public key itself (an "identity"
multihash), so anyone can check a record against the peer id it claims, with no other
key exchange.
"""

from __future__ import annotations

from collections.abc import Sequence

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# libp2p's crypto.proto: KeyType Ed25519 = 1. Field 1 (varint) is the type, field 2 the bytes.
_PRIVATE_HEADER = bytes([0x08, 0x01, 0x12, 0x40])  # then 64 bytes: seed || public key
_PUBLIC_HEADER = bytes([0x08, 0x01, 0x12, 0x20])  # then 32 bytes: public key
_IDENTITY_MULTIHASH = bytes([0x00, len(_PUBLIC_HEADER) + 32])
_MAX_PEER_ID_CHARS = 64


class IdentityError(ValueError):
    """A key file or peer id is not an Ed25519 libp2p identity."""


def _public_bytes(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def encode_private_key(key: Ed25519PrivateKey) -> bytes:
    """The libp2p protobuf of ``key``, as ``p2pd -id`` reads it."""
    seed = key.private_bytes_raw()
    return _PRIVATE_HEADER + seed + _public_bytes(key.public_key())


def decode_private_key(data: bytes) -> Ed25519PrivateKey:
    if len(data) != len(_PRIVATE_HEADER) + 64 or not data.startswith(_PRIVATE_HEADER):
        raise IdentityError(
            f"not an Ed25519 libp2p private key ({len(data)} bytes; expected "
            f"{len(_PRIVATE_HEADER) + 64} starting with {_PRIVATE_HEADER.hex()})"
        )
    body = data[len(_PRIVATE_HEADER) :]
    key = Ed25519PrivateKey.from_private_bytes(body[:32])
    if _public_bytes(key.public_key()) != body[32:]:
        raise IdentityError("Ed25519 private key file is corrupt: its public half does not match")
    return key


def peer_id_of(public_key: Ed25519PublicKey) -> str:
    """The base58 libp2p peer id (``12D3KooW…``) of an Ed25519 public key."""
    return base58.b58encode(
        _IDENTITY_MULTIHASH + _PUBLIC_HEADER + _public_bytes(public_key)
    ).decode()


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The public key embedded in an Ed25519 peer id; ``IdentityError`` for any other id."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise IdentityError(f"peer id must be a short string, got {peer_id!r:.80}")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise IdentityError(f"peer id {peer_id!r} is not base58") from e
    prefix = _IDENTITY_MULTIHASH + _PUBLIC_HEADER
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise IdentityError(f"peer id {peer_id!r} is not an Ed25519 identity peer id")
    return Ed25519PublicKey.from_public_bytes(raw[len(prefix) :])


def sign(key: Ed25519PrivateKey, domain: bytes, payload: bytes) -> bytes:
    """Sign ``payload`` under a domain tag, so a signature for one kind of message can never
    be replayed as another."""
    return key.sign(domain + b"\0" + payload)


def verify(peer_id: str, domain: bytes, payload: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``payload`` was made by the key of ``peer_id``."""
    try:
        public_key_of(peer_id).verify(signature, domain + b"\0" + payload)
    except (InvalidSignature, IdentityError, ValueError):
        return False
    return True


# Peer ids all start with "12D3KooW" (an Ed25519 key's multihash): show at least that and
# 8 characters more, and more where two listed peers share a longer prefix.
MIN_PEER_PREFIX = 16


def short_peer_ids(peer_ids: Sequence[str], min_len: int = MIN_PEER_PREFIX) -> dict[str, str]:
    """Each id's shortest prefix of at least ``min_len`` characters that no other id of
    ``peer_ids`` starts with (the whole id if another one starts with all of it):
    what a person can pass back, e.g. to ``swarmtrain run revoke --peer``."""
    ids = sorted(set(peer_ids))
    result = {}
    for i, pid in enumerate(ids):
        neighbours = ids[max(0, i - 1) : i] + ids[i + 1 : i + 2]  # sorted: the nearest share most
        shared = max((_common_prefix(pid, o) for o in neighbours), default=0)
        result[pid] = pid[: max(min_len, shared + 1)]
    return result


def resolve_peer_prefix(prefix: str, peer_ids: Sequence[str]) -> str:
    """The one id of ``peer_ids`` that starts with ``prefix`` (an id itself matches
    exactly); ``ValueError`` saying why if none does or several do."""
    if not prefix:
        raise ValueError("an empty peer id prefix matches every peer")
    ids = set(peer_ids)
    if prefix in ids:
        return prefix
    matches = sorted(p for p in ids if p.startswith(prefix))
    if not matches:
        raise ValueError(f"no known peer id starts with {prefix!r}")
    if len(matches) > 1:
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise ValueError(
            f"{len(matches)} peer ids start with {prefix!r} ({shown}): give more of the id"
        )
    return matches[0]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
