"""Checkpoints of the stages a node holds, written on a period and on a clean stop
(``node.daemon.checkpoint`` is their format on disk)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from node import events
from node.daemon import checkpoint
from node.daemon.stages import HeldStages
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpointer:
    """Writes every running stage of ``stages`` under ``root``, with the data position
    that ``data`` returns (None: the node does not train)."""

    stages: HeldStages
    spec: RunSpec
    root: Path
    data: Callable[[], checkpoint.DataPosition | None]

    async def write_all(self) -> None:
        """Write a checkpoint of every stage held (the copy holds the stage's lock for as
        long as copying its tensors takes; the write runs off the event loop). A stage
        that cannot be written is logged and skipped: a full disk must not stop the node."""
        for held in [h for h in self.stages.held.values() if h.averager.running]:
            started = time.monotonic()
            try:
                metadata, tensors = await asyncio.to_thread(held.averager.snapshot)
                path = await asyncio.to_thread(
                    checkpoint.write,
                    self.root,
                    self.spec,
                    held.stage,
                    metadata,
                    tensors,
                    data=self.data(),
                )
            except Exception as e:  # a full disk must not stop the node
                logger.warning("could not checkpoint stage %d: %s", held.stage, e)
                continue
            events.emit(
                "checkpoint.written", stage=held.stage, step=metadata["step"], path=str(path)
            )
            logger.info(
                "checkpointed stage %d at step %d in %.1f s: %s",
                held.stage,
                metadata["step"],
                time.monotonic() - started,
                path,
            )

    async def every(self, period_s: float) -> None:
        """Write every ``period_s`` for as long as the task runs."""
        while True:
            await asyncio.sleep(period_s)
            await self.write_all()
