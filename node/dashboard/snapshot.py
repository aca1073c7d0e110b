"""What a node is doing now, as plain values: what the dashboard's JSON API, its metrics
and its history are built from.

``snapshot_of`` reads a ``Node``'s public attributes on the event loop: counters and the
last read of the run's peers, no I/O, no lock, no waiting, so that it is cheap enough to
take on every request. The other modules of the package see only ``NodeSnapshot``, and
their tests build one by hand.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node.limits import TrafficCounts, traffic
from protocol.records import PeerInfo
from protocol.run_spec import RunSpec

if TYPE_CHECKING:
    from node.daemon.node import Node

RECENT_ROUNDS = 20  # a stage's mean round duration is over its last this many rounds


@dataclass(frozen=True)
class AveragingSnapshot:
    """One held stage's averaging, since the node took the stage (``AveragingStats``)."""

    mode: str  # "gradient" or "diloco"
    epoch: int
    rounds: int  # averaged with at least one other peer
    alone: int
    fallbacks: int
    catch_ups: int
    discarded: int
    last_round_s: float | None
    mean_round_s: float | None  # of the last ``RECENT_ROUNDS`` averaged rounds
    last_group: int  # peers in the last averaged round, this one included


@dataclass(frozen=True)
class StageSnapshot:
    """One stage this node holds: its server's counters since the node took it."""

    stage: int
    role: str  # "first" or "second"
    forward: int  # forward passes served (train and validation)
    backward: int
    refused: int  # requests refused
    steps: int  # optimizer steps of this copy
    load: int  # requests being received, queued or computed
    averaging: AveragingSnapshot


@dataclass(frozen=True)
class NodeSnapshot:
    """One node at one moment. Counters (``*_served``, ``trained_*``, ``loss_sum``) only
    grow over the node's life."""

    time: float  # Unix seconds, when taken
    run: str  # the run's id (its name before the node resolved it)
    peer_id: str
    state: str  # a ``protocol.records.PeerState`` value
    started: float  # Unix seconds
    spec: RunSpec | None = None  # None until the node has joined
    stage: int | None = None
    second_stage: int | None = None  # once it serves one
    device: str | None = None
    stages: tuple[StageSnapshot, ...] = ()
    micro_batches_served: int = 0
    samples_served: int = 0
    trained_micro_batches: int = 0
    trained_samples: int = 0
    loss_sum: float = 0.0  # of the trained micro-batches' losses
    calls: dict[int, int] = field(default_factory=dict)  # stage -> trainer calls answered
    peers: tuple[PeerInfo, ...] = ()  # the run's peers, as the node last read them
    peers_read_at: float | None = None  # Unix seconds
    traffic: TrafficCounts | None = None  # bytes moved by purpose, and the limits (node.limits)
    advertised_mbps: tuple[float, float] | None = None  # (up, down) its record says, if known

    @property
    def uptime_s(self) -> float:
        return max(0.0, self.time - self.started)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _averaging(averager) -> AveragingSnapshot:
    stats = averager.stats
    recent = list(stats.round_s)[-RECENT_ROUNDS:]
    return AveragingSnapshot(
        mode=averager.mode,
        epoch=averager.epoch,
        rounds=stats.rounds,
        alone=stats.alone,
        fallbacks=stats.fallbacks,
        catch_ups=stats.catch_ups,
        discarded=stats.discarded,
        last_round_s=_finite(stats.last_round_s),
        mean_round_s=sum(recent) / len(recent) if recent else None,
        last_group=stats.last_group,
    )


def _calls_by_stage(calls: dict[tuple[int, str], int]) -> dict[int, int]:
    by_stage: dict[int, int] = {}
    for (stage, _), n in list(calls.items()):
        by_stage[stage] = by_stage.get(stage, 0) + n
    return by_stage


def snapshot_of(node: Node) -> NodeSnapshot:
    """``node`` now. On the event loop that runs it."""
    stages = []
    for held in list(node.stages.held.values()):
        counters = held.server.counters
        stages.append(
            StageSnapshot(
                stage=held.stage,
                role=held.role,
                forward=counters.forward,
                backward=counters.backward,
                refused=counters.rejected,
                steps=counters.steps,
                load=held.server.load,
                averaging=_averaging(held.averager),
            )
        )
    spec = node.spec
    served = node.stages.micro_batches_served()
    trainer = node.trainer
    stats = None if trainer is None else trainer.stats
    return NodeSnapshot(
        time=time.time(),
        run=node.settings.run,
        peer_id=node.peer_id,
        state=node.state.value,
        started=node.started,
        spec=spec,
        stage=node.stages.stage,
        second_stage=node.stages.serving_second,
        device=None if node.device is None else node.device.description,
        stages=tuple(sorted(stages, key=lambda s: s.stage)),
        micro_batches_served=served,
        samples_served=0 if spec is None else served * spec.optim.micro_batch_size,
        trained_micro_batches=0 if stats is None else stats.micro_batches,
        trained_samples=0 if stats is None else stats.samples,
        loss_sum=0.0 if stats is None else stats.loss_sum,
        calls=_calls_by_stage(stats.calls) if stats is not None else {},
        peers=tuple(node.run_peers.peers),
        peers_read_at=node.run_peers.read_at,
        traffic=traffic.counts(),
        advertised_mbps=node.offer.advertised_bandwidth(),
    )
