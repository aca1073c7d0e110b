"""The stages a node serves, and their lifecycle: take one, load it, take a second one,
move, release.

``HeldStages`` is the bookkeeping (no I/O): the stages a node announces (its first may be
chosen but not yet loaded; its second is fixed once taken: a two-stage node never moves)
and those it holds, keyed by stage, so that one stage or two take the same code path.
``StageLifecycle`` changes it: it builds a stage (its state from a peer of it, else from
the node's newest checkpoint of it, else initial), serves it, and stops it. The node owns
the tasks that run ``load_second`` and ``rebalance``, and releases the stages on close.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P

from models.pretrained import Checkpoint, load_into, load_stage_state
from models.stages import Stage
from models.training import StageOptimizer
from node import events
from node.averaging.averager import AveragedStageServer, StageAverager
from node.averaging.progress_push import ProgressInbox
from node.daemon import checkpoint
from node.daemon.join import NodeError
from node.daemon.offer import Offer
from node.daemon.settings import NodeSettings
from node.daemon.start import Steps
from node.measure.capacity import Device, free_memory, stage_memory
from node.pipeline.server import StageServer
from node.placement.driver import Placement
from node.rpc.dht import SwarmDHT
from node.rpc.membership import MembershipGate
from protocol.admission import InFlight
from protocol.records import PeerState
from protocol.routing import BanList
from protocol.run_spec import RunSpec
from protocol.stage_messages import StageContract

logger = logging.getLogger(__name__)

# A first stage that failed to load (its peers handed over no state in time, its averager
# did not start, the daemon refused a handler) is loaded again after this many seconds,
# doubling up to ``LOAD_RETRY_MAX_S``: a peer that is busy, frozen for a while or on a slow
# link, or a loaded machine, must not stop the node that joins or moves to a stage.
LOAD_RETRY_S = 5.0
LOAD_RETRY_MAX_S = 60.0


async def import_optimizer_code() -> None:
    """Import, in a thread, what torch imports when the first optimizer is built:
    ``torch.optim.Optimizer`` imports ``torch._dynamo`` on first use, a heavy import of
    torch's own that every stage's optimizer needs. Done while the node chooses its stage,
    it is off the path to serving and off the event loop."""
    await asyncio.to_thread(importlib.import_module, "torch._dynamo")


@dataclass
class HeldStage:
    """A stage this node holds: its index, whether it is the node's first stage (which it
    may move) or a second one (fixed once taken), its averager and its server."""

    stage: int
    role: str  # "first" or "second"
    averager: StageAverager
    server: StageServer


@dataclass
class HeldStages:
    """The stages this node announces (``stage``, ``second``) and those it holds."""

    stage: int | None = None
    second: int | None = None
    held: dict[int, HeldStage] = field(default_factory=dict)
    served_before: int = 0  # micro-batches served by stage servers since unloaded

    @property
    def serving_second(self) -> int | None:
        """The second stage, once it is held (a second stage is announced before)."""
        return self.second if self.second is not None and self.second in self.held else None

    def micro_batches_served(self) -> int:
        """Forward passes (train and validation) our stage servers computed, since start."""
        return self.served_before + sum(h.server.counters.forward for h in self.held.values())

    def load(self) -> int:
        """Stage requests queued or running on every held stage."""
        return sum(h.server.load for h in self.held.values())

    def steps(self) -> int:
        """Optimizer steps taken by every held stage's server."""
        return sum(h.server.counters.steps for h in self.held.values())

    def server(self, stage: int, state: PeerState) -> StageServer | None:
        """This node's server of ``stage``, if it serves it now in node ``state`` (a first
        stage serves only in ``SERVING``; a second one once held)."""
        held = self.held.get(stage)
        if held is None or (held.role == "first" and state is not PeerState.SERVING):
            return None
        return held.server


