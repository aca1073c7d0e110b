"""Measuring the bandwidth of this node's link against a peer, over hivemind's P2P layer.

``BandwidthProbe`` serves two unary handlers: ``rpc_upload`` takes a payload and answers
with its size, ``rpc_download`` answers with as many bytes as it is asked for.
``measure_bandwidth`` times both against one peer and returns (up, down) in Mbit/s.

Unary calls travel through the daemon's persistent connection, whose messages hold at
most 4 MiB (``node.pipeline.server`` says what happens past that), so a probe moves at most
``MAX_PROBE_BYTES`` (2 MiB) per call. Nothing a peer sends decides what the probe
allocates: a download is a slice of one random buffer made at start, a request over the
limit is refused before anything is read into a response, and the bytes served per
second are budgeted, so that a flood of small requests cannot queue up large answers.

What is measured: the fastest of ``rounds`` calls, less the fastest round trip of an
empty call (latency is not bandwidth), but never less than half of the call, so that
jitter on a fast link cannot make the figure absurd. It includes both ends' copies
through their ``p2pd``; on loopback that caps it at what the P2P layer itself moves,
far above the home links it is meant for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import struct
import time
from collections.abc import Callable, Iterable

from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2

from node import limits
from node.limits import PROBE, RECEIVED, SENT, TokenBucket
from node.rpc.service import NodeServicer
from protocol.records import PeerInfo
from protocol.routing import BanList

logger = logging.getLogger(__name__)

MAX_PARTNERS = 3  # peers a node tries to measure its bandwidth against, at most
MAX_PROBE_BYTES = 2 * 2**20  # per call; within hivemind's 4 MiB unary message limit
DEFAULT_PROBE_BYTES = 2**20
# Bytes served per second, with bursts of BURST: enough for a few peers measuring at
# once, and a bound on what a flood of download requests can make this node send.
SERVE_RATE_BPS = 8 * 2**20
SERVE_BURST_BYTES = 16 * 2**20

_SIZE = struct.Struct(">Q")  # a download request and an upload's answer: a byte count
_REFUSED = "bandwidth probe refused: "


class BandwidthProbeError(ValueError):
    """Raised by the probe's handlers; the caller sees it as ``P2PHandlerError``."""


class BandwidthError(RuntimeError):
    """No measurement: the peer refused, could not be reached, timed out or answered
    nonsense. The node then advertises its bandwidth as unknown (or declared)."""


