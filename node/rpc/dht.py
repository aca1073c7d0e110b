"""The node's view of the DHT: hivemind's ``DHT`` behind a small surface.

Only this module (and the servicers that attach to its P2P) touch hivemind's DHT. Every
record read is validated here; invalid ones are dropped and logged, never returned.

Besides one run's keys, every node (and client) validates the run directory, the one key
of no run where public runs announce themselves (``protocol.announce``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TypeVar

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from node import events
from node.cli.maddrs import (
    check_announce_maddr,
    check_can_listen,
    check_listen_maddr,
    check_peer_maddr,
)
from node.log_budget import LogBudget
from node.rpc.child_process import die_with_parent
from node.rpc.gossip import PUBSUB_FLAGS
from node.rpc.hivemind_compat import (
    DHTCompat,
    become_dht_server,
    cap_frames,
    install,
    p2pd_options,
    routing_table_size,
    serve_averaging,
)
from node.rpc.relay import RelaySettings
from protocol.announce import (
    MAX_ANNOUNCE_AGE_S,
    RunAnnouncement,
    decode_announcement,
    encode_announcement,
)
from protocol.archive import ArchiveRecord, decode_archive, encode_archive
from protocol.keys import RUNS_KEY, archives_key, peers_key, revocations_key, spec_key
from protocol.membership import (
    Claim,
    MembershipPolicy,
    Revocations,
    claims_key,
    decode_claim,
    decode_revocations,
    encode_claim,
)
from protocol.progress import decode_progress_record, progress_key
from protocol.records import (
    MAX_CLOCK_SKEW_S,
    MAX_RECORD_AGE_S,
    MAX_STAGES,
    PeerBounds,
    PeerInfo,
    RecordError,
    decode_peer_info,
    encode_peer_info,
    expires_at,
)
from protocol.routing import refresh_period
from protocol.run_spec import (
    SignedSpec,
    decode_run_spec,
    earliest_spec,
    spec_differences,
)

logger = logging.getLogger(__name__)
R = TypeVar("R", PeerInfo, ArchiveRecord)

SPEC_TTL_S = 3600.0  # every node re-stores the spec (and revocations), so they outlive
# their creator
REVOCATIONS_TTL_S = 365 * 86400.0
MAX_SPECS = 16  # specs read under one run id (only its owner can sign one)
MAX_CLAIMS = 1000  # claim records read at once
# A node reads the run's peers from several places (trainer, placement, watch, averaging),
# each about once per second; a read this recent is shared, and longer in a large run
# (``protocol.routing.refresh_period``: up to 8 x as long past 64 peers). Each read costs
# every peer that answers it, and the reader's DHT process, all of the run's records:
# under a flood of records, unshared reads crowd out the node's own work.
PEERS_FRESH_S = 0.5
MAX_ACCEPTED = 8192  # records a validator remembers having accepted
CLAIM_SETTLE_S = 2.0  # after publishing a claim: how long others' claims have to show up
# What a DHT's p2pd does about relays unless told (``node.rpc.relay``): it offers one, with
# small limits, and reserves slots on none.
CLIENT_RELAY = RelaySettings(use=False)


def peers_fresh_s(listed: int) -> float:
    """How long a whole read of a run's peers that listed ``listed`` is shared."""
    return refresh_period(PEERS_FRESH_S, listed)


class SpecConflict(RecordError):
    """The DHT holds a different, earlier spec under this run id: a run's spec never changes."""


def spec_subkey(raw: bytes) -> str:
    """Each spec signed for a run id has its own slot (the hash of its signed bytes), so
    readers see every one and all keep the same (``earliest_spec``)."""
    return hashlib.sha256(raw).hexdigest()[:32]


class DHTStartError(RuntimeError):
    """The DHT process did not come up, for a reason said in one line."""


def _check_addresses(
    initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str]
) -> None:
    """Refuse addresses that cannot work before any process starts."""
    try:
        for m in initial_peers:
            check_peer_maddr(m)
        for m in announce_maddrs:
            check_announce_maddr(m)
        for m in host_maddrs:
            check_listen_maddr(m)
            check_can_listen(m)
    except ValueError as e:
        raise DHTStartError(str(e)) from None


