"""The records peers publish in the DHT, and their validation.

A record is a frozen pydantic model: an invalid one cannot be built. On the wire it is
the record's JSON plus an Ed25519 signature by the key of the peer it names, packed with
msgpack. ``decode_*`` checks size, signature, binding to the DHT subkey, protocol version,
run and age, in that order, and raises ``RecordError`` naming what was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal, Protocol, TypeVar

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from protocol.identity import public_key_of, sign, verify

PROTOCOL_VERSION = 1
MAX_RECORD_BYTES = 16 * 1024  # a peer record is a few hundred bytes; refuse anything large
MAX_STAGES = 256
MAX_CLOCK_SKEW_S = 30.0  # a record from further in the future than this is refused
MAX_RECORD_AGE_S = 120.0  # peers refresh every few seconds; older signed records are replays
# A run's name, then (in a run id) '@' and its owner's fingerprint (protocol.ownership).
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(@[a-z2-7]{24})?$")
MAX_MEMBERSHIP_CHARS = 2048  # a private run's membership proof, base64 (about 500 bytes)
_PEER_DOMAIN = b"swarmtrain/peer-info"
# A relay's TCP address and peer id: /ip4/A/tcp/P/p2p/ID or /ip6/A/tcp/P/p2p/ID.
RELAY_MADDR_PATTERN = r"^/ip[46]/[0-9a-fA-F.:]+/tcp/[0-9]{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]{1,64}$"

MAX_RATE = 1e9  # samples/s: what a record (or a run announcement) may claim of one stage
Rate = Annotated[float, Field(ge=0.0, le=MAX_RATE, allow_inf_nan=False)]
# How long a record lives in the DHT after its timestamp. A record that names it must be
# stored to expire exactly then (``expires_at``), so a peer's newer record always outlives
# its older ones: a replayed old record cannot displace a fresh one.
RecordTTL = Annotated[float, Field(gt=0.0, le=MAX_RECORD_AGE_S, allow_inf_nan=False)]


def expires_at(timestamp: float, ttl_s: float) -> float:
    """When a record dated ``timestamp`` that lives ``ttl_s`` seconds expires."""
    return timestamp + ttl_s


class RecordError(ValueError):
    """A record from the network is malformed, forged, stale, or from another version."""


def check_run_name(run: str) -> str:
    """A run's name (``NAME``) or id (``NAME@FINGERPRINT``), well formed."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ValueError(
            f"run name {run!r:.80} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (in a run id, then '@' and the owner's "
            "24-character fingerprint)"
        )
    return run


def check_peer_id(peer_id: str) -> str:
    """An Ed25519 peer id whose public key parses (``IdentityError``, a ValueError, if not)."""
    public_key_of(peer_id)
    return peer_id


# Field types that validate themselves, for every record that names a run or a peer.
RunName = Annotated[str, AfterValidator(check_run_name)]
PeerId = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(check_peer_id)]


class PeerState(StrEnum):
    JOINING = "joining"  # measuring and choosing a stage
    LOADING = "loading"  # building or downloading its stage; not routable yet
    SERVING = "serving"  # serves forward and backward for its stage
    LEAVING = "leaving"  # shutting down; not routable


