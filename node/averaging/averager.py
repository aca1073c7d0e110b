"""Averaging among the peers of one stage, and state download for a peer that joins it.

``StageAverager`` keeps the copies of a stage equal. Every peer of the stage publishes its
progress (``protocol.averaging.Progress``: epoch, samples accumulated toward the next
round) in the DHT and reads the others'; all apply the same rule (``decide``):

- gradient mode (default): once the stage's samples at this epoch, over all its peers,
  reach ``target_batch_size``, the peers average their mean gradients weighted by their
  sample counts (hivemind's ``DecentralizedAverager``, group prefix ``{run}_stage{i}``),
  and each takes the same optimizer step on the result;
- diloco mode: each peer takes AdamW steps alone, every ``target_batch_size`` of its own
  samples; once the stage has done about ``inner_steps`` of them per peer, the peers
  average their parameter deltas since the last outer step and each takes the same outer
  Nesterov step from the same anchor;
- a peer alone at its epoch steps alone at once; a peer that sees one ahead of it
  downloads the state (``load_state_from_peers``) instead.

Threads. ``on_accumulated`` runs on the stage server's compute thread, holding the
stage's lock: it only counts and wakes this object's tasks (diloco's inner step, a plain
``StageOptimizer.step``, runs there too). The rounds run as tasks on the event loop; the
averager itself is a child process. Gradients are moved out of ``.grad`` under the lock
when a round starts, so micro-batches served during the round accumulate for the next
epoch; the round's result is applied under the lock, in a worker thread.

Staleness (``OptimizerConfig.max_staleness`` 0, the default). A round takes the gradients
of every micro-batch this peer admitted at the epoch (it waits, at most ``DRAIN_S``, for the
open ones' backwards), and the server admits no new training micro-batch while the
stage's samples at the epoch, its peers' included (``admission``), make up the target batch
or a round is in flight. So every step averages gradients of exactly the parameters it
updates, from about ``target_batch_size`` samples. Each peer publishes as it admits and
reads its peers' progress before it admits; one that has admitted its share of the batch
waits ``SHARE_WAIT_S`` for them to admit theirs before it takes more, so that two peers
rarely take the last micro-batch at once (overshoot). With ``max_staleness`` 1,
micro-batches served during a round go into the next epoch, computed on the parameters
before the round's step, and the next round takes all of them, however many.

Evidence. After every epoch a peer logs a digest of the stage's parameters (diloco: of the
anchor, the parameters the outer step set), e.g. ``stage 1 (a1b2c3): epoch 12 params
3f9a2c1b ...``; ``compare_copies`` reads those lines from several peers' logs and says
whether their copies were equal at the epochs they share (``swarmtrain demo`` prints it).
They are DEBUG lines (most of a serving node's log otherwise), INFO in a process whose
environment sets ``SWARMTRAIN_LOG_DIGESTS`` (the demo's nodes).

Faults. The averaged tensors are a copy, and a result is applied only if it is finite
and completely averaged (``node.averaging.process``). A failed attempt is retried until
``round_timeout_s``; then the peer re-reads the DHT and either catches up (someone got
ahead) or applies its own contribution alone. Gradients of a discarded round go back
into ``.grad``: no sample is lost or counted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import NoCompression
from hivemind.utils import get_dht_time

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.averaging.process import StageAveragerProcess
from node.averaging.state import StageState, StateError
from node.pipeline.server import Admission, StageServer
from node.rpc.dht import SwarmDHT
from protocol.averaging import (
    MAX_ABS_CONTRIBUTION,
    Action,
    Progress,
    averaging_prefix,
    decide,
    decode_progress,
    encode_progress,
    progress_key,
)
from protocol.records import RecordError
from protocol.run_spec import AveragingSpec, RunSpec

logger = logging.getLogger(__name__)

DECLARE_STATE_PERIOD_S = 10.0  # a dead donor stays listed this long for joiners
MAX_PEER_RECORDS = 1024  # read at most this many progress records of one stage
F16_MAX = float(torch.finfo(torch.float16).max)
SKETCH_WIDTH = 4096  # a digest folds the parameters to this many sums, then projects them
SKETCH_DIMS = 4  # random directions of the projection
# Copies closer than this (relative distance) are equal up to float rounding: averaged
# without compression they differ by ~1e-7; one step apart, by ~1e-3 or more.
EQUAL_DISTANCE = 1e-5
# The longest a step waits for the backwards of the micro-batches its peer admitted (a lost
# micro-batch must not hold the stage): those that come later go into the next step.
DRAIN_S = 2.0


def process_settings(settings: AveragingSpec) -> dict[str, object]:
    """The round settings of a stage's hivemind averager (``scripts/bench_averaging.py``
    measures all-reduce with exactly these)."""
    return {
        "min_matchmaking_time": settings.matchmaking_s,
        "request_timeout": min(3.0, settings.matchmaking_s / 2),
        "allreduce_timeout": settings.allreduce_timeout_s,
        "next_chunk_timeout": settings.chunk_timeout_s,
        "compression": NoCompression(),  # float16 is in the buffers' dtype (see ``create``)
    }


# Set (to anything non-empty) in a node's environment: digests are logged at INFO.
DIGESTS_ENV = "SWARMTRAIN_LOG_DIGESTS"


class AveragerStartError(RuntimeError):
    """hivemind's averager process did not come up."""


class StateDownloadError(RuntimeError):
    """Peers of the stage exist, but none of them handed over a usable state in time."""