def _start_failure(e: BaseException, initial_peers: Sequence[str], host_maddrs: Sequence[str]):
    """What went wrong, in one line, from the daemon's error (hivemind's P2PDaemonError
    carries p2pd's own last line)."""
    text = " ".join(str(e).split())
    text = re.sub(r"^Daemon failed to start:\s*", "", text)
    text = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*", "", text)  # p2pd's timestamp
    if "failed to connect to bootstrap peers" in text:
        peers = ", ".join(initial_peers)
        return (
            f"cannot reach any initial peer ({peers}): is a node of the run running at that "
            "address, and is its port open to this machine? (a node prints its address at start)"
        )
    if m := re.search(r"local time must be within .*local: ([\d.]+), peer: ([\d.]+)", text):
        ahead = float(m.group(1)) - float(m.group(2))
        return (
            f"this machine's clock is {abs(ahead):.1f} s {'ahead of' if ahead > 0 else 'behind'} "
            "an initial peer's, and peers refuse a clock more than 3 s off theirs (averaging "
            "needs well under 1 s): turn on time synchronization (timedatectl set-ntp true) "
            "and start again"
        )
    if "failed to listen" in text:
        reason = m.group(1) if (m := re.search(r"bind: ([^\]]+)", text)) else text
        return (
            f"cannot listen on {', '.join(host_maddrs)}: {reason}; choose another address "
            "in --host-maddrs (tcp/0 takes any free port)"
        )
    return f"the p2p daemon did not start: {text or type(e).__name__}"


def _socket_dir() -> str:
    """A private directory (mode 0700) for one DHT's daemon sockets, short enough for a
    socket path (about 100 bytes at most)."""
    base = tempfile.gettempdir()
    if len(base) > 40 or not re.fullmatch(r"[\w./-]+", base):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="hivemind-", dir=base)


