"""What a volunteer lets the node take: bandwidth (``--max-upload-mbps``,
``--max-download-mbps``) and memory (``--max-memory``); and the bytes it moves, by purpose.

``TokenBucket`` is the rule, pure (the caller passes the clock): bytes are taken at
``rate`` per second with bursts of ``burst``; a take larger than what is left is granted
at once as a debt, and the answer is how long the caller waits before it sends (or reads
on), so a message larger than the burst still goes, just not sooner than the rate allows.

``Traffic`` applies it to one node, across its processes: the node's own (stage calls it
makes and serves, bandwidth probes) and the hivemind averager processes it forks
(averaging rounds, state downloads). Its buckets and byte counters live in shared memory
made before those forks, so every process of the node takes from one upload and one
download bucket, and the node reads every process's counts. ``install`` wraps hivemind's
``P2P.send_protobuf`` and ``P2P.receive_protobuf`` (every frame of a hivemind stream:
what the averager moves) so that each frame waits for its bytes and is counted; the
node's own stream readers (``node.pipeline``) call ``Traffic.receive`` themselves.
Unary calls (the DHT, matchmaking, gossip) travel through the daemon's control connection
and are neither counted nor limited: they are small.

The purpose of a frame is read from the ``PURPOSE`` context variable where the code that
moves it set one (a stage call, a state download), else from the process's default
(``set_default_purpose``: the averager process says ``averaging``).

What the node plans with under its limits, pure: ``throughput_within`` (the samples/s of a
stage that the bandwidth limits carry, from ``stage_bytes_per_sample``), and
``memory_refusal`` / ``stages_within`` (which stages fit in ``--max-memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass

from hivemind.p2p import P2P

from models.memory import stage_memory as count_stage_memory
from node.pipeline.wire import COMPRESSIONS, compression_name
from protocol.run_spec import RunSpec
from protocol.stage_messages import token_dtype, wire_nbytes

logger = logging.getLogger(__name__)

ACTIVATIONS = "activations"  # a forward's request and reply (stage calls)
GRADIENTS = "gradients"  # a backward's request and reply
AVERAGING = "averaging"  # averaging rounds' parts
STATE = "state"  # a stage's state, downloaded by a peer that takes the stage
PROBE = "probe"  # bandwidth probes
OTHER = "other"
PURPOSES = (ACTIVATIONS, GRADIENTS, AVERAGING, STATE, PROBE, OTHER)
SENT, RECEIVED = "sent", "received"
DIRECTIONS = (SENT, RECEIVED)
UP, DOWN = 0, 1  # the buckets: what the node sends, what it receives

# What a frame adds to its body on a hivemind stream: a marker byte and an 8-byte length.
FRAME_OVERHEAD = 1 + 8
# A bucket holds this many seconds of its rate (at least MIN_BURST_BYTES): enough that a
# frame rarely waits on a link that is not busy, little enough that a window of a few
# seconds sees the rate.
BURST_S = 0.25
MIN_BURST_BYTES = 2**16
# The shared lock is held for microseconds; a process killed while holding it would stop
# every other one for good, so past this the figures are skipped, not waited for.
LOCK_TIMEOUT_S = 1.0

PURPOSE: contextvars.ContextVar[str | None] = contextvars.ContextVar("purpose", default=None)


def mbps_to_bytes(mbps: float) -> float:
    """Mbit/s (10**6 bits) -> bytes per second."""
    return mbps * 1e6 / 8


@dataclass
class TokenBucket:
    """Bytes at ``rate`` per second, at most ``burst`` saved up; ``tokens`` may be
    negative (a debt that later takes wait out). No clock of its own: ``now`` is
    monotonic seconds, from the caller."""

    rate: float  # bytes per second; > 0
    burst: float  # bytes; > 0
    tokens: float
    at: float  # when ``tokens`` was last brought up to date

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst > 0):
            raise ValueError(f"rate and burst must be > 0, got {self.rate} and {self.burst}")

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def take(self, n: float, now: float) -> float:
        """Take ``n`` bytes now; returns the seconds to wait before moving them (0: at
        once). Waits of successive takes add up: each caller waits for its own bytes and
        for those granted before it."""
        if n < 0:
            raise ValueError(f"cannot take {n} bytes")
        self.refill(now)
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def burst_for(rate: float) -> float:
    return max(MIN_BURST_BYTES, rate * BURST_S)


@dataclass(frozen=True)
class TrafficCounts:
    """A copy of the counters at one moment; every figure only grows."""

    bytes: dict[tuple[str, str], int]  # (purpose, direction) -> bytes
    waited_s: dict[str, float]  # direction -> seconds takes waited for the limit
    limits: dict[str, float | None]  # direction -> bytes per second (None: no limit)

    def total(self, direction: str) -> int:
        return sum(n for (_, d), n in self.bytes.items() if d == direction)


class Traffic:
    """One node's buckets and counters, shared with the processes it forks after this is
    built. Without a limit a direction is only counted."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._lock = ctx.Lock()
        # per bucket (UP, DOWN): rate (0: none), burst, tokens, at, seconds waited
        self._buckets = ctx.RawArray("d", 2 * 5)
        self._bytes = ctx.RawArray("q", len(PURPOSES) * len(DIRECTIONS))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[bool]:
        """Holds the shared lock if it comes within ``LOCK_TIMEOUT_S``; yields whether it did."""
        got = self._lock.acquire(timeout=LOCK_TIMEOUT_S)
        if not got:
            logger.warning("the traffic counters' lock is stuck; this frame goes uncounted")
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def set_limits(self, up_mbps: float | None, down_mbps: float | None) -> None:
        """Limit what the node sends and receives (Mbit/s; None: no limit)."""
        for mbps in (up_mbps, down_mbps):
            if mbps is not None and not mbps > 0:
                raise ValueError(f"a limit must be more than 0 Mbit/s, got {mbps}")
        now = time.monotonic()
        with self._locked():
            for i, mbps in ((UP, up_mbps), (DOWN, down_mbps)):
                rate = 0.0 if mbps is None else mbps_to_bytes(mbps)
                burst = burst_for(rate) if rate else 0.0
                self._buckets[5 * i : 5 * i + 4] = [rate, burst, burst, now]

    def limit(self, direction: int) -> float | None:
        """The bucket's rate in bytes per second, None without a limit."""
        rate = self._buckets[5 * direction]
        return rate or None

    def _take(self, direction: int, n: int, now: float) -> float:
        with self._locked() as got:
            b = self._buckets
            o = 5 * direction
            if not got or not b[o]:
                return 0.0
            bucket = TokenBucket(b[o], b[o + 1], b[o + 2], b[o + 3])
            wait = bucket.take(n, now)
            b[o + 2], b[o + 3] = bucket.tokens, bucket.at
            b[o + 4] += wait
            return wait

    def count(self, n: int, purpose: str, direction: str) -> None:
        i = PURPOSES.index(purpose) * len(DIRECTIONS) + DIRECTIONS.index(direction)
        with self._locked() as got:
            if got:
                self._bytes[i] += n

    async def send(self, n: int, purpose: str | None = None) -> None:
        """Count ``n`` bytes about to be sent, and wait until the upload limit lets them go."""
        await self._move(UP, SENT, n, purpose)

    async def receive(self, n: int, purpose: str | None = None) -> None:
        """Count ``n`` bytes just read, and wait until the download limit lets the caller
        read on (the bytes not read meanwhile hold the sender back)."""
        await self._move(DOWN, RECEIVED, n, purpose)

    async def _move(self, bucket: int, direction: str, n: int, purpose: str | None) -> None:
        self.count(n, purpose or current_purpose(), direction)
        wait = self._take(bucket, n, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)

    def counts(self) -> TrafficCounts:
        with self._locked():
            raw = list(self._bytes)
            buckets = list(self._buckets)
        by = {
            (p, d): raw[i * len(DIRECTIONS) + j]
            for i, p in enumerate(PURPOSES)
            for j, d in enumerate(DIRECTIONS)
        }
        return TrafficCounts(
            bytes=by,
            waited_s={SENT: buckets[5 * UP + 4], RECEIVED: buckets[5 * DOWN + 4]},
            limits={SENT: buckets[5 * UP] or None, RECEIVED: buckets[5 * DOWN] or None},
        )


