"""The node's view of the DHT: hivemind's ``DHT`` behind a small surface.

Only this module (and the servicers that attach to its P2P) touch hivemind's DHT. Every
record read is validated here; invalid ones are dropped and logged, never returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from node.child_process import die_with_parent
from node.frame_cap import cap_hivemind_frames
from node.gossip import daemon_pubsub
from protocol.keys import peers_key, revocations_key, spec_key
from protocol.membership import MembershipPolicy, Revocations, decode_revocations
from protocol.records import (
    MAX_RECORD_AGE_S,
    PeerInfo,
    RecordError,
    decode_peer_info,
    encode_peer_info,
)
from protocol.run_spec import SignedSpec, decode_run_spec

logger = logging.getLogger(__name__)

SPEC_TTL_S = 3600.0  # every node re-stores the spec (and revocations), so they outlive
# their creator
REVOCATIONS_TTL_S = 365 * 86400.0


class DHTStartError(RuntimeError):
    """The DHT process did not come up."""


class RunRecordValidator(RecordValidatorBase):
    """Refuses to store or return a run's records that do not validate (hivemind calls this
    in the DHT process for every record it is asked to store or receives from a peer).

    hivemind validates a dictionary value read from a peer as a whole: one entry refused
    drops every entry that peer returned. So a verdict here must not turn from yes to no
    while a record sits in an honest peer's storage, or one record going stale would hide
    all the run's peers. Hence no age limit here; instead a peer record must expire from
    the DHT within ``MAX_RECORD_AGE_S`` of its timestamp, which at store time also refuses
    anything stale, and a record can never outlive its freshness. (``SwarmDHT.peers``
    checks the age of each record it returns, one by one.)"""

    def __init__(self, run: str) -> None:
        self.run = run
        self._peers_id = DHTID.generate(source=peers_key(run)).to_bytes()
        self._spec_id = DHTID.generate(source=spec_key(run)).to_bytes()
        self._revoked_id = DHTID.generate(source=revocations_key(run)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in (self._peers_id, self._spec_id, self._revoked_id):
            return True  # other subsystems' keys (e.g. averaging) are theirs to check
        try:
            value = DHTProtocol.serializer.loads(record.value)
            if record.key == self._spec_id:
                decode_run_spec(value, run=self.run)
            elif record.key == self._revoked_id:
                decode_revocations(value, run=self.run)
            else:
                subkey = DHTProtocol.serializer.loads(record.subkey)
                info = decode_peer_info(
                    value, subkey=subkey, run=self.run, now=get_dht_time(), max_age_s=math.inf
                )
                if record.expiration_time > info.timestamp + MAX_RECORD_AGE_S:
                    raise RecordError(
                        f"record of peer {info.peer_id} expires "
                        f"{record.expiration_time - info.timestamp:.0f} s after it is dated "
                        f"(limit {MAX_RECORD_AGE_S:.0f} s): it would go stale in storage"
                    )
        except Exception as e:  # anything a peer sends that we cannot read is refused
            logger.warning("refused a DHT record of run %s: %s", self.run, e)
            return False
        return True


class _OwnedDHT(hivemind.DHT):
    """hivemind's DHT process, tied to the process that started it: when a node dies, even
    by SIGKILL, its DHT process (and with it ``p2pd``) dies too, as a dead peer must. Its
    stream reads are capped (``node.frame_cap``)."""

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        cap_hivemind_frames()
        super().run()


class SwarmDHT:
    """A node's (or a client's) membership in one run's DHT.

    Once the run's spec is known, ``policy`` says who is a member: in a private run,
    records of peers without a valid invite are dropped as they are read."""

    def __init__(self, dht: hivemind.DHT, run: str) -> None:
        self.dht = dht
        self.run = run
        self.policy: MembershipPolicy | None = None
        self._dropped: set[str] = set()  # reasons already logged

    @classmethod
    def start(
        cls,
        run: str,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: Path | None = None,
        client_mode: bool = False,
        startup_timeout_s: float = 60.0,
        pubsub: bool = False,
    ) -> SwarmDHT:
        """Start hivemind's DHT (in its own process) and join ``initial_peers``, if any.

        Blocking, and to be called from the main thread: the DHT process is forked, and a
        fork from a worker thread of a running uvloop can leave the child unable to start
        its ``p2pd`` (seen as a node that hangs at start)."""
        kwargs = {
            "initial_peers": list(initial_peers),
            "host_maddrs": list(host_maddrs),
            "announce_maddrs": list(announce_maddrs) or None,
            "client_mode": client_mode,
            "record_validators": [RunRecordValidator(run)],
            "start": False,
        }
        if identity_path is not None:
            # hivemind's "identity taken" check only understands RSA keys; ours are Ed25519.
            kwargs.update(identity_path=str(identity_path), check_if_identity_free=False)
        dht = _OwnedDHT(**kwargs)
        try:
            with daemon_pubsub(pubsub):  # forked inside: its p2pd runs GossipSub (node.gossip)
                dht.run_in_background(await_ready=True, timeout=startup_timeout_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            dht.terminate()
            raise DHTStartError(
                f"hivemind's DHT did not start within {startup_timeout_s:.0f} s"
            ) from None
        return cls(dht, run)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def replicate_p2p(self) -> hivemind.P2P:
        """A P2P handle in this process on the DHT's daemon: same peer id, for RPCs."""
        return await self.dht.replicate_p2p()

    async def publish_peer(self, info: PeerInfo, key: Ed25519PrivateKey, ttl_s: float) -> bool:
        """Store ``info`` for ``ttl_s`` seconds, but never past ``MAX_RECORD_AGE_S`` after its
        timestamp (peers refuse to store a record that would go stale before it expires)."""
        expiration = min(get_dht_time() + ttl_s, info.timestamp + MAX_RECORD_AGE_S)
        return await self.dht.store(
            peers_key(self.run),
            subkey=info.peer_id,
            value=encode_peer_info(info, key),
            expiration_time=expiration,
            return_future=True,
        )

    async def peers(self) -> list[PeerInfo]:
        """The run's peer records that validate (and, in a private run, whose peers show a
        valid invite); the rest are logged and dropped."""
        found = await self.dht.get(peers_key(self.run), latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now, result = get_dht_time(), []
        for subkey, item in found.value.items():
            try:
                info = decode_peer_info(
                    item.value, subkey=subkey, run=self.run, now=now, max_age_s=MAX_RECORD_AGE_S
                )
                if self.policy is not None:
                    self.policy.check(info.peer_id, info.membership, now)
                result.append(info)
            except RecordError as e:
                self._log_dropped(e)
        return result

    def _log_dropped(self, e: RecordError) -> None:
        """Warn once per distinct reason (records are re-read every second or so)."""
        reason = str(e)
        if reason in self._dropped:
            logger.debug("dropped a peer record: %s", reason)
            return
        if len(self._dropped) >= 1000:
            self._dropped.clear()
        self._dropped.add(reason)
        logger.warning("dropped a peer record: %s", reason)

    async def publish_spec(self, signed: SignedSpec) -> bool:
        return await self._publish_owned(spec_key(self.run), signed.raw)

    async def _publish_owned(self, key: str, raw: bytes) -> bool:
        """Store an owner-signed record as it is (peers verify the owner's signature)."""
        expiration = get_dht_time() + SPEC_TTL_S
        return await self.dht.store(key, raw, expiration_time=expiration, return_future=True)

    async def spec(self) -> SignedSpec | None:
        found = await self.dht.get(spec_key(self.run), latest=True, return_future=True)
        if found is None:
            return None
        try:
            return decode_run_spec(found.value, run=self.run)
        except RecordError as e:
            logger.warning("dropped the run spec: %s", e)
            return None

    async def wait_for_spec(self, timeout_s: float) -> SignedSpec | None:
        """The run's spec, polling the DHT until it appears; None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (spec := await self.spec()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return spec

    async def known_peers(self) -> int:
        """How many DHT peers this node's routing table holds: 0 until it has reached one
        (so a lookup that finds nothing may just have asked nobody)."""
        return await self.dht.run_coroutine(_routing_table_size, return_future=True)

    def use_spec(self, spec) -> None:
        """From now on, read records as members of ``spec``'s run see them."""
        self.policy = spec.membership

    async def publish_revocations(self, revocations: Revocations, raw: bytes) -> bool:
        """Store the owner's revocations. They expire a fixed time after they were issued,
        so a node re-storing an older list can never outlast a newer one (hivemind keeps
        the value that expires last)."""
        return await self.dht.store(
            revocations_key(self.run),
            raw,
            expiration_time=revocations.issued + REVOCATIONS_TTL_S,
            return_future=True,
        )

    async def revocations(self) -> tuple[Revocations, bytes] | None:
        """The owner's latest revocations and their signed bytes, if any were published."""
        found = await self.dht.get(revocations_key(self.run), latest=True, return_future=True)
        if found is None:
            return None
        try:
            return decode_revocations(found.value, run=self.run), found.value
        except RecordError as e:
            logger.warning("dropped a revocation record: %s", e)
            return None

    async def refresh_revocations(self, *, restore: bool = False) -> None:
        """Apply the owner's latest revocations to ``policy``; with ``restore`` (a serving
        node, periodically) store them again, so that they outlive the owner's presence."""
        found = await self.revocations()
        if found is None or self.policy is None:
            return
        revocations, raw = found
        if restore:
            await self.publish_revocations(revocations, raw)
        current = self.policy.revocations
        if current is None or revocations.issued > current.issued:
            self.policy = dataclasses.replace(self.policy, revocations=revocations)
            logger.info(
                "the owner revoked %d peers and %d invites",
                len(revocations.peers),
                len(revocations.invites),
            )

    def shutdown(self) -> None:
        """Stop the DHT process and its ``p2pd`` (blocking, about a second)."""
        self.dht.shutdown()


async def _routing_table_size(_dht: hivemind.DHT, node: hivemind.DHTNode) -> int:
    """Run in the DHT process (``DHT.run_coroutine``): the size of its routing table."""
    return len(node.protocol.routing_table.uid_to_peer_id)
