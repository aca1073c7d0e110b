"""The messages peers gossip on their run's topic, and the filter every receiver applies.

Gossip carries what changes faster than DHT records are refreshed: a peer's intent to join
a stage, that it serves, its load, its intent to move, that it leaves. The DHT stays the
source of truth a newcomer reads; gossip only makes the swarm react in seconds. So a
message is small, idempotent (it states where a peer is, not a delta) and re-announced,
and losing one costs a period at most.

A message is a frozen pydantic model signed by the Ed25519 key of the peer it names (the
key that is also its libp2p identity), and carries the run, the protocol version, a
sequence number that grows with every message of that peer (also across restarts: it
starts from the clock, in microseconds) and a timestamp. On the wire it is the model's
JSON and the signature, packed with msgpack, as DHT records are (``protocol.records``).

:class:`GossipView` keeps the latest message of each peer and ignores, with a typed
reason, anything forged, replayed, stale, from another run or version, or relayed under
another peer's name. Pure: bytes in, messages out; the caller owns the clock and the
network (``node.rpc.gossip``). Imports nothing from hivemind, so that a py-libp2p process
(``scripts/watch_gossip.py``) can use it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Literal

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from protocol.assignment import Claim
from protocol.identity import peer_id_of, sign, verify
from protocol.records import (
    MAX_CLOCK_SKEW_S,
    MAX_STAGES,
    PROTOCOL_VERSION,
    PeerId,
    Rate,
    RecordError,
    RunName,
    check_run_name,
    first_error,
)

MAX_GOSSIP_BYTES = 4 * 1024  # a message is about 400 bytes; far below the daemon's 1 MiB cap
MAX_GOSSIP_AGE_S = 60.0  # peers re-announce every few seconds; older messages are replays
MAX_SEQNO = 2**63 - 1
_GOSSIP_DOMAIN = b"swarmtrain/gossip"

Stage = Annotated[int, Field(ge=0, lt=MAX_STAGES)]


def run_topic(run: str) -> str:
    """The GossipSub topic of ``run``'s assignment messages: one topic per run."""
    return f"swarmtrain/{check_run_name(run)}/assignment"


class Ignored(StrEnum):
    """Why a receiver ignored a message."""

    TOO_LARGE = "too large"
    MALFORMED = "malformed"
    OTHER_VERSION = "other protocol version"
    OTHER_RUN = "other run"
    WRONG_SENDER = "claimed peer is not the libp2p sender"
    FORGED = "bad signature"
    FUTURE = "dated in the future"
    STALE = "stale"
    REPLAYED = "old or repeated sequence number"
    OUT_OF_RANGE = "stage out of range"
    REFUSED = "refused by a validator"


