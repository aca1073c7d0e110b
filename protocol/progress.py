"""Averaging progress records: how far each peer of a stage is toward its next round.

Each peer of a stage stores its ``Progress`` (epoch, samples accumulated toward the next
round) under the stage's key (``progress_key``), its peer id as subkey. On the wire it is
a ``ProgressRecord`` signed by the peer it names (``protocol.records.encode_signed``), so
nobody can speak for another peer; a reader also ignores the progress of peers without a
valid peer record in the run (``node.averaging.progress``), so a key made up for the
occasion claims nothing. Peers refuse to store a record that would expire more than
``MAX_RECORD_AGE_S`` after its timestamp (``node.rpc.dht.RunRecordValidator``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field

from protocol.keys import spec_key
from protocol.records import (
    MAX_RECORD_AGE_S,
    PROTOCOL_VERSION,
    PeerId,
    RecordError,
    RunName,
    decode_signed,
    encode_signed,
)

MAX_EPOCH = 2**53  # msgpack and floats agree on every integer up to here
# How far past the median of a stage's claimed epochs a claim (or a downloaded state) is
# believed: peers of a stage step together, a few rounds apart at most.
MAX_EPOCHS_AHEAD = 8
MAX_PEER_ID_CHARS = 128
_PROGRESS_DOMAIN = b"swarmtrain/progress"

Count = Annotated[int, Field(strict=True, ge=0, lt=MAX_EPOCH)]


def progress_key(run: str, stage: int) -> str:
    """The stage's progress records, one subkey per peer id."""
    return spec_key(run).removesuffix("/spec") + f"/stage{int(stage)}/progress"


@dataclass(frozen=True)
class Progress:
    """A peer's progress toward its stage's next averaging round."""

    peer_id: str
    epoch: int  # rounds (gradient mode: optimizer steps) behind this peer's parameters
    samples: int  # accumulated toward round ``epoch + 1``, including any round in flight

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not 0 < len(self.peer_id) <= MAX_PEER_ID_CHARS:
            raise RecordError(f"progress peer id must be 1-{MAX_PEER_ID_CHARS} characters")
        for name in ("epoch", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_EPOCH:
                raise RecordError(
                    f"progress {name} must be an integer in [0, 2**53), got {value!r}"
                )


class ProgressRecord(BaseModel):
    """A ``Progress`` as signed and stored: whose, for which run, when."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_id: PeerId
    run: RunName
    version: Annotated[int, Field(ge=0, le=2**31)]
    epoch: Count
    samples: Count
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]


def encode_progress(p: Progress, *, run: str, key: Ed25519PrivateKey, timestamp: float) -> bytes:
    """``p``, signed by ``key`` (the key of ``p.peer_id``) and packed for the DHT."""
    record = ProgressRecord(
        peer_id=p.peer_id,
        run=run,
        version=PROTOCOL_VERSION,
        epoch=p.epoch,
        samples=p.samples,
        timestamp=timestamp,
    )
    return encode_signed(record, _PROGRESS_DOMAIN, key)


def decode_progress_record(
    raw: object, *, subkey: object, run: str, now: float, max_age_s: float = MAX_RECORD_AGE_S
) -> ProgressRecord:
    """A progress record read from the DHT under ``subkey``, checked as every signed record
    is (``protocol.records.decode_signed``); ``RecordError`` naming what was wrong."""
    if not isinstance(subkey, str):
        raise RecordError(f"a progress record's subkey must be a peer id, got {subkey!r:.80}")
    return decode_signed(
        raw,  # type: ignore[arg-type]  # decode_signed refuses anything but bytes
        ProgressRecord,
        _PROGRESS_DOMAIN,
        kind="progress",
        subkey=subkey,
        run=run,
        now=now,
        max_age_s=max_age_s,
    )


def decode_progress(
    raw: object, *, subkey: object, run: str, now: float, max_age_s: float = MAX_RECORD_AGE_S
) -> Progress:
    """The ``Progress`` of a record read from the DHT (``decode_progress_record``)."""
    record = decode_progress_record(raw, subkey=subkey, run=run, now=now, max_age_s=max_age_s)
    return Progress(record.peer_id, record.epoch, record.samples)


def believable_epochs(epochs: Sequence[int], max_ahead: int = MAX_EPOCHS_AHEAD) -> list[int]:
    """The epochs of ``epochs`` (a stage's peers' signed claims) at most ``max_ahead``
    above their median (the lower one): while most peers are honest the median is an
    honest epoch, and a claim far beyond it is one peer's word, not the stage's, so a
    joiner neither waits for it nor takes a state from it. A peer alone is believed (there
    is nothing to compare it with); an honest peer far ahead of a majority is not either,
    and the others catch up from it by averaging, not by a joiner's download."""
    if max_ahead < 0:
        raise ValueError(f"max_ahead must be >= 0, got {max_ahead}")
    if not epochs:
        return []
    median = sorted(epochs)[(len(epochs) - 1) // 2]
    return [e for e in epochs if e <= median + max_ahead]
