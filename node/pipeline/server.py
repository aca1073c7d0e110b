"""Serving one pipeline stage over hivemind's P2P layer: forward and stateless backward.

Handlers (``StageServer.rpc_forward`` / ``rpc_backward``) are hivemind stream handlers:
a request and its response are each a stream of protobufs carrying tensors in 64 KiB
chunks (``node.pipeline.wire``), whose frames ``NodeServicer`` reads (refusing one over
``MAX_FRAME_BYTES`` before reading it). hivemind's unary calls cannot carry activations: a unary
message travels through the daemon's persistent connection, which holds 4 MiB
(``DEFAULT_MAX_MSG_SIZE``; hivemind's own MoE client streams anything above
``MAX_UNARY_PAYLOAD_SIZE``, 2 MiB). Over that, a unary request fails at the caller
(``P2PDaemonError``), and a unary response never arrives: hivemind 1.1.12 builds the
error reply with a field that does not exist, and the caller waits for its timeout. The
``small`` preset's activations (8 x 256 x 384 float32 = 3 MiB) come close, ``base``'s are
24 MiB. So every size takes one code path, the stream; what a stream round trip costs
against a unary one, and a served forward against a local one, is measured by
``python -m scripts.bench_stage_rpc`` (figures in BENCHMARKS.md, "Pipeline").

Sessions. Opening a stream costs more CPU than a small request on a stream already open
(a new socket to each daemon and a new libp2p stream; ``python -m scripts.bench_stage_rpc``
measures both), so callers keep streams open: the ``session`` handler serves one request
after another on one stream, each request ended by hivemind's end-of-stream frame and
answered as ``rpc_forward`` / ``rpc_backward`` answer (the request's ``StageMeta.kind``
says which). Each request is admitted, charged, timed, checked and counted as a request
on a stream of its own is; its ticket is held from its first frame to its answer, not
while the session is idle. A caller holds at most ``AdmissionLimits.per_caller`` sessions
(the node ``total``), one is closed when its first request does not start within
``AdmissionLimits.first_s`` or when it idles for ``SESSION_IDLE_S``, and after any error
(a refusal, a shed request, a bad frame) the session ends as a refused stream does.
``rpc_forward`` and ``rpc_backward`` (one request per stream) stay for callers that open a
stream per call.

A backward is stateless: the caller re-sends the stage's inputs with the gradient of its
outputs, so any peer of the stage can serve the backward of a forward that ran elsewhere.
The computation (kept forward graphs, recompute, accumulation into ``.grad``) is the
torch-only ``node.pipeline.executor.StageExecutor``; this module is the RPC shell around
it. The server steps (``on_accumulated``) once its optimizer has seen
``target_batch_size`` samples.

Admission (``OptimizerConfig.max_staleness`` 0). A training micro-batch enters the stage at
its forward (the last stage: its one train call) and leaves it when its gradients are in
``.grad`` (the backward); in between it is *open*. Once the samples accumulated and open
at this stage make up the next step's batch (``_admission``; an averaging stage counts its
peers' too), new training micro-batches wait, on the event loop and before any compute,
until that step is applied: every step then averages gradients of exactly the parameters
it updates, and the kept graphs stay valid. The wait is bounded (``HOLD_S``; while a
gradient round is in progress, ``HOLD_ROUND_S``): past it the
micro-batch is admitted anyway, and its gradient may be one step stale (a DiLoCo stage's
outer round then goes on overlapped: ``on_overdue``). A trainer waits
``HOLD_ROUND_S`` longer for a training call than for others (``node.pipeline.trainer``), so
a held call is late, not failed. A request whose caller left while it was held or queued
(its session closed: the caller timed out) is dropped before it is computed, counted in
``StageCounters.abandoned`` and a ``stage.abandoned`` event: the caller sends the
micro-batch again, maybe elsewhere, and only the copy it gets an answer for is counted.
Backward requests, evaluation forwards and inference forwards (generation) never wait.
Without this, a pipeline with micro-batches in flight (and a stage averaging in rounds)
trains on stale gradients (``python -m scripts.bench_parity`` measures both settings;
BENCHMARKS.md, "Loss per sample").

Every request is checked (``protocol.stage_messages``) before it touches any state, and
gradients are computed into fresh tensors and checked finite before they are added, so a
bad request leaves parameters, gradients and counters as they were (but ``rejected``).
Every refusal counts against its caller (``NodeServicer.refused``): one that is refused
``BAN_AFTER`` times within ``BAN_WINDOW_S`` is banned for ``BAN_S``, its streams refused
before they are read. In a private run, refusals as a non-member are forgiven once the
caller is admitted (it presented its invite after a restart of either side).

Load (``protocol.admission``). Streams are admitted when they open against caps on requests
in flight, per caller and for the node (``in_flight``, which a node shares among its
stages), and charged the bytes their tensor headers declare; what does not fit is shed at
once with a ``BUSY`` error the caller reroutes on, and counted (``rpc.refused`` events,
``StageCounters.shed``), never as a strike. A stream must bring its metadata within
``AdmissionLimits.first_s`` and its whole request by ``request_deadline_s`` (scaled to the
stage's message limit over the node's download bandwidth, ``download_mbps``; at most
``receive_timeout``), or it is dropped as ``slow``. ``load``, which the node advertises,
counts only requests received whole and queued or computing: streams that are open but
idle, or shed, are not work.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# hivemind recognises stream handlers by typing.AsyncIterator, not collections.abc's.
from typing import AsyncIterator  # noqa: UP035

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from models.stages import Stage
from models.training import StageOptimizer
from node import events, limits
from node.aio import wait_event
from node.pipeline.executor import StageExecutor
from node.pipeline.wire import (
    FAILED,
    MAX_FRAME_BYTES,
    REFUSED,
    Assembler,
    compression_name,
    compression_type,
    deserialize,
    encode_response_meta,
    serialize,
    split_message,
)
from node.rpc.hivemind_compat import DETACH_TIMEOUT_S, p2pd_running
from node.rpc.service import (
    BAN_AFTER,
    BAN_S,
    BAN_WINDOW_S,
    MEMBERSHIP,
    FrameError,
    NodeServicer,
    admitted_ticket,
    read_frame,
    refuse,
    write_frames,
)
from protocol.admission import BUSY, InFlight, Refusal, request_deadline_s
from protocol.averaging import OPEN_S, RECENT_TRIPS, drain_wait_s
from protocol.routing import BanList
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    StageContract,
    StageMeta,
    StageRequestError,
    check_header,
    check_meta,
    parse_request,
)

logger = logging.getLogger(__name__)

# A held training micro-batch is admitted after this long even if the step it waits for has
# not come (a round that falls back to its timeout, a lost peer), unless a round is on its
# way (``HOLD_ROUND_S``).
HOLD_S = 3.0
# While the step that the held micro-batch waits for is on its way (``round_on_way``: a
# gradient round is in progress), it is held up to this long instead: admitted
# before the step, its gradient would be one step stale, which costs about a fifth of the
# loss per sample, and a round on a home link (its all-reduce) takes longer than ``HOLD_S``.
# A trainer adds it to its timeout for a training call, on top of what the call's compute
# takes (``CallTimer``).
HOLD_ROUND_S = 15.0
# A peer that has admitted its share of the step's batch (the target over the stage's peers
# at the epoch) waits this long for its peers to admit theirs before it takes more: two
# peers that admit at once, each before it reads the other's progress, overshoot the batch.
SHARE_WAIT_S = 0.5
# The handler of sessions: streams that carry one request after another (module docstring).
SESSION = "session"
# A session with no request for this long is closed: callers reuse a stream for less time
# (``node.pipeline.client.IDLE_S``), so they never send on one the server is closing.
SESSION_IDLE_S = 60.0


class CallerGone(Exception):
    """The caller's stream ended in the middle of a request (nobody to answer)."""


