"""The base of this node's RPC services on hivemind's P2P: attached once, detached on
shutdown, served under a fixed name.

Streaming handlers are served by ``NodeServicer`` itself, not by hivemind's
``add_protobuf_handler``: hivemind reads each frame of a stream by trusting its 8-byte
length header, so a caller declaring a frame of 2**62 bytes could make the node buffer
everything it sends until the handler times out. Here the frames (hivemind's: a marker
byte, 0 for a message and 1 for an error, then the body's length, 8 bytes big-endian,
then the body) are read by ``read_frame``, which refuses a declared length over
``max_frame_bytes`` before reading the body. Unary handlers travel through the daemon's
persistent connection, which caps messages itself, and stay hivemind's.

Callers that keep being refused are banned (``callers``): their streams are refused before
anything is read, and their unary calls before the handler runs. A node gives all its
services one ``BanList``, so that a peer refused by one (bad stage requests, bad bandwidth
probes, forged invites) is refused by all.

A service with an ``in_flight`` (``protocol.admission.InFlight``, which a node shares among
its stage servers) admits each stream when it opens, before reading it: one over its
caller's or the node's cap is shed at once with a ``BUSY`` error (``shed``: a ``rpc.refused``
event, not a strike against the caller), and an admitted stream's ticket is the handler's
``admitted_ticket`` until the stream ends. A refused stream lingers for the caller to read
its error (``refuse``), but at most ``MAX_LINGERING`` at once: past that, a flood of
streams is closed right after its errors are sent, so that it cannot hold the node's
descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import ClassVar

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.servicer import RPCHandler
from hivemind.proto.p2pd_pb2 import RPCError

from node import events, limits
from node.rpc.hivemind_compat import DETACH_TIMEOUT_S, PinnedHandleNames, p2pd_running
from protocol.admission import BUSY, InFlight, Refusal, RefusalTally, Ticket
from protocol.routing import BanList

logger = logging.getLogger(__name__)

WRITE_BYTES = 2**18  # frames gathered into one write (and one wait for the upload limit)
MAX_PREFETCH = 5  # frames read ahead of the handler, as hivemind does: at most 6 in memory
REFUSAL_LINGER_S = 2.0  # for a refused caller to close the stream once it has the error
# A caller is banned for BAN_S after BAN_AFTER refused requests within BAN_WINDOW_S.
BAN_AFTER = 5
BAN_WINDOW_S = 60.0
BAN_S = 60.0
# The cause of a refusal as a non-member (``BanList.strike``): forgiven once the caller is
# admitted, since a restart of either side makes a member look like a stranger for a while.
MEMBERSHIP = "membership"
# Refused streams that may linger at once (``refuse``); more are closed as soon as their
# error is sent (a caller may then see a reset rather than the error).
MAX_LINGERING = 128
# The ticket of the stream a stream handler serves (``NodeServicer.in_flight``), if any.
admitted_ticket: ContextVar[Ticket | None] = ContextVar("admitted_ticket", default=None)
_lingering = 0  # refused streams lingering now, in this process (on its event loop)


class FrameError(Exception):
    """A stream frame that is not read: oversized or malformed."""


class BannedCaller(Exception):
    """A unary call from a banned caller, refused before its handler runs."""


async def read_frame(
    reader: asyncio.StreamReader, message_type: type[Message], max_bytes: int
) -> Message | RPCError:
    """The next message of a hivemind stream, or an ``RPCError`` (a server's error, or
    a caller's end of stream)."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise FrameError(f"a frame with marker {marker!r}, not a message or an end of stream")
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    body = await reader.readexactly(length)
    message = message_type() if marker == P2P.MESSAGE_MARKER else RPCError()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise FrameError(f"a frame of {length} bytes is not a {message_type.__name__}") from None
    return message


async def write_frames(
    messages: Iterable[Message | RPCError], writer: asyncio.StreamWriter
) -> None:
    """Send ``messages`` as hivemind frames (``P2P.send_protobuf``'s, counted and paced by
    ``node.limits`` as it counts them), gathered into writes of up to ``WRITE_BYTES``:
    hivemind writes a frame's marker, length and body apart, a system call each."""
    pending: list[bytes] = []
    size = 0
    for message in messages:
        body = message.SerializeToString()
        marker = P2P.ERROR_MARKER if isinstance(message, RPCError) else P2P.MESSAGE_MARKER
        pending += (marker, len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), body)
        size += len(body) + limits.FRAME_OVERHEAD
        if size >= WRITE_BYTES:
            await _write(pending, size, writer)
            pending, size = [], 0
    if pending:
        await _write(pending, size, writer)


