"""Who joins and leaves a run, as one node's reads of the run's peers see it, and the
node's heartbeat. ``watch_run`` (a task the node owns) reads the run's peers every
``CHECK_S`` into ``RunPeers``, the node's last read of them. ``Members`` is the bookkeeping
(no I/O): a peer has joined when a read first shows it, and has left when it announces
``leaving`` or its record has been missing for longer than ``grace_s``. Joins and leaves
are each an event, but only the first few of each per minute are a log line
(``LogBudget``): a flood of sybil records is a thousand joins, and then one summary
line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node import events
from node.log_budget import LogBudget
from protocol.records import PeerInfo, PeerState

if TYPE_CHECKING:
    from node.rpc.dht import SwarmDHT

logger = logging.getLogger(__name__)

ANNOUNCED = "announced it"  # why a peer that said it leaves has left
CHECK_S = 5.0  # how often the node reads the run's peers to log who joined or left


@dataclass
class RunPeers:
    """The run's peers as this node last read them, and when (Unix seconds; None: never)."""

    peers: list[PeerInfo] = field(default_factory=list)
    read_at: float | None = None

    def update(self, peers: list[PeerInfo]) -> None:
        """Take a read made just now."""
        self.peers, self.read_at = peers, time.time()


@dataclass
class Members:
    """The other peers of the run this node has seen, and when each was last read."""

    me: str
    grace_s: float
    seen: dict[str, float] | None = None  # None before the first read
    joined: list[PeerInfo] = field(default_factory=list)  # from the last ``update``
    left: list[tuple[str, str]] = field(default_factory=list)  # (peer id, why)
    joins_logged: LogBudget = field(default_factory=lambda: LogBudget("peers joined"))
    leaves_logged: LogBudget = field(default_factory=lambda: LogBudget("peers left"))

    def update(self, peers: list[PeerInfo], now: float) -> None:
        """Take one read of the run's peers; ``joined`` and ``left`` say what changed (at
        the first read, nothing: whoever is there was there before us)."""
        present = {
            p.peer_id: p for p in peers if p.peer_id != self.me and p.state is not PeerState.LEAVING
        }
        leaving = {p.peer_id for p in peers if p.state is PeerState.LEAVING}
        self.joined, self.left = [], []
        if self.seen is None:
            self.seen = dict.fromkeys(present, now)
            return
        self.joined = [p for peer_id, p in sorted(present.items()) if peer_id not in self.seen]
        kept = {}
        for peer_id, last in self.seen.items():
            if peer_id in present:
                continue
            if peer_id in leaving or now - last > self.grace_s:
                why = ANNOUNCED if peer_id in leaving else f"no record for {now - last:.0f} s"
                self.left.append((peer_id, why))
            else:
                kept[peer_id] = last
        self.seen = kept | dict.fromkeys(present, now)

    def report(self, first: bool, now: float | None = None) -> None:
        """Emit (``peer.joined``, ``peer.left``) the last update's changes, and log them
        within the budgets (``now``: ``time.monotonic()`` unless given)."""
        now = time.monotonic() if now is None else now
        if first and self.seen:
            logger.info("%d other peers in the run", len(self.seen))
        for p in self.joined:
            if self.joins_logged.take(now, logger):
                stage = "no stage yet" if p.stage is None else f"stage {p.stage}"
                logger.info("peer %s joined the run (%s)", p.peer_id, stage)
            events.emit("peer.joined", peer=p.peer_id, stage=p.stage)
        for peer_id, why in self.left:
            if self.leaves_logged.take(now, logger):
                logger.info("peer %s left the run (%s)", peer_id, why)
            events.emit("peer.left", peer=peer_id, announced=why == ANNOUNCED, why=why)
        self.joins_logged.flush(now, logger)
        self.leaves_logged.flush(now, logger)


@dataclass(frozen=True)
class Heartbeat:
    """What a serving node says of itself every heartbeat period: its stage(s),
    micro-batches served, optimizer steps of its stage(s), peers serving or loading its
    stage(s) (itself included) and peers in the run."""

    stage: int | None
    second_stage: int | None
    served: int
    steps: int
    stage_peers: int
    run_peers: int

    @classmethod
    def of(
        cls,
        me: str,
        peers: list[PeerInfo],
        *,
        first: int | None,
        second: int | None,
        served: int,
        steps: int,
    ) -> Heartbeat:
        """The heartbeat of ``me`` holding ``first`` (and ``second``, if it serves one),
        given a read of the run's ``peers``."""
        stages = {first, second} - {None}
        present = [p for p in peers if p.state is not PeerState.LEAVING]
        stage_peers = {p.peer_id for p in present if ({p.stage, p.second_stage} & stages) - {None}}
        return cls(
            stage=first,
            second_stage=second,
            served=served,
            steps=steps,
            stage_peers=len(stage_peers | {me}),
            run_peers=len({p.peer_id for p in present} | {me}),
        )

    def report(self) -> None:
        second = "-" if self.second_stage is None else self.second_stage
        logger.info(
            "heartbeat: stage=%s second_stage=%s served=%d steps=%d stage_peers=%d run_peers=%d",
            self.stage, second, self.served, self.steps, self.stage_peers, self.run_peers,
        )  # fmt: skip
        events.emit("node.heartbeat", **vars(self))


async def watch_run(
    dht: SwarmDHT,
    seen: RunPeers,
    me: str,
    record_ttl_s: float,
    heartbeat_s: float,
    on_read: Callable[[list[PeerInfo]], Awaitable[None]],
    heartbeat: Callable[[list[PeerInfo]], Heartbeat | None],
) -> None:
    """Read the run's peers every ``CHECK_S`` into ``seen`` (then ``on_read`` them), log and
    emit who joins and leaves the run (``Members``) and, every ``heartbeat_s``, the
    ``heartbeat`` of the node (None: it has none to give now, as while not serving).
    Runs until cancelled; a failed read is retried at the next check."""
    loop = asyncio.get_running_loop()
    members = Members(me, record_ttl_s + CHECK_S)
    peers: list[PeerInfo] = []
    next_beat = loop.time() + heartbeat_s
    while True:
        try:
            peers = await dht.peers()
        except Exception as e:  # a DHT hiccup: the next check retries
            logger.debug("reading the run's peers failed: %s", e)
        else:
            seen.update(peers)
            await on_read(peers)
            first = members.seen is None
            members.update(peers, loop.time())
            members.report(first)
        if loop.time() >= next_beat and (beat := heartbeat(peers)) is not None:
            next_beat = loop.time() + heartbeat_s
            beat.report()
        await asyncio.sleep(min(CHECK_S, heartbeat_s))