class RunRecordValidator(RecordValidatorBase):
    """Refuses to store or return a run's records that do not validate (hivemind calls this
    in the DHT process for every record it is asked to store or receives from a peer).

    hivemind validates a dictionary value read from a peer as a whole: one entry refused
    drops every entry that peer returned. So a verdict here must not turn from yes to no
    while a record sits in an honest peer's storage, or one record going stale would hide
    all the run's peers. Hence no age limit here; instead a peer record must expire from
    the DHT within ``MAX_RECORD_AGE_S`` of its timestamp, which at store time also refuses
    anything stale, and a record can never outlive its freshness. (``SwarmDHT.peers``
    checks the age of each record it returns, one by one.)

    Once it has seen the run's spec (every node reads it as it joins; the owner's node
    stores it), peer records must also fit the run (``PeerBounds``): with records sized
    for 256 stages and a private run's proof, a thousand forged ones would make the run's
    one peers value larger than a DHT response can carry (4 MiB), and no reader would
    see any peer. A spec seen once is kept, so the verdict only turns stricter in the
    seconds between a node's start and its reading of the spec."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.bounds: PeerBounds | None = None  # from the earliest spec seen
        self._specs: list[SignedSpec] = []
        # Peer and archive records accepted, as stored, and when each is dated: every read
        # of the run's peers brings them all again, and a verdict to accept turns only if
        # the clock goes back past the record's date (bounds only tighten, and then this
        # is forgotten).
        self._accepted: dict[tuple[bytes, bytes, bytes, float], float] = {}
        # A flood of bad records is a line each for the first few, then a count a minute.
        self._refusals_logged = LogBudget(f"DHT records of run {run} refused")
        self._peers_id = DHTID.generate(source=peers_key(run)).to_bytes()
        self._spec_id = DHTID.generate(source=spec_key(run)).to_bytes()
        self._revoked_id = DHTID.generate(source=revocations_key(run)).to_bytes()
        self._claims_id = DHTID.generate(source=claims_key(run)).to_bytes()
        self._archives_id = DHTID.generate(source=archives_key(run)).to_bytes()
        self._progress_ids = {
            DHTID.generate(source=progress_key(run, s)).to_bytes() for s in range(MAX_STAGES)
        }

    def validate(self, record: DHTRecord) -> bool:
        ours = (self._peers_id, self._spec_id, self._revoked_id, self._claims_id, self._archives_id)
        if record.key not in ours and record.key not in self._progress_ids:
            return True  # other subsystems' keys (e.g. hivemind averaging's) are theirs
        seen = (record.key, record.subkey, record.value, record.expiration_time)
        dated = self._accepted.get(seen)
        if dated is not None and dated <= get_dht_time() + MAX_CLOCK_SKEW_S:
            return True
        try:
            value = DHTProtocol.serializer.loads(record.value)
            if record.key == self._spec_id:
                signed = decode_run_spec(value, run=self.run)
                if DHTProtocol.serializer.loads(record.subkey) != spec_subkey(value):
                    raise RecordError("a run spec is stored under the hash of its bytes")
                self._saw_spec(signed)
            elif record.key == self._revoked_id:
                decode_revocations(value, run=self.run)
            elif record.key == self._claims_id:
                subkey = DHTProtocol.serializer.loads(record.subkey)
                claim = decode_claim(value, subkey=subkey, run=self.run)
                if record.expiration_time > claim.expires + 1:
                    raise RecordError("an invite claim would outlive its invite")
            elif record.key in self._progress_ids:
                subkey = DHTProtocol.serializer.loads(record.subkey)
                progress = decode_progress_record(
                    value, subkey=subkey, run=self.run, now=get_dht_time(), max_age_s=math.inf
                )
                whose = f"peer {progress.peer_id} (progress)"
                _check_expiration(record, progress.timestamp, MAX_RECORD_AGE_S, whose)
            else:
                subkey = DHTProtocol.serializer.loads(record.subkey)
                decode = decode_archive if record.key == self._archives_id else decode_peer_info
                info = decode(
                    value, subkey=subkey, run=self.run, now=get_dht_time(), max_age_s=math.inf
                )
                ttl_s = info.ttl_s
                if (
                    ttl_s is not None
                    and abs(record.expiration_time - expires_at(info.timestamp, ttl_s)) > 1e-3
                ):
                    raise RecordError(
                        f"record of peer {info.peer_id} is stored to expire at "
                        f"{record.expiration_time:.3f}, not {ttl_s:.1f} s after it is dated: "
                        "a replayed or altered record"
                    )
                _check_expiration(record, info.timestamp, MAX_RECORD_AGE_S, f"peer {info.peer_id}")
                if record.key == self._peers_id and self.bounds is not None:
                    self.bounds.check(info, len(value))
                if len(self._accepted) >= MAX_ACCEPTED:
                    self._accepted.clear()
                self._accepted[seen] = info.timestamp
        except Exception as e:  # anything a peer sends that we cannot read is refused
            if self._refusals_logged.take(time.monotonic(), logger):
                logger.warning("refused a DHT record of run %s: %s", self.run, e)
            events.emit("record.refused", run=self.run, reason=str(e))
            return False
        return True

    def _saw_spec(self, signed: SignedSpec) -> None:
        """Bound peer records by the spec peers keep of those seen (``earliest_spec``)."""
        if any(s.raw == signed.raw for s in self._specs) or len(self._specs) >= MAX_SPECS:
            return
        self._specs.append(signed)
        kept = earliest_spec(self._specs).spec
        self.bounds = PeerBounds(kept.n_stages, kept.private)
        self._accepted.clear()


def _check_expiration(record: DHTRecord, timestamp: float, max_age_s: float, whose: str) -> None:
    """``RecordError`` if ``record`` would be stored past ``max_age_s`` after it is dated:
    a validator's verdict must not change while a record sits in storage (see
    ``RunRecordValidator``), so a record may never outlive its freshness there."""
    if record.expiration_time > timestamp + max_age_s:
        raise RecordError(
            f"record of {whose} expires {record.expiration_time - timestamp:.0f} s after it "
            f"is dated (limit {max_age_s:.0f} s): it would go stale in storage"
        )


class DirectoryValidator(RecordValidatorBase):
    """Refuses to store or return an entry of the run directory (``RUNS_KEY``) that is not
    a valid announcement signed by the owner its run id names, under that run id, stored
    to expire within ``MAX_ANNOUNCE_AGE_S`` of its date (no age limit here, for the reason
    ``RunRecordValidator`` gives; readers check each entry's age)."""

    def __init__(self) -> None:
        self._key = DHTID.generate(source=RUNS_KEY).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key:
            return True
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
            found = decode_announcement(
                value, subkey=subkey, now=get_dht_time(), max_age_s=math.inf
            )
            _check_expiration(record, found.timestamp, MAX_ANNOUNCE_AGE_S, f"run {found.run}")
        except Exception as e:  # anything a peer sends that we cannot read is refused
            logger.warning("refused a run announcement: %s", e)
            events.emit("record.refused", run=None, key=RUNS_KEY, reason=str(e))
            return False
        return True


class _OwnedDHT(DHTCompat):
    """hivemind's DHT process, tied to the process that started it: when a node dies, even
    by SIGKILL, its DHT process (and with it ``p2pd``) dies too, as a dead peer must. Its
    stream reads are capped (``hivemind_compat.cap_frames``)."""

    def run(self) -> None:
        die_with_parent(self.parent_pid)
        cap_frames()
        super().run()


class SwarmDHT:
    """A node's (or a client's) membership in one run's DHT.

    Once the run's spec is known, ``policy`` says who is a member: in a private run,
    records of peers without a valid invite are dropped as they are read.

    ``run`` None: a client of no run (``swarmtrain runs``), which reads the run directory
    and, through ``of_run``, the peers of the runs announced there."""

    def __init__(self, dht: hivemind.DHT, run: str | None, socket_dir: str | None = None) -> None:
        self.dht = dht
        self.run = run
        self._socket_dir = socket_dir  # removed at shutdown
        self.policy: MembershipPolicy | None = None
        self.n_stages: int | None = None  # the run's, once its spec is known
        self.bounds: PeerBounds | None = None  # what the run's peer records may hold
        self._peers_read: tuple[float, object, list[PeerInfo]] | None = None  # when, policy
        self._peers_reading: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._dropped: set[str] = set()  # reasons already logged
        self._drops_logged = LogBudget("records dropped as they were read")
        self._spec_checked = False  # publish_spec looked for a conflicting spec
        self._kept_spec: bytes | None = None  # the spec ``spec`` last chose
        self._visible: list[str] | None = None  # ``visible_maddrs``, once asked
        self._conflicts: set[bytes] = set()  # later specs for this run id, already reported
        self._claims_seen: dict[tuple[str, str], Claim | None] = {}  # (peer, proof) -> claim

    @classmethod
    def start(
        cls,
        run: str | None,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: Path | None = None,
        client_mode: bool = False,
        startup_timeout_s: float = 60.0,
        pubsub: bool = False,
        peer_routing: bool = False,
        relay: RelaySettings = CLIENT_RELAY,
    ) -> SwarmDHT:
        """Start hivemind's DHT (in its own process) and join ``initial_peers``, if any.

        ``client_mode``: hivemind's DHT runs as a client (``become_server`` turns it into a
        full node). ``peer_routing``: ``p2pd``'s own libp2p DHT, which finds the addresses
        of peers it is not connected to, serves others even so (a node's always does: a
        peer that joined through it finds the rest of the swarm through it). ``relay``:
        the relay it offers, and whether it reserves slots on ``initial_peers`` when its
        AutoNAT finds it private (``node.rpc.relay``).

        Blocking, and to be called from the main thread: the DHT process is forked, and a
        fork from a worker thread of a running uvloop can leave the child unable to start
        its ``p2pd`` (seen as a node that hangs at start).

        ``DHTStartError``, in one line, for addresses that cannot work (checked before
        anything starts) and for a daemon that does not start; nothing is left behind."""
        install()
        _check_addresses(initial_peers, host_maddrs, announce_maddrs)
        kwargs = {
            "initial_peers": list(initial_peers),
            "host_maddrs": list(host_maddrs),
            "announce_maddrs": list(announce_maddrs) or None,
            "client_mode": client_mode,
            "dht_mode": "server" if peer_routing or not client_mode else "client",
            "record_validators": [
                DirectoryValidator(),
                *([RunRecordValidator(run)] if run is not None else []),
            ],
            "start": False,
        }
        if identity_path is not None:
            # hivemind's "identity taken" check only understands RSA keys; ours are Ed25519.
            kwargs.update(identity_path=str(identity_path), check_if_identity_free=False)
        dht = _OwnedDHT(**kwargs)
        socket_dir = _socket_dir()
        try:
            # The DHT's process, forked in start(), starts p2pd with these options: sockets
            # in a directory of ours (removed whatever happens to p2pd), GossipSub if asked,
            # the relay settings.
            extra_args = (*(PUBSUB_FLAGS if pubsub else ()), *relay.flags(initial_peers))
            with p2pd_options(socket_dir=socket_dir, extra_args=extra_args):
                dht.start()
            dht.wait_until_ready(timeout=startup_timeout_s)
            # Asked once now, before any event loop: hivemind caches the answer, which an
            # averager's construction reads (blocking) on the node's loop.
            dht.client_mode  # noqa: B018
        except BaseException as e:
            _stop_process(dht)
            shutil.rmtree(socket_dir, ignore_errors=True)
            if isinstance(e, TimeoutError):
                peers = f" through {', '.join(initial_peers)}" if initial_peers else ""
                raise DHTStartError(
                    f"could not join the DHT{peers} within {startup_timeout_s:.0f} s: is a "
                    "node of the run reachable there?"
                ) from None
            if isinstance(e, Exception):
                raise DHTStartError(_start_failure(e, initial_peers, host_maddrs)) from None
            raise
        return cls(dht, run, socket_dir)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        """The addresses peers dial this DHT's daemon at. Asked of the DHT process once
        (hivemind's answer does not change: its daemon's, as read at start), then
        remembered: the question blocks the caller, and a later one from the event loop
        would stall every task of the node, forever if the DHT process has died."""
        if self._visible is None:
            self._visible = [str(m) for m in self.dht.get_visible_maddrs()]
        return list(self._visible)

    async def replicate_p2p(self) -> hivemind.P2P:
        """A P2P handle in this process on the DHT's daemon: same peer id, for RPCs."""
        return await self.dht.replicate_p2p()

    async def publish_peer(
        self, info: PeerInfo, key: Ed25519PrivateKey, ttl_s: float | None = None
    ) -> bool:
        """Store this node's record (``_store``)."""
        raw = encode_peer_info(info, key)
        return await self._store(peers_key(self.run), info, raw, ttl_s)

    async def peers(
        self, select: Callable[[list[str]], Collection[str]] | None = None
    ) -> list[PeerInfo]:
        """The run's peer records that validate (and, in a private run, whose peers show a
        valid invite; once the spec is known, that fit the run's ``PeerBounds``: a
        throughput per stage for exactly its stages, so that every stage they name is one
        of the run's, and no larger than the run needs); the rest are logged and dropped.
        A whole read less than ``PEERS_FRESH_S`` old (times ``refresh_period``'s factor for
        as many peers as it listed), under the same policy, is returned again, and whole
        reads asked for at once share one read of the DHT. ``select``: given the peer ids
        the read found (before any record is checked), those whose records to return; a
        reader that needs a bounded part of a large read (a trainer: the peers it has
        proven, and a few others) then checks only that part, not each record of a flood
        (a fresh whole read serves it too)."""
        if select is not None:
            last = self._fresh_peers()
            if last is None:
                return await self._read(peers_key(self.run), decode_peer_info, self.bounds, select)
            chosen = set(select([p.peer_id for p in last]))
            return [p for p in last if p.peer_id in chosen]
        async with self._peers_lock():
            last = self._fresh_peers()
            if last is None:
                policy = self.policy
                last = await self._read(peers_key(self.run), decode_peer_info, self.bounds)
                self._peers_read = (time.monotonic(), policy, last)
            return list(last)

    def _fresh_peers(self) -> list[PeerInfo] | None:
        """The last whole read of the run's peers, if still fresh (see ``peers``)."""
        last = self._peers_read
        if last is None or last[1] is not self.policy:
            return None
        return last[2] if time.monotonic() - last[0] < peers_fresh_s(len(last[2])) else None

    def _peers_lock(self) -> asyncio.Lock:
        """The lock whole reads of the run's peers take, one per event loop (a client may
        run several in turn)."""
        loop = asyncio.get_running_loop()
        if self._peers_reading is None or self._peers_reading[0] is not loop:
            self._peers_reading = (loop, asyncio.Lock())
        return self._peers_reading[1]

    async def publish_archive(self, record: ArchiveRecord, key: Ed25519PrivateKey) -> bool:
        """Store this archive node's record (``_store``)."""
        raw = encode_archive(record, key)
        return await self._store(archives_key(self.run), record, raw)

    async def archives(self) -> list[ArchiveRecord]:
        """The run's archive records that validate (in a private run, of members only);
        the rest are logged and dropped."""
        return await self._read(archives_key(self.run), decode_archive)

    async def _store(
        self, key: str, record: PeerInfo | ArchiveRecord, raw: bytes, ttl_s: float | None = None
    ) -> bool:
        """Store a peer's signed record ``raw`` under its peer id: until ``record.ttl_s``
        after its timestamp when the record names it (``expires_at``; then every newer
        record of the peer outlives the older ones), else for ``ttl_s`` seconds but never
        past ``MAX_RECORD_AGE_S`` after its timestamp (peers refuse to store a record
        that would go stale before it expires)."""
        if record.ttl_s is not None:
            expiration = expires_at(record.timestamp, record.ttl_s)
        elif ttl_s is not None:
            expiration = min(get_dht_time() + ttl_s, record.timestamp + MAX_RECORD_AGE_S)
        else:
            raise ValueError("a record without ttl_s needs a ttl_s to be stored with")
        return await self.dht.store(
            key, subkey=record.peer_id, value=raw, expiration_time=expiration, return_future=True
        )

    async def _read(
        self,
        key: str,
        decode: Callable[..., R],
        bounds: PeerBounds | None = None,
        select: Callable[[list[str]], Collection[str]] | None = None,
    ) -> list[R]:
        """The signed per-peer records under ``key`` that ``decode`` accepts (and that fit
        ``bounds``, if given) and, in a private run, whose peers show a valid invite; the
        rest are logged and dropped. With ``select``, only the records of the subkeys it
        picks are checked and returned."""
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        items = found.value.items()
        if select is not None:
            chosen = set(select([k for k in found.value if isinstance(k, str)]))
            items = [(k, v) for k, v in items if k in chosen]
        now, records, result = get_dht_time(), [], []
        for subkey, item in items:
            try:
                record = decode(
                    item.value, subkey=subkey, run=self.run, now=now, max_age_s=MAX_RECORD_AGE_S
                )
                if bounds is not None:
                    bounds.check(record, len(item.value))
                records.append(record)
            except RecordError as e:
                self._log_dropped(e)
        self._drops_logged.flush(time.monotonic(), logger, logging.WARNING)
        if self.policy is not None and self.policy.private:
            # Each bearer proof is a claim on its invite: learn them all before judging any,
            # so that of two peers using one token at once, the later is dropped right away.
            self._learn_claims(self._claim_in(r) for r in records)
        for record in records:
            try:
                if self.policy is not None:
                    self.policy.check(record.peer_id, record.membership, now)
                result.append(record)
            except RecordError as e:
                self._log_dropped(e)
        return result

    def of_run(self, run: str) -> SwarmDHT:
        """A view of ``run`` through this DHT (its records read with no membership policy),
        for reading the peers of runs in the directory. It shares this object's DHT process:
        shut this object down, never the view."""
        return SwarmDHT(self.dht, run)

    async def publish_announcement(
        self, record: RunAnnouncement, owner_key: Ed25519PrivateKey
    ) -> bool:
        """Store the owner-signed announcement of a public run in the run directory, to
        expire ``MAX_ANNOUNCE_AGE_S`` after it is dated (the owner's node refreshes it)."""
        return await self.dht.store(
            RUNS_KEY,
            subkey=record.run,
            value=encode_announcement(record, owner_key),
            expiration_time=record.timestamp + MAX_ANNOUNCE_AGE_S,
            return_future=True,
        )

    async def announcements(self) -> list[RunAnnouncement]:
        """The run directory's announcements that validate (``protocol.announce``); the
        rest are logged and dropped. Claims: a reader checks them (``announce.listing``)."""
        found = await self.dht.get(RUNS_KEY, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now, result = get_dht_time(), []
        for subkey, item in found.value.items():
            try:
                result.append(
                    decode_announcement(
                        item.value, subkey=subkey, now=now, max_age_s=MAX_ANNOUNCE_AGE_S
                    )
                )
            except RecordError as e:
                self._log_dropped(e)
        return result

    def _claim_in(self, info: PeerInfo | ArchiveRecord) -> Claim | None:
        """The (verified) claim on a bearer invite that ``info``'s proof makes, if any.
        Remembered per proof: records are re-read every second or so."""
        if info.membership is None:
            return None
        seen = (info.peer_id, info.membership)
        if seen in self._claims_seen:
            return self._claims_seen[seen]
        try:
            claim = self.policy.verify(info.peer_id, info.membership)[1]
        except RecordError:
            claim = None  # ``check`` drops the record, saying why
        if len(self._claims_seen) >= 10_000:
            self._claims_seen.clear()
        self._claims_seen[seen] = claim
        return claim

    def _learn_claims(self, claims) -> None:
        """Add verified claims to ``policy``; warn when one beats a claim we held."""
        before = self.policy
        self.policy = before.with_claims(c for c in claims if c is not None)
        for invite_id, winner in self.policy.claims.items():
            held = before.claims.get(invite_id)
            if held is not None and held.peer_id != winner.peer_id:
                logger.warning(
                    "bearer invite %s: peer %s used it first; peer %s, which used it later, "
                    "is refused",
                    invite_id,
                    winner.peer_id,
                    held.peer_id,
                )

    def _log_dropped(self, e: RecordError) -> None:
        """Warn once per distinct reason (records are re-read every second or so), and of
        distinct reasons only the first few a minute (``LogBudget``: a flood of records
        from fresh keys is a distinct reason each)."""
        reason = str(e)
        if reason in self._dropped:
            logger.debug("dropped a record: %s", reason)
            return
        if len(self._dropped) >= 1000:
            self._dropped.clear()
        self._dropped.add(reason)
        if self._drops_logged.take(time.monotonic(), logger):
            logger.warning("dropped a record: %s", reason)

    async def publish_spec(self, signed: SignedSpec) -> bool:
        """Store the owner-signed spec (every node does, again and again, so it outlives
        the owner's presence). The first time, refuse (``SpecConflict``) if the DHT holds a
        different spec for the run that peers keep instead: a run's spec never changes, a
        new one needs a new run name. (A spec read from the DHT through ``spec`` is not
        checked again: re-publishing what peers keep never fails.)"""
        if not self._spec_checked and signed.raw != self._kept_spec:
            found = await self._specs()
            if found and (first := earliest_spec([*found, signed])).raw != signed.raw:
                changes = spec_differences(first.spec, signed.spec) or ["its signature"]
                raise SpecConflict(
                    f"run {self.run} already has a different spec (this one changes "
                    f"{'; '.join(changes)}): a run's spec never changes; start a new run "
                    "under a new name"
                )
            self._spec_checked = True
        return await self._publish_owned(spec_key(self.run), signed.raw, spec_subkey(signed.raw))

    async def _publish_owned(self, key: str, raw: bytes, subkey: str | None = None) -> bool:
        """Store an owner-signed record as it is (peers verify the owner's signature)."""
        expiration = get_dht_time() + SPEC_TTL_S
        return await self.dht.store(
            key, raw, expiration_time=expiration, subkey=subkey, return_future=True
        )

    async def _specs(self) -> list[SignedSpec]:
        """Every valid spec stored under the run's id (normally one)."""
        found = await self.dht.get(spec_key(self.run), latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        specs = []
        for item in list(found.value.values())[:MAX_SPECS]:
            try:
                specs.append(decode_run_spec(item.value, run=self.run))
            except RecordError as e:
                logger.warning("dropped a run spec: %s", e)
        return specs

    async def spec(self) -> SignedSpec | None:
        """The run's spec: if the owner ever signed two for its id, the earliest (peers all
        keep that one), with a warning naming what the other would change."""
        specs = await self._specs()
        if not specs:
            return None
        first = earliest_spec(specs)
        self._kept_spec = first.raw
        for other in specs:
            if other.raw != first.raw and other.raw not in self._conflicts:
                self._conflicts.add(other.raw)
                changes = spec_differences(first.spec, other.spec) or ["its signature"]
                events.emit("spec.conflict", run=self.run, changes=changes)
                logger.warning(
                    "run %s has two specs signed by its owner: keeping the first, ignoring "
                    "one created later that changes %s",
                    self.run,
                    "; ".join(changes),
                )
        return first

    async def wait_for_spec(self, timeout_s: float) -> SignedSpec | None:
        """The run's spec, polling the DHT until it appears; None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (spec := await self.spec()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return spec

    async def become_server(self) -> int:
        """Turn a DHT started with ``client_mode`` into a full DHT node: from now on peers
        add it to their routing tables and send it lookups (call it once others are known
        to be able to dial this node). Returns how many known peers were told at once."""
        told = await self.dht.run_coroutine(become_dht_server, return_future=True)
        serve_averaging(self.dht)  # what the DHT process now answers, without asking it
        return told

    def serve_averaging(self) -> None:
        """Averagers built from now on accept peers' requests although this DHT node stays
        a client (a node that serves through a relay)."""
        serve_averaging(self.dht)

    async def known_peers(self) -> int:
        """How many DHT peers this node's routing table holds: 0 until it has reached one
        (so a lookup that finds nothing may just have asked nobody)."""
        return await self.dht.run_coroutine(routing_table_size, return_future=True)

    def use_spec(self, spec) -> None:
        """From now on, read records as members of ``spec``'s run see them (and drop
        peer records that do not fit its stages)."""
        self.policy = spec.membership
        self.n_stages = spec.n_stages
        self.bounds = PeerBounds(spec.n_stages, spec.private)
        self._peers_read = None

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
        """Apply the owner's latest revocations, and the claims on bearer invites, to
        ``policy``; with ``restore`` (a serving node, periodically) store them again, so
        that they outlive the owner's (and the claimer's) presence."""
        if self.policy is None or not self.policy.private:
            return
        await self._refresh_claims(restore=restore)
        found = await self.revocations()
        if found is None:
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

    async def claims(self) -> list[Claim]:
        """The claims on the run's bearer invites stored in the DHT that validate."""
        found = await self.dht.get(claims_key(self.run), latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        result = []
        for subkey, item in list(found.value.items())[:MAX_CLAIMS]:
            try:
                result.append(decode_claim(item.value, subkey=subkey, run=self.run))
            except RecordError as e:
                self._log_dropped(e)
        return result

    async def _refresh_claims(self, *, restore: bool) -> None:
        self._learn_claims(await self.claims())
        if restore:  # the winners only: a beaten claim need not outlive its claimer
            now = get_dht_time()
            for claim in list(self.policy.claims.values()):
                if claim.expires > now:
                    await self._store_claim(claim)

    async def _store_claim(self, claim: Claim) -> bool:
        return await self.dht.store(
            claims_key(self.run),
            encode_claim(claim, self.policy.owner),
            expiration_time=claim.expires,
            subkey=claim.subkey,
            return_future=True,
        )

    async def claim_invite(self, peer_id: str, proof: str | None) -> None:
        """Publish our claim on a bearer invite (``proof`` made by ``prove_membership``),
        give others' claims ``CLAIM_SETTLE_S`` to show up, and raise ``MembershipError``
        ("this bearer invite was already used by peer ...") if one of them holds instead.
        Does nothing for other invites, or in a public run."""
        if proof is None or self.policy is None or not self.policy.private:
            return
        claim = self.policy.verify(peer_id, proof)[1]
        if claim is None:
            return
        if not await self._store_claim(claim):  # e.g. stored before: a restart
            logger.debug("the DHT did not store our claim on the bearer invite")
        await asyncio.sleep(CLAIM_SETTLE_S)
        await self._refresh_claims(restore=False)
        self._learn_claims([claim])
        self.policy.admit(peer_id, proof, get_dht_time())  # raises if another claim holds

    def shutdown(self) -> None:
        """Stop the DHT process and its ``p2pd`` (blocking, about a second; a process that
        does not end when asked, stopped or stuck, is killed), and remove their sockets."""
        try:
            self.dht.shutdown()
            if self.dht.is_alive():  # a stopped process keeps SIGTERM pending: kill it
                self.dht.join(1)
                if self.dht.is_alive():
                    self.dht.kill()
                    self.dht.join(5)
        finally:
            if self._socket_dir is not None:
                shutil.rmtree(self._socket_dir, ignore_errors=True)


def _stop_process(dht: hivemind.DHT) -> None:
    """Stop a DHT process that did not start (it may have exited already)."""
    if dht.pid is None:
        return
    if dht.is_alive():
        dht.terminate()
    dht.join(5)
