"""The records peers publish in the DHT, and their validation.

A record is a frozen pydantic model: an invalid one cannot be built. On the wire it is
the record's JSON plus an Ed25519 signature by the key of the peer it names, packed with
msgpack. ``decode_*`` checks size, signature, binding to the DHT subkey, protocol version,
run and age, in that order, and raises ``RecordError`` naming what was wrong.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocol.identity import IdentityError, public_key_of, sign, verify

PROTOCOL_VERSION = 1
MAX_RECORD_BYTES = 16 * 1024  # a peer record is a few hundred bytes; refuse anything large
MAX_STAGES = 256
MAX_CLOCK_SKEW_S = 30.0  # a record from further in the future than this is refused
MAX_RECORD_AGE_S = 120.0  # peers refresh every few seconds; older signed records are replays
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_PEER_DOMAIN = b"swarmtrain/peer-info"

Rate = Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]


class RecordError(ValueError):
    """A record from the network is malformed, forged, stale, or from another version."""


def check_run_name(run: str) -> str:
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ValueError(
            f"run name {run!r:.80} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run


class PeerState(StrEnum):
    JOINING = "joining"  # measuring and choosing a stage
    LOADING = "loading"  # building or downloading its stage; not routable yet
    SERVING = "serving"  # serves forward and backward for its stage
    LEAVING = "leaving"  # shutting down; not routable


class PeerInfo(BaseModel):
    """What a peer tells the swarm about itself, refreshed every few seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_id: Annotated[str, Field(min_length=1, max_length=64)]
    run: str
    version: Annotated[int, Field(ge=0, le=2**31)]
    device: Annotated[str, Field(max_length=64)]
    throughput: Annotated[tuple[Rate, ...], Field(min_length=1, max_length=MAX_STAGES)]
    throughput_source: Literal["measured", "declared"]
    bandwidth_up_mbps: Rate
    bandwidth_down_mbps: Rate
    bandwidth_source: Literal["measured", "declared", "unknown"]
    stage: Annotated[int, Field(ge=0, lt=MAX_STAGES)] | None
    state: PeerState
    load: Annotated[int, Field(ge=0, le=1_000_000)]
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        return check_run_name(v)

    @field_validator("peer_id")
    @classmethod
    def _peer_id(cls, v: str) -> str:
        try:
            public_key_of(v)
        except IdentityError as e:
            raise ValueError(str(e)) from None
        return v

    def model_post_init(self, _context) -> None:
        if self.stage is not None and self.stage >= len(self.throughput):
            raise ValueError(
                f"stage {self.stage} is out of range for {len(self.throughput)} stages"
            )

    @property
    def routable(self) -> bool:
        return self.state is PeerState.SERVING and self.stage is not None


def encode_peer_info(info: PeerInfo, key: Ed25519PrivateKey) -> bytes:
    """Sign and pack ``info`` for the DHT."""
    payload = info.model_dump_json().encode()
    return msgpack.packb({"record": payload, "sig": sign(key, _PEER_DOMAIN, payload)})


def decode_peer_info(
    raw: bytes,
    *,
    subkey: str | None,
    run: str,
    now: float,
    max_age_s: float,
) -> PeerInfo:
    """Validate bytes read from the DHT under ``subkey``; ``RecordError`` if anything is off."""
    payload, signature = _unpack(raw)
    try:
        info = PeerInfo.model_validate_json(payload)
    except ValidationError as e:
        raise RecordError(f"malformed peer record: {first_error(e)}") from None
    if subkey is not None and subkey != info.peer_id:
        raise RecordError(f"record of peer {info.peer_id} stored under another peer's key {subkey}")
    if not verify(info.peer_id, _PEER_DOMAIN, payload, signature):
        raise RecordError(f"bad signature on the record of peer {info.peer_id}")
    if info.version != PROTOCOL_VERSION:
        raise RecordError(
            f"peer {info.peer_id} speaks protocol version {info.version}, we speak "
            f"{PROTOCOL_VERSION}"
        )
    if info.run != run:
        raise RecordError(f"record of peer {info.peer_id} is for run {info.run!r}, not {run!r}")
    if info.timestamp > now + MAX_CLOCK_SKEW_S:
        raise RecordError(
            f"record of peer {info.peer_id} is dated {info.timestamp - now:.0f} s in the future"
        )
    if info.timestamp < now - max_age_s:
        raise RecordError(
            f"record of peer {info.peer_id} is {now - info.timestamp:.0f} s old "
            f"(limit {max_age_s:.0f} s): stale or replayed"
        )
    return info


def _unpack(raw: bytes) -> tuple[bytes, bytes]:
    if not isinstance(raw, bytes):
        raise RecordError(f"record must be bytes, got {type(raw).__name__}")
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(raw)} bytes exceeds the limit of {MAX_RECORD_BYTES}")
    try:
        envelope = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"record is not valid msgpack: {e}") from None
    if (
        not isinstance(envelope, dict)
        or set(envelope) != {"record", "sig"}
        or not isinstance(envelope["record"], bytes)
        or not isinstance(envelope["sig"], bytes)
    ):
        raise RecordError("record envelope must be a map of exactly {record: bytes, sig: bytes}")
    return envelope["record"], envelope["sig"]


def first_error(e: ValidationError, whole: str = "record") -> str:
    """The first of pydantic's errors on one line: where (a field's path, or ``whole``) and
    what, without echoing the input back."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or whole
    return f"{where}: {err['msg']}"
