"""A node's trainer loop: micro-batches driven through the swarm for as long as the node
runs, from where its last checkpoint left its data stream, over its share of the run's
data (``protocol.data_split``) in a run with shards. Whatever stops the trainer pauses it
for ``PAUSE_S``: the node goes on serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hivemind.p2p import P2P

from models.data import Corpus
from node import events
from node.daemon import checkpoint
from node.daemon.settings import NodeSettings
from node.daemon.watch import RunPeers
from node.data import token_stream
from node.pipeline.server import StageServer
from node.pipeline.trainer import MicroBatchResult, Trainer, TrainerError
from node.rpc.dht import SwarmDHT
from protocol.data_split import TokenRange, share_of
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)

PAUSE_S = 10.0  # a node's trainer that cannot go on waits this long to try again
EVENT_EVERY = 10  # micro-batches between two ``train.progress`` events
LOG_EVERY = 50  # micro-batches between two log lines of their mean loss


class Training:
    """Trains on ``corpus`` through the swarm. ``local(stage)`` is this node's own server
    of a stage while it serves it (its trainer calls it in-process); ``peers`` is the
    node's last read of the run's peers (the trainers its data is shared among)."""

    def __init__(
        self,
        settings: NodeSettings,
        spec: RunSpec,
        dht: SwarmDHT,
        p2p: P2P,
        corpus: Corpus | None,
        membership: str | None,
        checkpoints: Path,
        peers: RunPeers,
        local: Callable[[int], StageServer | None],
    ) -> None:
        self._settings = settings
        self._spec = spec
        self._dht = dht
        self._p2p = p2p
        self._corpus = corpus
        self._membership = membership
        self._checkpoints = checkpoints
        self._peers = peers
        self._local = local
        self.trainer: Trainer | None = None  # once ``run`` has started it

    def data_position(self) -> checkpoint.DataPosition | None:
        """Where the trainer's data stream is now (None before it starts), for checkpoints."""
        if self.trainer is None:
            return None
        return checkpoint.DataPosition(self.trainer.settings.stream, self.trainer.data_position)

    async def run(self) -> None:
        """Drive micro-batches through the swarm until cancelled."""
        me = self._dht.peer_id
        stream = zlib.crc32(me.encode())
        start = await asyncio.to_thread(
            checkpoint.data_position, self._checkpoints, self._spec, stream
        )
        if start:
            logger.info("training resumes its data stream at micro-batch %d", start)
        settings = replace(self._settings.trainer, stream=stream, start=start)
        self.trainer = trainer = Trainer(
            self._dht,
            self._p2p,
            self._spec,
            self._corpus,
            settings,
            membership=self._membership,
            local=self._local,
        )
        losses: list[float] = []

        def on_result(r: MicroBatchResult) -> None:
            losses.append(r.loss)
            if trainer.stats.micro_batches % EVENT_EVERY == 0:
                events.emit(
                    "train.progress", micro_batches=trainer.stats.micro_batches, loss=r.loss
                )
            if len(losses) == LOG_EVERY:
                logger.info(
                    "trained %d micro-batches; mean loss of the last %d: %.3f",
                    trainer.stats.micro_batches,
                    LOG_EVERY,
                    sum(losses) / len(losses),
                )
                losses.clear()

        share: tuple[TokenRange, ...] = ()
        if self._spec.dataset is not None and self._peers.read_at is None:
            with contextlib.suppress(Exception):  # else the share waits for the watch loop
                self._peers.update(await self._dht.peers())
        while True:  # whatever stops the trainer pauses it: the node goes on serving
            try:
                share = self._read_share(trainer, share)  # shards gone: a pause, no exit
                await trainer.train(100, on_result)
            except TrainerError as e:
                logger.warning("training paused for %.0f s: %s", PAUSE_S, e)
                await asyncio.sleep(PAUSE_S)
            except Exception:
                logger.exception("the trainer failed; trying again in %.0f s", PAUSE_S)
                await asyncio.sleep(PAUSE_S)

    def _read_share(
        self, trainer: Trainer, share: tuple[TokenRange, ...]
    ) -> tuple[TokenRange, ...]:
        """In a run with shards, point ``trainer`` at this node's share of them among the
        run's live peers (``protocol.data_split``, from the peers the node last read;
        every peer counts as a trainer, so a ``--no-train`` peer's share goes unread rather
        than read twice) when it differs from ``share``; the share it reads now."""
        dataset, directory = self._spec.dataset, self._settings.data
        if dataset is None or directory is None:
            return share
        me = self._dht.peer_id
        trainers = {p.peer_id for p in self._peers.peers} | {me}
        new = share_of([(s.name, s.tokens) for s in dataset.train], trainers, me)
        if new != share:
            tokens = token_stream(dataset, directory.expanduser(), new)
            trainer.read_from(tokens)
            share_ranges = [[r.shard, r.start, r.end] for r in new]
            events.emit("data.share", trainers=len(trainers), ranges=len(new), tokens=len(tokens),
                        share=share_ranges)  # fmt: skip
            logger.info("reading %d of the run's %d training tokens (%d trainers)", len(tokens),
                        sum(s.tokens for s in dataset.train), len(trainers))  # fmt: skip
        return new