class GossipError(RecordError):
    """A gossip message that a receiver ignores; ``reason`` says why, the text the details."""

    def __init__(self, reason: Ignored, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Message(BaseModel):
    """What every message carries: who, where, which protocol, in what order, when."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_id: PeerId
    run: RunName
    version: Annotated[int, Field(ge=0, le=2**31)]
    seqno: Annotated[int, Field(ge=1, le=MAX_SEQNO)]
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]

    @property
    def claimed_stage(self) -> int | None:
        """The stage this message says the peer holds or is about to hold; None if none."""
        raise NotImplementedError

    @property
    def serving(self) -> bool:
        """Whether the peer serves ``claimed_stage`` now (not only intends to)."""
        return False


class _AtStage(_Message):
    """A message about one stage the peer holds, or is about to hold."""

    stage: Stage
    throughput: Rate  # the peer's measured throughput for this stage, samples/s

    @property
    def claimed_stage(self) -> int:
        return self.stage


class JoinIntent(_AtStage):
    """A joining peer chose ``stage`` and is about to load it: others count it at once."""

    kind: Literal["join"] = "join"


class _Served(_AtStage):
    @property
    def serving(self) -> bool:
        return True


class Serving(_Served):
    """The peer has loaded ``stage`` and serves it."""

    kind: Literal["serving"] = "serving"


class LoadUpdate(_Served):
    """A serving peer's queue length, for routing; also re-announces where it is."""

    kind: Literal["load"] = "load"
    load: Annotated[int, Field(ge=0, le=1_000_000)]


class MoveIntent(_Message):
    """A serving peer leaves ``from_stage`` for ``to_stage``: announced before it unloads."""

    kind: Literal["move"] = "move"
    from_stage: Stage
    to_stage: Stage
    throughput: Rate  # for ``to_stage``

    def model_post_init(self, _context) -> None:
        if self.from_stage == self.to_stage:
            raise ValueError(f"a move must change stage, got {self.from_stage} -> {self.to_stage}")

    @property
    def claimed_stage(self) -> int:
        return self.to_stage


class Leaving(_Message):
    """The peer shuts down; route nothing more to it."""

    kind: Literal["leaving"] = "leaving"
    stage: Stage | None

    @property
    def claimed_stage(self) -> None:
        return None


GossipMessage = Annotated[
    JoinIntent | Serving | LoadUpdate | MoveIntent | Leaving, Field(discriminator="kind")
]
_MESSAGE = TypeAdapter(GossipMessage)


def encode_message(message: _Message, key: Ed25519PrivateKey) -> bytes:
    """Sign and pack ``message``; ``ValueError`` if ``key`` is not its peer's or it is too
    large (a programming error: messages have bounded fields)."""
    if peer_id_of(key.public_key()) != message.peer_id:
        raise ValueError(f"cannot sign a message of peer {message.peer_id} with another key")
    payload = message.model_dump_json().encode()
    raw = msgpack.packb({"msg": payload, "sig": sign(key, _GOSSIP_DOMAIN, payload)})
    if len(raw) > MAX_GOSSIP_BYTES:
        raise ValueError(f"gossip message of {len(raw)} bytes exceeds {MAX_GOSSIP_BYTES}")
    return raw


def decode_message(
    raw: bytes,
    *,
    run: str,
    sender: str | None,
    now: float,
    max_age_s: float = MAX_GOSSIP_AGE_S,
    num_stages: int | None = None,
) -> GossipMessage:
    """Validate bytes received from ``sender`` (the libp2p peer the pubsub envelope names,
    which the daemon has authenticated; None when there is none) on ``run``'s topic.
    Cheap checks come first, the signature after, so junk costs little. ``GossipError``
    names what was wrong."""
    payload, signature = _unpack(raw)
    try:
        message = _MESSAGE.validate_json(payload)
    except ValidationError as e:
        raise GossipError(Ignored.MALFORMED, first_error(e, "message")) from None
    who = f"message {message.seqno} of peer {message.peer_id}"
    if message.version != PROTOCOL_VERSION:
        raise GossipError(
            Ignored.OTHER_VERSION,
            f"{who} speaks protocol version {message.version}, we speak {PROTOCOL_VERSION}",
        )
    if message.run != run:
        raise GossipError(Ignored.OTHER_RUN, f"{who} is for run {message.run!r}, not {run!r}")
    if sender is not None and sender != message.peer_id:
        raise GossipError(Ignored.WRONG_SENDER, f"{who} was published by peer {sender}")
    if not verify(message.peer_id, _GOSSIP_DOMAIN, payload, signature):
        raise GossipError(Ignored.FORGED, f"{who} is not signed by that peer's key")
    if message.timestamp > now + MAX_CLOCK_SKEW_S:
        raise GossipError(
            Ignored.FUTURE, f"{who} is dated {message.timestamp - now:.0f} s in the future"
        )
    if message.timestamp < now - max_age_s:
        raise GossipError(
            Ignored.STALE, f"{who} is {now - message.timestamp:.0f} s old (limit {max_age_s:.0f} s)"
        )
    if num_stages is not None:
        stages = [getattr(message, f, None) for f in ("stage", "from_stage", "to_stage")]
        if any(s is not None and s >= num_stages for s in stages):
            raise GossipError(
                Ignored.OUT_OF_RANGE, f"{who} names a stage beyond the run's {num_stages}"
            )
    return message


def _unpack(raw: bytes) -> tuple[bytes, bytes]:
    if not isinstance(raw, bytes):
        raise GossipError(Ignored.MALFORMED, f"message must be bytes, got {type(raw).__name__}")
    if len(raw) > MAX_GOSSIP_BYTES:
        raise GossipError(
            Ignored.TOO_LARGE,
            f"message of {len(raw)} bytes exceeds the limit of {MAX_GOSSIP_BYTES}",
        )
    try:
        envelope = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise GossipError(Ignored.MALFORMED, f"message is not valid msgpack: {e}") from None
    if (
        not isinstance(envelope, dict)
        or set(envelope) != {"msg", "sig"}
        or not all(isinstance(v, bytes) for v in envelope.values())
    ):
        raise GossipError(
            Ignored.MALFORMED, "message envelope must be a map of exactly {msg: bytes, sig: bytes}"
        )
    return envelope["msg"], envelope["sig"]


class GossipSigner:
    """Stamps and signs one peer's messages for one run. Holds the last sequence number,
    nothing else; the caller passes the time."""

    def __init__(self, key: Ed25519PrivateKey, run: str) -> None:
        self.key = key
        self.run = check_run_name(run)
        self.peer_id = peer_id_of(key.public_key())
        self._seqno = 0

    def next_seqno(self, now: float) -> int:
        """Strictly increasing, and from the clock in microseconds, so that a restarted
        peer (same key, counter lost) is not taken for a replay of its former self."""
        self._seqno = max(self._seqno + 1, int(now * 1_000_000))
        if self._seqno > MAX_SEQNO:
            raise ValueError(f"sequence number {self._seqno} overflows; is the clock {now} sane?")
        return self._seqno

    def _sign(self, cls: type[_Message], now: float, **fields) -> bytes:
        message = cls(
            peer_id=self.peer_id,
            run=self.run,
            version=PROTOCOL_VERSION,
            seqno=self.next_seqno(now),
            timestamp=now,
            **fields,
        )
        return encode_message(message, self.key)

    def join(self, stage: int, throughput: float, now: float) -> bytes:
        return self._sign(JoinIntent, now, stage=stage, throughput=throughput)

    def serving(self, stage: int, throughput: float, now: float) -> bytes:
        return self._sign(Serving, now, stage=stage, throughput=throughput)

    def load(self, stage: int, throughput: float, load: int, now: float) -> bytes:
        return self._sign(LoadUpdate, now, stage=stage, throughput=throughput, load=load)

    def move(self, from_stage: int, to_stage: int, throughput: float, now: float) -> bytes:
        return self._sign(
            MoveIntent, now, from_stage=from_stage, to_stage=to_stage, throughput=throughput
        )

    def leaving(self, stage: int | None, now: float) -> bytes:
        return self._sign(Leaving, now, stage=stage)


Validator = Callable[[GossipMessage], None]  # raises ValueError to refuse a message


class GossipView:
    """The latest valid message of each peer on one run's topic.

    ``receive`` returns a message it accepted or raises ``GossipError``; the caller logs
    and goes on. A peer's message replaces its previous one only with a larger sequence
    number, so replays and reordered deliveries never roll a peer back. Extra checks (a
    private run's membership, say) plug in as ``validators``, run after the built-in ones.
    ``ignored`` counts what was ignored, by reason.
    """

    def __init__(
        self,
        run: str,
        *,
        num_stages: int | None = None,
        max_age_s: float = MAX_GOSSIP_AGE_S,
        validators: Sequence[Validator] = (),
    ) -> None:
        self.run = check_run_name(run)
        self.num_stages = num_stages
        self.max_age_s = max_age_s
        self.validators = tuple(validators)
        self.ignored: Counter[Ignored] = Counter()
        self._latest: dict[str, GossipMessage] = {}

    @property
    def latest(self) -> Mapping[str, GossipMessage]:
        """Peer id -> its latest accepted message (read-only)."""
        return MappingProxyType(self._latest)

    def receive(self, raw: bytes, sender: str | None, now: float) -> GossipMessage:
        try:
            message = decode_message(
                raw,
                run=self.run,
                sender=sender,
                now=now,
                max_age_s=self.max_age_s,
                num_stages=self.num_stages,
            )
            previous = self._latest.get(message.peer_id)
            if previous is not None and message.seqno <= previous.seqno:
                raise GossipError(
                    Ignored.REPLAYED,
                    f"message {message.seqno} of peer {message.peer_id} is not newer than "
                    f"{previous.seqno}",
                )
            for validate in self.validators:
                try:
                    validate(message)
                except GossipError:
                    raise
                except ValueError as e:
                    raise GossipError(Ignored.REFUSED, str(e)) from None
        except GossipError as e:
            self.ignored[e.reason] += 1
            raise
        self._latest[message.peer_id] = message
        return message

    def expire(self, now: float) -> list[str]:
        """Forget peers whose latest message is older than ``max_age_s`` (so is anything
        that could replay them: older messages are stale too); return their ids."""
        gone = [p for p, m in self._latest.items() if m.timestamp < now - self.max_age_s]
        for p in gone:
            del self._latest[p]
        return gone

    def leaving(self) -> set[str]:
        """Peers whose latest word is that they leave."""
        return {p for p, m in self._latest.items() if isinstance(m, Leaving)}

    def claims(self, exclude: Iterable[str] = ()) -> list[Claim]:
        """Each peer's hold on a stage as its latest message states it, for
        ``protocol.assignment.view_from_peers(intents=...)``: intents and moves count as
        not serving yet; leaving peers have none."""
        skip = set(exclude)
        return [
            Claim(p, m.claimed_stage, m.throughput, m.serving)
            for p, m in sorted(self._latest.items())
            if m.claimed_stage is not None and p not in skip
        ]
