"""Reachability: dialling peers back on request, and asking peers to dial us back.

``DialBack`` serves one unary handler, ``rpc_dial_back`` (``protocol.reachability`` has
the messages and the rules). The dial is genuinely fresh: a raw TCP connection from this
process to the address asked about, never the daemon's (p2pd reuses the connection it
already has to a peer, which proves nothing about whether the peer can be dialled), and
it counts only if a libp2p listener answers with its multistream header. It does not
prove whose listener it is: a peer that forwards its port to another peer's passes.

``check_reachability`` asks a few peers at once and applies ``verdict``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence

from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2

from node.rpc.service import NodeServicer
from protocol.reachability import (
    MAX_MADDRS,
    MULTISTREAM_HEADER,
    DialBackAnswer,
    DialBackRequest,
    DialResult,
    Reachability,
    ReachabilityError,
    decode,
    dial_target,
    encode,
    observed_ip,
    verdict,
)
from protocol.routing import BanList

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0  # per address: a home router that drops the SYN costs this much
ASK_PEERS = 5  # peers asked at once
MAX_CONCURRENT_DIALS = 8  # dials this node runs for others at once; more wait


class DialBack(NodeServicer):
    """Dials peers back when they ask; build with ``await DialBack.create(p2p)``."""

    service_name = "DialBack"

    def __init__(self, *, timeout_s: float = DIAL_TIMEOUT_S, callers: BanList | None = None):
        self.timeout_s = timeout_s
        self.callers = callers  # malformed requests count against their caller
        self._dials = asyncio.Semaphore(MAX_CONCURRENT_DIALS)

    @classmethod
    async def create(cls, p2p: P2P, **settings) -> DialBack:
        self = cls(**settings)
        await self.attach(p2p)
        return self

    async def shutdown(self) -> None:
        await self.detach()

    async def rpc_dial_back(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A ``DialBackRequest`` (JSON in ``metadata``) -> a ``DialBackAnswer``."""
        try:
            asked = decode(request.metadata, DialBackRequest)
        except ReachabilityError as e:
            self.refused(context, "a dial-back request", str(e))
            raise
        observed = await self._observed(context.remote_id)
        ips = {observed_ip(m) for m in observed}
        results = await asyncio.gather(*(self._check(m, ips) for m in asked.maddrs))
        answer = DialBackAnswer(observed=tuple(observed[:MAX_MADDRS]), results=tuple(results))
        return runtime_pb2.ExpertResponse(metadata=encode(answer))

    async def _observed(self, peer: PeerID) -> list[str]:
        """The remote addresses of our connections to ``peer``."""
        return [str(a) for p in await self.p2p.list_peers() if p.peer_id == peer for a in p.addrs]

    async def _check(self, maddr: str, ips: set[str | None]) -> DialResult:
        try:
            ip, port = dial_target(maddr)
        except ValueError as e:
            return DialResult(maddr=maddr, ok=False, error=str(e)[:200])
        if ip not in ips:
            seen = ", ".join(sorted(str(i) for i in ips)) or "nowhere"
            why = f"not dialled: your connections come from {seen}, not {ip}"
            return DialResult(maddr=maddr, ok=False, error=why[:200])
        async with self._dials:
            error = await dial(ip, port, self.timeout_s)
        return DialResult(maddr=maddr, ok=error is None, error=error)


async def dial(ip: str, port: int, timeout_s: float) -> str | None:
    """None if a fresh TCP connection to ``ip:port`` reaches a libp2p listener within
    ``timeout_s``, else why not (one line)."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(ip, port)
            header = await reader.readexactly(len(MULTISTREAM_HEADER))
        if header != MULTISTREAM_HEADER:
            return "something other than a libp2p listener answered"
        return None
    except TimeoutError:
        return f"no answer within {timeout_s:.0f} s"
    except (OSError, asyncio.IncompleteReadError) as e:
        return f"{type(e).__name__}: {e}"[:200]
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def ask_dial_back(
    p2p: P2P, peer: PeerID, maddrs: Sequence[str], timeout_s: float
) -> DialBackAnswer:
    """``peer``'s answer to "dial me back at ``maddrs``"; ``ReachabilityError`` if it did
    not answer within ``timeout_s``, refused, or answered nonsense."""
    request = runtime_pb2.ExpertRequest(metadata=encode(DialBackRequest(maddrs=tuple(maddrs))))
    try:
        async with asyncio.timeout(timeout_s):
            response = await DialBack.get_stub(p2p, peer).rpc_dial_back(request)
    except TimeoutError:
        raise ReachabilityError(f"peer {peer} did not answer within {timeout_s:.0f} s") from None
    except (P2PHandlerError, P2PDaemonError, OSError, asyncio.IncompleteReadError) as e:
        raise ReachabilityError(f"peer {peer} did not dial back: {e}") from None
    return decode(response.metadata, DialBackAnswer)


async def check_reachability(
    p2p: P2P,
    candidates: Sequence[PeerID],
    maddrs: Sequence[str],
    *,
    ask: int = ASK_PEERS,
    timeout_s: float = DIAL_TIMEOUT_S,
) -> Reachability:
    """Ask up to ``ask`` of ``candidates`` (the first ones; callers put the likeliest
    answerers first) to dial us back at ``maddrs`` (the first ``MAX_MADDRS``), all at
    once, and return the ``verdict`` of those that answered."""
    maddrs = list(dict.fromkeys(maddrs))[:MAX_MADDRS]
    asked = list(dict.fromkeys(candidates))[:ask]
    if not asked or not maddrs:
        return verdict([])
    wait = timeout_s * 2 + 5  # the peer's dials run at once: one timeout, and the call

    async def one(peer: PeerID) -> DialBackAnswer | None:
        try:
            return await ask_dial_back(p2p, peer, maddrs, wait)
        except ReachabilityError as e:
            logger.debug("reachability: %s", e)
            return None

    answers = await asyncio.gather(*(one(p) for p in asked))
    got = [a for a in answers if a is not None]
    for peer, answer in zip(asked, answers, strict=True):
        if answer is not None and answer.reachable_at is None:
            errors = "; ".join(f"{r.maddr}: {r.error}" for r in answer.results)
            logger.info("peer %s could not dial us back: %s", peer, errors)
    return verdict(got)


def shuffled(peers: Sequence[PeerID], seed: str) -> list[PeerID]:
    """``peers`` in an order drawn from ``seed`` (the asker's id): askers spread their
    questions over the swarm."""
    out = list(peers)
    random.Random(seed).shuffle(out)
    return out
