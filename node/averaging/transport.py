"""How a stage's contributions travel: its hivemind averager process and the buffers it
averages in place.

``HivemindTransport.start`` forks the process (``node.averaging.process``) and waits
until it is ready; ``exchange`` is one attempt at averaging a contribution with the
peers at the same epoch; ``download`` fetches a peer's state; ``close`` stops the
process. Two seams for fault tests: ``process_class`` (the averager process) and
``outgoing`` (a function of the tensors this peer sends into a round, applied after its
own checks).

The averaged tensors are a copy: a result is returned only if it is finite, in range and
completely averaged, and if no groupmate is ahead of us (its result is for the epoch we
must catch up to).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2

from node.averaging.process import StageAveragerProcess
from node.rpc.dht import SwarmDHT
from protocol import sparsify
from protocol.averaging import OPEN_S, averaging_prefix, within_bounds
from protocol.run_spec import AveragingSpec, RunSpec

logger = logging.getLogger(__name__)

DECLARE_STATE_PERIOD_S = 10.0  # a dead donor stays listed this long for joiners
DECLARE_EPOCH_S = 2.0  # a new epoch is declared at once at most this often
# hivemind's part size (its default): each part is one message each way, below the frame
# cap (``hivemind_compat.MAX_FRAME_BYTES``), and must cross a slow link within
# ``chunk_timeout_s``.
PART_BYTES = 2**19
F16_MAX = float(torch.finfo(torch.float16).max)

Tensors = list[torch.Tensor]


class BlockCodec(CompressionBase):
    """``protocol.sparsify``'s lossless wire format as a hivemind compression (of float32
    parts), in the slot of hivemind's ``BLOCKWISE_8BIT`` (which needs bitsandbytes; the
    stage pipeline's uint8 is ``UNIFORM_8BIT``), in the averager process only. Values the
    sender rounded to 8 bits (``sparsify.round_to_grid``) travel in about a byte each, and
    so do the means a reducer returns, once it rounds them to the parts' grid
    (``snap_mean``; float16 or float32 blocks where that grid needs more bits). A
    malformed part raises ``sparsify.CodecError`` (the round refuses that sender, as for
    any bad part)."""

    compression_type = runtime_pb2.BLOCKWISE_8BIT

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=sparsify.encode(tensor),
            size=tensor.shape,
            dtype="float32",
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        size = tuple(serialized_tensor.size)
        if serialized_tensor.dtype != "float32" or any(d < 0 for d in size):
            raise sparsify.CodecError(
                f"a {serialized_tensor.dtype} part of shape {size}: float32 expected"
            )
        return sparsify.decode(serialized_tensor.buffer, math.prod(size)).reshape(size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # Parts sized as uncompressed ones: a part of means can be float32 all through, and
        # must stay below the frame cap.
        return 1.0

    def snap_mean(self, mean: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        """The mean a reducer returns (``sparsify.snap_mean``): less each part, it travels
        in about a byte per value, and every copy applies it bitwise."""
        return sparsify.snap_mean(mean, parts)


def first_part_slack_s(settings: AveragingSpec) -> float:
    """How much later than ``chunk_timeout_s`` a groupmate's first part may come. A
    gradient round looks for its group while it drains (``schedule``), and each peer
    hands over its tensors when its own drain ends: at most ``OPEN_S`` after the group
    formed. A groupmate whose drain ends later than ours is slow to start, not gone, and
    dropping it fails the round on one side only (its values come back un-averaged: it
    catches up by downloading the whole state). DiLoCo rounds start at once: no slack."""
    return OPEN_S if settings.mode == "gradient" else 0.0


def process_settings(settings: AveragingSpec) -> dict[str, object]:
    """The round settings of a stage's hivemind averager (``scripts/bench_averaging.py``
    measures all-reduce with exactly these). A sender is dropped once it is silent for
    ``chunk_timeout_s`` plus ``first_part_slack_s`` (hivemind has one timeout for the
    first part and the gaps between parts), a reducer once it is silent for another
    ``chunk_timeout_s`` (hivemind wants it longer than the sender's)."""
    # float16 is in the buffers' dtype (see ``start``); uint8 values are rounded by the
    # strategy and travel exactly in ``BlockCodec``.
    compression = BlockCodec() if settings.compression == "uint8" else NoCompression()
    sender_s = settings.chunk_timeout_s + first_part_slack_s(settings)
    return {
        "min_matchmaking_time": settings.matchmaking_s,
        "request_timeout": min(3.0, settings.matchmaking_s / 2),
        "allreduce_timeout": settings.allreduce_timeout_s,
        "next_chunk_timeout": settings.chunk_timeout_s,
        "sender_timeout": sender_s,
        "reducer_timeout": sender_s + settings.chunk_timeout_s,
        "compression": compression,
        "part_size_bytes": PART_BYTES,
    }


class AveragerStartError(RuntimeError):
    """hivemind's averager process did not come up."""


@dataclass(frozen=True)
class Exchange:
    """The outcome of one attempt at averaging."""

    averaged: Tensors | None  # the result; None: the attempt gave none
    mates: dict[str, int] = field(default_factory=dict)  # groupmates' epochs, as they said
    # The groupmates' copies' lineages, as they said (``exchange``'s ``lineage``), ours
    # included; 0 for a peer that said none (an older one).
    lineages: dict[str, int] = field(default_factory=dict)
    discarded: bool = False  # a result came (or the step failed) and was thrown away
    # When its all-reduce began (``time.monotonic``; its group had formed); None: it did not.
    allreduce_began: float | None = None
    # With our weight 0, the result was NaN: every groupmate had weight 0 (nothing to
    # average), and another try with the same contributions gives the same.
    empty: bool = False


class HivemindTransport:
    """One stage's averager process; build with ``await HivemindTransport.start(...)``."""

    def __init__(
        self,
        process: StageAveragerProcess,
        buffers: Tensors,
        settings: AveragingSpec,
        *,
        peer_id: str,
        name: str,
        outgoing: Callable[[Tensors], Tensors] | None = None,
    ) -> None:
        self.process = process
        self.peer_id = peer_id
        self.settings = settings
        self._buffers = buffers
        self._name = name  # in log lines
        self._outgoing = outgoing
        self._declared_at = -math.inf  # when ``sharing_epoch`` last declared (monotonic)
        self._steps: list[StepControl] = []  # of the rounds in flight (``in_group``)

    @classmethod
    async def start(
        cls,
        dht: SwarmDHT,
        spec: RunSpec,
        stage_index: int,
        shapes: Sequence[torch.Size],
        settings: AveragingSpec,
        state_source: Callable[[], tuple[dict, Tensors]],
        *,
        name: str,
        process_class: type[StageAveragerProcess] = StageAveragerProcess,
        outgoing: Callable[[Tensors], Tensors] | None = None,
        startup_timeout_s: float = 60.0,
    ) -> HivemindTransport:
        """Fork the averager process (from the calling thread: the event loop's) and wait
        until it is ready; ``AveragerStartError`` if it is not within the timeout.
        ``state_source`` answers peers that download our state (on a background thread)."""
        # float16: our contribution travels as float16, and results come back as float32
        # deltas (hivemind returns average - ours) that land in float16 buffers, so every
        # copy rounds the same average. Compressing the deltas too (hivemind's
        # Float16Compression) leaves each copy its own rounding: 1.5e-4 apart after 20
        # rounds of the tiny preset, against bitwise equal this way.
        dtype = torch.float16 if settings.compression == "float16" else torch.float32
        buffers = [torch.zeros(shape, dtype=dtype) for shape in shapes]
        process = process_class(
            buffers,
            dht.dht,
            start=False,
            state_source=state_source,
            membership=spec.membership,  # a private run averages with members only
            prefix=averaging_prefix(spec.run, stage_index),
            allow_state_sharing=False,  # until our own state is loaded
            declare_state_period=DECLARE_STATE_PERIOD_S,
            **process_settings(settings),
        )
        self = cls(process, buffers, settings, peer_id=dht.peer_id, name=name, outgoing=outgoing)
        # Not run_in_background: it sets SIGINT to "ignore" in *this* process.
        process.start()
        try:
            await asyncio.to_thread(process.wait_until_ready, startup_timeout_s)
        except TimeoutError:
            await self.close()
            raise AveragerStartError(
                f"the averager process of stage {stage_index} did not start within "
                f"{startup_timeout_s:.0f} s"
            ) from None
        except BaseException:
            await self.close()
            raise
        return self

    def share_state(self, epoch: int) -> None:
        """Hand our state to peers that download it, preferring the highest epoch."""
        if not self.process.client_mode:
            self.process.allow_state_sharing = True
        self.sharing_epoch(epoch)

    def sharing_epoch(self, epoch: int) -> None:
        """Our state is now at ``epoch`` (its priority among donors). It is declared in the
        DHT at once if the last declaration is ``DECLARE_EPOCH_S`` old; sooner, it goes
        out with the next one (hivemind also declares every ``DECLARE_STATE_PERIOD_S``),
        not as a DHT store of its own at every epoch. A donor's priority only orders the
        donors a download asks first."""
        if not self.process.allow_state_sharing:
            return
        now = time.monotonic()
        if now - self._declared_at >= DECLARE_EPOCH_S:
            self._declared_at = now
            self.process.state_sharing_priority = float(epoch)  # stored now if it changed
        else:
            self.process.set_state_priority_quietly(float(epoch))

    async def download(
        self, timeout_s: float, *, only: Collection[str] | None = None
    ) -> tuple[object, object, str] | None:
        """A peer's state as it sent it (metadata, tensors: unchecked) and the peer it came
        from (as the transport knows it, not as the state says), or None. ``only``: the
        peers (base58) to ask; None: any the process allows."""
        future = self.process.load_state(timeout_s, only=only)
        try:
            async with asyncio.timeout(timeout_s + self.settings.chunk_timeout_s):
                return await future
        except TimeoutError:
            future.cancel()
            logger.warning("%s: state download timed out", self._name)
            return None

    def refuse_source(self, peer: str, for_s: float) -> None:
        """Download no state from ``peer`` for ``for_s`` seconds (its state was refused)."""
        self.process.refuse_source(peer, for_s)

    def schedule(
        self, *, epoch: int, group_size: int, deadline: float, lineage: int = 0
    ) -> StepControl | None:
        """Start looking for a group of the peers at ``epoch`` now, before our contribution
        is ready (so that matchmaking overlaps what comes before it: the drain); a group
        that forms waits (hivemind's ``require_trigger``) until ``exchange(scheduled=)``
        hands over the tensors, or the step's ``deadline`` (monotonic) passes. The caller
        cancels a step it does not hand to ``exchange``. ``lineage``: as ``exchange``'s.
        None if the averager process has exited."""
        if not self.process.is_alive():  # hivemind's step would wait for it for good
            return None
        self.process.set_round(epoch, group_size)
        return self._track(
            self.process.step(
                gather=[epoch, lineage],
                weight=0.0,
                timeout=deadline - time.monotonic(),
                allow_retries=False,
                require_trigger=True,
                wait=False,
            )
        )

    def _track(self, step: StepControl) -> StepControl:
        self._steps = [s for s in self._steps if not s.done()] + [step]
        return step

    @property
    def in_group(self) -> bool:
        """A step of ours has joined a group that has not finished: the groupmates wait
        on our parts (or on our trigger), and leaving now fails their round."""
        return any(
            not s.done()
            and s.stage in (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)
            for s in self._steps
        )

    async def exchange(
        self,
        tensors: Tensors,
        weight: int,
        *,
        epoch: int,
        group_size: int,
        deadline: float,
        leave: Callable[[], bool],
        scheduled: StepControl | None = None,
        lineage: int = 0,
    ) -> Exchange:
        """One try at averaging ``tensors`` (weighted by ``weight``) with the peers at
        ``epoch``, before ``deadline`` (monotonic). ``leave`` is polled while the group
        forms: True (a peer got ahead of us) ends the try. ``scheduled``: a step from
        ``schedule`` at this epoch, which this try completes (it is cancelled if the try
        ends early). ``lineage``: our copy's (``protocol.averaging.fork_lineage``), told
        to the groupmates (``Exchange.lineages``)."""
        started = time.monotonic()
        timeout = deadline - started
        if self._outgoing is not None:
            tensors = self._outgoing(tensors)
        try:
            await asyncio.to_thread(self._write, tensors, timeout)
        except TimeoutError:
            if scheduled is not None:
                scheduled.cancel()
            return Exchange(None)
        if scheduled is None or scheduled.done():
            if scheduled is not None:
                started = time.monotonic()  # the scheduled step failed: a new one
            if not self.process.is_alive():  # hivemind's step would wait for it for good
                return Exchange(None)
            self.process.set_round(epoch, group_size)
            control = self._track(
                self.process.step(
                    gather=[epoch, lineage],
                    weight=float(weight),
                    timeout=timeout,
                    allow_retries=False,
                    wait=False,
                )
            )
        else:
            control = scheduled
            control.weight = float(weight)
            control.allow_allreduce()
        try:
            gathered = await self._wait(
                control, timeout + self.settings.allreduce_timeout_s + 5.0, leave
            )
        except _Left:
            logger.debug("%s: left matchmaking at epoch %d: a peer is ahead", self._name, epoch)
            return Exchange(None)
        except Exception as e:
            logger.info("%s: averaging attempt failed: %r", self._name, e)
            return Exchange(None, discarded=True)
        began = self.process.allreduce_began
        began = began if began >= started else None
        if not isinstance(gathered, dict) or len(gathered) < 2:
            return Exchange(None, allreduce_began=began)
        mates, lineages = {}, {}
        for peer, data in gathered.items():
            their = data[0] if isinstance(data, list | tuple) and data else None
            if not isinstance(their, int) or isinstance(their, bool):
                return Exchange(None, discarded=True, allreduce_began=began)
            theirs = data[1] if len(data) > 1 else 0
            if not isinstance(theirs, int) or isinstance(theirs, bool) or not 0 <= theirs < 2**53:
                return Exchange(None, discarded=True, allreduce_began=began)
            lineages[peer.to_base58()] = theirs
            if peer.to_base58() != self.peer_id:
                mates[peer.to_base58()] = their
        if any(e > epoch for e in mates.values()):
            # A groupmate is ahead of us: the result is theirs to apply; we catch up.
            return Exchange(None, mates, discarded=True, allreduce_began=began)
        averaged = await asyncio.to_thread(self._read, timeout)
        if averaged is None or not within_bounds(averaged):
            # An average of in-range values is in range: this one has a faulty groupmate's,
            # or (NaN, with our weight 0) every groupmate had weight 0.
            empty = (
                weight == 0
                and averaged is not None
                and any(bool(t.isnan().any()) for t in averaged)
            )
            log = logger.info if weight == 0 else logger.warning
            log("%s: discarded a non-finite or out-of-range result", self._name)
            return Exchange(None, discarded=True, allreduce_began=began, empty=empty)
        return Exchange(averaged, mates, lineages, allreduce_began=began)

    async def _wait(self, control: StepControl, timeout: float, leave: Callable[[], bool]):
        """The step's gathered data. While it still looks for a group, leave (``_Left``) as
        soon as ``leave()``: that group is not coming."""
        waiter = asyncio.ensure_future(_result(control))
        try:
            end = time.monotonic() + timeout
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=self.settings.report_period_s)
                if waiter.done():
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"the averaging step did not end within {timeout:.0f} s")
                if control.stage == AveragingStage.LOOKING_FOR_GROUP and leave():
                    raise _Left()
            return waiter.result()
        finally:
            if not control.done():
                control.cancel()
            waiter.cancel()
            await asyncio.wait({waiter})  # its end, whatever it was; ours propagates

    def _write(self, tensors: Tensors, timeout: float) -> None:
        if not self.process.lock_averaged_tensors.acquire(timeout=max(timeout, 0.0)):
            raise TimeoutError("the averager still holds its tensors")
        try:
            for buffer, t in zip(self._buffers, tensors, strict=True):
                buffer.copy_(t)
                if buffer.dtype == torch.float16:  # in place, no float32 copy
                    buffer.clamp_(-F16_MAX, F16_MAX)  # not inf: the others would drop us
        finally:
            self.process.lock_averaged_tensors.release()

    def _read(self, timeout: float) -> Tensors | None:
        if not self.process.lock_averaged_tensors.acquire(timeout=max(timeout, 1.0)):
            return None
        try:
            return [b.clone() for b in self._buffers]
        finally:
            self.process.lock_averaged_tensors.release()

    def exited(self) -> int | None:
        """The averager process's exit code once it has exited (before ``close``: it
        died); None while it runs."""
        return None if self.process.is_alive() else self.process.exitcode

    async def close(self) -> None:
        """Stop the process (killed if it does not stop within 5 s)."""
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        process = self.process
        if process.is_alive():
            process.shutdown()
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)


class _Left(Exception):
    """The caller asked to leave matchmaking."""


async def _result(control: StepControl):
    return await control
