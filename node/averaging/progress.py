"""The progress records of a stage's peers in the DHT, and this peer's view of them.

Every peer of a stage stores its ``protocol.averaging.Progress`` (epoch, samples toward
the next round) under the stage's key, its peer id as subkey, and reads the others'. A
read returns one DHT node's copy of the records and may miss one, so the view corrects
what it reads with what this peer knows better (``view``, ``learn``). A peer that claims
to be ahead and does not hand over its state when asked is ignored for a while
(``distrust``).

How often the records are read (``next_read``): every report period, and sooner while a
round waits only on the other peers' last samples (``waiting_on_others``, ``ReadCadence``):
without their pushes (below), a DHT read is how a peer learns that its groupmates filled
the batch.

Records are signed by the peer they name (``protocol.progress``), and the view holds
only peers with a valid peer record in the run (``SwarmDHT.peers``, which in a private run
also checks invites): a key made up for the occasion cannot shape our rounds.

Pushes (``accept``). A peer also sends its signed record straight to the stage's peers
it sees (``node.averaging.progress_push``) whenever it changes (in DiLoCo, where a count
below one peer's share cannot make the round due, once some count at its epoch reached
it: ``protocol.averaging.tell_at_once``) and at least every report period. A pushed
record is checked as a read one is, from the peer the connection authenticates, and
replaces that peer's record in the view only if it is newer (its timestamp), so a late
DHT copy never undoes a push. While every peer in the view has pushed within
``push_fresh_s`` (``pushes_cover_view``), the view is as current as a read would make
it, and the averager reads the DHT only to find peers that push to us not yet, every
``PUSHED_READ_S`` (``read_every``: at the report period once a peer we do not know
pushed, or while a peer's pushes lag).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from node.rpc.dht import SwarmDHT
from protocol.averaging import Action, decide
from protocol.clock import ClockCheck
from protocol.progress import (
    Progress,
    ProgressRecord,
    decode_progress_record,
    encode_progress,
    progress_key,
)
from protocol.records import MAX_RECORD_AGE_S, RecordError
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)

MAX_PEER_RECORDS = 1024  # read at most this many progress records of one stage
# The longest a store or read of progress records may take: one that has not ended by then
# counts as failed (the next period retries), so a DHT call that never answers cannot stop
# our reports and reads, and with them every round of the stage.
DHT_CALL_S = 10.0
# The run's peer records are re-read when a progress record names a peer we do not know,
# at most this often, and at least this often (a peer whose record expired drops out).
PEERS_REFRESH_S = 2.0
PEERS_MAX_AGE_S = 15.0
# While only the others' last samples keep a round from being due, the records are read
# this often (as a server waiting to admit a micro-batch reads them), at most this many
# times in a row (then every report period: ``ReadCadence``).
FAST_READ_S = 0.1
FAST_READS = 10
# While every peer in the view pushes its record to us (``pushes_cover_view``), the view is
# current without reads, and the DHT is read only to find the stage's peers that push to
# us not yet: at most this often, or at the report period once a peer we do not know yet
# (a joiner) has pushed to us since the last read, or while a peer's last push is more
# than two periods old (``read_every``).
PUSHED_READ_S = 5.0


def waiting_on_others(
    me: str, epoch: int, mine: int, others: Sequence[Progress], target: int, *, per_peer: bool
) -> bool:
    """Whether a round is about to be due and only the other peers' samples hold it: by
    ``decide``'s rule we wait, other peers share our epoch, and our own ``mine`` samples
    make up our share of the target (the target over the peers at our epoch)."""
    decision = decide(me, epoch, mine, others, target, per_peer=per_peer)
    if decision.action is not Action.WAIT or decision.peers == 0:
        return False
    return mine >= target if per_peer else mine * (1 + decision.peers) >= target


class ReadCadence:
    """How long until the next read of the stage's progress (pure: no clock). ``period``
    while nothing is imminent; while we wait on the others' last samples
    (``waiting_on_others``), every ``fast`` seconds, at most ``reads`` times in a row
    (then ``period`` until the wait ends): the last samples are seen within ``fast`` of
    their record, and peers that stay slow cost a bounded number of extra reads."""

    def __init__(self, fast: float = FAST_READ_S, reads: int = FAST_READS) -> None:
        if not fast > 0 or reads < 0:
            raise ValueError(f"fast must be > 0 and reads >= 0, got {fast} and {reads}")
        self.fast = fast
        self.reads = reads
        self._left = reads  # fast reads left in this wait

    def delay(self, waiting: bool, period: float) -> float:
        """Seconds until the next read, given whether we wait on the others now."""
        if not waiting:
            self._left = self.reads
            return period
        if self._left == 0:
            return period
        self._left -= 1
        return min(self.fast, period)


class ProgressBoard:
    """This peer's published progress and its view of the other peers' (on the event loop).
    Records live ``ttl_s`` seconds (at most ``MAX_RECORD_AGE_S``).

    ``clock`` (monotonic seconds) times how long a record missing from reads stays in the
    view; the DHT's own clock times expirations. ``key`` (this peer's, which signs its
    records) is needed only to ``publish``."""

    def __init__(
        self,
        dht: SwarmDHT,
        spec: RunSpec,
        stage_index: int,
        *,
        ttl_s: float,
        name: str,
        key: Ed25519PrivateKey | None = None,
        clock: Callable[[], float] = time.monotonic,
        push_fresh_s: float = 1.5,
    ) -> None:
        self.dht = dht
        self._signer = key
        self.spec = spec
        self.peer_id = dht.peer_id
        # Of our record (peers refuse one that lives past ``MAX_RECORD_AGE_S``), and of a
        # record missing from reads in the view.
        self.ttl = min(ttl_s, MAX_RECORD_AGE_S)
        self._key = progress_key(spec.run, stage_index)
        self._name = name  # in log lines
        self._clock = clock
        self.records: list[Progress] = []  # the other peers' records, as last read
        self._seen: dict[str, tuple[Progress, float]] = {}  # peer -> last record, when (view)
        self._known: dict[str, int] = {}  # peer -> the highest epoch we know it reached
        self._expires: dict[str, float] = {}  # peer -> its newest record's DHT expiration
        self._unproven: dict[str, float] = {}  # peer -> until when its claims are ignored
        self._in_run: set[str] = set()  # peers with a valid peer record, as last read
        self._in_run_read = -math.inf  # when (clock)
        # peer -> the upload rate (Mbit/s) its peer record announces, as last read (us too;
        # 0: not announced): how long a download of the stage's state may take
        self.uploads: dict[str, float] = {}
        self._cadence = ReadCadence()
        self._stamps: dict[str, float] = {}  # peer -> its last record's timestamp (DHT time)
        self.push_fresh_s = push_fresh_s
        self.reads = 0  # DHT reads of the stage's records (``refresh``)
        self.stores = 0  # DHT stores of our record (``publish``)
        self._pushed: dict[str, tuple[ProgressRecord, float]] = {}  # peer -> newest, when (clock)
        self._stranger_pushed = False  # a peer not in ``_in_run`` pushed since the last read
        self.clocks = ClockCheck()  # the pushing peers' clocks against ours (DHT time)

    @property
    def can_publish(self) -> bool:
        """This board holds the key that signs our records."""
        return self._signer is not None

    @property
    def peers(self) -> int:
        """Other live peers of the stage in the view (at any epoch)."""
        return len(self._seen)

    @property
    def alone(self) -> bool:
        """No other peer of the stage in sight, as of the last read."""
        return not self.records and not self._seen

    def sign(self, mine: Progress) -> tuple[bytes, float]:
        """Our record, signed now, and its timestamp (DHT time): what ``publish`` stores
        and what a push sends. ``ValueError`` if this board has no key to sign with."""
        if self._signer is None:
            raise ValueError("publishing progress needs this peer's key to sign it")
        now = get_dht_time()
        return encode_progress(mine, run=self.spec.run, key=self._signer, timestamp=now), now

    async def publish(self, mine: Progress, signed: tuple[bytes, float] | None = None) -> bool:
        """Store our record (``signed``, else signed now) for ``ttl`` seconds; False
        (logged) if the DHT refused it. ``ValueError`` if this board has no key to sign
        with."""
        value, now = signed if signed is not None else self.sign(mine)
        self.stores += 1
        try:
            async with asyncio.timeout(DHT_CALL_S):
                return await self.dht.dht.store(
                    self._key,
                    subkey=self.peer_id,
                    value=value,
                    expiration_time=now + self.ttl,
                    return_future=True,
                )
        except Exception as e:  # a DHT hiccup: the next period retries
            logger.warning("%s: publishing progress failed: %r", self._name, e)
            return False

    async def refresh(self) -> list[Progress]:
        """Read the other peers' live records into ``records`` and return them; on a failed
        read, keep the last ones. Invalid records are dropped and logged; records of peers
        without a valid peer record in the run are dropped."""
        self.reads += 1
        self._stranger_pushed = False
        self._forget_gone()
        try:
            async with asyncio.timeout(DHT_CALL_S):
                found = await self.dht.dht.get(self._key, latest=True, return_future=True)
        except Exception as e:
            logger.warning("%s: reading progress failed: %r", self._name, e)
            return self.records
        if found is None or not isinstance(found.value, dict):
            self.records = []
            return self.records
        result, now = [], get_dht_time()
        for subkey, item in list(found.value.items())[:MAX_PEER_RECORDS]:
            try:
                signed = decode_progress_record(
                    item.value, subkey=subkey, run=self.spec.run, now=now
                )
            except RecordError as e:
                logger.warning("%s: dropped a progress record: %s", self._name, e)
                continue
            if signed.peer_id != self.peer_id:
                pushed = self._pushed.get(signed.peer_id)
                if pushed is not None and pushed[0].timestamp > signed.timestamp:
                    signed = pushed[0]  # this DHT copy is older than what the peer pushed
                result.append((signed, item.expiration_time))
        read = {signed.peer_id for signed, _ in result}
        for peer, (signed, at) in list(self._pushed.items()):  # pushed, missing from this read
            if self._clock() - at > self.ttl:
                del self._pushed[peer]
            elif peer not in read:
                result.append((signed, signed.timestamp + self.ttl))
        result = [r for r in result if not self._ignored(r[0].peer_id)]
        in_run = await self._peers_in_run({signed.peer_id for signed, _ in result})
        # Only the records kept are remembered: anyone can store a record signed by a fresh
        # key, and a flood of them must not grow what this board keeps.
        self.records = []
        for signed, expires in result:
            if (peer := signed.peer_id) in in_run:
                self._stamps[peer] = max(self._stamps.get(peer, -math.inf), signed.timestamp)
                self._expires[peer] = max(self._expires.get(peer, -math.inf), expires)
                self.records.append(Progress(peer, signed.epoch, signed.samples))
        return self.records

    def _forget_gone(self) -> None:
        """Drop what this board keeps of peers that left the view (and whose newest
        record is past its time to live), and the distrust that has run out: a node runs
        for days among peers that come and go."""
        in_view, now = set(self._seen) | set(self._pushed), get_dht_time()
        for peer in [p for p, t in self._stamps.items() if p not in in_view and now - t > self.ttl]:
            del self._stamps[peer]
        for peer in [p for p, t in self._expires.items() if p not in in_view and t < now]:
            del self._expires[peer]
        for peer in [p for p in self._known if p not in in_view]:
            del self._known[peer]
        for peer in list(self._unproven):
            self._ignored(peer)  # deletes an expired entry

    def accept(self, raw: object, sender: str) -> bool:
        """A record ``sender`` (the peer the connection authenticates) pushed to us: True
        if it is now that peer's record in the view. False, and nothing changes, if
        ``sender`` has no valid peer record in the run as last read (the next read looks
        it up) or its claims are ignored (``distrust``), both seen before anything is
        decoded; then checked as a read record is (``RecordError`` if it is not a valid
        record of ``sender`` for this run), and False if not newer than the record we hold
        of that peer."""
        if sender == self.peer_id or self._ignored(sender):
            return False  # before the signature is checked: a stranger's push costs little
        if sender not in self._in_run:
            self._stranger_pushed = True  # the next read looks it up (``read_every``)
            return False
        now = get_dht_time()
        signed = decode_progress_record(raw, subkey=sender, run=self.spec.run, now=now)
        peer = signed.peer_id
        self.clocks.observe(peer, signed.timestamp, now)
        if signed.timestamp <= self._stamps.get(peer, -math.inf):
            return False
        self._pushed[peer] = (signed, self._clock())
        self._stamps[peer] = signed.timestamp
        expires = self._expires.get(peer, -math.inf)
        self._expires[peer] = max(expires, signed.timestamp + self.ttl)
        record = Progress(peer, signed.epoch, signed.samples)
        self.records = [r for r in self.records if r.peer_id != peer] + [record]
        return True

    def read_every(self, period: float) -> float:
        """Seconds between DHT reads while pushes cover the view: ``PUSHED_READ_S`` (at
        least ``period``), or ``period`` once a peer not known to be in the run pushed to us
        since the last read (it may be a joiner, whose record a read finds), or while a
        peer in the view last pushed more than two periods ago (each pushes at least every
        period: one of its pushes was lost or is late, and its stored record may be newer)."""
        now = self._clock()
        lagging = any(
            now - self._pushed[peer][1] > 2 * period for peer in self._seen if peer in self._pushed
        )
        return period if self._stranger_pushed or lagging else max(period, PUSHED_READ_S)

    def pushes_cover_view(self) -> bool:
        """Every peer in the view has pushed its record to us within ``push_fresh_s`` (and
        there is at least one): the view is as current as a DHT read would make it."""
        now = self._clock()
        peers = [p.peer_id for p in self.view()]
        fresh = (self._pushed.get(peer) for peer in peers)
        return bool(peers) and all(f is not None and now - f[1] <= self.push_fresh_s for f in fresh)

    async def _peers_in_run(self, wanted: set[str]) -> set[str]:
        """The peers with a valid peer record in the run (members, in a private run): a
        stranger's progress must not shape our rounds. Re-read when ``wanted`` names one we
        do not know (at most every ``PEERS_REFRESH_S``), and every ``PEERS_MAX_AGE_S``; on
        a failed read, the last ones."""
        age = self._clock() - self._in_run_read
        if age >= PEERS_MAX_AGE_S or (age >= PEERS_REFRESH_S and not wanted <= self._in_run):
            try:
                peers = await self.dht.peers()
                self._in_run = {p.peer_id for p in peers}
                self.uploads = {p.peer_id: p.bandwidth_up_mbps for p in peers}
                self._in_run_read = self._clock()
            except Exception as e:
                logger.warning("%s: reading the run's peers failed: %s", self._name, e)
        return self._in_run

    def view(self) -> list[Progress]:
        """The other peers' progress, corrected by what we know better than the last read.

        A peer's epoch never goes down: a record that says otherwise is older than one we
        saw, or than a round the peer took with us (or a state it handed us). And a record
        missing from one read (a DHT read can miss a subkey) stays for its time to live.
        Without this, right after a round our groupmates would look one epoch behind, and
        we would step alone."""
        now = self._clock()
        for record in self.records:
            self._seen[record.peer_id] = (record, now)
        view = []
        for peer, (record, seen_at) in list(self._seen.items()):
            if now - seen_at > self.ttl or self._ignored(peer):
                del self._seen[peer]
                self._expires.pop(peer, None)
                continue
            known = max(self._known.get(peer, 0), record.epoch)
            self._known[peer] = known
            view.append(record if record.epoch == known else Progress(peer, known, 0))
        return view

    def published_at(self, epoch: int) -> float | None:
        """When (DHT time, as the peers stamped them) the newest record of the peers in the
        view at ``epoch`` was published; None if none is."""
        at = [p.peer_id for p in self.view() if p.epoch == epoch]
        stamps = [self._stamps[peer] for peer in at if peer in self._stamps]
        return max(stamps, default=None)

    def learn(self, epochs: Mapping[str, int]) -> None:
        """Peers we know reached an epoch (groupmates, donors), whether or not our reads of
        the DHT show them: a DHT read returns one node's copy of the stage's records, which
        can lack a peer that stored its own through another node."""
        now = self._clock()
        for peer, epoch in epochs.items():
            self._known[peer] = max(self._known.get(peer, 0), epoch)
            record, seen_at = self._seen.get(peer, (Progress(peer, epoch, 0), now))
            self._seen[peer] = (record, max(seen_at, now))

    def next_read(
        self, epoch: int, mine: int, target: int, *, per_peer: bool, period: float
    ) -> float:
        """Seconds until the stage's progress is worth reading again (``ReadCadence``):
        ``period``, or sooner while a round at ``epoch`` waits only on the others' samples
        (``mine``: ours; ``target`` and ``per_peer``: as ``decide`` takes them)."""
        waiting = waiting_on_others(
            self.peer_id, epoch, mine, self.view(), target, per_peer=per_peer
        )
        return self._cadence.delay(waiting, period)

    def ahead(self, epoch: int) -> list[str]:
        """The peers in the view that are past ``epoch``."""
        return [p.peer_id for p in self.view() if p.epoch > epoch]

    def distrust(self, peers: list[str], for_s: float) -> None:
        """Ignore ``peers``' records (and what we learnt of them) for ``for_s`` seconds:
        they claimed an epoch ahead of ours and none of them handed over a state of it.
        A claim of being ahead is believed only once proven: a record that claims any
        epoch costs nothing to store, and waiting for it would stop our steps."""
        until = self._clock() + for_s
        for peer in peers:
            self._unproven[peer] = until
            self._known.pop(peer, None)
            self._seen.pop(peer, None)
            self._pushed.pop(peer, None)
        self.records = [r for r in self.records if not self._ignored(r.peer_id)]

    def _ignored(self, peer: str) -> bool:
        until = self._unproven.get(peer)
        if until is None:
            return False
        if self._clock() >= until:
            del self._unproven[peer]
            return False
        return True

    def ahead_of(self, epoch: int) -> bool:
        """Some peer in the view is past ``epoch``."""
        return any(p.epoch > epoch for p in self.view())

    def mates_left(self, epoch: int) -> bool:
        """Whether any other peer is still at ``epoch`` and alive: its newest record has
        not expired. (``view`` keeps a record a while longer, for reads that miss it; a
        groupmate killed mid-round would then outlive the round's first attempt, and we
        would try again with nobody.)"""
        now = get_dht_time()
        return any(
            p.epoch == epoch and self._expires.get(p.peer_id, math.inf) > now for p in self.view()
        )