class PeerInfo(BaseModel):
    """What a peer tells the swarm about itself, refreshed every few seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_id: PeerId
    run: RunName
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
    # Private runs: the peer's proof of an invite (protocol.membership), base64.
    membership: Annotated[str, Field(max_length=MAX_MEMBERSHIP_CHARS)] | None = None
    # A second stage it holds (protocol.assignment.second_stage), and whether it serves it
    # yet: routing lends it calls there, the assignment rule plans without its time there.
    second_stage: Annotated[int, Field(ge=0, lt=MAX_STAGES)] | None = None
    second_serving: bool = False
    # What status shows: samples the peer's stage servers computed a forward for (train
    # and validation calls, over both its stages), and when the peer started (DHT time).
    samples_served: Annotated[int, Field(ge=0, le=2**62)] = 0
    started: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    ttl_s: RecordTTL | None = None
    # Whether other peers can dial it (``protocol.reachability``): None while unknown (no
    # peer asked yet, or they disagreed; records from before the field also read None).
    # An unreachable peer is never routed to, unless it serves through a relay:
    reachable: bool | None = None
    # The circuit relay it serves through (``/ip4/A/tcp/P/p2p/RELAY``): callers dial it at
    # ``RELAY/p2p-circuit/p2p/PEER`` (``protocol.reachability.circuit_maddr``).
    relay: Annotated[str, Field(max_length=256, pattern=RELAY_MADDR_PATTERN)] | None = None

    def model_post_init(self, _context) -> None:
        n = len(self.throughput)
        if self.stage is not None and self.stage >= n:
            raise ValueError(f"stage {self.stage} is out of range for {n} stages")
        if self.second_stage is not None and (
            self.stage is None or self.second_stage == self.stage or self.second_stage >= n
        ):
            raise ValueError(
                f"second stage {self.second_stage} must be another of the {n} stages than "
                f"its first ({self.stage})"
            )
        if self.second_serving and self.second_stage is None:
            raise ValueError("second_serving without a second stage")
        if self.started is not None and self.started > self.timestamp:
            raise ValueError("started after the record's timestamp")

    @property
    def routable(self) -> bool:
        """Serving a stage, and reachable directly (or not known not to be) or through a
        relay."""
        return (
            self.state is PeerState.SERVING
            and self.stage is not None
            and (self.reachable is not False or self.relay is not None)
        )

    def routable_by(self, dials_relays: bool) -> bool:
        """``routable``, for a caller that can (``dials_relays``) or cannot open streams
        through a circuit relay (``--no-relay``: its ``p2pd`` runs without the circuit
        transport): a peer known to be reachable only through its relay is out of reach
        of the latter."""
        return self.routable and (dials_relays or self.reachable is not False)


# What a peer record takes on the wire besides its throughput and membership proof, with
# every field at its longest (run id, peer id, device, numbers) and the signed envelope;
# and what each throughput entry adds at its longest (``1.2345678901234567e-300,``).
_RECORD_BASE_BYTES = 900
_RATE_BYTES = 24


@dataclass(frozen=True)
class PeerBounds:
    """What a run's peer records may hold: a throughput for each of its ``n_stages``
    stages, a membership proof only in a ``private`` run, and so at most ``max_bytes``.
    The generic limits (``MAX_STAGES``, ``MAX_MEMBERSHIP_CHARS``) let a record of a small
    public run be ten times the size it needs; records that size cost every reader of
    the run's peers, whose one DHT value holds them all."""

    n_stages: int
    private: bool

    def __post_init__(self) -> None:
        if not 1 <= self.n_stages <= MAX_STAGES:
            raise ValueError(f"n_stages must be in [1, {MAX_STAGES}], got {self.n_stages}")

    @property
    def max_bytes(self) -> int:
        proof = MAX_MEMBERSHIP_CHARS + 16 if self.private else 0
        return _RECORD_BASE_BYTES + _RATE_BYTES * self.n_stages + proof

    def check(self, info: PeerInfo, size: int) -> None:
        """``RecordError`` unless ``info`` (``size`` bytes as stored) fits the run."""
        if len(info.throughput) != self.n_stages:
            raise RecordError(
                f"record of peer {info.peer_id} names {len(info.throughput)} stages; the run "
                f"has {self.n_stages}"
            )
        if info.membership is not None and not self.private:
            raise RecordError(
                f"record of peer {info.peer_id} carries a membership proof in a public run"
            )
        if size > self.max_bytes:
            raise RecordError(
                f"record of peer {info.peer_id} is {size} bytes; a record of this run "
                f"takes at most {self.max_bytes}"
            )


def encode_peer_info(info: PeerInfo, key: Ed25519PrivateKey) -> bytes:
    """Sign and pack ``info`` for the DHT."""
    return encode_signed(info, _PEER_DOMAIN, key)


def decode_peer_info(
    raw: bytes,
    *,
    subkey: str | None,
    run: str,
    now: float,
    max_age_s: float,
) -> PeerInfo:
    """Validate bytes read from the DHT under ``subkey``; ``RecordError`` if anything is off."""
    return decode_signed(
        raw,
        PeerInfo,
        _PEER_DOMAIN,
        kind="peer",
        subkey=subkey,
        run=run,
        now=now,
        max_age_s=max_age_s,
    )


class SignedRecord(Protocol):
    """What ``decode_signed`` checks of a record: whose it is, for which run, when."""

    peer_id: str
    run: str
    version: int
    timestamp: float


_R = TypeVar("_R", bound=BaseModel)


def encode_signed(record: BaseModel, domain: bytes, key: Ed25519PrivateKey) -> bytes:
    """Sign ``record`` (its JSON) in ``domain`` and pack it for the DHT."""
    payload = record.model_dump_json().encode()
    return msgpack.packb({"record": payload, "sig": sign(key, domain, payload)})


