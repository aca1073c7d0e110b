"""Archive nodes: what they announce, and where a peer that takes a stage starts from.

An archive node serves no stage; it keeps checkpoints of every stage of a run, pulled
from their peers, and hands the newest it holds to peers that download a stage's state.
It announces what it holds in an ``ArchiveRecord`` (one per archive, signed by it, under
its peer id). A record is a claim: a peer that acts on one still checks the state it
downloads like any other, and takes it only if it is newer than what it has.

``start_from`` is the one rule, for every peer that takes a stage, of where its state
comes from: the newest of what the stage's live peers, its own checkpoint and the
archives hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field

from protocol.records import (
    MAX_MEMBERSHIP_CHARS,
    MAX_STAGES,
    PeerId,
    RecordTTL,
    RunName,
    decode_signed,
    encode_signed,
)

_ARCHIVE_DOMAIN = b"swarmtrain/archive"
Epoch = Annotated[int, Field(ge=0, le=2**62)]


class ArchiveRecord(BaseModel):
    """What an archive node holds: for each stage, the epoch and step of its newest
    checkpoint of it (None: none yet)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_id: PeerId
    run: RunName
    version: Annotated[int, Field(ge=0, le=2**31)]
    epochs: Annotated[tuple[Epoch | None, ...], Field(min_length=1, max_length=MAX_STAGES)]
    steps: Annotated[tuple[Epoch | None, ...], Field(min_length=1, max_length=MAX_STAGES)]
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    membership: Annotated[str, Field(max_length=MAX_MEMBERSHIP_CHARS)] | None = None
    ttl_s: RecordTTL | None = None

    def model_post_init(self, _context) -> None:
        if len(self.steps) != len(self.epochs):
            raise ValueError(f"{len(self.epochs)} epochs but {len(self.steps)} steps")
        if any((e is None) != (s is None) for e, s in zip(self.epochs, self.steps, strict=True)):
            raise ValueError("a stage has an epoch without a step, or a step without an epoch")

    def epoch_of(self, stage: int) -> int | None:
        """The epoch of the newest checkpoint of ``stage`` it holds (None: none)."""
        return self.epochs[stage] if 0 <= stage < len(self.epochs) else None


def encode_archive(record: ArchiveRecord, key: Ed25519PrivateKey) -> bytes:
    """Sign and pack ``record`` for the DHT."""
    return encode_signed(record, _ARCHIVE_DOMAIN, key)


def decode_archive(
    raw: bytes, *, subkey: str | None, run: str, now: float, max_age_s: float
) -> ArchiveRecord:
    """Validate an archive record read from the DHT under ``subkey``; ``RecordError``."""
    return decode_signed(
        raw,
        ArchiveRecord,
        _ARCHIVE_DOMAIN,
        kind="archive",
        subkey=subkey,
        run=run,
        now=now,
        max_age_s=max_age_s,
    )


class Start(StrEnum):
    PEERS = "peers"  # download from a live peer of the stage
    ARCHIVE = "archive"  # download the newest archived state
    CHECKPOINT = "checkpoint"  # this peer's own newest checkpoint
    INITIAL = "initial"  # the initial weights


def start_from(
    live_epochs: Iterable[int], saved_epoch: int | None, archived: Iterable[int]
) -> Start:
    """Where a peer taking a stage gets its state: the newest of the live peers' epochs,
    its own checkpoint's (``saved_epoch``) and the archives' wins; on a tie live peers
    first (they are the run as it is now), then its own checkpoint (no download), then
    an archive. Nothing anywhere: the initial weights. A peer whose own checkpoint is
    newer than every live peer's keeps it, and they catch up from it."""
    ranked = [
        (max(live_epochs, default=-1), 3, Start.PEERS),
        (-1 if saved_epoch is None else saved_epoch, 2, Start.CHECKPOINT),
        (max(archived, default=-1), 1, Start.ARCHIVE),
    ]
    epoch, _, start = max(ranked)
    return start if epoch >= 0 else Start.INITIAL
