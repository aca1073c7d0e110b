"""An archive node (``swarmtrain node --archive DIR``): it serves no stage and keeps every
stage of a run (``protocol.archive``).

Every ``period_s`` it downloads each stage's state from the stage's peers, as a joiner
does; a state newer than the copy it holds becomes its copy, is written as a checkpoint
in ``DIR`` (``node.daemon.checkpoint``'s layout, so ``swarmtrain export --checkpoint DIR``
reads it), and is handed to peers that download the stage. What it holds is announced in
an ``ArchiveRecord``. At start it loads the newest checkpoint of each stage it kept, so a
run whose every node stopped finds its stages there again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from models.stages import Stage
from models.training import StageOptimizer
from node import events
from node.averaging import state as stage_state
from node.averaging.averager import StageAverager
from node.daemon import checkpoint
from node.daemon.join import Joined, NodeError
from node.rpc.dht import SwarmDHT
from protocol.archive import ArchiveRecord
from protocol.records import PROTOCOL_VERSION
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)

# Bytes of a stage's checkpoint per byte of its parameters, at most: the parameters, AdamW's
# two moments, and DiLoCo's anchor and outer momentum.
STATE_PER_PARAM_BYTE = 5


def bytes_needed(spec: RunSpec, param_bytes: list[int], keep: int = checkpoint.KEEP) -> int:
    """Disk an archive of ``spec`` needs, at most: ``keep`` checkpoints of every stage and
    one more being written (``param_bytes``: each stage's parameters, in bytes)."""
    per_param = STATE_PER_PARAM_BYTE if spec.averaging.mode == "diloco" else 3
    return (keep + 1) * per_param * sum(param_bytes)


def check_disk(root: Path, needed: int, free: int) -> None:
    """``NodeError`` before the archive starts if ``free`` bytes cannot hold ``needed``."""
    if free < needed:
        raise NodeError(
            f"the archive directory {root} has {free / 2**30:.2f} GiB free, but keeping "
            f"{checkpoint.KEEP} checkpoints of every stage needs about {needed / 2**30:.2f} "
            "GiB: free some space or choose another --archive directory"
        )


@dataclass
class ArchivedStage:
    stage: int
    averager: StageAverager  # never averages: it downloads and shares the stage's state
    epoch: int | None = None  # of the copy held (None: none yet)
    step: int | None = None


class Archive:
    """Keeps every stage of one run in ``root``; build with ``await Archive.open(...)``,
    then ``await run()`` until cancelled, ``await close()`` at the end."""

    def __init__(
        self,
        dht: SwarmDHT,
        joined: Joined,
        root: Path,
        key: Ed25519PrivateKey,
        stages: list[ArchivedStage],
        *,
        period_s: float,
        record_ttl_s: float,
    ) -> None:
        self.dht = dht
        self.spec = joined.spec
        self.membership = joined.membership
        self.root = root
        self.key = key
        self.stages = stages
        self.period_s = period_s
        self.record_ttl_s = record_ttl_s

    @classmethod
    async def open(
        cls,
        dht: SwarmDHT,
        joined: Joined,
        root: Path,
        key: Ed25519PrivateKey,
        *,
        period_s: float,
        record_ttl_s: float,
    ) -> Archive:
        """Check the disk, start one averager per stage, and load what ``root`` kept."""
        spec = joined.spec
        modules = [Stage(spec.model, spec.stage_range(s)) for s in range(spec.n_stages)]
        param_bytes = [
            sum(p.numel() * p.element_size() for _, p in stage_state.trainable(m)) for m in modules
        ]
        root.mkdir(parents=True, exist_ok=True)
        check_disk(root, bytes_needed(spec, param_bytes), shutil.disk_usage(root).free)
        self = cls(dht, joined, root, key, [], period_s=period_s, record_ttl_s=record_ttl_s)
        try:
            for stage, module in enumerate(modules):
                optimizer = StageOptimizer(module, spec.optim)
                averager = await StageAverager.create(dht, spec, stage, module, optimizer)
                self.stages.append(ArchivedStage(stage, averager))
                await self._load_kept(self.stages[-1])
        except BaseException:
            await self.close()
            raise
        return self

    async def _load_kept(self, held: ArchivedStage) -> None:
        kept = await asyncio.to_thread(checkpoint.newest, self.root, self.spec, held.stage)
        if kept is None:
            return
        module = held.averager.module
        try:
            state = stage_state.parse(
                kept.metadata, kept.tensors, module, mode=self.spec.averaging.mode
            )
        except stage_state.StateError as e:
            logger.warning("archive: cannot use %s: %s", kept.path, e)
            return
        await held.averager.keep(state)
        held.epoch, held.step = held.averager.epoch, held.averager.step
        logger.info("archive: stage %d at step %d from %s", held.stage, held.step, kept.path)

    def record(self) -> ArchiveRecord:
        return ArchiveRecord(
            peer_id=self.dht.peer_id,
            run=self.spec.run,
            version=PROTOCOL_VERSION,
            epochs=tuple(h.epoch for h in self.stages),
            steps=tuple(h.step for h in self.stages),
            timestamp=get_dht_time(),
            membership=self.membership,
            ttl_s=self.record_ttl_s,
        )

    async def run(self) -> None:
        """Announce what is held and pull every stage, every ``period_s``, until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._announce_loop(), name="archive-announce")
            tasks.create_task(self._pull_loop(), name="archive-pull")

    async def _announce_loop(self) -> None:
        while True:
            if not await self.dht.publish_archive(self.record(), self.key):
                logger.warning("archive: could not store its record in the DHT")
            await asyncio.sleep(self.record_ttl_s / 3)

    async def _pull_loop(self) -> None:
        while True:
            started = time.monotonic()
            for held in self.stages:
                await self._pull(held)
            await asyncio.sleep(max(0.0, self.period_s - (time.monotonic() - started)))

    async def _pull(self, held: ArchivedStage) -> None:
        """Download the stage's state from its peers; keep and write it if it is newer."""
        state = await held.averager.fetch(self.spec.averaging.round_timeout_s)
        if state is None or (held.epoch is not None and state.epoch <= held.epoch):
            return
        await held.averager.keep(state)
        held.epoch, held.step = held.averager.epoch, held.averager.step
        try:
            metadata, tensors = await asyncio.to_thread(held.averager.snapshot)
            path = await asyncio.to_thread(
                checkpoint.write, self.root, self.spec, held.stage, metadata, tensors
            )
        except Exception as e:  # a full disk must not stop the archive
            logger.warning("archive: could not write stage %d: %s", held.stage, e)
            return
        logger.info(
            "archive: stage %d at step %d from %s: %s", held.stage, held.step, state.source, path
        )
        events.emit("checkpoint.written", stage=held.stage, step=held.step, path=str(path))

    async def close(self) -> None:
        for held in self.stages:
            with contextlib.suppress(Exception):
                await held.averager.shutdown()
        self.stages = []