class BandwidthProbe(NodeServicer):
    """Answers other peers' bandwidth probes; build with ``await BandwidthProbe.create(p2p)``."""

    service_name = "BandwidthProbe"

    def __init__(
        self,
        *,
        max_bytes: int = MAX_PROBE_BYTES,
        rate_bps: float = SERVE_RATE_BPS,
        burst_bytes: float = SERVE_BURST_BYTES,
        callers: BanList | None = None,
    ) -> None:
        if not 0 < max_bytes <= MAX_PROBE_BYTES or burst_bytes < max_bytes:
            raise ValueError(
                f"max_bytes must be in 1..{MAX_PROBE_BYTES} and burst_bytes >= max_bytes, "
                f"got {max_bytes} and {burst_bytes}"
            )
        self.max_bytes = max_bytes
        self._payload = os.urandom(max_bytes)  # incompressible; downloads are slices of it
        self._budget = TokenBucket.full(rate_bps, burst_bytes, time.monotonic())
        self.callers = callers  # malformed or oversized calls count against their caller
        self.served = 0  # calls answered
        self.refusals = 0  # calls refused

    @classmethod
    async def create(cls, p2p: P2P, **settings) -> BandwidthProbe:
        self = cls(**settings)
        await self.attach(p2p)
        return self

    async def shutdown(self) -> None:
        await self.detach()

    async def rpc_upload(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A payload in ``metadata`` -> its size (8 bytes, big-endian)."""
        n = len(request.metadata)
        if n > self.max_bytes or request.tensors or request.uid:
            self._refuse(context, f"an upload of {n} bytes (the limit is {self.max_bytes})")
        await limits.traffic.receive(n, PROBE)
        self.served += 1
        return runtime_pb2.ExpertResponse(metadata=_SIZE.pack(n))

    async def rpc_download(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A byte count (8 bytes, big-endian, in ``metadata``) -> that many random bytes."""
        if len(request.metadata) != _SIZE.size or request.tensors or request.uid:
            self._refuse(context, "a malformed download request (expected an 8-byte size)")
        (n,) = _SIZE.unpack(request.metadata)
        if n > self.max_bytes:
            self._refuse(context, f"a download of {n} bytes (the limit is {self.max_bytes})")
        if not self._within_budget(n):  # not the caller's fault: no strike
            self._refuse(
                context, f"a download of {n} bytes: busy, try again in a few seconds", strike=False
            )
        await limits.traffic.send(n, PROBE)
        self.served += 1
        return runtime_pb2.ExpertResponse(metadata=self._payload[:n])

    def _within_budget(self, n: int) -> bool:
        """Take ``n`` bytes from the serving budget if they are there now (never waits)."""
        budget, now = self._budget, time.monotonic()
        budget.refill(now)
        if n > budget.tokens:
            return False
        budget.take(n, now)
        return True

    def _refuse(self, context: P2PContext, what: str, strike: bool = True) -> None:
        self.refusals += 1
        if strike:
            self.refused(context, "a bandwidth probe", what)
        else:
            logger.warning("refused %s from %s", what, context.remote_id)
        raise BandwidthProbeError(_REFUSED + what)


async def measure_bandwidth(
    p2p: P2P,
    peer_id: PeerID,
    nbytes: int = DEFAULT_PROBE_BYTES,
    rounds: int = 2,
    timeout: float = 10.0,
) -> tuple[float, float]:
    """(upload, download) bandwidth to ``peer_id`` in Mbit/s; ``BandwidthError`` if the peer
    cannot be measured within ``timeout`` seconds (all calls together)."""
    if not 0 < nbytes <= MAX_PROBE_BYTES or rounds < 1:
        raise ValueError(
            f"nbytes must be in 1..{MAX_PROBE_BYTES} and rounds >= 1, got {nbytes} and {rounds}"
        )
    stub = BandwidthProbe.get_stub(p2p, peer_id)
    upload = runtime_pb2.ExpertRequest(metadata=os.urandom(nbytes))
    download = runtime_pb2.ExpertRequest(metadata=_SIZE.pack(nbytes))
    empty = runtime_pb2.ExpertRequest(metadata=_SIZE.pack(0))

    async def fastest(call, request, check) -> float:
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            response = await call(request)
            best = min(best, time.perf_counter() - started)
            if not check(response.metadata):
                raise BandwidthError(f"peer {peer_id} answered a probe with nonsense")
        return best

    try:
        async with asyncio.timeout(timeout):
            # the empty calls also connect, if need be, before anything is timed
            rtt = await fastest(stub.rpc_download, empty, lambda got: got == b"")
            up = await fastest(stub.rpc_upload, upload, lambda got: got == _SIZE.pack(nbytes))
            down = await fastest(stub.rpc_download, download, lambda got: len(got) == nbytes)
            limits.traffic.count(rounds * nbytes, PROBE, SENT)
            limits.traffic.count(rounds * nbytes, PROBE, RECEIVED)
    except TimeoutError:
        raise BandwidthError(f"peer {peer_id}: no measurement within {timeout} s") from None
    except P2PHandlerError as e:
        message = str(e)  # the repr of the remote exception
        if _REFUSED in message:
            reason = message.split(_REFUSED, 1)[1].rstrip("')\"")
            raise BandwidthError(f"peer {peer_id} refused the probe: {reason}") from None
        raise BandwidthError(f"peer {peer_id} failed to serve the probe: {message}") from None
    except (P2PDaemonError, OSError, asyncio.IncompleteReadError) as e:
        raise BandwidthError(f"peer {peer_id} unreachable: {type(e).__name__}: {e}") from None
    return _mbps(nbytes, up, rtt), _mbps(nbytes, down, rtt)


def partners(
    records: Iterable[PeerInfo],
    me: str,
    reached: Callable[[str], bool],
    seed: str,
    limit: int = MAX_PARTNERS,
) -> list[str]:
    """At most ``limit`` serving peers to measure against, in the order to try them: those
    this node has reached (``reached``: a live host holds the key: on the run's topic
    with us, or dialed) first, then the others, each group in an order drawn from
    ``seed``. A record costs nothing to forge: with the others first, a flood of records
    would spend every try on peers that run no host."""
    rng = random.Random(seed)
    serving = sorted({p.peer_id for p in records if p.routable and p.peer_id != me})
    first = [p for p in serving if reached(p)]
    rest = [p for p in serving if not reached(p)]
    rng.shuffle(first)
    rng.shuffle(rest)
    return (first + rest)[: max(0, limit)]


def advertised(
    figure: tuple[float, float] | float | None, limit_up: float | None, limit_down: float | None
) -> tuple[float, float] | None:
    """(up, down) Mbit/s as a record says them: ``figure`` (measured (up, down), or one
    declared figure for both; None: unknown) capped by the node's limits (None: none).
    An unknown figure with both limits set is the limits; with one, still unknown."""
    if isinstance(figure, tuple):
        up, down = figure
    else:
        up = down = figure
    if up is None:
        if limit_up is None or limit_down is None:
            return None
        return limit_up, limit_down
    return (
        up if limit_up is None else min(up, limit_up),
        down if limit_down is None else min(down, limit_down),
    )


def _mbps(nbytes: int, elapsed: float, rtt: float) -> float:
    transfer = max(elapsed - rtt, elapsed / 2)
    return nbytes * 8 / transfer / 1e6