@dataclass(frozen=True)
class LoadedState:
    loaded: bool  # from a peer; False: no peer had the stage, we keep the initial weights
    step: int
    epoch: int
    source: str | None = None


@dataclass(frozen=True)
class ParamDigest:
    """A short fingerprint of a stage's parameters, logged after every epoch so that the
    copies of different peers can be compared from their logs.

    ``crc`` (crc32 of the float32 bytes) is equal only for bitwise equal copies. Copies
    averaged without compression differ in the last bits (each adds its own rounding of
    ``average - own``), so the digest also carries the norm and a random projection of the
    parameters (``sketch``): two copies' sketches differ by about their distance."""

    crc: int
    norm: float
    sketch: tuple[float, ...]

    PATTERN = re.compile(
        r"stage (\d+) \(\w+\): epoch (\d+) params ([0-9a-f]{8}) norm (\S+) sketch (\S+)"
    )

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> ParamDigest:
        crc, squares = 0, 0.0
        folded = torch.zeros(SKETCH_WIDTH, dtype=torch.float64)
        for t in tensors:
            flat = t.detach().reshape(-1).float().cpu()
            crc = zlib.crc32(flat.numpy(), crc)
            wide = flat.double()
            squares += float(wide.square().sum())
            pad = -len(wide) % SKETCH_WIDTH
            folded += torch.nn.functional.pad(wide, (0, pad)).view(-1, SKETCH_WIDTH).sum(0)
        sketch = folded @ _directions()
        return cls(crc, math.sqrt(squares), tuple(float(v) for v in sketch))

    def __str__(self) -> str:
        values = ",".join(f"{v:.9e}" for v in self.sketch)
        return f"{self.crc:08x} norm {self.norm:.9e} sketch {values}"

    def distance(self, other: ParamDigest) -> float:
        """About ``|a - b| / |a|`` for the two copies (0 when bitwise equal)."""
        if self.crc == other.crc:
            return 0.0
        diff = sum((x - y) ** 2 for x, y in zip(self.sketch, other.sketch, strict=True))
        return math.sqrt(diff / SKETCH_DIMS) / max(self.norm, other.norm, 1e-30)