@dataclass(frozen=True)
class StageLifecycle:
    """Takes, loads, moves and releases the stages in ``stages``: what building and
    serving a stage needs, and ``set_state`` / ``on_change`` to announce what changed."""

    stages: HeldStages
    settings: NodeSettings
    spec: RunSpec
    dht: SwarmDHT
    p2p: P2P
    key: Ed25519PrivateKey
    device: Device
    pretrained: Checkpoint | None  # where stages start from (a peer's or a checkpoint's wins)
    checkpoints: Path
    offer: Offer
    placement: Placement
    gate: MembershipGate
    callers: BanList
    in_flight: InFlight
    inbox: ProgressInbox
    set_state: Callable[[PeerState], None]
    on_change: Callable[[], None]

    async def join(self) -> None:
        """Take a stage, load it, and decide on a second one."""
        await self._take_stage()
        self.stages.second = await self._second_choice()

    async def _take_stage(self) -> None:
        """Choose a stage and load it; torch's optimizer code is imported meanwhile."""
        imported = asyncio.create_task(import_optimizer_code(), name="import-optimizer-code")
        try:
            await self._choose_stage()
            await imported
        finally:
            imported.cancel()  # it stops being waited for; the import ends in its thread
        self.set_state(PeerState.LOADING)
        await self._hold_first(self.stages.stage)
        self.set_state(PeerState.SERVING)

    async def _hold_first(self, stage: int) -> None:
        """Hold ``stage`` as the node's first stage, loading it again (after
        ``LOAD_RETRY_S``, doubling up to ``LOAD_RETRY_MAX_S``) for as long as it fails (its
        live peers hand over no state, say): the node serves no weights older than its
        peers', and stays up. A ``NodeError`` (the stage does not fit) is final."""
        wait = LOAD_RETRY_S
        while True:
            try:
                await self.hold(stage, "first")
                return
            except NodeError:
                raise
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                logger.warning("could not load stage %d (%s); trying again in %.0f s", stage,
                               error, wait)  # fmt: skip
                events.emit("stage.load_failed", stage=stage, error=error[:300], retry_s=wait)
            await asyncio.sleep(wait)
            wait = min(LOAD_RETRY_MAX_S, 2 * wait)

    async def _choose_stage(self) -> None:
        """Choose a stage (``--stage`` pins it; a node that kept a checkpoint takes that
        checkpoint's stage again)."""
        if self.settings.stage is not None:
            self.stages.stage = self.settings.stage
            return

        def on_choice(stage: int) -> None:
            self.stages.stage = stage
            self.set_state(PeerState.JOINING)  # the record and the gossip carry the intent

        kept = await asyncio.to_thread(checkpoint.kept_stages, self.checkpoints, self.spec)
        await self.placement.join(on_choice, kept)

    async def _second_choice(self) -> int | None:
        """The second stage this node takes as well, if any: pinned, or (for a node that
        chose its first) what the rule says once the first serves."""
        s, first = self.settings, self.stages.stage
        if s.second_stage is not None or s.stage is not None or not s.two_stage:
            return s.second_stage
        try:
            second = await self.placement.second_stage(first)
        except Exception as e:  # a DHT hiccup: one stage is what every node can do
            logger.warning("could not decide on a second stage: %s", e)
            return None
        if second is None:
            return None
        if refusal := self.offer.memory_refusal([first, second]):
            logger.info("not taking stage %d as a second stage: %s", second, refusal[1])
            return None
        need, free = stage_memory(self.spec, second), free_memory(self.device)
        if need > free:
            logger.info(
                "not taking stage %d as a second stage: it needs about %.0f MiB, %.0f MiB free",
                second,
                need / 2**20,
                free / 2**20,
            )
            return None
        self.on_change()  # announce it at once: others count it in the reserve
        return second

    async def load_second(self) -> None:
        """Load and serve the second stage too; its time goes where routing sends calls.
        If that fails the node goes on with one stage (it does not move either)."""
        try:
            await self.hold(self.stages.second, "second")
        except Exception as e:
            logger.warning("could not load stage %d as a second stage: %s", self.stages.second, e)
            self.stages.second = None
        self.on_change()

    async def rebalance(self) -> None:
        """Move when a check says so and the stage we leave keeps a serving peer."""
        while True:
            move = await self.placement.next_move(lambda: self.stages.stage)
            started = asyncio.get_running_loop().time()
            if not await self.placement.confirm_move(move):
                self.on_change()  # re-announce that we stay
                continue
            self.stages.stage = move.to_stage
            self.set_state(PeerState.LOADING)
            await self.release(move.from_stage)
            await self._hold_first(move.to_stage)
            self.set_state(PeerState.SERVING)
            logger.info(
                "moved from stage %d to %d in %.1f s (announced, confirmed, loaded)",
                move.from_stage,
                move.to_stage,
                asyncio.get_running_loop().time() - started,
            )

    async def hold(self, stage: int, role: str) -> None:
        """Build ``stage`` (its state from a peer of it, else from our newest checkpoint of
        it, else initial), and serve it."""
        together = [self.stages.stage, stage] if role == "second" else [stage]
        self.offer.check_memory(together)
        if role == "first":
            logger.info("took stage %d of %d", stage, self.spec.n_stages)
        steps = Steps()
        model = self.spec.model
        module = Stage(model, self.spec.stage_range(stage))
        if self.pretrained is not None:  # the initial state; a peer's or a checkpoint's wins
            r = module.range
            state = await asyncio.to_thread(
                load_stage_state, self.pretrained, range(r.start, r.end)
            )
            load_into(module, state, str(self.pretrained.directory))
        module = module.to(self.device.torch)
        optimizer = StageOptimizer(module, self.spec.optim)
        steps.done("built")
        averager = await StageAverager.create(
            self.dht, self.spec, stage, module, optimizer, key=self.key
        )
        averager.push_through(self.p2p, self.inbox)
        steps.done("averager started")
        try:
            kept = await asyncio.to_thread(checkpoint.newest, self.checkpoints, self.spec, stage)
            saved = None if kept is None else (kept.metadata, kept.tensors, str(kept.path))
            loaded = await averager.load_state(
                saved=saved, archived=functools.partial(self._archived, stage)
            )
            steps.done("state loaded")
            logger.info("stage %d state: %s", stage, loaded)
            server = await AveragedStageServer.create(
                self.p2p,
                module,
                optimizer,
                StageContract.for_stage(model, module.range, stage),
                self.spec.run,
                compression=self.spec.compression,
                averager=averager,
                admission=self.gate.refusal if self.spec.private else None,
                callers=self.callers,
                in_flight=self.in_flight,
                download_mbps=self.offer.download_mbps,
            )
        except BaseException:
            await averager.shutdown()
            raise
        steps.done("serving")
        self.stages.held[stage] = HeldStage(stage, role, averager, server)
        logger.info("stage %d held in %s", stage, steps.line())
        if role == "second":
            logger.info("serving stage %d as well (a second stage)", stage)
        events.emit(
            "stage.held",
            stage=stage,
            role=role,
            loaded=str(loaded.origin),
            source=loaded.source,
            step=loaded.step,
        )

    async def _archived(self, stage: int) -> dict[str, int]:
        """The archive nodes that hold ``stage``, and the epoch of their newest copy."""
        held = {}
        for record in await self.dht.archives():
            epoch = record.epoch_of(stage)
            if epoch is not None and record.peer_id != self.dht.peer_id:
                held[record.peer_id] = epoch
        return held

    async def release(self, stage: int) -> None:
        """Stop serving and averaging ``stage`` (before taking another, or on close)."""
        held = self.stages.held.pop(stage, None)
        if held is None:
            return
        await held.averager.finish_round()  # before the server stops: the round may drain
        await held.server.shutdown()
        self.stages.served_before += held.server.counters.forward
        await held.averager.shutdown()
        events.emit("stage.released", stage=stage)

    async def release_all(self) -> None:
        """Release every held stage, the last taken first."""
        for stage in reversed(list(self.stages.held)):
            await self.release(stage)
