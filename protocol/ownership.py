"""Run owners, and the run ids bound to them.

A run is created by an owner: an Ed25519 key that signs the run's spec, its invites and
its revocations. The run's id is ``NAME@FINGERPRINT``, the fingerprint a hash of the
owner's public key, so whoever knows the id can check that a spec (or an invite) comes
from the owner, and nobody else can publish one under that id. Owners are written like
peer ids (``12D3KooW…``: the public key itself, base58), so the identity module's
encoding and signatures serve for both.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocol.identity import IdentityError, peer_id_of, public_key_of
from protocol.records import RecordError, check_run_name

FINGERPRINT_CHARS = 24  # base32: 120 bits of the key's hash


def fingerprint(owner: str) -> str:
    """The short hash of an owner's public key that ends its runs' ids."""
    try:
        raw = public_key_of(owner).public_bytes(Encoding.Raw, PublicFormat.Raw)
    except IdentityError as e:
        raise RecordError(f"run owner: {e}") from None
    digest = hashlib.sha256(b"swarmtrain/owner\0" + raw).digest()
    return base64.b32encode(digest).decode().lower()[:FINGERPRINT_CHARS]


def make_run_id(name: str, owner: str) -> str:
    """``NAME@FINGERPRINT``: how peers name a run of ``owner``."""
    if "@" in check_run_name(name):
        raise ValueError(f"a run's name cannot contain '@' (got {name!r})")
    return f"{name}@{fingerprint(owner)}"


def check_run_id(run: str) -> str:
    """``run`` if it is a run id (``NAME@FINGERPRINT``); else ``RecordError`` saying so."""
    if "@" not in check_run_name(run):
        raise RecordError(
            f"run {run!r} names no owner: run ids are NAME@FINGERPRINT, as the run's "
            "first node printed it"
        )
    return run


def check_owner(run: str, owner: str | Ed25519PublicKey) -> None:
    """``RecordError`` unless ``run``'s id was made from ``owner``'s key."""
    if isinstance(owner, Ed25519PublicKey):
        owner = peer_id_of(owner)
    fp = check_run_id(run).partition("@")[2]
    if fp != fingerprint(owner):
        raise RecordError(f"run {run!r} does not belong to owner {owner}")