_default_purpose = OTHER


def set_default_purpose(purpose: str) -> None:
    """What this process's frames count as where no ``PURPOSE`` is set."""
    global _default_purpose
    if purpose not in PURPOSES:
        raise ValueError(f"unknown purpose {purpose!r}; one of {', '.join(PURPOSES)}")
    _default_purpose = purpose


def current_purpose() -> str:
    return PURPOSE.get() or _default_purpose


# The node's, made at import: before the node forks its DHT and averager processes.
traffic = Traffic()

_hivemind_send_protobuf = P2P.__dict__["send_protobuf"].__func__
_hivemind_receive_protobuf = P2P.__dict__["receive_protobuf"].__func__


async def _send_protobuf(protobuf, writer: asyncio.StreamWriter) -> None:
    await traffic.send(protobuf.ByteSize() + FRAME_OVERHEAD)
    await _hivemind_send_protobuf(protobuf, writer)


async def _receive_protobuf(input_protobuf_type, reader: asyncio.StreamReader):
    message, error = await _hivemind_receive_protobuf(input_protobuf_type, reader)
    got = message if message is not None else error
    await traffic.receive(got.ByteSize() + FRAME_OVERHEAD)
    return message, error


def install(up_mbps: float | None = None, down_mbps: float | None = None) -> None:
    """Set the node's limits and make every hivemind stream frame of this process (and of
    those it forks from now on) wait for them and count (idempotent)."""
    traffic.set_limits(up_mbps, down_mbps)
    P2P.send_protobuf = staticmethod(_send_protobuf)
    P2P.receive_protobuf = staticmethod(_receive_protobuf)


