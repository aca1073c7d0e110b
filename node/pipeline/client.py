"""The calls a trainer makes to stage servers: forward, the last stage's loss, backward;
and for generation, inference forwards and the last stage's logits.

Every failure raises a ``StageCallError``: ``StageRefused`` when the server refused the
request (it is malformed for the stage: do not retry it anywhere), ``StageUnavailable``
when the peer could not serve it (unreachable, gone, failed, timed out, answered
nonsense: retry on another peer of the stage), and of those ``StageBusy`` when the peer
shed it for load (``protocol.admission.BUSY``: retry elsewhere, without holding it
against the peer for long).

Calls go through sessions (``node.pipeline.server``): a stream to a peer's stage is kept
open after a call that was answered, and the next call to that stage of that peer takes
it instead of opening a new one (a stream open costs more CPU than a small call). A call
holds its stream alone (calls in flight to one peer use one stream each); a stream that
failed in any way (an error answer, a timeout, a cancellation) is closed, never reused;
one idle for ``IDLE_S`` is closed then (a call or not), as are the idle ones to a peer that
left the caller's view (``forget_peers``), and at most ``MAX_IDLE_STREAMS`` idle ones are
kept per peer and stage.

Gradients follow ``models.training``'s convention: the last stage back-propagates
``loss * B``, so every gradient that comes back is a sum over the micro-batch's samples.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from node import limits
from node.pipeline.server import SESSION, SESSION_IDLE_S, StageServer, stage_namespace
from node.pipeline.wire import (
    FAILED,
    MAX_FRAME_BYTES,
    REFUSED,
    Assembler,
    Encoded,
    decode_response_meta,
    generic_header_check,
    narrow_ids,
    received,
    serialize,
    split_message,
)
from node.rpc.service import FrameError, read_frame, write_frames
from protocol.admission import BUSY
from protocol.stage_messages import BACKWARD, FORWARD, StageMeta, StageRequestError

DEFAULT_TIMEOUT = 30.0
MAX_RESPONSE_BYTES = 2**30
# An idle stream is reused for at most this long, well within the server's own idle limit,
# so that a call never goes out on a stream the server is closing.
IDLE_S = SESSION_IDLE_S / 3
MAX_IDLE_STREAMS = 8  # idle streams kept per peer and stage (calls in flight there, at most)


class StageCallError(Exception):
    """A stage call that returned no result."""

    retry_elsewhere = True

    def __init__(self, peer_id: PeerID, message: str) -> None:
        super().__init__(f"peer {peer_id}: {message}")
        self.peer_id = peer_id
        self.reason = message


class StageRefused(StageCallError):
    """The server refused the request as malformed; any peer of the stage would."""

    retry_elsewhere = False


class StageUnavailable(StageCallError):
    """The peer did not serve the request: unreachable, gone, failed or answered nonsense."""


class StageBusy(StageUnavailable):
    """The peer shed the request for load (or it arrived too slowly): it works, but is
    full now."""


class StageTimeout(StageUnavailable):
    """No complete response within the timeout."""


async def call(
    p2p: P2P,
    peer_id: PeerID,
    kind: str,
    metadata: bytes,
    tensors: list[runtime_pb2.Tensor],
    *,
    stage: int,
    timeout: float = DEFAULT_TIMEOUT,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    local: StageServer | None = None,
    keep_encoded: bool = False,
) -> list[torch.Tensor | Encoded]:
    """Send one raw ``kind`` request to ``peer_id``'s server of ``stage`` (in a session:
    see the module docstring) and return the response's tensors. ``local``: ``peer_id``
    is this process's own peer and this is its server of ``stage``; the request is served
    in-process. ``keep_encoded``: hidden states and gradients (float, (B, T, W)) that came
    in a lossy encoding stay encoded (``node.pipeline.wire.received``), for a trainer to
    pass on to the next stage as they are; they are checked to decode finite, and
    ``_expect`` checks their shapes."""
    if kind not in (FORWARD, BACKWARD):
        raise ValueError(f"kind must be {FORWARD!r} or {BACKWARD!r}, got {kind!r}")
    if local is not None:
        out = await _call_local(local, peer_id, kind, metadata, tensors, timeout)
        try:
            return [received(t, keep_encoded) for t in out]
        except StageRequestError as e:
            raise StageUnavailable(peer_id, f"malformed response: {e}") from None
    assembler = Assembler(max_response_bytes, generic_header_check(max_response_bytes))
    # the bytes both ways count (and wait for the node's limits) as the call's purpose
    purpose = limits.PURPOSE.set(purpose_of(kind))
    try:
        async with asyncio.timeout(timeout):
            return await _call_on_stream(
                p2p, peer_id, kind, stage, metadata, tensors, assembler, keep_encoded
            )
    except TimeoutError:
        raise StageTimeout(peer_id, f"no response within {timeout} s") from None
    except P2PHandlerError as e:
        message = str(e)
        if BUSY in message:
            raise StageBusy(peer_id, message.split(BUSY, 1)[1]) from None
        if REFUSED in message:
            raise StageRefused(peer_id, message.split(REFUSED, 1)[1]) from None
        raise StageUnavailable(peer_id, message.split(FAILED, 1)[-1]) from None
    except StageRequestError as e:
        raise StageUnavailable(peer_id, f"malformed response: {e}") from None
    except (P2PDaemonError, OSError, asyncio.IncompleteReadError) as e:
        raise StageUnavailable(peer_id, f"unreachable: {type(e).__name__}: {e}") from None
    finally:
        limits.PURPOSE.reset(purpose)


@dataclass
class _Stream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0  # time.monotonic() when its last call was answered


class _Sessions:
    """The idle session streams of one ``P2P``, per (peer, handle). A stream idle for
    ``IDLE_S`` is closed then, whether or not any call comes (a timer on the event loop
    that ``close`` cancels, armed only while streams are idle), so a peer that left the
    caller's view, or a trainer that stopped calling, holds no stream (and, on the server,
    no session task) for longer."""

    def __init__(self) -> None:
        self._idle: dict[tuple[PeerID, str], list[_Stream]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None  # the loop it runs on

    def take(self, key: tuple[PeerID, str]) -> _Stream | None:
        """The most recently used idle stream of ``key`` that is still open, if any."""
        now = time.monotonic()
        idle = self._idle.get(key, [])
        while idle:
            stream = idle.pop()
            if now - stream.idle_since < IDLE_S and not stream.reader.at_eof():
                return stream
            stream.writer.close()  # the server closed it (it shut down, or idled it out)
        return None

    def give_back(self, key: tuple[PeerID, str], stream: _Stream) -> None:
        """``stream`` answered its call whole: keep it for the next call of ``key``."""
        idle = self._idle.setdefault(key, [])
        if len(idle) >= MAX_IDLE_STREAMS:
            stream.writer.close()
            return
        stream.idle_since = time.monotonic()
        idle.append(stream)
        loop = asyncio.get_running_loop()
        if self._timer is None or self._timer_loop is not loop:  # none, or a closed loop's
            self._arm(loop, IDLE_S)

    def forget(self, peers: Collection[PeerID]) -> None:
        """Close the idle streams to ``peers`` (they left the caller's view)."""
        for key in [k for k in self._idle if k[0] in peers]:
            for stream in self._idle.pop(key):
                stream.writer.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for idle in self._idle.values():
            for stream in idle:
                stream.writer.close()
        self._idle.clear()

    def _expire(self) -> None:
        """Close the streams idle past ``IDLE_S``; armed again for the next to expire."""
        self._timer = None
        now, oldest = time.monotonic(), None
        for key, idle in list(self._idle.items()):
            for stream in idle:
                if now - stream.idle_since >= IDLE_S:
                    stream.writer.close()
            idle[:] = [s for s in idle if now - s.idle_since < IDLE_S]
            if not idle:
                del self._idle[key]
                continue
            first = min(s.idle_since for s in idle)
            oldest = first if oldest is None else min(oldest, first)
        if oldest is not None:
            self._arm(asyncio.get_running_loop(), max(oldest + IDLE_S - now, 0.0))

    def _arm(self, loop: asyncio.AbstractEventLoop, wait_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_loop = loop.call_later(wait_s, self._expire), loop


# Each P2P's idle streams; None: its calls open a stream each (``reuse_streams``).
_sessions: weakref.WeakKeyDictionary[P2P, _Sessions | None] = weakref.WeakKeyDictionary()


def reuse_streams(p2p: P2P, reuse: bool) -> None:
    """Whether calls made through ``p2p`` from now on keep their streams for the next call
    (the default) or open one per call to the ``rpc_forward`` / ``rpc_backward`` handlers,
    closed once answered (what ``python -m scripts.bench_pipeline`` compares)."""
    close_sessions(p2p)
    if not reuse:
        _sessions[p2p] = None


def close_sessions(p2p: P2P) -> None:
    """Close the idle streams that calls made through ``p2p`` keep (before it shuts down)."""
    sessions = _sessions.pop(p2p, None)
    if sessions is not None:
        sessions.close()


def forget_peers(p2p: P2P, peers: Collection[PeerID]) -> None:
    """Close the idle streams that calls made through ``p2p`` keep to ``peers`` (peers
    that left the caller's view: a call to one, if any comes, opens a new stream)."""
    sessions = _sessions[p2p] if peers and p2p in _sessions else None
    if sessions is not None:
        sessions.forget(peers)


async def _call_on_stream(
    p2p: P2P,
    peer_id: PeerID,
    kind: str,
    stage: int,
    metadata: bytes,
    tensors: list[runtime_pb2.Tensor],
    assembler: Assembler,
    keep_encoded: bool,
) -> list[torch.Tensor | Encoded]:
    """One request and its response on an idle session stream to ``peer_id``'s ``stage``
    (a new one if none is idle, or if the idle one turns out closed before any answer: the
    server closed it unread), kept for the next call only if this one was answered whole;
    or, where ``p2p`` reuses no streams, on a new stream to ``rpc_<kind>``."""
    if p2p in _sessions and _sessions[p2p] is None:
        sessions, handle = None, f"rpc_{kind}"
    else:
        sessions, handle = _sessions.setdefault(p2p, _Sessions()), SESSION
    key = (peer_id, StageServer.handle_name(stage_namespace(stage), handle))
    idle = sessions.take(key) if sessions is not None else None
    if idle is not None:
        try:
            return await _exchange(sessions, key, idle, metadata, tensors, assembler, keep_encoded)
        except (ConnectionError, asyncio.IncompleteReadError):
            if assembler.received:
                raise  # it was answering: the server broke, not the idle stream
    _, reader, writer = await p2p.call_binary_stream_handler(*key)
    stream = _Stream(reader, writer)
    return await _exchange(sessions, key, stream, metadata, tensors, assembler, keep_encoded)


async def _exchange(
    sessions: _Sessions | None,
    key: tuple[PeerID, str],
    stream: _Stream,
    metadata: bytes,
    tensors: list[runtime_pb2.Tensor],
    assembler: Assembler,
    keep_encoded: bool,
) -> list[torch.Tensor | Encoded]:
    """Send the request on ``stream`` and read its response; then keep the stream in
    ``sessions`` if it was answered whole, else close it."""
    answered = False
    try:
        sending = asyncio.create_task(_send(stream.writer, metadata, tensors))
        try:
            out = await _receive(stream.reader, assembler, keep_encoded)
            await sending  # a server answers once it has read the whole request
        finally:
            sending.cancel()  # done, or the server answered before reading it all
            await asyncio.gather(sending, return_exceptions=True)
        answered = True
        return out
    finally:
        if answered and sessions is not None:
            sessions.give_back(key, stream)
        else:  # closing tells the server we are done
            stream.writer.close()


def purpose_of(kind: str) -> str:
    """What a stage call's bytes are, for ``node.limits``: a forward moves activations (a
    last stage's reply to a training call carries a gradient too), a backward gradients."""
    return limits.ACTIVATIONS if kind == FORWARD else limits.GRADIENTS


async def _call_local(
    server: StageServer,
    peer_id: PeerID,
    kind: str,
    metadata: bytes,
    tensors: list[runtime_pb2.Tensor],
    timeout: float,
) -> list[runtime_pb2.Tensor]:
    """A call to our own server, with the remote path's errors."""
    try:
        async with asyncio.timeout(timeout):
            out = await server.call_local(kind, metadata, tensors, peer_id.to_base58())
    except TimeoutError:
        raise StageTimeout(peer_id, f"no response within {timeout} s") from None
    except StageRequestError as e:
        raise StageRefused(peer_id, str(e)) from None
    except Exception as e:  # shut down meanwhile (a move), or a fault of this peer
        raise StageUnavailable(peer_id, f"{type(e).__name__}: {e}") from None
    return out


async def _send(
    writer: asyncio.StreamWriter, metadata: bytes, tensors: list[runtime_pb2.Tensor]
) -> None:
    messages = split_message(runtime_pb2.ExpertRequest, metadata, tensors)
    await write_frames(itertools.chain(messages, [P2P.END_OF_STREAM]), writer)


async def _receive(
    reader: asyncio.StreamReader, assembler: Assembler, keep_encoded: bool
) -> list[torch.Tensor | Encoded]:
    """Read response frames (each capped, like the server's: a hostile server cannot make
    us buffer a frame larger than ``MAX_FRAME_BYTES``) until the response is complete."""
    n_tensors = None
    while True:
        try:
            frame = await read_frame(reader, runtime_pb2.ExpertResponse, MAX_FRAME_BYTES)
        except FrameError as e:
            raise StageRequestError(str(e)) from None
        except asyncio.IncompleteReadError:
            raise ConnectionError("the stream closed before the response was complete") from None
        await limits.traffic.receive(frame.ByteSize() + limits.FRAME_OVERHEAD)
        if isinstance(frame, RPCError):
            raise P2PHandlerError(frame.message)
        if n_tensors is None:
            n_tensors = decode_response_meta(frame.metadata)
        assembler.add(frame)
        if assembler.complete(n_tensors):
            return [received(t, keep_encoded) for t in assembler.tensors()]


def _meta(
    run_id: str, stage: int, kind: str, micro_batch: int, train: bool = False, infer: bool = False
) -> bytes:
    return StageMeta(run_id, stage, kind, micro_batch, train, infer).encode()


def _expect(
    peer_id: PeerID, tensors: list[torch.Tensor | Encoded], shapes: list[tuple[int, ...]]
) -> Iterator[torch.Tensor | Encoded]:
    """Check a response's tensors: as many as expected, with these shapes, finite floats
    (an ``Encoded`` one was checked finite as it arrived)."""
    got = [tuple(t.shape) for t in tensors]
    if got != shapes:
        raise StageUnavailable(peer_id, f"malformed response: expected shapes {shapes}, got {got}")
    for t in tensors:
        if isinstance(t, Encoded):
            continue
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise StageUnavailable(peer_id, "malformed response: a non-finite or non-float tensor")
    return iter(tensors)


async def forward(
    p2p: P2P,
    peer_id: PeerID,
    inputs: torch.Tensor | Encoded,
    *,
    run_id: str,
    stage: int,
    micro_batch: int = 0,
    train: bool = False,
    infer: bool = False,
    compression: str = "none",
    tokens: torch.Tensor | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    local: StageServer | None = None,
    keep_encoded: bool = False,
) -> torch.Tensor | Encoded:
    """Stage ``stage`` (not the last): token ids (B, T) or hidden states (B, T, W) ->
    hidden states (B, T, W) (``keep_encoded``: see ``call``). ``tokens``: the sequences'
    token ids, which a stage that takes hidden states across a low-rank boundary
    (``models.boundary``) needs with every request (the same keyword in ``loss``,
    ``logits`` and ``backward``). ``train``: a backward for ``micro_batch`` will follow,
    and the server may keep the forward's graph for it (sent to this peer, it skips the
    recompute). ``infer``: an inference forward (generation), counted apart from training
    and validation forwards."""
    meta = _meta(run_id, stage, FORWARD, micro_batch, train, infer)
    tensors = [serialize(inputs, compression)]
    tensors += [serialize(narrow_ids(tokens))] if tokens is not None else []
    how = {"stage": stage, "timeout": timeout, "local": local, "keep_encoded": keep_encoded}
    out = await call(p2p, peer_id, FORWARD, meta, tensors, **how)
    b, t = inputs.shape[:2]
    if len(out) != 1 or len(out[0].shape) != 3:
        raise StageUnavailable(peer_id, f"malformed response: {[tuple(o.shape) for o in out]}")
    return next(_expect(peer_id, out, [(b, t, out[0].shape[2])]))


async def loss(
    p2p: P2P,
    peer_id: PeerID,
    inputs: torch.Tensor | Encoded,
    targets: torch.Tensor,
    *,
    run_id: str,
    stage: int,
    train: bool,
    micro_batch: int = 0,
    compression: str = "none",
    tokens: torch.Tensor | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    local: StageServer | None = None,
    keep_encoded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | Encoded | None]:
    """The last stage: the mean loss over the micro-batch and, with ``train``, the
    gradient of ``loss * B`` w.r.t. ``inputs`` (None without ``train``, or when the last
    stage is also the first and its inputs are token ids; ``keep_encoded``: see ``call``).
    ``train`` also accumulates the stage's parameter gradients on the server; without it
    nothing changes there."""
    meta = _meta(run_id, stage, FORWARD, micro_batch, train)
    tensors = [serialize(inputs, compression), serialize(targets)]
    tensors += [serialize(narrow_ids(tokens))] if tokens is not None else []
    how = {"stage": stage, "timeout": timeout, "local": local, "keep_encoded": keep_encoded}
    out = await call(p2p, peer_id, FORWARD, meta, tensors, **how)
    with_grad = train and inputs.is_floating_point()
    shapes = [()] + ([tuple(inputs.shape)] if with_grad else [])
    got = _expect(peer_id, out, shapes)
    return next(got), next(got) if with_grad else None


async def logits(
    p2p: P2P,
    peer_id: PeerID,
    inputs: torch.Tensor | Encoded,
    *,
    run_id: str,
    stage: int,
    vocab_size: int,
    micro_batch: int = 0,
    compression: str = "none",
    tokens: torch.Tensor | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    local: StageServer | None = None,
) -> torch.Tensor:
    """The last stage, in inference (generation): token ids (B, T) or hidden states
    (B, T, C) -> the logits (B, ``vocab_size``) of each sequence's last position. Nothing
    is kept or accumulated on the server."""
    meta = _meta(run_id, stage, FORWARD, micro_batch, infer=True)
    tensors = [serialize(inputs, compression)]
    tensors += [serialize(narrow_ids(tokens))] if tokens is not None else []
    out = await call(
        p2p, peer_id, FORWARD, meta, tensors, stage=stage, timeout=timeout, local=local
    )
    return next(_expect(peer_id, out, [(inputs.shape[0], vocab_size)]))


async def backward(
    p2p: P2P,
    peer_id: PeerID,
    inputs: torch.Tensor | Encoded,
    grad_outputs: torch.Tensor | Encoded,
    *,
    run_id: str,
    stage: int,
    micro_batch: int = 0,
    compression: str = "none",
    tokens: torch.Tensor | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    local: StageServer | None = None,
    keep_encoded: bool = False,
) -> torch.Tensor | Encoded | None:
    """Stage ``stage`` (not the last) recomputes its forward on ``inputs`` (exactly what
    its forward got), accumulates its parameter gradients and returns the gradient w.r.t.
    ``inputs`` (None at stage 0, whose inputs are token ids; ``keep_encoded``: see ``call``)."""
    meta = _meta(run_id, stage, BACKWARD, micro_batch)
    tensors = [serialize(inputs, compression), serialize(grad_outputs, compression)]
    tensors += [serialize(narrow_ids(tokens))] if tokens is not None else []
    how = {"stage": stage, "timeout": timeout, "local": local, "keep_encoded": keep_encoded}
    out = await call(p2p, peer_id, BACKWARD, meta, tensors, **how)
    if not inputs.is_floating_point():
        _expect(peer_id, out, [])
        return None
    return next(_expect(peer_id, out, [tuple(inputs.shape)]))