class Shed(Exception):
    """A request the stream's admission ticket cannot take on (``protocol.admission``)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.value)
        self.refusal = refusal


class Admission(enum.Enum):
    """Whether a stage takes a new training micro-batch now."""

    OPEN = "open"
    FULL = "full"  # the step's batch is committed: wait for the step
    SHARE = "share"  # this peer admitted its share: wait a little for its peers to admit theirs


@dataclass(frozen=True)
class StageCounters:
    forward: int  # forward requests served (a last-stage train call counts here too)
    backward: int  # backward passes served (rpc_backward and last-stage train calls)
    rejected: int  # requests refused
    steps: int  # optimizer steps taken
    samples: int  # samples accumulated since the last step
    reused: int = 0  # backward passes served from a forward's kept graph (no recompute)
    held: int = 0  # training micro-batches that waited for a step before they were admitted
    waiting: int = 0  # of those, still waiting
    overdue: int = 0  # of those, admitted after ``HOLD_S`` without the step (may be stale)
    inferred: int = 0  # inference forwards served (generation), not counted in ``forward``
    shed: int = 0  # requests this server shed for load or for arriving too slowly
    sessions: int = 0  # sessions opened (each serves requests one after another)
    abandoned: int = 0  # requests dropped uncomputed: their caller left while they waited


def stage_namespace(stage: int) -> str:
    """Where a stage's handlers are named, so that one node can serve two stages."""
    return f"stage{stage}"


