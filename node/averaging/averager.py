"""Averaging among the peers of one stage: the round loop, and the server that feeds it.

``StageAverager`` keeps the copies of a stage equal. Every peer of the stage publishes its
progress (``protocol.averaging.Progress``: epoch, samples accumulated toward the next
round) in the DHT and reads the others' (``progress.ProgressBoard``); all apply the same
rule (``protocol.averaging.decide``): once the stage's peers at an epoch have the samples
their strategy asks for (``strategies``: one target batch shared by the peers in gradient
mode, ``inner_steps`` batches per peer in DiLoCo), they average (``transport``) and each
applies the same step; a peer alone at its epoch steps alone; a peer that sees one ahead
of it downloads the state (``download``) instead.

Threads. ``on_accumulated`` runs on the stage server's compute thread, holding the
stage's lock: it only counts, lets the strategy step where no round is needed (a peer
alone; DiLoCo's inner steps), and wakes this object's tasks. The rounds run as tasks on
the event loop; the averager itself is a child process. A contribution is taken under the
lock when a round starts, so micro-batches served during the round accumulate for the
next epoch; the round's result is applied under the lock, in a worker thread.

Staleness (``OptimizerConfig.max_staleness`` 0, the default). In gradient mode a round
takes the gradients of every micro-batch this peer admitted at the epoch (it waits for
the open ones' backwards, as long as the stage's recent trips say they take:
``protocol.averaging.drain_wait_s``), and the server admits no new training micro-batch
while the stage's samples at the epoch, its peers' included (``admission``), make up the
target batch or a round is in flight. So every step averages gradients of
exactly the parameters it updates, from about ``target_batch_size`` samples. Each peer
publishes as it admits and reads its peers' progress before it admits (``push_through``:
it sends its record straight to its peers, and while they all send theirs, stores to
the DHT at the report period only and reads it only to find peers that do not push to it
yet); one that has admitted its share of the batch waits ``SHARE_WAIT_S`` for them to
admit theirs before it takes more, so that two peers rarely take the last micro-batch at
once (overshoot). With
``max_staleness`` 1, micro-batches served during a round go into the next epoch, computed
on the parameters before the round's step, and the next round takes all of them.

Overlap (DiLoCo with ``AveragingSpec.overlap``). The round takes the copy's delta from a
snapshot of its parameters, and the copy goes on: the server keeps admitting micro-batches
and the copy keeps taking inner steps while the all-reduce runs; the outer step, once the
averaged delta arrives, moves the parameters by the new anchor minus the snapshot, so the
progress made meanwhile is kept, and it counts toward the next round
(``protocol.averaging.OuterRound``: at most one round in flight). A micro-batch in flight
across that step recomputes its forward for its backward (the parameters changed).

Holding (DiLoCo without overlap). While an outer round runs the server holds new training
micro-batches, each at most ``node.pipeline.server.HOLD_S``. Once one has waited that long
the round is overdue and overlapped from then on (``protocol.averaging.OuterRound.overdue``,
``Strategy.overdue``): the copy admits micro-batches and takes inner steps, and the outer
step keeps them, so a long round (a slow link, a loaded machine, a fallback at its
timeout) does not cut the pipeline down to one micro-batch per hold.

Matchmaking. A round looks for its group from its trigger on (``transport.schedule``),
while it waits for the backwards of the micro-batches it admitted: at stage 0 that wait
is a whole trip through the later stages, and hivemind's matchmaking (DHT declarations and
reads) fits in it. The group that forms waits for our tensors, which the first attempt
hands over once they are taken; a later attempt matches afresh. ``EARLY_MATCH_ENV`` "0"
matches after the wait, as before (for benchmarks that compare the two).

Events. After every epoch it reaches, and after a round that failed without a step, the
averager emits ``averaging.round`` (``node.events``), a timed round with its parts
(``ROUND_PARTS``); with digests on
(``digests.digests_wanted``) the event carries a digest of the tensors the copies agreed
on, which ``digests.compare_copies`` compares across peers.

Faults. A failed attempt is retried until ``round_timeout_s``; then the peer re-reads the
DHT and either catches up (someone got ahead) or applies its own contribution alone (a
fallback). A discarded round's contribution goes back (``Strategy.give_back``): no sample
is lost or counted twice. A copy that fell back is its own (its groupmates took another
step, or fell back too): it takes a lineage of its own (``protocol.averaging.fork_lineage``,
shipped with its state), each groupmate tells its lineage in a round's matchmaking, and
once a round averaged, the copies of every lineage but the one ``resync_source`` chooses
forgo the round's step (``Strategy.forgo``) and catch up from a copy of that one, so that
the stage holds one copy again.

Downloads. A catch-up waits for the state as long as its bytes take at the upload rate
its sources announce (``protocol.averaging.download_patience_s``), at least a round's
timeout. After each epoch the peers at it hold their next step for the peers behind them
(joiners downloading the state) as long as a download from the slowest of them may take
(``decide``'s ``patient_for``; ``protocol.averaging.Patience`` bounds it per peer behind
and in all): a catch-up then lands at the epoch its source is at, rather than chase a
stage that steps faster than its state downloads. A joiner's first load is not waited
for (its progress is published once it holds a state).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.averaging.control import StepControl
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from models.stages import Stage
from models.training import StageOptimizer
from node import events
from node.aio import cancel_and_wait, wait_event
from node.averaging.digests import ParamDigest, digests_wanted
from node.averaging.download import LoadedState, Saved, download, initial_state
from node.averaging.process import StageAveragerProcess
from node.averaging.progress import ProgressBoard
from node.averaging.progress_push import ProgressInbox, ProgressPusher
from node.averaging.state import StageState, shipped_bytes
from node.averaging.strategies import AveragingStats, Contribution, Strategy, make_strategy
from node.averaging.transport import HivemindTransport
from node.pipeline.server import Admission, StageServer
from node.rpc.dht import SwarmDHT
from protocol.averaging import (
    DRAIN_S,
    Action,
    Patience,
    Progress,
    decide,
    download_patience_s,
    fork_lineage,
    resync_source,
    tell_at_once,
    within_bounds,
)
from protocol.progress import MAX_EPOCHS_AHEAD
from protocol.run_spec import AveragingSpec, RunSpec

logger = logging.getLogger(__name__)

SHUTDOWN_S = 10.0  # the rounds' task is waited for this long after its cancellation
# At most this long a stopping peer lets a round whose group formed run to its end (the
# groupmates wait on its parts), within the round's own all-reduce timeout.
FINISH_ROUND_S = 20.0

# How long the progress records of peers that claimed to be ahead, but handed over no newer
# state when asked, are ignored (``ProgressBoard.distrust``).
UNPROVEN_S = 60.0
# For benchmarks of the round's path only: "0" in the environment makes a round look for
# its group after the drain, as it did before matchmaking overlapped the drain.
EARLY_MATCH_ENV = "SWARMTRAIN_EARLY_MATCH"
# Catch-ups in a row in which no state came at all (a timeout proves nothing: the claimant
# may be loaded) before the progress of claimants at most ``MAX_EPOCHS_AHEAD`` ahead of us
# is ignored; a claim further ahead, or a state that came and is not newer, is ignored at
# once.
SILENT_CATCH_UPS = 2


# The parts of a round, in order, each from the mark before it (``averaging.round`` fields):
# the trigger's drain of open micro-batches, taking the contribution, matchmaking (every
# attempt until the one whose group formed), the all-reduce, applying the step.
ROUND_PARTS = ("drain", "begin", "match", "allreduce", "finish")


class _Timeline:
    """The marks of one round (``time.monotonic``), from its trigger."""

    def __init__(self, started: float) -> None:
        self.marks: dict[str, float] = {"trigger": started}

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks[name] = time.monotonic() if at is None else at

    def fields(self) -> dict[str, float]:
        """``PART_s`` for each part of ``ROUND_PARTS`` whose end was marked, from the latest
        mark before it (0 for an end marked before that)."""
        fields, last = {}, self.marks["trigger"]
        for part in ROUND_PARTS:
            end = self.marks.get(part)
            if end is not None:
                fields[f"{part}_s"] = round(max(0.0, end - last), 4)
                last = max(last, end)
        return fields


@dataclass(frozen=True)
class _Window:
    """Where a step's measurements start: the time, the stage server's compute seconds
    (``StageServer.compute_seconds``; None without a server) and the inner steps taken."""

    started: float
    computed: float | None
    inner_steps: int


class StageAverager:
    """Averaging for one stage held by this node; build with ``await create(...)``, then
    ``await load_state()`` (which also starts averaging), ``await shutdown()`` at the end.
    Or, to download the stage's state without averaging: ``await fetch(...)``."""

    def __init__(
        self,
        spec: RunSpec,
        stage_index: int,
        strategy: Strategy,
        board: ProgressBoard,
        transport: HivemindTransport,
        *,
        settings: AveragingSpec,
        digests: bool,
    ) -> None:
        self.spec = spec
        self.stage_index = stage_index
        self.strategy = strategy
        self.board = board
        self.transport = transport
        self.settings = settings
        self.digests = digests  # emit parameter digests with every averaging.round event
        # look for the round's group from its trigger on, while the drain runs
        self.early_match = os.environ.get(EARLY_MATCH_ENV, "1") != "0"
        self.stats = strategy.stats
        self.peer_id = board.peer_id
        self.server: StageServer | None = None  # set by the server that serves this stage
        self._name = f"stage {stage_index} ({self.peer_id[-6:]})"  # in log lines
        self._busy = False
        # set while no step's task runs (``_busy`` ends before it: once the step is applied)
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False  # ``finish_round`` was called: no new round starts
        self._stepped_now = False  # on_accumulated stepped alone: the epoch is to announce
        self._catch_up_after = 0.0
        self._silent_catch_ups = 0  # catch-ups in a row that got no state at all
        # Whom an epoch's due step waits for (joiners behind us, downloading our state):
        # after each epoch, at most as long as a download of it takes.
        self._patience = Patience()
        self._state_bytes = shipped_bytes(strategy.module, strategy.mode)
        self._admitted_at = 0.0  # when (DHT time) the server last admitted a micro-batch
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._publish_now = asyncio.Event()
        self._runner: asyncio.Task | None = None  # the report and round loops, once loaded
        self._pusher: ProgressPusher | None = None  # with ``push_through``
        self._inbox: ProgressInbox | None = None
        self._taken = 0  # peers' pushed records that updated the view
        self._admission_reads = [0, 0]  # before an admission: reads made, reads the pushes spared

    @classmethod
    async def create(
        cls,
        dht: SwarmDHT,
        spec: RunSpec,
        stage_index: int,
        module: Stage,
        optimizer: StageOptimizer,
        *,
        lock: threading.Lock | None = None,
        settings: AveragingSpec | None = None,
        startup_timeout_s: float = 60.0,
        digests: bool | None = None,
        key: Ed25519PrivateKey | None = None,
        process_class: type[StageAveragerProcess] = StageAveragerProcess,
        outgoing: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> StageAverager:
        """Start the averager process (forked from the calling thread: the event loop's).

        ``lock`` is the stage's lock (a new one by default: pass it to the server, as
        ``AveragedStageServer`` does). ``digests``: emit parameter digests (default: as
        the environment asks, ``digests.DIGESTS_ENV``). ``key``: this node's, which signs
        its progress records; an averager without one can only ``fetch`` and ``keep``.
        ``process_class`` and ``outgoing`` are the transport's fault seams
        (``transport.HivemindTransport``)."""
        settings = settings or spec.averaging
        name = f"stage {stage_index} ({dht.peer_id[-6:]})"
        strategy = make_strategy(
            module,
            optimizer,
            lock or threading.Lock(),
            settings,
            AveragingStats(),
            salt=f"{spec.run}/{stage_index}",
        )
        board = ProgressBoard(
            dht,
            spec,
            stage_index,
            ttl_s=4 * settings.report_period_s + 1.0,
            name=name,
            key=key,
            push_fresh_s=4 * settings.report_period_s + 1.0,
        )
        transport = await HivemindTransport.start(
            dht,
            spec,
            stage_index,
            strategy.shapes,
            settings,
            lambda: strategy.capture(dht.peer_id),
            name=name,
            process_class=process_class,
            outgoing=outgoing,
            startup_timeout_s=startup_timeout_s,
        )
        return cls(
            spec,
            stage_index,
            strategy,
            board,
            transport,
            settings=settings,
            digests=digests_wanted() if digests is None else digests,
        )

    # -- what the node reads ------------------------------------------------------------

    @property
    def module(self) -> Stage:
        return self.strategy.module

    @property
    def optimizer(self) -> StageOptimizer:
        return self.strategy.optimizer

    @property
    def lock(self) -> threading.Lock:
        """The stage's lock: held whenever parameters or gradients change."""
        return self.strategy.lock

    @property
    def mode(self) -> str:
        return self.strategy.mode

    @property
    def step(self) -> int:
        """Optimizer steps behind this peer's parameters (diloco: inner steps)."""
        return self.optimizer.step_count

    @property
    def epoch(self) -> int:
        """Averaging rounds behind this peer's parameters (gradient mode: equal to ``step``
        for every peer that took all its steps with the swarm)."""
        return self.strategy.epoch

    @property
    def running(self) -> bool:
        return self._runner is not None and not self._runner.done()

    @property
    def peers(self) -> int:
        """Other live peers of the stage we see (at any epoch)."""
        return self.board.peers

    @property
    def busy(self) -> bool:
        """A step (a round, a step alone, a catch-up) is in progress."""
        return self._busy

    @property
    def round_on_way(self) -> bool:
        """A gradient step is in progress (a round, a step alone or a catch-up): the step
        that the server's held micro-batches wait for is coming, within the round's own
        timeouts (``StageServer.round_on_way``)."""
        return self._busy and self.strategy.mode == "gradient"

    def push_through(self, p2p: P2P, inbox: ProgressInbox) -> None:
        """Push our progress to the stage's peers we see, and take theirs from ``inbox``
        (``progress_push``): while every peer in the view pushes, the DHT is stored at
        the report period only, not around every micro-batch, and read every
        ``PUSHED_READ_S`` (``ProgressBoard.read_every``). Call before ``load_state``."""
        if self.running:
            raise RuntimeError("push_through() comes before load_state()")
        self._pusher = ProgressPusher(p2p, self.stage_index, name=self._name)
        self._inbox = inbox
        inbox.add(self.stage_index, self._pushed)

    def _pushed(self, raw: bytes, sender: str) -> bool:
        """A peer pushed its record (on the event loop): ``RecordError`` if invalid."""
        if not self.board.accept(raw, sender):
            return False
        if (skew := self.board.clocks.verdict(get_dht_time())) is not None:
            logger.warning("%s: %s", self._name, skew.line())
            events.emit(
                "averaging.clock_skew",
                stage=self.stage_index,
                offset_s=round(skew.offset_s, 3),
                peers=skew.peers,
            )
        self._taken += 1
        if self.strategy.per_peer and self._tell_at_once():
            # Its count may have reached its share: ours, held back until now, counts.
            self._publish_now.set()
        self._wake.set()  # it may complete the batch
        self._gate_changed()
        return True

    def _relying_on_pushes(self) -> bool:
        """Whether the view is kept current by pushes alone (no DHT read is needed)."""
        return self._pusher is not None and self.board.pushes_cover_view()

    # -- the server's admission -----------------------------------------------------------

    def admission(self) -> Admission:
        """Whether the server takes a new training micro-batch (``Strategy.admission``).
        On the event loop."""
        return self.strategy.admission(self._samples(), self._level(), self._busy)

    async def read_progress(self) -> None:
        """Read our peers' progress now: the server is about to admit a micro-batch, and
        what they admitted since the last read may fill the epoch."""
        if not (self.strategy.shares_batch and self.board.view()):  # alone: ours decides
            return
        if self._relying_on_pushes():  # the view is as current as a read would make it
            self._admission_reads[1] += 1
            return
        self._admission_reads[0] += 1
        await self.board.refresh()
        self._wake.set()  # what we read may make the round due

    def progress_changed(self) -> None:
        """The server admitted a micro-batch: publish our progress now (on the event loop)
        where it may count at once (``tell_at_once``: a shared batch, which our peers
        count before they admit more; or a per-peer target some count has reached), so
        that a round it makes due starts at once, not after the next report; else the
        report loop carries it at its period. See whether it completes our batch."""
        self._admitted_at = get_dht_time()
        if self._tell_at_once():
            self._publish_now.set()
        self._wake.set()  # our samples may complete the batch: no need to wait for a read

    def _tell_at_once(self) -> bool:
        """Whether our count may make a round due, as our view shows the peers at our
        epoch (``tell_at_once``)."""
        target, per_peer = self.strategy.target, self.strategy.per_peer
        return tell_at_once(self._samples(), self._level(), target, per_peer=per_peer)

    def _level(self) -> list[Progress]:
        """The records of the peers at our epoch, as our view shows them."""
        return [p for p in self.board.view() if p.epoch == self.epoch]

    def overdue(self) -> None:
        """The server admitted a micro-batch it held for the longest it holds one
        (``Strategy.overdue``). Blocking: takes the stage's lock."""
        self.strategy.overdue()

    def _gate_changed(self) -> None:
        if self.server is not None:
            self.server.gate_changed()

    async def _drain(self) -> None:
        """Wait for the backwards of the micro-batches admitted at this epoch, as long as
        the stage's recent trips say they take (``StageServer.drain_wait_s``), so that the
        step takes their gradients (a shared batch only)."""
        if self.strategy.shares_batch and self.server is not None and self.server.gated:
            await self.server.wait_drained(self.server.drain_wait_s())

    # -- the compute thread's hook ------------------------------------------------------

    def on_accumulated(self) -> None:
        """Called on the compute thread, holding ``lock``, after a micro-batch's gradients
        were added to ``.grad``. Never waits for the network."""
        alone = not self._busy and self.board.alone  # as of the last read (load_state did one)
        if self.strategy.on_accumulated_locked(alone):
            self._stepped_now = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- state ----------------------------------------------------------------------------

    async def load_state(
        self,
        timeout_s: float | None = None,
        saved: Saved | None = None,
        archived: Callable[[], Awaitable[dict[str, int]]] | None = None,
    ) -> LoadedState:
        """Load the stage's state (``download.initial_state``: from a live peer, else the
        newer of ``saved`` and the archives' (``archived``), else the initial weights), then
        start averaging. Raises
        ``StateDownloadError`` if peers exist but none hands over a valid state within
        ``timeout_s`` (default: twice a download's patience, ``_download_patience``)."""
        if self.running:
            raise RuntimeError("load_state() runs once, before averaging starts")
        if not self.board.can_publish:
            raise RuntimeError("an averager that averages needs the node's key (create(key=))")
        loaded = await initial_state(
            self.board,
            self.transport,
            self.strategy,
            timeout_s=timeout_s if timeout_s is not None else 2 * self._download_patience([]),
            retry_s=self.settings.report_period_s,
            saved=saved,
            name=self._name,
            archived=archived,
        )
        await self._announce(how="loaded", peers=0, ok=True)
        await self.board.refresh()
        # Visible to the stage's peers (and joiners) from the moment this returns.
        await self.board.publish(Progress(self.peer_id, self.epoch, self._samples()))
        self.transport.share_state(self.epoch)
        self._runner = asyncio.create_task(self._run(), name=f"averaging-stage{self.stage_index}")
        return loaded

    async def fetch(self, timeout_s: float) -> StageState | None:
        """Download the stage's state from a peer of it without taking part in the stage
        (no progress record, no rounds: ``load_state`` is never called); None if no peer
        handed over a valid state within ``timeout_s``."""
        if self.running:
            raise RuntimeError("fetch() is for an averager that does not average")
        return await download(self.transport, self.strategy, timeout_s, name=self._name)

    async def keep(self, state: StageState) -> None:
        """Make ``state`` this copy's (one that does not average: an archive's) and hand it
        to peers that download the stage, at its epoch's priority."""
        if self.running:
            raise RuntimeError("keep() is for an averager that does not average")
        await asyncio.to_thread(self.strategy.apply_state, state)
        self.transport.share_state(self.epoch)

    def snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        """A copy of the stage's state, as a joiner would download it (blocking: takes
        the stage's lock while it copies the tensors)."""
        return self.strategy.capture(self.peer_id)

    # -- the background: progress reports and rounds ------------------------------------

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._report_loop(), name="averaging-report")
                tasks.create_task(self._round_loop(), name="averaging-rounds")
                if self._pusher is not None:
                    tasks.create_task(self._pusher.run(), name="averaging-push")
        except Exception:
            logger.exception("%s: averaging stopped", self._name)
            raise

    def _samples(self) -> int:
        """Samples toward our next round (the round in flight included)."""
        server = self.server
        if server is not None and server.gated:
            return self.strategy.pending() + server.committed_samples()
        return self.strategy.pending() + self.optimizer.samples

    async def _report_loop(self) -> None:
        """Publish our progress as it changes and read the peers', every report period
        and sooner while a round waits on them. While every peer in the view pushes
        (``pushes_cover_view``), our changes go to them as pushes, the DHT is stored at
        the report period only and read only to find peers that push to us not yet
        (``ProgressBoard.read_every``)."""
        published: Progress | None = None  # as last stored in the DHT
        pushed: Progress | None = None  # as last offered to the peers
        published_at = read_at = pushed_at = -math.inf
        period = self.settings.report_period_s
        while True:
            self._publish_now.clear()
            mine = Progress(self.peer_id, self.epoch, self._samples())
            now = get_dht_time()
            relying = self._relying_on_pushes()
            pusher = self._pusher
            push = pusher is not None and (mine != pushed or now - pushed_at >= period)
            changed = mine != published and (not relying or now - published_at >= period)
            store = changed or now - published_at > self.board.ttl / 3
            signed = self.board.sign(mine) if push or store else None
            if pusher is not None and signed is not None and push:
                pusher.offer(signed[0], [p.peer_id for p in self.board.view()])
                pushed, pushed_at = mine, now
            if store and await self.board.publish(mine, signed):
                published, published_at = mine, now
            if not relying or get_dht_time() - read_at >= self.board.read_every(period):
                await self.board.refresh()
                read_at = get_dht_time()
            self.board.view()  # refreshes what .peers counts
            self._wake.set()
            self._gate_changed()  # our peers' progress decides whether the server admits
            wait = self.board.next_read(
                self.epoch,
                self._samples(),
                self.strategy.target,
                per_peer=self.strategy.per_peer,
                period=period,
            )
            if relying:  # pushes wake the rounds: no fast reads
                next_read = read_at + self.board.read_every(period)
                wait = max(0.0, min(period, next_read - get_dht_time()))
            await wait_event(self._publish_now, wait)

    async def _round_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._stepped_now:  # on_accumulated stepped alone: announce the epoch
                self._stepped_now = False
                await self._after_epoch(how="alone", peers=1, ok=True)
            now, view = time.monotonic(), self.board.view()
            decision = decide(
                self.peer_id,
                self.epoch,
                self._samples(),
                view,
                self.strategy.target,
                catch_up=now >= self._catch_up_after,
                patient_for=self._patience.deserving(view, self.epoch, now),
                per_peer=self.strategy.per_peer,
            )
            held = self._patience.note(decision.waiting_for, self.epoch, now)
            if held is not None:
                events.emit(
                    "averaging.held",
                    stage=self.stage_index,
                    epoch=held.epoch,
                    seconds=round(held.seconds, 3),
                    peers=list(held.peers),
                )
            if decision.action is Action.WAIT or self._closing:
                continue
            self._busy = True
            self._idle.clear()
            try:
                if decision.action is Action.CATCH_UP:
                    await self._catch_up()
                elif decision.action is Action.STEP_ALONE:
                    await self._step_alone()
                else:
                    await self._average(group_size=decision.peers + 1)
            finally:
                self._busy = False
                self._idle.set()
                self._gate_changed()

    async def _catch_up(self) -> None:
        """Download the state of a peer that claims to be ahead (only those are asked).
        Their progress is ignored for ``UNPROVEN_S`` when what they hand over is not newer
        than ours, or when no state came and one claims more than ``MAX_EPOCHS_AHEAD``
        epochs past ours, or after ``SILENT_CATCH_UPS`` tries in a row with no state at
        all; until then the next try waits a round's timeout. A download may take as long
        as the claimants' announced upload rates say (``_download_patience``)."""
        retry = self.settings.round_timeout_s
        ahead = [p for p in self.board.view() if p.epoch > self.epoch]
        claimants = [p.peer_id for p in ahead]
        near = all(p.epoch <= self.epoch + MAX_EPOCHS_AHEAD for p in ahead)
        state = await download(
            self.transport,
            self.strategy,
            self._download_patience(claimants),
            name=self._name,
            only=claimants,
        )
        self._catch_up_after = time.monotonic() + retry
        self._silent_catch_ups = self._silent_catch_ups + 1 if state is None else 0
        if state is None and near and self._silent_catch_ups < SILENT_CATCH_UPS:
            logger.info(
                "%s: %s claim to be past epoch %d, but no state came: trying again in %.0f s",
                self._name,
                ", ".join(p[-6:] for p in claimants) or "peers",
                self.epoch,
                retry,
            )
            return
        if state is None or state.epoch <= self.epoch:
            self._silent_catch_ups = 0
            logger.warning(
                "%s: %s claim to be past epoch %d, but no newer state came: their progress "
                "is ignored for %.0f s",
                self._name,
                ", ".join(p[-6:] for p in claimants) or "peers",
                self.epoch,
                UNPROVEN_S,
            )
            self.board.distrust(claimants, UNPROVEN_S)
            events.emit(
                "progress.unproven", stage=self.stage_index, peers=claimants, epoch=self.epoch
            )
            return
        await asyncio.to_thread(self.strategy.apply_state, state)
        self.board.learn({state.source: state.epoch})
        self._catch_up_after = 0.0
        self.stats.catch_ups += 1
        logger.info("%s: caught up to epoch %d from %s", self._name, self.epoch, state.source)
        await self._after_epoch(how="caught_up", peers=0, ok=True)

    def _download_patience(self, sources: list[str]) -> float:
        """How long a download of this stage's state from one of ``sources`` may take
        (``protocol.averaging.download_patience_s`` over the upload rates their peer records
        announce), at least a round's timeout."""
        uploads = self.board.uploads
        return download_patience_s(
            self._state_bytes,
            [uploads.get(p, 0.0) for p in sources],
            floor_s=self.settings.round_timeout_s,
        )

    def _window(self) -> _Window:
        server = self.server
        computed = None if server is None else server.compute_seconds()
        return _Window(time.monotonic(), computed, self.stats.inner_steps)

    def _measured(self, window: _Window) -> dict[str, float | int]:
        """The ``averaging.round`` fields of a step taken since ``window`` opened: its
        ``seconds``, and with a server its ``idle_s`` (seconds in which the stage's
        compute thread served nothing), in DiLoCo its ``inner_steps`` meanwhile."""
        seconds = time.monotonic() - window.started
        fields: dict[str, float | int] = {"seconds": round(seconds, 3)}
        if self.server is not None and window.computed is not None:
            busy = self.server.compute_seconds() - window.computed
            fields["idle_s"] = round(max(0.0, seconds - busy), 3)
        if self.mode == "diloco":
            fields["inner_steps"] = self.stats.inner_steps - window.inner_steps
        return fields

    async def _step_alone(self) -> None:
        window = self._window()
        await self._drain()
        if not await asyncio.to_thread(self.strategy.step_alone):
            return
        self.stats.last_round_s = time.monotonic() - window.started
        logger.debug(
            "%s: stepped alone to epoch %d (others: %s)",
            self._name,
            self.epoch,
            ", ".join(f"{p.peer_id[-6:]} at {p.epoch}" for p in self.board.view()) or "none",
        )
        await self._after_epoch(how="alone", peers=1, ok=True, measured=self._measured(window))

    async def _average(self, group_size: int) -> None:
        """One round: take our contribution, average it until the round's deadline, apply
        the result (or our own contribution alone, or catch up). ``group_size``: the peers
        at our epoch, us included; a group of that size starts at once."""
        window = self._window()
        timeline = _Timeline(window.started)
        ready = self._ready_s()
        deadline = window.started + self.settings.round_timeout_s
        scheduled = None
        if self.early_match:
            scheduled = self.transport.schedule(
                epoch=self.epoch,
                group_size=group_size,
                deadline=self._attempt_end(deadline),
                lineage=self.strategy.lineage,
            )
        try:
            await self._average_from(window, timeline, ready, deadline, group_size, scheduled)
        finally:
            if scheduled is not None and not scheduled.done():
                scheduled.cancel()

    async def _average_from(
        self,
        window: _Window,
        timeline: _Timeline,
        ready: float | None,
        deadline: float,
        group_size: int,
        scheduled: StepControl | None,
    ) -> None:
        drain_began = time.monotonic()
        await self._drain()
        timeline.mark("drain")
        # A drain longer than the shortest leaves the round its usual time to average.
        deadline += max(0.0, time.monotonic() - drain_began - DRAIN_S)
        contribution = await asyncio.to_thread(self.strategy.begin)
        timeline.mark("begin")
        if not within_bounds(contribution.tensors):
            # The server checks every micro-batch, so this is a bug or broken hardware: drop
            # what we hold, and still take part (weight 0) to stay in step with the others.
            logger.error("%s: our own contribution is not finite or out of range", self._name)
            contribution.settled = True
            contribution = contribution.emptied()
        try:
            await self._average_until(
                contribution, window, deadline, group_size, timeline, ready, scheduled
            )
        finally:
            await asyncio.shield(asyncio.to_thread(self.strategy.give_back, contribution))

    def _attempt_end(self, deadline: float) -> float:
        """The deadline of an attempt at averaging that starts now: a few matchmaking
        times, so that a peer that fell behind (its groupmates went on without it) notices
        and catches up early; at most the round's ``deadline``."""
        return min(deadline, time.monotonic() + 3 * self.settings.matchmaking_s)

    def _ready_s(self) -> float | None:
        """About how long ago the batch that triggers a round became complete across the
        group: since the newest of our last admission and our peers' records at our epoch
        (their timestamps); None if we know neither."""
        stamps = [self._admitted_at or None, self.board.published_at(self.epoch)]
        newest = max((s for s in stamps if s is not None), default=None)
        return None if newest is None else round(max(0.0, get_dht_time() - newest), 4)

    async def _average_until(
        self,
        contribution: Contribution,
        window: _Window,
        deadline: float,
        group_size: int,
        timeline: _Timeline,
        ready: float | None,
        scheduled: StepControl | None,
    ) -> None:
        started = window.started
        epoch = self.epoch
        averaged, mates, lineages, attempts, early = None, {}, {}, 0, False
        last_start = deadline - self.settings.matchmaking_s - 0.5
        while averaged is None and time.monotonic() < last_start and not self.board.ahead_of(epoch):
            exchange = await self.transport.exchange(
                contribution.tensors,
                contribution.weight,
                epoch=epoch,
                group_size=group_size,
                deadline=self._attempt_end(deadline),
                leave=lambda: self.board.ahead_of(epoch),
                scheduled=scheduled if attempts == 0 else None,
                lineage=self.strategy.lineage,
            )
            early = attempts == 0 and scheduled is not None and exchange.averaged is not None
            attempts += 1
            self.stats.discarded += exchange.discarded
            averaged, mates, lineages = exchange.averaged, exchange.mates, exchange.lineages
            if averaged is not None and exchange.allreduce_began is not None:
                timeline.mark("match", exchange.allreduce_began)
                timeline.mark("allreduce")
            if averaged is None and mates:
                self.board.learn(mates)  # a groupmate is ahead: we catch up
            if averaged is None and not self.board.mates_left(epoch):
                break  # our groupmates are gone (killed mid-round): no one to wait for
            if exchange.empty:
                break  # nobody had samples: the round loop decides again (and drains)
        lineages = {self.peer_id: self.strategy.lineage, **lineages}
        source = None if averaged is None else resync_source(self.peer_id, lineages)
        if source is not None:
            await self._resync(source, contribution, epoch, peers=len(mates) + 1)
            return
        if averaged is not None:
            await asyncio.to_thread(self.strategy.finish, averaged, contribution)
            timeline.mark("finish")
            self.board.learn(dict.fromkeys(mates, self.epoch))
            self.stats.rounds += 1
            self.stats.last_group = len(mates) + 1
            self.stats.round_s.append(time.monotonic() - started)
            logger.debug(
                "%s: averaged with %s in %.2f s, now at epoch %d",
                self._name,
                ", ".join(m[-6:] for m in mates),
                time.monotonic() - started,
                self.epoch,
            )
            self.stats.last_round_s = time.monotonic() - started
            measured = self._measured(window) | timeline.fields()
            measured |= {"attempts": attempts, "early_match": early}
            if ready is not None:
                measured["ready_s"] = ready
            await self._after_epoch(
                how="averaged", peers=len(mates) + 1, ok=True, measured=measured
            )
            return
        await self.board.refresh()
        if contribution.weight == 0 or self.board.ahead_of(epoch):
            # Nothing of ours to step on, or we are behind: the contribution goes back.
            self._catch_up_after = 0.0
            await self._announce(how="abandoned", peers=0, ok=False, digest=False)
            return
        logger.warning(
            "%s: no averaging result after %.1f s, stepping alone at epoch %d",
            self._name,
            time.monotonic() - started,
            epoch,
        )
        # Our groupmates step too (on their own, or on an average we missed): our copy is
        # our own from now on, and a peer that downloads it takes its lineage.
        self.strategy.lineage = fork_lineage(self.peer_id, epoch)
        await asyncio.to_thread(self.strategy.finish, contribution.tensors, contribution)
        self.stats.fallbacks += 1
        self.stats.last_round_s = time.monotonic() - started
        measured = self._measured(window) | timeline.fields()
        measured |= {"attempts": attempts, "early_match": early}
        await self._after_epoch(how="fallback", peers=1, ok=False, measured=measured)

    async def _resync(
        self, source: str, contribution: Contribution, epoch: int, *, peers: int
    ) -> None:
        """The group just averaged, but its copies are not one (a fallback forked them):
        ours is not the one ``resync_source`` chose. Our contribution is in the step of
        the copies that take it: it is forgone, and we catch up from ``source``, which is
        now past ``epoch``."""
        await asyncio.to_thread(self.strategy.forgo, contribution)
        self.board.learn({source: epoch + 1})
        self._catch_up_after = 0.0
        logger.warning(
            "%s: our copy left the group's in a fallback: taking %s's after the round of epoch %d",
            self._name,
            source[-6:],
            epoch,
        )
        events.emit("averaging.resync", stage=self.stage_index, epoch=epoch, source=source)
        await self._announce(how="resync", peers=peers, ok=False, digest=False)

    async def _after_epoch(
        self,
        *,
        how: str,
        peers: int,
        ok: bool,
        measured: dict[str, float | int] | None = None,
    ) -> None:
        # Peers behind us download the state of a peer at our epoch: wait as long as that
        # may take from the slowest of them (they all open the same window).
        level = [p.peer_id for p in self._level()]
        window = self._download_patience([self.peer_id, *level])
        self._patience.open(time.monotonic(), window, self._download_patience([self.peer_id]))
        self._silent_catch_ups = 0  # a new epoch: a later claim starts its own count
        self.transport.sharing_epoch(self.epoch)
        self._publish_now.set()
        # The step is applied: the server may admit again while we announce it (the
        # digest reads only what this task changes).
        self._busy = False
        self._gate_changed()
        await self._announce(how=how, peers=peers, ok=ok, measured=measured)

    async def _announce(
        self,
        *,
        how: str,
        peers: int,
        ok: bool,
        digest: bool = True,
        measured: dict[str, float | int] | None = None,
    ) -> None:
        """Emit ``averaging.round`` for the epoch we are at (see ``node.events``);
        ``measured``: of a timed step (``_measured``), from its trigger to the step."""
        fields: dict[str, object] = dict(measured or {})
        if digest and self.digests:
            # No lock: only this task changes the tensors the copies agree on.
            tensors = self.strategy.digest_tensors()
            fields["digest"] = (await asyncio.to_thread(ParamDigest.of, tensors)).fields()
        logger.debug("%s: epoch %d (%s, %d peers)", self._name, self.epoch, how, peers)
        pusher = self._pusher
        progress = dict(
            reads=self.board.reads,
            stores=self.board.stores,
            pushed=0 if pusher is None else pusher.sent,
            push_failed=0 if pusher is None else pusher.failed,
            taken=self._taken,
            admission_reads=self._admission_reads[0],
            admission_reads_spared=self._admission_reads[1],
        )
        events.emit(
            "averaging.round",
            stage=self.stage_index,
            epoch=self.epoch,
            peers=peers,
            ok=ok,
            how=how,
            progress=progress,
            **fields,
        )

    # -- shutdown -----------------------------------------------------------------------

    async def finish_round(self, grace_s: float = FINISH_ROUND_S) -> None:
        """Start no new round; if the round in flight has its group (the groupmates wait on
        our parts, or on our trigger), let it run to its end, for at most ``grace_s`` (and
        the settings' all-reduce timeout), so that leaving does not fail the groupmates'
        round and the step lands in our state before it is checkpointed. A round still
        looking for its group is left to ``shutdown``, which abandons it."""
        self._closing = True
        if self._idle.is_set() or not self.transport.in_group:
            return
        limit = min(grace_s, self.settings.allreduce_timeout_s)
        logger.info("%s: finishing the round in flight before leaving", self._name)
        started = time.monotonic()
        if await wait_event(self._idle, limit):
            logger.info("%s: round finished in %.1f s", self._name, time.monotonic() - started)
        else:
            logger.warning("%s: the round did not finish within %.0f s", self._name, limit)

    async def shutdown(self) -> None:
        """Stop averaging and the averager process, after ``finish_round`` (a round whose
        group has not formed is abandoned)."""
        if self._runner is not None:
            await self.finish_round()
        if self._inbox is not None:
            self._inbox.remove(self.stage_index, self._pushed)
        if self._runner is not None:
            await cancel_and_wait(self._runner, SHUTDOWN_S, self._name + "'s rounds")
            self._runner = None
        await self.transport.close()


class AveragedStageServer(StageServer):
    """A ``StageServer`` whose stage averages with its peers: build with
    ``await AveragedStageServer.create(p2p, stage, optimizer, contract, run_id,
    averager=averager, ...)``. It shares the averager's lock."""

    def __init__(self, *args, averager: StageAverager, **settings) -> None:
        super().__init__(*args, lock=averager.lock, **settings)
        if averager.module is not self.stage or averager.optimizer is not self.optimizer:
            raise ValueError("the averager must average this server's stage and optimizer")
        self.averager = averager
        averager.server = self

    def on_accumulated(self) -> None:
        self.averager.on_accumulated()

    def _admission(self) -> Admission:
        return self.averager.admission()

    async def before_admit(self) -> None:
        await self.averager.read_progress()

    def round_on_way(self) -> bool:
        return self.averager.round_on_way

    def on_admitted(self) -> None:
        self.averager.progress_changed()

    async def on_overdue(self) -> None:
        # takes the stage's lock, which the compute thread holds while it computes
        await asyncio.to_thread(self.averager.overdue)
