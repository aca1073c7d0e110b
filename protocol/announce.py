"""Run announcements: how a public run makes itself known, and how a reader lists them.

A public run's owner node publishes a ``RunAnnouncement`` under one well-known DHT key
(``protocol.keys.RUNS_KEY``), its subkey the run id, signed by the run's owner key: the
key whose fingerprint ends the run id (``protocol.ownership``), so nobody else can
announce a run under that id, or misdescribe one. The owner's node refreshes it every
``ANNOUNCE_PERIOD_S``; it is stored to expire at most ``MAX_ANNOUNCE_AGE_S`` after it is
dated, so a run whose owner node is down drops off the list within that time (its other
peers train on, and whoever has its id still joins it). Private runs are never announced.

What a reader lists (``listing``), and what a flood of announcements from fresh keys can
and cannot do to it:

- An announcement not signed by the owner named in its run id (another key, or a run id
  whose fingerprint is not the signer's) is refused by every node asked to store it, and
  by every reader (``decode_announcement``); so is one that is malformed, larger than
  ``MAX_ANNOUNCE_BYTES``, stale, or stored to outlive its freshness.
- An announcement is a claim; a run is listed only if the reader finds, in the run's own
  peers key, at least one live peer record (self-signed by its peer, at most
  ``protocol.records.MAX_RECORD_AGE_S`` old) of a peer that is not leaving. The peers and
  samples/s shown are the reader's own count from those records (``live_figures``), not
  the announced ones. So a flood of bare announcements (signed by fresh owner keys, each
  for its own run, and nothing else kept alive) is never listed, whatever figures it
  claims, and cannot outrank a real run.
- Reader work is bounded: one read of ``RUNS_KEY`` (each DHT answer is at most the
  frame cap, 4 MiB, so at most a few thousand announcements), then one lookup per
  announcement, ``VOUCH_CONCURRENCY`` at a time, in an order of the reader's own
  (``vouch_order``: random, so a flood cannot put itself first), until the reader's
  deadline. A flood delays a listing by its lookups; a real run is missed only when the
  deadline passes before its lookup, and the listing then says how many it did not check.

What does not hold: a flood whose runs also keep live peer records (each a fresh peer
key refreshing a record at least every 2 minutes) cannot be told apart from real runs
and is listed beside them, ranked by the peers it keeps alive: the list is a directory,
not a reputation system. A flood large enough that a storage node's answer passes the
frame cap makes that node's answer unreadable (its replicas still answer), and storage
nodes hold what it stores until it expires.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field

from models.config import PRESETS
from protocol.identity import peer_id_of
from protocol.ownership import check_owner
from protocol.records import (
    MAX_RATE,
    MAX_STAGES,
    PROTOCOL_VERSION,
    PeerId,
    PeerInfo,
    PeerState,
    Rate,
    RecordError,
    RunName,
    decode_signed,
    encode_signed,
)
from protocol.routing import candidates_by_stage
from protocol.run_spec import RunSpec

_ANNOUNCE_DOMAIN = b"swarmtrain/run-announcement"
ANNOUNCE_PERIOD_S = 30.0  # the owner's node re-announces its run this often
MAX_ANNOUNCE_AGE_S = 120.0  # 4 periods: a run whose owner node is down drops off by then
MAX_ANNOUNCE_BYTES = 4096  # a real one is a few hundred bytes (2 KiB with 256 stages)
MAX_DATA_CHARS = 64  # the data description shown in a listing
VOUCH_CONCURRENCY = 16  # a reader's lookups of runs' peers in flight at once
MAX_ANNOUNCED_PEERS = 1_000_000


class RunAnnouncement(BaseModel):
    """What a public run says of itself in the run directory, signed by its owner. The
    figures are the owner node's view of the run's peer records when it was dated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner: PeerId  # the owner's public key, written as a peer id; it signs the record
    run: RunName  # NAME@FINGERPRINT, the fingerprint of ``owner``
    version: Annotated[int, Field(ge=0, le=2**31)]
    preset: Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_-]+$")]
    n_layer: Annotated[int, Field(ge=1, le=100_000)]
    n_embd: Annotated[int, Field(ge=1, le=1_000_000)]
    data: Annotated[str, Field(max_length=MAX_DATA_CHARS)]
    peers: Annotated[int, Field(ge=0, le=MAX_ANNOUNCED_PEERS)]  # live peers (not leaving)
    # Samples/s routing offers on each stage (protocol.routing.candidates_by_stage): its
    # length is the run's number of stages, its least the pipeline's pace.
    stage_throughput: Annotated[tuple[Rate, ...], Field(min_length=1, max_length=MAX_STAGES)]
    created: Annotated[float, Field(ge=0, allow_inf_nan=False)]  # the spec's
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]

    def model_post_init(self, _context) -> None:
        check_owner(self.run, self.owner)  # the run id names this owner
        if self.created > self.timestamp:
            raise ValueError("the run is created after the announcement is dated")

    @property
    def peer_id(self) -> str:
        """Whose signature the record carries (``records.decode_signed``): the owner's."""
        return self.owner

    @property
    def stages(self) -> int:
        return len(self.stage_throughput)


