"""Joining a run, one sequence for every command that joins one (``swarmtrain node``,
``train``, ``status``, ``export``, ``generate``): find the run's signed spec in the DHT (or
bring it), learn the owner's revocations, prove membership with an invite (the owner's
machine makes its own: ``member_invite``), and claim a bearer invite. A member that serves
no stage but downloads stages' state (``export``) announces itself (``announce_member``).

A run started by name on its owner's machine keeps the spec it was created with
(``owned_spec``: ``runs/RUN_ID.spec.json`` beside the owner key), since a run's spec never
changes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from node.files import load_or_create_key, write_atomic
from node.rpc.dht import SwarmDHT
from node.rpc.membership import prove_membership
from protocol.identity import peer_id_of
from protocol.membership import issue_invite
from protocol.ownership import fingerprint
from protocol.records import (
    MAX_RECORD_AGE_S,
    PROTOCOL_VERSION,
    PeerInfo,
    PeerState,
    RecordError,
)
from protocol.run_spec import (
    RunSpec,
    SignedSpec,
    read_spec_file,
    sign_run_spec,
    spec_differences,
    spec_file_text,
)

# Once a peer is reached, how long a run's spec may stay unfound before the run is taken
# not to exist (lookups that find nothing while peers answer are definitive).
SPEC_GRACE_S = 5.0
OWN_INVITE_S = 30 * 86400.0  # an owner's machine invites itself for this long


class NodeError(RuntimeError):
    """The node cannot start or continue, for a reason a person can act on."""


def no_such_run(run: str) -> str:
    """What ``node``, ``train`` and ``status`` say when the peers they reached know no
    spec for ``run``: one wording for one situation."""
    return (
        f"no run {run!r} found: the run's peers that were reached know no spec for it. Is "
        "the run id right (NAME@FINGERPRINT, as the owner's node prints it), and do "
        "--initial-peers name a node of that run?"
    )


def no_peer_reached(run: str, timeout_s: float) -> str:
    """What they say when no DHT peer could be reached to look ``run`` up."""
    return (
        f"no peer reached to look up run {run!r} within {timeout_s:.0f} s: give "
        "--initial-peers of a node of that run"
    )


async def find_spec(
    dht: SwarmDHT, timeout_s: float = 30.0, grace_s: float = SPEC_GRACE_S
) -> SignedSpec:
    """The run's signed spec from the DHT, else ``NodeError`` (one message for every
    command: ``no_such_run`` or ``no_peer_reached``).

    While the DHT knows no peer, lookups are retried for up to ``timeout_s``. Once it knows
    one (a DHT started with ``initial_peers`` has pinged at least one), a lookup that finds
    nothing is an answer: the run does not exist there. It is retried for ``grace_s`` only
    (a store in flight, a peer slow to answer), so a wrong run id fails within seconds."""
    loop = asyncio.get_running_loop()
    deadline, definitive = loop.time() + timeout_s, math.inf
    while True:
        signed = await dht.spec()
        if signed is not None:
            return signed
        now = loop.time()
        if definitive == math.inf and await dht.known_peers() > 0:
            definitive = now + grace_s
        if now >= definitive:
            raise NodeError(no_such_run(dht.run))
        if now >= deadline:
            raise NodeError(no_peer_reached(dht.run, timeout_s))
        await asyncio.sleep(0.5)


def owned_spec(
    owner_key_path: Path, key: Ed25519PrivateKey, spec: RunSpec, recorded_wins: Iterable[str] = ()
) -> SignedSpec:
    """The signed spec of the run ``spec`` describes, as its owner created it: the one
    recorded at creation (``runs/RUN_ID.spec.json`` beside the owner key) if its settings
    are ``spec``'s, or ``spec`` signed and recorded now if the run is new. ``ValueError``
    naming the difference if the run was created with other settings. ``recorded_wins``:
    settings (``RunSpec`` fields) the caller did not choose, only defaulted: a recorded
    run keeps its own (a run created under older defaults restarts as it was)."""
    path = owner_key_path.expanduser().parent / "runs" / f"{spec.run}.spec.json"
    if path.exists():
        try:
            recorded = read_spec_file(path.read_text())
        except (OSError, RecordError) as e:
            raise ValueError(f"cannot read the record of run {spec.run} at {path}: {e}") from None
        kept = {name: getattr(recorded.spec, name) for name in recorded_wins}
        changes = spec_differences(recorded.spec, spec.model_copy(update=kept))
        if changes:
            raise ValueError(
                f"run {spec.run} exists with other settings (this changes "
                f"{'; '.join(changes)}; it was created as {path}): a run's spec never "
                "changes, so start a new run under a new name"
            )
        return recorded
    signed = sign_run_spec(spec, key)
    write_atomic(path, spec_file_text(signed).encode())
    return signed


@dataclass(frozen=True)
class Joined:
    """What joining a run gave: its signed spec and this peer's proof of membership (None
    in a public run)."""

    signed: SignedSpec
    membership: str | None

    @property
    def spec(self) -> RunSpec:
        return self.signed.spec


async def join_run(
    dht: SwarmDHT,
    invite_for: Callable[[RunSpec], str | None],
    *,
    signed: SignedSpec | None = None,
    spec_timeout_s: float = 30.0,
) -> Joined:
    """Join the run ``dht`` is in: publish ``signed`` (a node that brings the spec) or find
    the spec (``find_spec``), use it, read the revocations, prove membership with the
    invite ``invite_for(spec)`` returns, and claim it if it is a bearer invite (first claim
    wins). ``NodeError`` naming the reason when this peer cannot join."""
    if signed is not None:
        await dht.publish_spec(signed)
    else:
        signed = await find_spec(dht, spec_timeout_s)
    dht.use_spec(signed.spec)
    await dht.refresh_revocations()
    try:
        membership = prove_membership(dht.policy, dht.peer_id, invite_for(signed.spec))
        await dht.claim_invite(dht.peer_id, membership)
    except RecordError as e:  # not a member, or a bearer invite someone else claimed
        raise NodeError(f"this peer cannot join: {e}") from None
    return Joined(signed, membership)


def owner_key_of(owner_key_path: Path, run: str) -> Ed25519PrivateKey | None:
    """The owner key of ``run`` if ``owner_key_path`` holds it (its fingerprint is the run
    id's), else None."""
    path = owner_key_path.expanduser()
    if not path.exists():
        return None
    owner_key = load_or_create_key(path)
    if fingerprint(peer_id_of(owner_key.public_key())) != run.partition("@")[2]:
        return None
    return owner_key


def member_invite(
    invite: str | None, owner_key_path: Path, peer_id: str
) -> Callable[[RunSpec], str | None]:
    """The invite ``peer_id`` shows to join a run (``join_run``'s ``invite_for``):
    ``invite``, or in a private run one bound to ``peer_id`` that the run's owner key makes
    when ``owner_key_path`` holds it: the run's owner needs no invite. None otherwise (a
    public run, or a private one that then refuses us, saying how to get an invite)."""

    def invite_for(spec: RunSpec) -> str | None:
        if invite is not None or not spec.private:
            return invite
        owner_key = owner_key_of(owner_key_path, spec.run)
        if owner_key is None:
            return None
        expires = get_dht_time() + OWN_INVITE_S
        return issue_invite(owner_key, spec.run, expires=expires, peer_id=peer_id)

    return invite_for


async def announce_member(
    dht: SwarmDHT, joined: Joined, key: Ed25519PrivateKey, state: PeerState = PeerState.JOINING
) -> None:
    """Publish the record of a member that serves no stage (an export), valid for
    ``MAX_RECORD_AGE_S``; ``key`` is ``dht``'s identity. It holds no stage and declares no
    throughput, so routing and placement count it nowhere; it shows our proof of
    membership, which is what a private run's averagers check before they hand a peer
    their state (``node.averaging.process``). ``state`` ``LEAVING`` says we are done.
    ``NodeError`` if the DHT stored it nowhere."""
    now = get_dht_time()
    info = PeerInfo(
        peer_id=dht.peer_id,
        run=joined.spec.run,
        version=PROTOCOL_VERSION,
        device="none (serves no stage)",
        throughput=(0.0,) * joined.spec.n_stages,
        throughput_source="declared",
        bandwidth_up_mbps=0.0,
        bandwidth_down_mbps=0.0,
        bandwidth_source="unknown",
        stage=None,
        state=state,
        load=0,
        timestamp=now,
        membership=joined.membership,
        started=now,
        ttl_s=MAX_RECORD_AGE_S,
    )
    if not await dht.publish_peer(info, key):
        raise NodeError(f"could not store this peer's record in the DHT of run {dht.run}")