async def _write(parts: list[bytes], size: int, writer: asyncio.StreamWriter) -> None:
    await limits.traffic.send(size)
    writer.write(b"".join(parts))
    await writer.drain()


async def _send_error(writer: asyncio.StreamWriter, message: str) -> None:
    with contextlib.suppress(ConnectionError):  # the caller may be gone: nothing to tell
        await P2P.send_protobuf(RPCError(message=message), writer)


async def refuse(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: str, max_bytes: int
) -> None:
    """Send ``message`` as the stream's error, then drop what the caller still sends (at
    most ``max_bytes``, for at most ``REFUSAL_LINGER_S``) until it closes the stream:
    closing first lets the daemons reset the stream, and the caller then loses the error
    (9 in 60 banned calls on loopback without this; none in 60 with it). With
    ``MAX_LINGERING`` refused streams lingering already, returns once the error is sent."""
    global _lingering
    await _send_error(writer, message)
    if _lingering >= MAX_LINGERING:
        return
    _lingering += 1
    try:
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(REFUSAL_LINGER_S):
                while max_bytes > 0 and (data := await reader.read(2**16)):
                    max_bytes -= len(data)
    finally:
        _lingering -= 1


class NodeServicer(PinnedHandleNames):
    """Handlers are named after ``service_name`` (``handle_name``), so that a subclass (one
    that injects faults) serves where clients call. They are unary
    (``rpc_x(request, context) -> response``) or stream both ways (``AsyncIterator`` in and
    out)."""

    max_frame_bytes: ClassVar[int]  # the largest stream frame read: streaming services set it
    refusal_prefix: ClassVar[str] = ""  # starts what a caller refused for a bad frame reads
    callers: BanList | None = None  # callers banned after repeated refusals, if any
    in_flight: InFlight | None = None  # caps on streams in flight, if any
    shed_tally: RefusalTally | None = None  # shed requests, by caller and reason
    namespace: str | None = None  # prefixes the handlers' names: one service per namespace
    _p2p: P2P | None = None

    async def attach(self, p2p: P2P) -> None:
        await asyncio.gather(*(self._add_handler(p2p, h) for h in self.rpc_handlers()))
        self._p2p = p2p

    async def detach(self, timeout_s: float = DETACH_TIMEOUT_S) -> None:
        """Stop taking requests, within ``timeout_s`` (the daemon may already be gone: a
        unary handler's removal then waits forever on its broken control connection)."""
        if self._p2p is not None and p2pd_running(self._p2p):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout_s):
                    await self.remove_p2p_handlers(self._p2p, namespace=self.namespace)
            self._p2p = None

    @property
    def p2p(self) -> P2P | None:
        """The P2P this service is attached to (None once detached)."""
        return self._p2p

    async def _add_handler(self, p2p: P2P, rpc: RPCHandler) -> None:
        name = self.handle_name(self.namespace, rpc.method_name)
        method = getattr(self, rpc.method_name)
        if not rpc.stream_input and not rpc.stream_output:

            async def unary(request: Message, context: P2PContext) -> Message:
                if banned := self.ban_refusal(context):
                    raise BannedCaller(banned)
                return await method(request, context)

            await p2p.add_protobuf_handler(name, unary, rpc.request_type)
            return
        if not rpc.stream_input or not rpc.stream_output:
            raise TypeError(f"{name} must stream both ways or neither")
        max_bytes = self.max_frame_bytes

        async def serve(
            info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
            await self._serve_stream(method, rpc.request_type, max_bytes, context, reader, writer)

        await p2p.add_binary_stream_handler(name, serve)

    async def _serve_stream(
        self,
        method: Callable[[AsyncIterator[Message], P2PContext], AsyncIterator[Message]],
        request_type: type[Message],
        max_bytes: int,
        context: P2PContext,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Admit the stream (``in_flight``), then feed its messages to ``method`` and send
        back what it yields, until either side ends (the caller closing the stream cancels
        the handler)."""
        with contextlib.closing(writer):
            if banned := self.ban_refusal(context):
                await refuse(reader, writer, banned, max_bytes)
                return
            ticket = None
            if self.in_flight is not None:
                ticket = self.in_flight.admit(context.remote_id.to_base58())
                if isinstance(ticket, Refusal):
                    reason = self.shed(context, ticket)
                    await refuse(reader, writer, BUSY + reason, max_bytes)
                    return
            try:
                await self._read_and_respond(
                    method, request_type, max_bytes, context, reader, writer, ticket
                )
            finally:
                if ticket is not None:
                    self.in_flight.release(ticket)

    async def _read_and_respond(
        self,
        method: Callable[[AsyncIterator[Message], P2PContext], AsyncIterator[Message]],
        request_type: type[Message],
        max_bytes: int,
        context: P2PContext,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ticket: Ticket | None,
    ) -> None:
        """Feed the stream's messages to ``method`` and send back what it yields (see
        ``_serve_stream``); ``ticket``: the stream's admission, as ``admitted_ticket``."""
        admitted_ticket.set(ticket)  # the tasks below copy it
        requests: asyncio.Queue[Message | None] = asyncio.Queue(MAX_PREFETCH)

        async def read() -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:  # past the end of stream too: the caller closing ends it
                    frame = await read_frame(reader, request_type, max_bytes)
                    await requests.put(None if isinstance(frame, RPCError) else frame)

        async def incoming() -> AsyncIterator[Message]:
            while (request := await requests.get()) is not None:
                yield request

        async def respond() -> None:
            try:
                async for response in method(incoming(), context):
                    await P2P.send_protobuf(response, writer)
            except ConnectionError:
                return  # the caller is gone
            except Exception as e:
                await _send_error(writer, str(e))

        reading, responding = asyncio.create_task(read()), asyncio.create_task(respond())
        try:
            await asyncio.wait((reading, responding), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, responding):
                task.cancel()
            await asyncio.gather(reading, responding, return_exceptions=True)
        error = None if reading.cancelled() else reading.exception()
        if isinstance(error, FrameError):
            self.refused(context, f"a {context.handle_name} stream", str(error))
            message = self.refusal_prefix + str(error)
            await refuse(reader, writer, message, max_bytes)
        elif error is not None:
            logger.warning(f"reading a stream from {context.remote_id} failed: {error!r}")

    def ban_refusal(self, context: P2PContext) -> str | None:
        """Why the caller's requests are refused unread now, or None if it is not banned."""
        if self.callers is None:
            return None
        now = time.monotonic()
        until = self.callers.until(context.remote_id.to_base58(), now)
        if until is None:
            return None
        clock = (datetime.now() + timedelta(seconds=until - now)).strftime("%H:%M:%S")
        return (
            f"{self.service_name}: peer {context.remote_id} is banned until {clock} "
            f"({until - now:.0f} s from now) after repeated refused requests"
        )

    def shed(self, context: P2PContext, refusal: Refusal, reason: str = "") -> str:
        """Count a request shed for load (or too slow to arrive): not a strike against its
        caller. Logged and reported as a ``rpc.refused`` event with the number of such
        refusals since the last (``shed_tally``: the first, then at most one a second per
        caller and reason). Returns the reason to send back."""
        caller = context.remote_id.to_base58()
        if not reason:
            reason = self.in_flight.reason(refusal, caller) if self.in_flight else refusal.value
        if self.shed_tally is None:
            self.shed_tally = RefusalTally()
        count = self.shed_tally.note(caller, refusal, time.monotonic())
        if count is not None:
            events.emit(
                "rpc.refused",
                service=self.service_name,
                peer=caller,
                reason=refusal.value,
                count=count,
            )
            logger.warning(
                f"shed {count} request(s) from {context.remote_id} "
                f"({context.handle_name}): {reason}"
            )
        return reason

    def refused(self, context: P2PContext, what: str, reason: str, cause: str = "") -> None:
        """Log a refused request and count it against its caller, which is banned (logged
        once, and a ``peer.banned`` event) after ``callers.strikes`` refusals within
        ``callers.window_s``."""
        logger.warning(f"refused {what} from {context.remote_id}: {reason}")
        if self.callers is None:
            return
        caller = context.remote_id.to_base58()
        if self.callers.strike(caller, time.monotonic(), cause) is not None:
            events.emit("peer.banned", peer=caller, service=self.service_name)
            logger.warning(
                f"banned {context.remote_id} for {self.callers.duration_s:.0f} s: "
                f"{self.callers.strikes} refused requests within {self.callers.window_s:.0f} s"
            )