def encode_announcement(record: RunAnnouncement, owner_key: Ed25519PrivateKey) -> bytes:
    """Sign and pack ``record`` for the DHT; ``ValueError`` if the key is not its owner's."""
    if peer_id_of(owner_key.public_key()) != record.owner:
        raise ValueError(f"this key is not the owner ({record.owner}) of run {record.run!r}")
    return encode_signed(record, _ANNOUNCE_DOMAIN, owner_key)


def decode_announcement(
    raw: bytes, *, subkey: object, now: float, max_age_s: float
) -> RunAnnouncement:
    """The announcement stored under ``subkey`` (the run id) in ``RUNS_KEY``, checked in
    size, form (the run id names the signer), signature, binding to the subkey, protocol
    version and age; ``RecordError`` naming what was wrong."""
    if isinstance(raw, bytes) and len(raw) > MAX_ANNOUNCE_BYTES:
        raise RecordError(
            f"run announcement of {len(raw)} bytes exceeds the limit of {MAX_ANNOUNCE_BYTES}"
        )
    if not isinstance(subkey, str):
        raise RecordError(f"a run announcement's subkey must be its run id, got {subkey!r:.80}")
    return decode_signed(
        raw,
        RunAnnouncement,
        _ANNOUNCE_DOMAIN,
        kind="run announcement",
        subkey=None,  # the subkey is the run id, checked as ``run``
        run=subkey,
        now=now,
        max_age_s=max_age_s,
    )


def live_figures(peers: Iterable[PeerInfo], n_stages: int) -> tuple[int, tuple[float, ...]]:
    """How many peers of a run are live (not leaving), and the samples/s routing offers on
    each of its ``n_stages`` stages, from a read of its peer records: the owner announces
    these, and a reader counts them again from the records it reads. Each saturates at
    what an announcement may hold (``MAX_ANNOUNCED_PEERS``, ``MAX_RATE`` a stage): records
    from fresh keys cost nothing, and claims summing past the bound must not make the
    owner's announcement invalid, and so unstored."""
    present = [p for p in peers if p.state is not PeerState.LEAVING]
    totals = tuple(
        min(round(sum(c.throughput for c in stage), 1), MAX_RATE)
        for stage in candidates_by_stage(present, n_stages)
    )
    return min(len({p.peer_id for p in present}), MAX_ANNOUNCED_PEERS), totals


def preset_of(spec: RunSpec) -> str:
    """The name of the preset whose model ``spec`` trains, else ``"custom"``."""
    return next((name for name, make in PRESETS.items() if make()[0] == spec.model), "custom")


def describe_data(data: str) -> str:
    """``data`` in at most ``MAX_DATA_CHARS`` characters (a long path keeps its end)."""
    return data if len(data) <= MAX_DATA_CHARS else "..." + data[-(MAX_DATA_CHARS - 3) :]


def announcement_of(spec: RunSpec, peers: Iterable[PeerInfo], *, now: float) -> RunAnnouncement:
    """The announcement of ``spec``'s run dated ``now``, with the figures of ``peers`` (a
    read of its peer records). ``ValueError`` for a private run: those are never
    announced."""
    if spec.private:
        raise ValueError(f"run {spec.run} is private: private runs are never announced")
    count, totals = live_figures(peers, spec.n_stages)
    return RunAnnouncement(
        owner=spec.owner,
        run=spec.run,
        version=PROTOCOL_VERSION,
        preset=preset_of(spec),
        n_layer=spec.model.n_layer,
        n_embd=spec.model.n_embd,
        data=describe_data(spec.data),
        peers=count,
        stage_throughput=totals,
        created=min(spec.created, now),
        timestamp=now,
    )


def vouch_order(announcements: Iterable[RunAnnouncement], seed: int) -> list[str]:
    """The run ids to look up, in the order a reader looks them up: shuffled with the
    reader's own ``seed``, so that no announcement can place itself first."""
    runs = sorted({a.run for a in announcements})
    random.Random(seed).shuffle(runs)
    return runs


@dataclass(frozen=True)
class Listed:
    """A run as a reader lists it: its announcement, and the figures the reader counted
    from the run's live peer records (``live_figures``)."""

    announcement: RunAnnouncement
    peers: int
    stage_throughput: tuple[float, ...]

    @property
    def throughput(self) -> float:
        """The pipeline's pace: the samples/s of its slowest (bottleneck) stage."""
        return min(self.stage_throughput)

    @property
    def bottleneck_stage(self) -> int:
        return min(range(len(self.stage_throughput)), key=lambda s: self.stage_throughput[s])


def listing(
    announcements: Iterable[RunAnnouncement], live: Mapping[str, Sequence[PeerInfo]]
) -> list[Listed]:
    """The runs to list: those whose lookup (``live``: run id -> its peer records that
    validate; a run not looked up is absent) found a live peer, with the figures counted
    from those records. Largest first: most live peers, then most samples/s at the
    bottleneck; then newest (latest ``created``); then by run id."""
    result = []
    for a in announcements:
        count, totals = live_figures(live.get(a.run, ()), a.stages)
        if count > 0:
            result.append(Listed(a, count, totals))
    return sorted(
        result, key=lambda r: (-r.peers, -r.throughput, -r.announcement.created, r.announcement.run)
    )