def memory_refusal(
    needs: list[int], budget: int | None, stages: list[int]
) -> tuple[int, str] | None:
    """Whether a node whose stages may take ``budget`` bytes (None: no limit) can hold
    ``stages`` together, each needing ``needs[stage]`` bytes: None if it can, else the
    stage it cannot take and why, in one line."""
    if budget is None:
        return None
    used = 0
    for stage in stages:
        used += needs[stage]
        if used > budget:
            also = f" besides stage {stages[0]}" if stage != stages[0] else ""
            return stage, (
                f"stage {stage} needs about {_mib(needs[stage])} MiB{also}, more than "
                f"--max-memory allows ({_mib(budget)} MiB)"
            )
    return None


def stages_within(needs: list[int], budget: int | None) -> list[int]:
    """The stages that fit in ``budget`` bytes one at a time (all of them without a limit)."""
    return [s for s, need in enumerate(needs) if budget is None or need <= budget]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


# Bytes a value of an averaging round takes on the wire, by ``averaging.compression``
# (uint8: a byte a value, its block's scale aside); float32 otherwise.
AVERAGED_BYTES = {"float16": 2, "uint8": 1}


def stage_bytes_per_sample(spec: RunSpec, stage: int) -> tuple[float, float]:
    """(sent, received) bytes per training sample that a peer serving ``stage`` moves, for
    planning: the stage's requests and replies (a forward and a backward, or the last
    stage's one call) at the run's compression, and its share of the averaging rounds
    (about twice the values it averages each way per round, at the rounds' compression: its
    parameters, or their ``density`` share; a round per ``target_batch_size`` samples, or
    per ``inner_steps`` of them in DiLoCo). Its own trainer's calls are not
    counted: they are the trainer's, not the stage's."""
    model, optim, averaging = spec.model, spec.optim, spec.averaging
    hidden = wire_nbytes(compression_name(COMPRESSIONS[spec.compression]), "float32",
                         model.block_size * model.boundary_width)  # fmt: skip
    tokens = 8 * model.block_size
    first, last = stage == 0, stage == spec.n_stages - 1
    inputs = tokens if first else hidden
    back = 0 if first else hidden  # the gradient w.r.t. the inputs
    if model.boundary_rank and not first:  # a low-rank boundary: token ids with the states
        inputs += wire_nbytes("NONE", token_dtype(model.vocab_size - 1), model.block_size)
    if last:  # one call: inputs and targets in; the loss (8 bytes) and that gradient out
        sent, received = 8 + back, inputs + tokens
    else:  # a forward (inputs in, outputs out), then a backward (both in, a gradient out)
        sent, received = hidden + back, 2 * inputs + hidden
    element = AVERAGED_BYTES.get(averaging.compression, 4) * averaging.density
    per_round = 2 * element * count_stage_memory(model, spec.stage_range(stage)).parameters
    rounds = 1 / optim.target_batch_size
    if averaging.mode == "diloco":
        rounds /= averaging.inner_steps
    return sent + per_round * rounds, received + per_round * rounds


def throughput_within(
    spec: RunSpec, stage: int, throughput: float, up_mbps: float | None, down_mbps: float | None
) -> float:
    """``throughput`` (samples/s of compute) capped by what the limits let the stage move
    (``stage_bytes_per_sample``): what routing and assignment should plan with."""
    sent, received = stage_bytes_per_sample(spec, stage)
    for mbps, per_sample in ((up_mbps, sent), (down_mbps, received)):
        if mbps is not None and per_sample > 0:
            throughput = min(throughput, mbps_to_bytes(mbps) / per_sample)
    return throughput