@cache
def _directions() -> torch.Tensor:
    """The sketch's random directions: the same on every peer."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(SKETCH_WIDTH, SKETCH_DIMS, generator=g, dtype=torch.float64)


@dataclass(frozen=True)
class CopiesCheck:
    """Whether the peers of one stage held equal copies at the epochs two or more of them
    logged a digest for."""

    peers: int  # peers that logged digests of the stage
    common: int  # epochs logged by two peers or more
    bitwise: int  # of those, epochs at which the copies were bitwise equal
    worst: float  # the largest relative distance between two copies at a common epoch
    differ: tuple[int, ...]  # epochs at which copies were further apart than EQUAL_DISTANCE

    @property
    def equal(self) -> bool:
        return self.peers < 2 or (self.common > 0 and not self.differ)

    def __str__(self) -> str:
        if self.peers < 2:
            return "one copy, nothing to compare"
        if self.common == 0:
            return "COPIES NEVER COMPARED: no epoch was logged by two peers"
        if self.differ:
            return (
                f"COPIES DIFFER at {len(self.differ)} of {self.common} common epochs "
                f"(first at epoch {self.differ[0]}; largest relative distance {self.worst:.1e})"
            )
        text = f"copies equal at {self.common} of {self.common} common epochs (bitwise at "
        if self.bitwise == self.common:
            return text + "all)"
        return text + f"{self.bitwise}, the others within {self.worst:.1e} relative distance)"


def compare_copies(logs: Sequence[str], stage: int) -> CopiesCheck:
    """Compare the parameter digests that peers (one log each) logged for ``stage``."""
    by_epoch: dict[int, list[ParamDigest]] = defaultdict(list)
    peers = 0
    for log in logs:
        mine: dict[int, ParamDigest] = {}  # a peer's last digest of each epoch
        for m in ParamDigest.PATTERN.finditer(log):
            if int(m[1]) == stage:
                sketch = tuple(float(v) for v in m[5].split(","))
                mine[int(m[2])] = ParamDigest(int(m[3], 16), float(m[4]), sketch)
        peers += bool(mine)
        for epoch, digest in mine.items():
            by_epoch[epoch].append(digest)
    distances = {
        epoch: max(ds[0].distance(d) for d in ds[1:])
        for epoch, ds in sorted(by_epoch.items())
        if len(ds) > 1
    }
    return CopiesCheck(
        peers=peers,
        common=len(distances),
        bitwise=sum(d == 0.0 for d in distances.values()),
        worst=max(distances.values(), default=0.0),
        differ=tuple(e for e, d in distances.items() if d > EQUAL_DISTANCE),
    )


@dataclass
class AveragingStats:
    rounds: int = 0  # averaged with at least one other peer
    alone: int = 0  # stepped alone: no other peer at our epoch
    fallbacks: int = 0  # a round found no usable result in time: applied our own alone
    discarded: int = 0  # attempts whose result was thrown away (failed, not finite, ...)
    catch_ups: int = 0  # state downloads after falling behind
    samples: int = 0  # our samples in the steps applied (each counted once)
    inner_steps: int = 0  # diloco: local AdamW steps
    last_round_s: float = math.nan  # from our trigger to the applied result
    last_group: int = 0  # peers in the last successful round, us included
    round_s: list[float] = field(default_factory=list)  # every successful round's duration


class StageAverager:
    """Averaging for one stage held by this node; build with ``await create(...)``, then
    ``await load_state()`` (which also starts averaging), ``await shutdown()`` at the end."""

    process_class = StageAveragerProcess  # tests inject faults by subclassing it

    def __init__(
        self,
        dht: SwarmDHT,
        spec: RunSpec,
        stage_index: int,
        module: Stage,
        optimizer: StageOptimizer,
        lock: threading.Lock,
        settings: AveragingSpec,
    ) -> None:
        self.dht = dht
        self.spec = spec
        self.stage_index = stage_index
        self.module = module
        self.optimizer = optimizer
        self.lock = lock  # the stage's: held whenever parameters or gradients change
        self.settings = settings
        self.mode = settings.mode
        self.stats = AveragingStats()
        self.peer_id = dht.peer_id
        self._name = f"stage {stage_index} ({self.peer_id[-6:]})"  # in log lines
        self._params = [p for _, p in stage_state.trainable(module)]
        self._key = progress_key(spec.run, stage_index)
        self._ttl = 4 * settings.report_period_s + 1.0
        self._batch = spec.optim.target_batch_size
        self._epoch = 0
        self._round_samples = 0  # gradient mode: samples of the round in flight
        self._inner_samples = 0  # diloco: samples stepped on since the last outer step
        self._outer_busy = False  # diloco: an outer round is in flight (inner steps wait)
        self._anchor: list[torch.Tensor] | None = None  # diloco: parameters at the last outer step
        self._outer: torch.optim.SGD | None = None
        self._records: list[Progress] = []  # the other peers' records, as last read
        self._seen: dict[str, tuple[Progress, float]] = {}  # peer -> last record, when (_view)
        self._known: dict[str, int] = {}  # peer -> the highest epoch we know it reached
        self._expires: dict[str, float] = {}  # peer -> its newest record's DHT expiration
        self._busy = False
        self._stepped_now = False  # on_accumulated stepped alone; _after_epoch is due
        self._catch_up_after = 0.0
        # Until then, an epoch's step waits for peers behind us (joiners) rather than
        # stepping alone: once per epoch, at most a round's timeout.
        self._patience_until = 0.0
        self._process: StageAveragerProcess | None = None
        self._buffers: list[torch.Tensor] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._publish_now: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None
        self.server: StageServer | None = None  # set by the server that serves this stage
        if self.mode == "diloco":
            self._anchor = [p.detach().clone() for p in self._params]
            self._outer = torch.optim.SGD(
                self._anchor,
                lr=settings.outer_lr,
                momentum=settings.outer_momentum,
                nesterov=True,
            )

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
    ) -> StageAverager:
        """Start the averager process (forked from the calling thread: the event loop's).

        ``lock`` is the stage's lock (a new one by default: pass it to the server, as
        ``AveragedStageServer`` does)."""
        self = cls(
            dht,
            spec,
            stage_index,
            module,
            optimizer,
            lock or threading.Lock(),
            settings or spec.averaging,
        )
        self._loop = asyncio.get_running_loop()
        self._wake, self._publish_now = asyncio.Event(), asyncio.Event()
        s = self.settings
        # float16: our contribution travels as float16, and results come back as float32
        # deltas (hivemind returns average - ours) that land in float16 buffers, so every
        # copy rounds the same average. Compressing the deltas too (hivemind's
        # Float16Compression) leaves each copy its own rounding: 1.5e-4 apart after 20
        # rounds of the tiny preset, against bitwise equal this way.
        dtype = torch.float16 if s.compression == "float16" else torch.float32
        self._buffers = [torch.zeros(p.shape, dtype=dtype) for p in self._params]
        self._process = self.process_class(
            self._buffers,
            dht.dht,
            start=False,
            state_source=self._current_state,
            membership=spec.membership,  # a private run averages with members only
            prefix=averaging_prefix(spec.run, stage_index),
            allow_state_sharing=False,  # until our own state is loaded
            declare_state_period=DECLARE_STATE_PERIOD_S,
            **process_settings(s),
        )
        # Not run_in_background: it sets SIGINT to "ignore" in *this* process.
        self._process.start()
        try:
            await asyncio.to_thread(self._process.wait_until_ready, startup_timeout_s)
        except TimeoutError:
            await asyncio.to_thread(self._kill_process)
            raise AveragerStartError(
                f"the averager process of stage {stage_index} did not start within "
                f"{startup_timeout_s:.0f} s"
            ) from None
        except BaseException:
            await asyncio.to_thread(self._kill_process)
            raise
        return self

    # -- what the node reads ------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps behind this peer's parameters (diloco: inner steps)."""
        return self.optimizer.step_count

    @property
    def epoch(self) -> int:
        """Averaging rounds behind this peer's parameters (gradient mode: equal to ``step``
        for every peer that took all its steps with the swarm)."""
        return self._epoch

    @property
    def running(self) -> bool:
        return self._runner is not None and not self._runner.done()

    @property
    def peers(self) -> int:
        """Other live peers of the stage we see (at any epoch)."""
        return len(self._seen)

    @property
    def busy(self) -> bool:
        """A step (a round, a step alone, a catch-up) is in progress."""
        return self._busy

    # -- the server's admission -----------------------------------------------------------

    def admission(self) -> Admission:
        """Whether the server takes a new training micro-batch: not while the samples
        committed to this epoch at the stage (accumulated or open, ours and our peers')
        make up its batch, or a step is in progress (FULL); only after a short wait once
        ours make up our share of it (SHARE). On the event loop."""
        if self.mode == "diloco":  # inner steps are this peer's own batches
            full = self._outer_busy or self._samples() - self._inner_samples >= self._batch
            return Admission.FULL if full else Admission.OPEN
        if self._busy:
            return Admission.FULL
        target, mine = self._target(), self._samples()
        same = [p for p in self._view() if p.epoch == self._epoch]
        if min(mine, target) + sum(min(p.samples, target) for p in same) >= target:
            return Admission.FULL
        if same and mine >= math.ceil(target / (1 + len(same))):
            return Admission.SHARE
        return Admission.OPEN

    async def read_progress(self) -> None:
        """Read our peers' progress now: the server is about to admit a micro-batch, and
        what they admitted since the last read may fill the epoch."""
        if self.mode == "gradient" and self._view():  # alone or diloco: ours decides
            self._records = await self._read_progress()

    def progress_changed(self) -> None:
        """The server admitted a micro-batch: publish our progress now (on the event loop),
        so that our peers count it before they admit more."""
        if self._publish_now is not None:
            self._publish_now.set()

    def _gate_changed(self) -> None:
        if self.server is not None:
            self.server.gate_changed()

    async def _drain(self) -> None:
        """Wait (at most ``DRAIN_S``) for the backwards of the micro-batches admitted at this
        epoch, so that the step takes their gradients (gradient mode)."""
        if self.server is not None and self.server.gated:
            await self.server.wait_drained(DRAIN_S)

    # -- the compute thread's hook ------------------------------------------------------

    def on_accumulated(self) -> None:
        """Called on the compute thread, holding ``lock``, after a micro-batch's gradients
        were added to ``.grad``. Never waits for the network."""
        if self.mode == "diloco" and not self._outer_busy and self.optimizer.samples >= self._batch:
            self._inner_samples += self.optimizer.samples
            self.optimizer.step()
            self.stats.inner_steps += 1
        elif self._alone_and_due():
            # Nobody to average with: step now, as the micro-batch that completed the
            # target batch returns, so that the next one sees the step (a single-peer
            # stage then computes exactly what one process would).
            self._step_locked()
            self._stepped_now = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
                loop.call_soon_threadsafe(wake.set)

    # -- state download -----------------------------------------------------------------

    async def load_state(
        self,
        timeout_s: float | None = None,
        saved: tuple[dict, list[torch.Tensor], str] | None = None,
    ) -> LoadedState:
        """Download the stage's state from one of its peers, then start averaging.

        With no live peer of the stage (no progress record), start from ``saved`` (a
        state ``snapshot`` gave, its metadata, tensors and where it was kept) if it fits
        the stage, else from the initial weights. Raises ``StateDownloadError`` if peers
        exist but none hands over a valid state within ``timeout_s`` (default: twice the
        round timeout)."""
        if self.running:
            raise RuntimeError("load_state() runs once, before averaging starts")
        timeout_s = timeout_s if timeout_s is not None else 2 * self.settings.round_timeout_s
        deadline = time.monotonic() + timeout_s
        result = LoadedState(False, self.step, self.epoch)
        while others := await self._read_progress():
            state = await self._download(max(1.0, deadline - time.monotonic()))
            if state is not None:
                await asyncio.to_thread(self._apply_state, state)
                result = LoadedState(True, self.step, self.epoch, state.source)
                logger.info(
                    "%s: loaded step %d (epoch %d) from %s",
                    self._name,
                    self.step,
                    self.epoch,
                    state.source,
                )
                break
            if time.monotonic() > deadline:
                raise StateDownloadError(
                    f"stage {self.stage_index} has {len(others)} live peers, but none of them "
                    f"handed over a valid state within {timeout_s:.0f} s"
                )
            await asyncio.sleep(self.settings.report_period_s)
        else:
            result = await self._resume(saved) or result
        await self._log_digest()
        self._records = await self._read_progress()
        # Visible to the stage's peers (and joiners) from the moment this returns.
        await self._publish(Progress(self.peer_id, self._epoch, self._samples()), self._expiry())
        assert self._process is not None
        if not self._process.client_mode:
            self._process.allow_state_sharing = True
            self._process.state_sharing_priority = float(self._epoch)
        self._runner = asyncio.create_task(self._run(), name=f"averaging-stage{self.stage_index}")
        return result

    async def _resume(
        self, saved: tuple[dict, list[torch.Tensor], str] | None
    ) -> LoadedState | None:
        """Start from a state kept on disk, when no peer holds the stage."""
        if saved is not None:
            metadata, tensors, where = saved
            try:
                state = stage_state.parse(metadata, tensors, self.module, mode=self.mode)
            except StateError as e:
                logger.warning("%s: cannot resume from %s: %s", self._name, where, e)
            else:
                await asyncio.to_thread(self._apply_state, state)
                logger.info(
                    "%s: no peer holds it, resumed step %d (epoch %d) from %s",
                    self._name,
                    self.step,
                    self.epoch,
                    where,
                )
                return LoadedState(True, self.step, self.epoch, where)
        logger.info("%s: no peer holds it, starting from initial weights", self._name)
        return None

    async def fetch(self, timeout_s: float) -> StageState | None:
        """Download the stage's state from a peer of it without taking part in the stage
        (no progress record, no rounds: ``load_state`` is never called); None if no peer
        handed over a valid state within ``timeout_s``."""
        if self.running:
            raise RuntimeError("fetch() is for an averager that does not average")
        return await self._download(timeout_s)

    def snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        """A copy of the stage's state, as a joiner would download it (blocking: takes
        the stage's lock while it copies the tensors)."""
        return self._current_state()

    def _current_state(self) -> tuple[dict, list[torch.Tensor]]:
        """For a peer downloading our state (on hivemind's background thread)."""
        with self.lock:
            return stage_state.capture(
                self.module,
                self.optimizer,
                epoch=self._epoch,
                mode=self.mode,
                peer=self.peer_id,
                params=self._anchor,
                momentum=self._momentum(),
            )

    def _momentum(self) -> list[torch.Tensor] | None:
        if self._outer is None or not self._outer.state:
            return None
        return [self._outer.state[a]["momentum_buffer"] for a in self._anchor]

    async def _download(self, timeout_s: float) -> StageState | None:
        assert self._process is not None
        future = self._process.load_state_from_peers(wait=False, timeout=timeout_s)
        try:
            found = await asyncio.wait_for(future, timeout_s + self.settings.chunk_timeout_s)
        except TimeoutError:
            future.cancel()
            logger.warning("%s: state download timed out", self._name)
            return None
        if found is None:
            return None
        try:
            return stage_state.parse(*found, self.module, mode=self.mode)
        except StateError as e:
            logger.warning("%s: refused a downloaded state: %s", self._name, e)
            return None

    def _apply_state(self, state: StageState) -> None:
        with self.lock:
            stage_state.apply(state, self.module, self.optimizer)
            self._epoch = state.epoch
            if self.mode == "diloco":
                self._set_anchor(state.params, state.momentum)
                self._inner_samples = 0

    # -- the background: progress reports and rounds ------------------------------------

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._report_loop(), name="averaging-report")
                tasks.create_task(self._round_loop(), name="averaging-rounds")
        except Exception:
            logger.exception("%s: averaging stopped", self._name)
            raise

    def _samples(self) -> int:
        """Samples toward our next round (the round in flight included)."""
        done = self._inner_samples if self.mode == "diloco" else self._round_samples
        server = self.server
        if server is not None and server.gated:
            return done + server.committed_samples()
        return done + self.optimizer.samples

    def _target(self) -> int:
        return self._batch * (self.settings.inner_steps if self.mode == "diloco" else 1)

    async def _report_loop(self) -> None:
        assert self._wake is not None and self._publish_now is not None
        published: Progress | None = None
        published_at = -math.inf
        while True:
            self._publish_now.clear()
            mine = Progress(self.peer_id, self._epoch, self._samples())
            now = get_dht_time()
            due = mine != published or now - published_at > self._ttl / 3
            if due and await self._publish(mine, self._expiry()):
                published, published_at = mine, now
            self._records = await self._read_progress()
            self._view()  # refreshes what .peers counts
            self._wake.set()
            self._gate_changed()  # our peers' progress decides whether the server admits
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._publish_now.wait(), self.settings.report_period_s)

    def _expiry(self) -> float:
        return get_dht_time() + self._ttl

    async def _publish(self, mine: Progress, expiration: float) -> bool:
        try:
            return await self.dht.dht.store(
                self._key,
                subkey=self.peer_id,
                value=encode_progress(mine),
                expiration_time=expiration,
                return_future=True,
            )
        except Exception as e:  # a DHT hiccup: the next period retries
            logger.warning("%s: publishing progress failed: %s", self._name, e)
            return False

    async def _read_progress(self) -> list[Progress]:
        """The other peers' live progress records (invalid ones are dropped and logged)."""
        try:
            found = await self.dht.dht.get(self._key, latest=True, return_future=True)
        except Exception as e:
            logger.warning("%s: reading progress failed: %s", self._name, e)
            return self._records
        if found is None or not isinstance(found.value, dict):
            return []
        result = []
        for subkey, item in list(found.value.items())[:MAX_PEER_RECORDS]:
            try:
                record = decode_progress(subkey, item.value)
            except RecordError as e:
                logger.warning("%s: dropped a progress record: %s", self._name, e)
                continue
            if record.peer_id != self.peer_id:
                result.append(record)
                expires = self._expires.get(record.peer_id, -math.inf)
                self._expires[record.peer_id] = max(expires, item.expiration_time)
        if self.spec.private and result:  # a stranger's progress must not shape our rounds
            members = {p.peer_id for p in await self.dht.peers()}
            result = [r for r in result if r.peer_id in members]
        return result

    def _view(self) -> list[Progress]:
        """The other peers' progress, corrected by what we know better than the last read.

        A peer's epoch never goes down: a record that says otherwise is older than one we
        saw, or than a round the peer took with us (or a state it handed us). And a record
        missing from one read (a DHT read can miss a subkey) stays for its time to live.
        Without this, right after a round our groupmates would look one epoch behind, and
        we would step alone."""
        now = time.monotonic()
        for record in self._records:
            self._seen[record.peer_id] = (record, now)
        view = []
        for peer, (record, seen_at) in list(self._seen.items()):
            if now - seen_at > self._ttl:
                del self._seen[peer]
                self._expires.pop(peer, None)
                continue
            known = max(self._known.get(peer, 0), record.epoch)
            self._known[peer] = known
            view.append(record if record.epoch == known else Progress(peer, known, 0))
        return view

    def _learn(self, epochs: dict[str, int]) -> None:
        """Peers we know reached an epoch (groupmates, donors), whether or not our reads of
        the DHT show them: a DHT read returns one node's copy of the stage's records, which
        can lack a peer that stored its own through another node."""
        now = time.monotonic()
        for peer, epoch in epochs.items():
            self._known[peer] = max(self._known.get(peer, 0), epoch)
            record, seen_at = self._seen.get(peer, (Progress(peer, epoch, 0), now))
            self._seen[peer] = (record, max(seen_at, now))

    def _someone_ahead(self) -> bool:
        return any(p.epoch > self._epoch for p in self._view())

    async def _round_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._stepped_now:  # on_accumulated stepped alone: announce the epoch
                self._stepped_now = False
                await self._after_epoch()
            decision = decide(
                self.peer_id,
                self._epoch,
                self._samples(),
                self._view(),
                self._target(),
                catch_up=time.monotonic() >= self._catch_up_after,
                patient=time.monotonic() < self._patience_until,
                per_peer=self.mode == "diloco",
            )
            if decision.action is Action.WAIT:
                continue
            self._busy = True
            try:
                if decision.action is Action.CATCH_UP:
                    await self._catch_up()
                elif decision.action is Action.STEP_ALONE:
                    await self._step_alone()
                else:
                    await self._average(group_size=decision.peers + 1)
            finally:
                self._busy = False
                self._gate_changed()

    async def _catch_up(self) -> None:
        self._catch_up_after = time.monotonic() + self.settings.round_timeout_s
        state = await self._download(self.settings.round_timeout_s)
        if state is None or state.epoch <= self._epoch:
            logger.warning(
                "%s: a peer is ahead of epoch %d, but no newer state came (retry in %.0f s)",
                self._name,
                self._epoch,
                self.settings.round_timeout_s,
            )
            return
        await asyncio.to_thread(self._apply_state, state)
        self._learn({state.source: state.epoch})
        self._catch_up_after = 0.0
        self.stats.catch_ups += 1
        logger.info("%s: caught up to epoch %d from %s", self._name, self._epoch, state.source)
        await self._after_epoch()

    async def _after_epoch(self) -> None:
        assert self._process is not None and self._publish_now is not None
        self._patience_until = time.monotonic() + self.settings.round_timeout_s
        if self._process.allow_state_sharing:
            self._process.state_sharing_priority = float(self._epoch)
        self._publish_now.set()
        await self._log_digest()

    async def _log_digest(self) -> None:
        """Log the digest of the parameters this epoch's step set. No lock: only this
        task changes them (gradient mode: the parameters; diloco: the anchor)."""
        tensors = self._anchor if self._anchor is not None else self._params
        digest = await asyncio.to_thread(ParamDigest.of, tensors)
        level = logging.INFO if os.environ.get(DIGESTS_ENV) else logging.DEBUG
        logger.log(level, "%s: epoch %d params %s", self._name, self._epoch, digest)

    def _alone_and_due(self) -> bool:
        """Gradient mode, the target batch reached, no round in flight, and no other peer
        of the stage in sight (as of the last progress read, which ``load_state`` did)."""
        return (
            self.mode == "gradient"
            and self._loop is not None
            and not self._busy
            and not self._records
            and not self._seen
            and self.optimizer.samples >= self._target()
        )

    def _step_locked(self) -> None:
        """A step on our own samples; the caller holds ``lock``."""
        self.stats.samples += self.optimizer.samples
        self.optimizer.step()
        self._epoch += 1
        self.stats.alone += 1

    async def _step_alone(self) -> None:
        started = time.monotonic()
        if self.mode == "diloco":
            contribution = await asyncio.to_thread(self._begin_outer)
            await asyncio.to_thread(self._finish, contribution.tensors, contribution)
            self.stats.alone += 1
        else:
            await self._drain()

            def step() -> None:
                with self.lock:
                    if self.optimizer.samples >= self._target():  # else: stepped already
                        self._step_locked()

            await asyncio.to_thread(step)
        self.stats.last_round_s = time.monotonic() - started
        logger.debug(
            "%s: stepped alone to epoch %d (others: %s)",
            self._name,
            self._epoch,
            ", ".join(f"{p.peer_id[-6:]} at {p.epoch}" for p in self._view()) or "none",
        )
        await self._after_epoch()

    async def _average(self, group_size: int) -> None:
        """One round: take our contribution, average it until the round's deadline, apply
        the result (or our own contribution alone, or catch up). ``group_size``: the peers
        at our epoch, us included; a group of that size starts at once."""
        assert self._process is not None
        started = time.monotonic()
        deadline = started + self.settings.round_timeout_s
        if self.mode == "diloco":
            begin = self._begin_outer
        else:
            begin = self._take_gradients
            await self._drain()
        contribution = await asyncio.to_thread(begin)
        if not _in_range(contribution.tensors):
            # The server checks every micro-batch, so this is a bug or broken hardware: drop
            # what we hold, and still take part (weight 0) to stay in step with the others.
            logger.error("%s: our own contribution is not finite or out of range", self._name)
            contribution = _Contribution(0, [torch.zeros_like(t) for t in contribution.tensors], [])
        try:
            result = None
            # Attempts of a few matchmaking times each, so that a peer that fell behind (its
            # groupmates went on without it) notices and catches up early.
            last_start = deadline - self.settings.matchmaking_s - 0.5
            while result is None and time.monotonic() < last_start and not self._someone_ahead():
                attempt_end = min(deadline, time.monotonic() + 3 * self.settings.matchmaking_s)
                result = await self._attempt(contribution, attempt_end, group_size)
                if result is None and not self._mates_left():
                    break  # our groupmates are gone (killed mid-round): no one to wait for
            if result is not None:
                averaged, mates = result
                await asyncio.to_thread(self._finish, averaged, contribution)
                self._learn(dict.fromkeys(mates, self._epoch))
                self.stats.rounds += 1
                self.stats.last_group = len(mates) + 1
                self.stats.round_s.append(time.monotonic() - started)
                logger.debug(
                    "%s: averaged with %s in %.2f s, now at epoch %d",
                    self._name,
                    ", ".join(m[-6:] for m in mates),
                    time.monotonic() - started,
                    self._epoch,
                )
            else:
                self._records = await self._read_progress()
                if contribution.weight == 0 or self._someone_ahead():
                    await self._give_back(contribution)  # nothing of ours to step on / behind
                    self._catch_up_after = 0.0
                    return
                logger.warning(
                    "%s: no averaging result after %.1f s, stepping alone at epoch %d",
                    self._name,
                    time.monotonic() - started,
                    self._epoch,
                )
                await asyncio.to_thread(self._finish, contribution.tensors, contribution)
                self.stats.fallbacks += 1
            self.stats.last_round_s = time.monotonic() - started
            await self._after_epoch()
        finally:
            await asyncio.shield(self._give_back(contribution))  # no-op once applied

    def _mates_left(self) -> bool:
        """Whether any other peer is still at our epoch and alive: its newest record has
        not expired. (``_view`` keeps a record a while longer, for reads that miss it; a
        groupmate killed mid-round would then outlive the round's first attempt, and we
        would try again with nobody.)"""
        now = get_dht_time()
        return any(
            p.epoch == self._epoch and self._expires.get(p.peer_id, math.inf) > now
            for p in self._view()
        )

    def _finish(self, result: list[torch.Tensor], contribution: _Contribution) -> None:
        with self.lock:
            if contribution.settled:
                return
            contribution.settled = True
            self.stats.samples += contribution.weight
            if self.mode == "diloco":
                self._finish_outer(result)
            else:
                self._apply_gradients(result)

    async def _attempt(
        self, contribution: _Contribution, deadline: float, group_size: int
    ) -> tuple[list[torch.Tensor], list[str]] | None:
        """One try at averaging: the averaged tensors and our groupmates' peer ids, or None
        (logged) on failure."""
        assert self._process is not None
        timeout = deadline - time.monotonic()
        try:
            await asyncio.to_thread(self._write_buffers, contribution.tensors, timeout)
        except TimeoutError:
            return None
        self._process.set_round(self._epoch, group_size)
        control = self._process.step(
            gather=[self._epoch, contribution.weight],
            weight=float(contribution.weight),
            timeout=timeout,
            allow_retries=False,
            wait=False,
        )
        try:
            gathered = await self._wait_for_step(
                control, timeout + self.settings.allreduce_timeout_s + 5.0
            )
        except _FellBehind:
            logger.debug(
                "%s: left matchmaking at epoch %d: a peer is ahead", self._name, self._epoch
            )
            return None
        except Exception as e:
            self.stats.discarded += 1
            logger.info("%s: averaging attempt failed: %r", self._name, e)
            return None
        if not isinstance(gathered, dict) or len(gathered) < 2:
            return None
        mates = {}
        for peer, data in gathered.items():
            epoch = data[0] if isinstance(data, list | tuple) and data else None
            if not isinstance(epoch, int) or isinstance(epoch, bool):
                self.stats.discarded += 1
                return None
            if peer.to_base58() != self.peer_id:
                mates[peer.to_base58()] = epoch
        if any(e > self._epoch for e in mates.values()):
            # A groupmate is ahead of us: the result is theirs to apply; we catch up.
            self._learn(mates)
            self.stats.discarded += 1
            return None
        averaged = await asyncio.to_thread(self._read_buffers, timeout)
        if averaged is None or not _in_range(averaged):
            # An average of in-range values is in range: this one has a faulty groupmate's.
            self.stats.discarded += 1
            logger.warning("%s: discarded a non-finite or out-of-range result", self._name)
            return None
        return averaged, list(mates)

    async def _wait_for_step(self, control: StepControl, timeout: float):
        """The step's gathered data. While it still looks for a group, leave (``_FellBehind``)
        as soon as a peer is ahead of us: that group is not coming, we must catch up."""
        waiter = asyncio.ensure_future(_result(control))
        try:
            end = time.monotonic() + timeout
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=self.settings.report_period_s)
                if waiter.done():
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"the averaging step did not end within {timeout:.0f} s")
                if control.stage == AveragingStage.LOOKING_FOR_GROUP and self._someone_ahead():
                    raise _FellBehind()
            return waiter.result()
        finally:
            if not control.done():
                control.cancel()
            waiter.cancel()
            with contextlib.suppress(BaseException):
                await waiter

    def _write_buffers(self, tensors: list[torch.Tensor], timeout: float) -> None:
        assert self._process is not None
        if not self._process.lock_averaged_tensors.acquire(timeout=max(timeout, 0.0)):
            raise TimeoutError("the averager still holds its tensors")
        try:
            for buffer, t in zip(self._buffers, tensors, strict=True):
                if buffer.dtype == torch.float16:
                    t = t.clamp(-F16_MAX, F16_MAX)  # not inf: the others would drop us
                buffer.copy_(t)
        finally:
            self._process.lock_averaged_tensors.release()

    def _read_buffers(self, timeout: float) -> list[torch.Tensor] | None:
        assert self._process is not None
        if not self._process.lock_averaged_tensors.acquire(timeout=max(timeout, 1.0)):
            return None
        try:
            return [b.clone() for b in self._buffers]
        finally:
            self._process.lock_averaged_tensors.release()

    # -- gradient mode ------------------------------------------------------------------

    def _take_gradients(self) -> _Contribution:
        """Move the accumulated gradients out of ``.grad``: micro-batches that arrive from
        now on count toward the next epoch."""
        with self.lock:
            n = self.optimizer.samples
            sums = [p.grad for p in self._params]
            for p in self._params:
                p.grad = None
            self._round_samples = n  # before samples go to 0: a reader never sees them gone
            self.optimizer.samples = 0
        means = [
            torch.zeros(p.shape) if g is None or n == 0 else (g / n).float().cpu()
            for p, g in zip(self._params, sums, strict=True)
        ]
        return _Contribution(weight=n, tensors=means, sums=sums)

    def _apply_gradients(self, means: list[torch.Tensor]) -> None:
        """One optimizer step on ``means`` (mean gradients), keeping what accumulated since
        the round began for the next one. The caller holds the lock."""
        pending, pending_samples = [p.grad for p in self._params], self.optimizer.samples
        for p, m in zip(self._params, means, strict=True):
            p.grad = m.to(p.device, p.dtype)
        self.optimizer.samples = 1  # the gradients are means already
        self.optimizer.step()
        for p, g in zip(self._params, pending, strict=True):
            p.grad = g
        self.optimizer.samples = pending_samples
        self._round_samples = 0
        self._epoch += 1

    async def _give_back(self, contribution: _Contribution) -> None:
        """Return a discarded round's samples to ``.grad`` (gradient mode) or let inner steps
        resume (diloco)."""

        def give_back() -> None:
            with self.lock:
                if contribution.settled:
                    return
                contribution.settled = True
                if self.mode == "diloco":
                    self._outer_busy = False
                    return
                for p, g in zip(self._params, contribution.sums, strict=False):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
                self.optimizer.samples += contribution.weight
                self._round_samples = 0

        await asyncio.to_thread(give_back)

    # -- diloco mode --------------------------------------------------------------------

    def _set_anchor(self, params: list[torch.Tensor], momentum: list[torch.Tensor] | None) -> None:
        assert self._anchor is not None and self._outer is not None
        with torch.no_grad():
            for a, t in zip(self._anchor, params, strict=True):
                a.copy_(t)
        self._outer.state.clear()
        if momentum is not None:
            for a, m in zip(self._anchor, momentum, strict=True):
                self._outer.state[a] = {"momentum_buffer": m.to(a.device, a.dtype).clone()}

    def _begin_outer(self) -> _Contribution:
        """Our delta since the last outer step; inner steps wait until the round ends."""
        assert self._anchor is not None
        with self.lock:
            self._outer_busy = True
            weight = self._inner_samples
            deltas = [
                (a - p.detach()).float().cpu()
                for a, p in zip(self._anchor, self._params, strict=True)
            ]
        return _Contribution(weight=weight, tensors=deltas, sums=[])

    @torch.no_grad()
    def _finish_outer(self, deltas: list[torch.Tensor]) -> None:
        """One outer Nesterov step on the anchor with the averaged delta; every copy's
        parameters become the new anchor. The caller holds the lock."""
        assert self._anchor is not None and self._outer is not None
        for a, d in zip(self._anchor, deltas, strict=True):
            a.grad = d.to(a.device, a.dtype)
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        for p, a in zip(self._params, self._anchor, strict=True):
            p.copy_(a)
        self._inner_samples = 0
        self._epoch += 1
        self._outer_busy = False
        if self.optimizer.samples >= self._batch:  # what waited during the round
            self._inner_samples += self.optimizer.samples
            self.optimizer.step()
            self.stats.inner_steps += 1

    # -- shutdown -----------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop averaging (a round in flight is abandoned) and the averager process."""
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
            self._runner = None
        if self._process is not None:
            await asyncio.to_thread(self._kill_process)
            self._process = None

    def _kill_process(self) -> None:
        assert self._process is not None
        if self._process.is_alive():
            self._process.shutdown()
        self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)