class StageServer(NodeServicer):
    """Serves one stage of a run on a ``hivemind.P2P``; build with ``await create(...)``.

    Compute runs one request at a time on a worker thread holding ``lock``; the event
    loop only moves bytes. ``load`` counts requests received whole and queued or computed.
    ``in_flight``: the node's caps on requests in flight (its own, with the default
    limits, if not given); ``download_mbps``: the node's download bandwidth now (None:
    unknown), for how long a request may take to arrive.
    """

    service_name = "StageServer"
    max_frame_bytes = MAX_FRAME_BYTES
    refusal_prefix = REFUSED

    def __init__(
        self,
        stage: Stage,
        optimizer: StageOptimizer,
        contract: StageContract,
        run_id: str,
        *,
        compression: str = "none",
        receive_timeout: float = 60.0,
        close_grace: float = 10.0,
        admission: Callable[[str], str | None] | None = None,
        callers: BanList | None = None,
        keep_graphs: int = 4,
        keep_s: float = 60.0,
        lock: threading.Lock | None = None,
        in_flight: InFlight | None = None,
        download_mbps: Callable[[], float | None] = lambda: None,
    ) -> None:
        compression_type(compression)  # rejects unknown names now, not at the first response
        self.stage = stage
        self.optimizer = optimizer
        self.contract = contract
        self.namespace = stage_namespace(contract.stage_index)  # a node may serve two stages
        self.run_id = run_id
        self.compression = compression  # of the activations and gradients this server sends
        self.receive_timeout = receive_timeout  # for a whole request to arrive
        self.close_grace = close_grace  # for a caller to close the stream after a response
        self.admission = admission  # a caller's peer id -> why it is refused (private runs)
        self.callers = BanList(BAN_S, BAN_AFTER, BAN_WINDOW_S) if callers is None else callers
        self.in_flight = InFlight() if in_flight is None else in_flight
        self.download_mbps = download_mbps
        # held while parameters or gradients are read or changed (an averager shares it)
        self.lock = lock or threading.Lock()
        self.executor = StageExecutor(
            stage, contract, self._accumulated, lock=self.lock, keep_graphs=keep_graphs,
            keep_s=keep_s,
        )  # fmt: skip
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        # Seconds the compute thread spent on requests, and since when it runs one (None:
        # idle), under ``_busy_lock``: ``compute_seconds``.
        self._busy_lock = threading.Lock()
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._load = 0
        self._rejected = 0
        # Admission (see the module docstring): open micro-batches, (caller, micro-batch)
        # -> (samples, when admitted), under ``_gate_lock`` (the event loop admits, the
        # compute thread releases); ``_gate_changed`` is replaced by a new event each time
        # the gate may have opened, so that every waiter wakes.
        self._gate_lock = threading.Lock()
        self._open: dict[tuple[str, int], tuple[int, float]] = {}
        # the latest trips (admission to gradients in .grad, seconds), under ``_gate_lock``
        self._trips: deque[float] = deque(maxlen=RECENT_TRIPS)
        self._gate_changed: asyncio.Event | None = None
        self._gate_loop: asyncio.AbstractEventLoop | None = None
        self._held = self._overdue = self._waiting = self._abandoned = 0
        # Sessions open now: caller -> how many, and their writers (closed on detach).
        self._sessions: dict[str, int] = {}
        self._session_writers: set[asyncio.StreamWriter] = set()
        self._sessions_opened = 0

    @classmethod
    async def create(
        cls,
        p2p: P2P,
        stage: Stage,
        optimizer: StageOptimizer,
        contract: StageContract,
        run_id: str,
        **settings,
    ) -> StageServer:
        self = cls(stage, optimizer, contract, run_id, **settings)
        await self.attach(p2p)
        return self

    async def attach(self, p2p: P2P) -> None:
        await super().attach(p2p)
        await p2p.add_binary_stream_handler(
            self.handle_name(self.namespace, SESSION), self._serve_session
        )

    async def detach(self, timeout_s: float = DETACH_TIMEOUT_S) -> None:
        """Stop taking requests, and end the open sessions (their callers reroute)."""
        p2p = self._p2p
        if p2p is not None and p2pd_running(p2p):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout_s):
                    await p2p.remove_binary_stream_handler(
                        self.handle_name(self.namespace, SESSION)
                    )
        for writer in list(self._session_writers):
            writer.close()
        await super().detach(timeout_s)

    async def shutdown(self) -> None:
        """Stop taking requests and wait for the computation in progress."""
        await self.detach()
        await asyncio.to_thread(self._thread.shutdown)

    @property
    def peer_id(self) -> PeerID | None:
        return None if self._p2p is None else self._p2p.peer_id

    @property
    def load(self) -> int:
        return self._load

    @property
    def counters(self) -> StageCounters:
        return StageCounters(
            forward=self.executor.forward,
            backward=self.executor.backward,
            rejected=self._rejected,
            steps=self.optimizer.step_count,
            samples=self.optimizer.samples,
            reused=self.executor.reused,
            held=self._held,
            waiting=self._waiting,
            overdue=self._overdue,
            inferred=self.executor.inferred,
            shed=sum(self.shed_tally.totals.values()) if self.shed_tally else 0,
            sessions=self._sessions_opened,
            abandoned=self._abandoned,
        )

    @property
    def open_sessions(self) -> int:
        """Sessions open now."""
        return len(self._session_writers)

    def refused(self, context: P2PContext, what: str, reason: str, cause: str = "") -> None:
        self._rejected += 1  # bad frames too, which the handler never sees
        super().refused(context, what, reason, cause)

    def on_accumulated(self) -> None:
        """Called on the compute thread, holding ``lock``, after a micro-batch's gradients
        were added to ``.grad``. Steps locally once ``target_batch_size`` samples are in;
        averaging among the stage's peers replaces this."""
        if self.optimizer.samples >= self.optimizer.config.target_batch_size:
            self.optimizer.step()

    def compute_seconds(self) -> float:
        """Seconds the compute thread has spent on requests since the server started, the
        one it runs now included (any thread): what an averaging round subtracts from its
        duration to tell how long the stage stood idle during it."""
        with self._busy_lock:
            running = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self._busy_s + running

    # -- admission ------------------------------------------------------------------------

    @property
    def gated(self) -> bool:
        """Whether training micro-batches wait for a pending step (``max_staleness`` 0)."""
        return self.optimizer.config.max_staleness == 0

    def open_samples(self) -> int:
        """Samples admitted whose gradients are not in ``.grad`` yet (any thread); a
        micro-batch open longer than ``OPEN_S`` is forgotten (its backward went to another
        peer of the stage, or never came)."""
        with self._gate_lock:
            self._forget_expired()
            return sum(n for n, _ in self._open.values())

    def committed_samples(self) -> int:
        """Samples accumulated in ``.grad`` plus those open, read together (any thread): a
        micro-batch moves from one to the other at once."""
        with self._gate_lock:
            self._forget_expired()
            accumulated = self.optimizer.samples
            return accumulated + sum(n for n, _ in self._open.values())

    def _forget_expired(self) -> None:
        """Drop the micro-batches open longer than ``OPEN_S`` (holding ``_gate_lock``)."""
        cutoff = time.monotonic() - OPEN_S
        for key in [k for k, (_, at) in self._open.items() if at < cutoff]:
            del self._open[key]

    def _admission(self) -> Admission:
        """Whether a new training micro-batch may enter now. On the event loop."""
        if self.committed_samples() >= self.optimizer.config.target_batch_size:
            return Admission.FULL
        return Admission.OPEN

    async def _admit(
        self, key: tuple[str, int], samples: int, gone: Callable[[], bool] = lambda: False
    ) -> None:
        """Wait until the stage takes a new training micro-batch (at most ``HOLD_S``), then
        count it open. On the event loop: nothing else admits between the check and the
        count. ``CallerGone`` (nothing counted) if ``gone()`` says the caller left while the
        micro-batch waited."""
        if not self.gated:
            return
        if self._gate_changed is None:
            self._gate_loop, self._gate_changed = asyncio.get_running_loop(), asyncio.Event()
        now = time.monotonic()
        deadline, share_deadline = now + HOLD_S, now + SHARE_WAIT_S
        round_deadline = now + HOLD_ROUND_S
        await self.before_admit()
        state = self._admission()
        if state is not Admission.OPEN:
            self._held += 1
            self._waiting += 1
            try:
                while state is not Admission.OPEN:
                    now = time.monotonic()
                    if state is Admission.SHARE and now >= share_deadline:
                        break  # the others did not fill theirs: take part of it
                    if now >= deadline and (now >= round_deadline or not self.round_on_way()):
                        self._overdue += 1
                        logger.info("admitted micro-batch %s after %.1f s without the step",
                                    key, now - deadline + HOLD_S)  # fmt: skip
                        await self.on_overdue()
                        self.gate_changed()  # the others held may enter now
                        break
                    changed = self._gate_changed
                    # The timeout also catches what nothing announces (the clock of OPEN_S),
                    # and a peer's share is read again.
                    await wait_event(changed, min(deadline - now, 0.1) if now < deadline else 0.1)
                    if state is Admission.SHARE:
                        await self.before_admit()
                    state = self._admission()
            finally:
                self._waiting -= 1
            if gone():
                raise CallerGone()
        with self._gate_lock:
            self._open[key] = (samples, time.monotonic())
        self.on_admitted()

    def round_on_way(self) -> bool:
        """Whether the step that held micro-batches wait for is on its way (a gradient round
        is in progress): they are then held up to ``HOLD_ROUND_S``, not ``HOLD_S``."""
        return False

    async def before_admit(self) -> None:
        """Bring what ``_admission`` reads up to date (an averaging stage reads its peers'
        progress)."""

    def on_admitted(self) -> None:
        """A training micro-batch was admitted (on the event loop)."""

    async def on_overdue(self) -> None:
        """A training micro-batch is admitted after ``HOLD_S`` without the step it waited
        for (on the event loop)."""

    def _release(self, key: tuple[str, int]) -> None:
        with self._gate_lock:
            self._open.pop(key, None)
        self.gate_changed()

    def gate_changed(self) -> None:
        """The gate may have opened: wake the micro-batches waiting on it (any thread)."""
        loop = self._gate_loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            loop.call_soon_threadsafe(self._wake_gate)

    def _wake_gate(self) -> None:
        changed, self._gate_changed = self._gate_changed, asyncio.Event()
        if changed is not None:
            changed.set()

    def drain_wait_s(self) -> float:
        """How long a step waits for the open micro-batches' gradients
        (``protocol.averaging.drain_wait_s`` over this stage's recent trips; at most
        ``OPEN_S``, after which an open micro-batch is forgotten anyway). Any thread."""
        with self._gate_lock:
            admitted = [at for _, at in self._open.values()]
            trips = list(self._trips)
        return drain_wait_s(admitted, trips, time.monotonic(), ceiling_s=OPEN_S)

    async def wait_drained(self, timeout: float) -> bool:
        """Wait until no admitted micro-batch is open (at most ``timeout`` seconds), so that
        a step takes the gradients of all of them. True if none is."""
        deadline = time.monotonic() + timeout
        while self.open_samples():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._gate_changed is None:
                return False
            changed = self._gate_changed
            await wait_event(changed, min(remaining, 0.25))
        return True

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Inputs -> outputs; at the last stage inputs and targets -> loss (and, with
        ``train``, the gradient of ``loss * B`` w.r.t. the inputs), or with ``infer``
        inputs -> the logits of each sequence's last position."""
        limits.PURPOSE.set(limits.ACTIVATIONS)  # the stream's task: what it reads and sends
        for message in await self._serve(FORWARD, requests, context):
            yield message
        await self._linger()

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Inputs and grad_outputs -> gradient w.r.t. the inputs (none at stage 0)."""
        limits.PURPOSE.set(limits.GRADIENTS)  # the stream's task: what it reads and sends
        for message in await self._serve(BACKWARD, requests, context):
            yield message
        await self._linger()

    async def call_local(
        self, kind: str, metadata: bytes, tensors: list[runtime_pb2.Tensor], caller: str
    ) -> list[runtime_pb2.Tensor]:
        """Serve a request of this node's own trainer in-process: the same checks and
        computation as a request that came over the network (so the same result, kept
        graphs included), without the hop, since libp2p never dials its own peer id.
        Raises ``StageRequestError`` where a remote caller would be refused, and
        ``RuntimeError`` once the server is shut down."""
        if kind not in (FORWARD, BACKWARD):
            raise ValueError(f"kind must be {FORWARD!r} or {BACKWARD!r}, got {kind!r}")
        self._load += 1
        admitted: tuple[str, int] | None = None  # stays open only if it was served
        try:
            meta = StageMeta.decode(metadata)
            check_meta(self.contract, meta, run_id=self.run_id, kind=kind)
            if kind == FORWARD and meta.train and tensors and tensors[0].size:
                key = (caller, meta.micro_batch)
                await self._admit(key, int(tensors[0].size[0]))  # as a remote caller's
                admitted = key
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(self._thread, self._compute, meta, tensors, caller)
            admitted = None
            return out
        except StageRequestError:
            self._rejected += 1
            raise
        finally:
            self._load -= 1
            if admitted is not None:  # refused, failed or cancelled: holds no step back
                self._release(admitted)

    async def _linger(self) -> None:
        # Keep the stream open until the caller, holding the whole response, closes it
        # (hivemind then cancels this handler): closing first can cut the last chunk short.
        await asyncio.sleep(self.close_grace)

    async def _serve_session(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve the requests of one session until the caller closes it, it idles past
        ``SESSION_IDLE_S``, or a request fails (see the module docstring)."""
        name = self.handle_name(self.namespace, SESSION)
        local_id = self._p2p.peer_id if self._p2p is not None else info.peer_id
        context = P2PContext(handle_name=name, local_id=local_id, remote_id=info.peer_id)
        caller = info.peer_id.to_base58()
        with contextlib.closing(writer):
            if banned := self.ban_refusal(context):
                await refuse(reader, writer, banned, MAX_FRAME_BYTES)
                return
            if refusal := self._session_refusal(caller):
                await refuse(reader, writer, BUSY + self.shed(context, *refusal), MAX_FRAME_BYTES)
                return
            self._sessions[caller] = self._sessions.get(caller, 0) + 1
            self._sessions_opened += 1
            self._session_writers.add(writer)
            try:
                # the first request comes as soon as the session opens, as a stream's does
                wait_s = min(self.in_flight.limits.first_s, SESSION_IDLE_S)
                while await self._serve_in_session(context, reader, writer, wait_s):
                    wait_s = SESSION_IDLE_S
            finally:
                self._session_writers.discard(writer)
                self._sessions[caller] -= 1
                if not self._sessions[caller]:
                    del self._sessions[caller]

    def _session_refusal(self, caller: str) -> tuple[Refusal, str] | None:
        """Why ``caller`` may not open another session now, or None."""
        limits = self.in_flight.limits
        if self._sessions.get(caller, 0) >= limits.per_caller:
            return Refusal.CALLER_REQUESTS, f"peer {caller} has {limits.per_caller} sessions open"
        if sum(self._sessions.values()) >= limits.total:
            return Refusal.TOTAL_REQUESTS, f"{limits.total} sessions open"
        return None

    async def _serve_in_session(
        self,
        context: P2PContext,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        wait_s: float,
    ) -> bool:
        """Serve the session's next request, if it starts within ``wait_s``; whether the
        session goes on."""
        try:
            async with asyncio.timeout(wait_s):
                first = await read_frame(reader, runtime_pb2.ExpertRequest, MAX_FRAME_BYTES)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False  # idle, or the caller closed the session
        except FrameError as e:
            self.refused(context, "a stage session", str(e))
            await refuse(reader, writer, REFUSED + str(e), MAX_FRAME_BYTES)
            return False
        if isinstance(first, RPCError):
            return False  # the caller ended the session
        if banned := self.ban_refusal(context):
            await refuse(reader, writer, banned, MAX_FRAME_BYTES)
            return False
        ticket = self.in_flight.admit(context.remote_id.to_base58())
        if isinstance(ticket, Refusal):
            await refuse(reader, writer, BUSY + self.shed(context, ticket), MAX_FRAME_BYTES)
            return False

        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            """The request's frames, up to its end-of-stream frame."""
            yield first
            while True:
                try:
                    frame = await read_frame(reader, runtime_pb2.ExpertRequest, MAX_FRAME_BYTES)
                except FrameError as e:
                    raise StageRequestError(str(e)) from None
                except (asyncio.IncompleteReadError, ConnectionError):
                    raise CallerGone() from None
                if isinstance(frame, RPCError):
                    return
                yield frame

        kind = _kind_of(first)
        purpose = limits.PURPOSE.set(limits.ACTIVATIONS if kind == FORWARD else limits.GRADIENTS)
        try:
            admitted = admitted_ticket.set(ticket)
            try:
                responses = await self._serve(kind, requests(), context, reader.at_eof)
            except CallerGone:
                return False
            except Exception as e:  # refused, shed or failed: the session ends as a stream does
                await refuse(reader, writer, str(e), MAX_FRAME_BYTES)
                return False
            finally:
                admitted_ticket.reset(admitted)
                self.in_flight.release(ticket)
            await write_frames(responses, writer)
            return True
        except ConnectionError:
            return False  # the caller is gone
        finally:
            limits.PURPOSE.reset(purpose)

    async def _serve(
        self,
        kind: str,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
        context: P2PContext,
        gone: Callable[[], bool] = lambda: False,
    ) -> list[runtime_pb2.ExpertResponse]:
        """Receive, admit, compute and answer one request. ``gone``: whether the caller has
        left (its session ended) since it sent the request, polled before the request is
        computed: if so, ``CallerGone``, and nothing is counted."""
        cause = ""  # of a refusal, for the caller's ban count
        admitted: tuple[str, int] | None = None  # stays open only if it was served
        loaded = False  # received whole: counted in ``load``
        computed = False
        limits = self.in_flight.limits
        deadline = min(
            self.receive_timeout,
            request_deadline_s(limits, self.contract.max_message_bytes, self.download_mbps()),
        )
        first = min(limits.first_s, deadline)
        loop = asyncio.get_running_loop()
        opened, arrived = loop.time(), False  # arrived: the first message did

        def on_metadata() -> None:
            nonlocal arrived
            arrived = True
            limit.reschedule(opened + deadline)

        try:
            async with asyncio.timeout(first) as limit:
                if self.admission:
                    caller = context.remote_id.to_base58()
                    if refusal := self.admission(caller):
                        cause = MEMBERSHIP
                        await self._discard(requests, 0)
                        raise StageRequestError(refusal)
                    self.callers.forgive(caller, MEMBERSHIP)
                meta, serialized = await self._receive(kind, requests, on_metadata)
            self._load += 1
            loaded = True
            caller = context.remote_id.to_base58()
            if kind == FORWARD and meta.train and serialized:
                key = (caller, meta.micro_batch)
                await self._admit(key, int(serialized[0].size[0]), gone)  # size: checked
                admitted = key
            outputs = await loop.run_in_executor(
                self._thread, self._compute, meta, serialized, caller, gone
            )
            computed = True
            if gone() and admitted is not None:
                raise CallerGone()  # nobody takes its outputs: it holds no step back
            admitted = None
        except Shed as e:
            reason = self.shed(context, e.refusal)
            raise StageRequestError(BUSY + reason) from None
        except TimeoutError:
            # Not malformed, maybe only slow (a loaded caller, a slow link): shed, so that
            # the caller may try another peer, and not held against it.
            if arrived:
                reason = f"request not received within {deadline:.1f} s"
            else:
                reason = f"request not received within {first:.1f} s (nothing arrived)"
            self.shed(context, Refusal.SLOW, reason)
            raise StageRequestError(BUSY + reason) from None
        except StageRequestError as e:
            self.refused(context, f"a {kind} request", str(e), cause)
            raise StageRequestError(REFUSED + str(e)) from None
        except CallerGone:
            if loaded and not computed:  # received whole, then dropped uncomputed
                self._abandon(context, meta)
            raise
        except Exception as e:
            logger.exception(f"failed to serve a {kind} request from {context.remote_id}")
            raise RuntimeError(f"{FAILED}{type(e).__name__}: {e}") from None
        finally:
            if loaded:
                self._load -= 1
            if admitted is not None:  # refused, failed or cancelled: holds no step back
                self._release(admitted)
        meta = encode_response_meta(len(outputs))
        return list(split_message(runtime_pb2.ExpertResponse, meta, outputs))

    async def _receive(
        self,
        kind: str,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
        on_metadata: Callable[[], None] = lambda: None,
    ) -> tuple[StageMeta, list[runtime_pb2.Tensor]]:
        """Read a request's messages, refusing it at the first part that breaks the contract
        (``StageRequestError``) or that the stream's ticket cannot be charged for
        (``Shed``). ``on_metadata``: called once the first message has arrived."""
        meta: StageMeta | None = None
        batch: tuple[int, int] | None = None
        roles: tuple[str, ...] = ()
        ticket = admitted_ticket.get()

        def check(index: int, header: runtime_pb2.Tensor) -> int:
            nonlocal batch
            if index >= len(roles):
                raise StageRequestError(
                    f"a {kind} request to stage {self.contract.stage_index} carries "
                    f"{len(roles)} tensors {list(roles)}, got more"
                )
            bt, nbytes = check_header(
                self.contract,
                roles[index],
                dtype=header.dtype,
                shape=tuple(header.size),
                compression=compression_name(header.compression),
                batch=batch,
            )
            batch = bt
            if ticket is not None and (refusal := self.in_flight.charge(ticket, nbytes)):
                raise Shed(refusal)
            return nbytes

        assembler = Assembler(self.contract.max_message_bytes, check)
        try:
            async for message in requests:
                if meta is None:
                    if not message.metadata:
                        raise StageRequestError("the first message must carry metadata")
                    on_metadata()
                    meta = StageMeta.decode(message.metadata)
                    check_meta(self.contract, meta, run_id=self.run_id, kind=kind)
                    roles = self.contract.roles(kind, infer=meta.infer)
                assembler.add(message)
                await limits.traffic.receive(message.ByteSize() + limits.FRAME_OVERHEAD)
        except (StageRequestError, Shed):
            await self._discard(requests, assembler.received)
            raise
        if meta is None:
            raise StageRequestError("empty request")
        return meta, assembler.tensors()

    async def _discard(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], received: int
    ) -> None:
        """Read and drop the rest of a refused request, up to the message size limit.

        Replying while the caller still sends can make the daemons reset the stream, and
        the caller then sees a reset, not the refusal. Draining avoids that for any request
        within the limits; past them, a refusal may still reach the caller as a reset
        (``StageUnavailable``)."""
        async for message in requests:
            received += message.ByteSize()
            if received > self.contract.max_message_bytes:
                return

    def _abandon(self, context: P2PContext, meta: StageMeta) -> None:
        """A request received whole whose caller left before its answer: count it, say so."""
        self._abandoned += 1
        caller = context.remote_id.to_base58()
        logger.info("dropped micro-batch %d of %s: the caller left while it waited",
                    meta.micro_batch, caller[-8:])  # fmt: skip
        events.emit(
            "stage.abandoned",
            stage=self.contract.stage_index,
            peer=caller,
            micro_batch=meta.micro_batch,
            kind=meta.kind,
            train=meta.train,
        )

    def _compute(
        self,
        meta: StageMeta,
        serialized: list[runtime_pb2.Tensor],
        caller: str,
        gone: Callable[[], bool] = lambda: False,
    ) -> list[runtime_pb2.Tensor]:
        """On the compute thread: decode, check, and only then run the stage, unless the
        caller left while the request was queued (``gone``: ``CallerGone``). A loss (or
        the logits) travels exact; activations and gradients with the server's
        compression, except in answer to an inference forward (generation), which travels
        exact too: its output is deterministic, as the export's."""
        if gone():
            raise CallerGone()
        with self._busy_lock:
            self._busy_since = time.monotonic()
        try:
            return self._compute_timed(meta, serialized, caller)
        finally:
            with self._busy_lock:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None

    def _compute_timed(
        self, meta: StageMeta, serialized: list[runtime_pb2.Tensor], caller: str
    ) -> list[runtime_pb2.Tensor]:
        request = parse_request(self.contract, meta, [deserialize(s) for s in serialized])
        outputs = self.executor.run(request, caller)
        return [
            serialize(
                out.detach().float().cpu(),
                "none"
                if meta.infer or (i == 0 and self.contract.returns_loss)
                else self.compression,
            )
            for i, out in enumerate(outputs)
        ]

    @property
    def device(self) -> torch.device:
        return self.executor.device

    def _accumulated(self, key: tuple[str, int], batch_size: int) -> None:
        """The executor added a micro-batch's gradients (compute thread, holding ``lock``):
        count its samples, no longer open (the gate never sees a dip), and maybe step."""
        with self._gate_lock:
            opened = self._open.pop(key, None)
            if opened is not None:
                self._trips.append(time.monotonic() - opened[1])
            self.optimizer.accumulated(batch_size)
        self.on_accumulated()
        self.gate_changed()


def _kind_of(first: runtime_pb2.ExpertRequest) -> str:
    """The kind a session's request declares (``FORWARD`` if it declares none that is
    valid: ``_serve`` then refuses its metadata as any handler would)."""
    try:
        kind = StageMeta.decode(first.metadata).kind
    except Exception:  # whatever it is, ``_serve`` refuses it with the reason
        return FORWARD
    return kind if kind in (FORWARD, BACKWARD) else FORWARD
