"""Peer identities: Ed25519 keys in libp2p's encoding, and the peer ids derived from them.

One key per node is both its libp2p identity (the ``p2pd`` daemon loads it) and the key
that signs its records. An Ed25519 peer id embeds the public key itself (an "identity"
multihash), so anyone can check a record against the peer id it claims, with no other
key exchange.
"""

from __future__ import annotations

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