# Records whose signature verified, by their bytes: the run's peers are re-read every
# second or so, mostly unchanged, and parsing and verifying each again would make a reader's
# work grow with every record anyone stores (a flood's). The checks that depend on the
# reader (subkey, version, run, age) run on every read. Forgotten all at once past
# ``MAX_VERIFIED_BYTES`` of records.
MAX_VERIFIED_BYTES = 8 * 2**20
_verified: dict[tuple[type, bytes, bytes], BaseModel] = {}
_verified_bytes = 0


def decode_signed(
    raw: bytes,
    cls: type[_R],
    domain: bytes,
    *,
    kind: str,
    subkey: str | None,
    run: str,
    now: float,
    max_age_s: float,
) -> _R:
    """A record of ``cls`` signed in ``domain`` by the peer it names, read from the DHT
    under ``subkey`` (``kind`` names it in errors): checked in size, signature, binding to
    the subkey, protocol version, run and age, in that order; ``RecordError`` naming what
    was wrong."""
    what = f"{kind} record"
    info = _verified.get((cls, domain, raw)) if isinstance(raw, bytes) else None
    if info is None:
        envelope = unpack_signed(raw, ("record", "sig"), "record")
        payload, signature = envelope["record"], envelope["sig"]
        try:
            info = cls.model_validate_json(payload)
        except ValidationError as e:
            raise RecordError(f"malformed {what}: {first_error(e)}") from None
        if subkey is not None and subkey != info.peer_id:
            raise RecordError(
                f"{what} of peer {info.peer_id} stored under another peer's key {subkey}"
            )
        if not verify(info.peer_id, domain, payload, signature):
            raise RecordError(f"bad signature on the record of peer {info.peer_id} ({kind})")
        _remember(cls, domain, raw, info)
    elif subkey is not None and subkey != info.peer_id:
        raise RecordError(f"{what} of peer {info.peer_id} stored under another peer's key {subkey}")
    if info.version != PROTOCOL_VERSION:
        raise RecordError(
            f"peer {info.peer_id} speaks protocol version {info.version}, we speak "
            f"{PROTOCOL_VERSION}"
        )
    if info.run != run:
        raise RecordError(f"{what} of peer {info.peer_id} is for run {info.run!r}, not {run!r}")
    if info.timestamp > now + MAX_CLOCK_SKEW_S:
        raise RecordError(
            f"{what} of peer {info.peer_id} is dated {info.timestamp - now:.0f} s in the future"
        )
    if info.timestamp < now - max_age_s:
        raise RecordError(
            f"{what} of peer {info.peer_id} is {now - info.timestamp:.0f} s old "
            f"(limit {max_age_s:.0f} s): stale or replayed"
        )
    return info


def _remember(cls: type, domain: bytes, raw: bytes, info: BaseModel) -> None:
    global _verified_bytes
    if _verified_bytes + len(raw) > MAX_VERIFIED_BYTES:
        _verified.clear()
        _verified_bytes = 0
    _verified[(cls, domain, raw)] = info
    _verified_bytes += len(raw)


def unpack_signed(
    raw: bytes, fields: tuple[str, ...], what: str, optional: tuple[str, ...] = ()
) -> dict[str, bytes]:
    """A msgpack map of ``fields`` (and maybe some of ``optional``), each bytes, within
    ``MAX_RECORD_BYTES``: the envelope every signed record travels in, checked before
    anything in it is trusted."""
    if not isinstance(raw, bytes):
        raise RecordError(f"{what} must be bytes, got {type(raw).__name__}")
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{what} of {len(raw)} bytes exceeds the limit of {MAX_RECORD_BYTES}")
    try:
        envelope = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"{what} is not valid msgpack: {e}") from None
    if (
        not isinstance(envelope, dict)
        or not set(fields) <= set(envelope) <= set(fields) | set(optional)
        or not all(isinstance(v, bytes) for v in envelope.values())
    ):
        names = ", ".join([f"{f}: bytes" for f in fields] + [f"[{f}: bytes]" for f in optional])
        raise RecordError(f"{what} envelope must be a map of exactly {{{names}}}")
    return envelope


def first_error(e: ValidationError, whole: str = "record") -> str:
    """The first of pydantic's errors on one line: where (a field's path, or ``whole``) and
    what, without echoing the input back."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or whole
    return f"{where}: {err['msg']}"