def _in_range(tensors: list[torch.Tensor]) -> bool:
    """Finite, and within what training produces (``MAX_ABS_CONTRIBUTION``)."""
    return all(
        bool(torch.isfinite(t).all())
        and (t.numel() == 0 or float(t.abs().max()) <= MAX_ABS_CONTRIBUTION)
        for t in tensors
    )


class _FellBehind(Exception):
    """A peer got ahead of us while we looked for a group."""


async def _result(control: StepControl):
    return await control


@dataclass
class _Contribution:
    weight: int  # samples behind it
    tensors: list[torch.Tensor]  # what we average: mean gradients, or parameter deltas
    sums: list[torch.Tensor | None]  # gradient mode: the gradient sums taken out of .grad
    settled: bool = False  # applied, or given back (under the lock): never both


class AveragedStageServer(StageServer):
    """A ``StageServer`` whose stage averages with its peers: build with
    ``await AveragedStageServer.create(p2p, stage, optimizer, contract, run_id,
    averager=averager, ...)``. It shares the averager's lock."""

    def __init__(self, *args, averager: StageAverager, **settings) -> None:
        super().__init__(*args, **settings)
        if averager.module is not self.stage or averager.optimizer is not self.optimizer:
            raise ValueError("the averager must average this server's stage and optimizer")
        self.averager = averager
        self.lock = averager.lock
        averager.server = self

    def on_accumulated(self) -> None:
        self.averager.on_accumulated()

    def _admission(self) -> Admission:
        return self.averager.admission()

    async def before_admit(self) -> None:
        await self.averager.read_progress()

    def on_admitted(self) -> None:
        self.averager.progress_changed()
