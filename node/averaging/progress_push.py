"""Progress records sent straight to a stage's peers, beside the DHT.

A stage's peers publish their progress in the DHT (``progress.ProgressBoard``), and a
gated stage of a shared batch (gradient mode) reads and stores it around every
micro-batch it admits: each DHT read and store is a search over several DHT nodes, and
on a small model those searches cost more CPU than the micro-batches. A push is one
call: ``ProgressPusher`` sends our newest signed record to each peer of the stage we
see, and ``ProgressInbox`` (one per node, for every stage it holds) hands what peers
send to the stage's board (``ProgressBoard.accept``), which checks it as it checks a
record read from the DHT. The DHT stays the record of truth: records are still stored
there at the report period, and read there at it while any peer in the view pushes
nothing (an older node, a failed connection) or lags; while all push, the DHT is read
every ``progress.PUSHED_READ_S`` only, so a peer that pushes nothing and is not in the
view yet is seen within that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from node.rpc.service import NodeServicer
from protocol.records import RecordError
from protocol.routing import BanList

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 2.0  # a push that has not been answered by then failed
MAX_RECORD_BYTES = 4096  # a signed progress record is a few hundred bytes

# Takes a record (its raw bytes) and the peer that sent it; True if it is now that peer's
# record in the stage's view. Raises ``RecordError`` for a record that is not valid.
Receiver = Callable[[bytes, str], bool]


class ProgressInbox(NodeServicer):
    """Takes the progress records that peers push, for the stages this node holds; build
    with ``await ProgressInbox.create(p2p)``, ``add`` a stage's receiver when the stage is
    held and ``remove`` it when released."""

    service_name = "ProgressInbox"

    def __init__(self, *, callers: BanList | None = None) -> None:
        self.callers = callers  # invalid records count against their sender
        self._receivers: dict[int, Receiver] = {}

    @classmethod
    async def create(cls, p2p: P2P, **settings) -> ProgressInbox:
        self = cls(**settings)
        await self.attach(p2p)
        return self

    async def shutdown(self) -> None:
        await self.detach()

    def add(self, stage: int, receiver: Receiver) -> None:
        self._receivers[stage] = receiver

    def remove(self, stage: int, receiver: Receiver) -> None:
        if self._receivers.get(stage) is receiver:
            del self._receivers[stage]

    async def rpc_progress(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """``uid``: the stage (decimal); ``metadata``: the sender's signed record. Answers
        ``b"1"`` if the record is now the sender's in our view, ``b""`` if not (a stage we
        do not hold, a record no newer than ours); an invalid record is refused."""
        receiver = self._receivers.get(_stage(request.uid))
        if receiver is None:
            return runtime_pb2.ExpertResponse()
        try:
            if len(request.metadata) > MAX_RECORD_BYTES:
                raise RecordError(f"a progress record of {len(request.metadata)} bytes")
            taken = receiver(request.metadata, context.remote_id.to_base58())
        except RecordError as e:
            self.refused(context, "a pushed progress record", str(e))
            raise
        return runtime_pb2.ExpertResponse(metadata=b"1" if taken else b"")


def _stage(uid: str) -> int | None:
    """The stage a push names, or None if ``uid`` is not a small decimal number."""
    return int(uid) if uid.isdecimal() and len(uid) <= 6 else None


class ProgressPusher:
    """Sends our newest signed record of one stage to the peers we name (``offer``), from
    a task of its own (``run``): at most one round of sends at a time, each send bounded
    by ``PUSH_TIMEOUT_S``; a record offered meanwhile replaces the one waiting, so a burst
    of changes costs one send per peer per round trip."""

    def __init__(self, p2p: P2P, stage: int, *, name: str) -> None:
        self.p2p = p2p
        self.stage = stage
        self._name = name  # in log lines
        self._next: tuple[bytes, tuple[str, ...]] | None = None
        self._ready = asyncio.Event()
        self.sent = 0  # pushes a peer answered
        self.failed = 0  # pushes that failed or timed out

    def offer(self, value: bytes, peers: Sequence[str]) -> None:
        """Send ``value`` to ``peers`` next (on the event loop)."""
        if peers:
            self._next = (value, tuple(peers))
            self._ready.set()

    async def run(self) -> None:
        """Send what is offered, until cancelled."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._next is None:
                continue
            (value, peers), self._next = self._next, None
            await asyncio.gather(*(self._send(peer, value) for peer in peers))

    async def _send(self, peer: str, value: bytes) -> None:
        request = runtime_pb2.ExpertRequest(uid=str(self.stage), metadata=value)
        try:
            stub = ProgressInbox.get_stub(self.p2p, PeerID.from_base58(peer))
            async with asyncio.timeout(PUSH_TIMEOUT_S):
                await stub.rpc_progress(request)
            self.sent += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the DHT still carries our record to this peer
            self.failed += 1
            logger.debug("%s: pushing progress to %s failed: %r", self._name, peer[-6:], e)
