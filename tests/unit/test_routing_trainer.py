"""Probation routing as the trainer runs it, without a swarm: a view of one honest peer per
stage and sybil records claiming 1e9 samples/s (half per stage), whose calls all fail."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
from hivemind.p2p import PeerID

from node import events
from node.pipeline.client import StageUnavailable
from node.pipeline.trainer import StageCalls, Trainer, TrainerSettings
from tests.records import peer_info
from tests.unit.test_trainer import _DHT, SPEC, _peer_id


class _Counted(_DHT):
    """The view, counting how many records each read returned."""

    def __init__(self, infos) -> None:
        super().__init__(infos)
        self.returned: list[int] = []

    async def peers(self, select=None):
        found = await super().peers(select)
        self.returned.append(len(found))
        return found


class _Flooded:
    """Stage calls that succeed on ``honest`` peers only (the sybils run no node)."""

    def __init__(self, honest: set[str]) -> None:
        self.honest = honest
        self.failed = 0
        self.by_peer: Counter = Counter()

    async def _serve(self, peer: PeerID) -> None:
        await asyncio.sleep(0.001)  # a call takes a while: other tasks run meanwhile
        if peer.to_base58() not in self.honest:
            self.failed += 1
            self.by_peer[peer.to_base58()] += 1
            raise StageUnavailable(peer, "unreachable")

    async def forward(self, p2p: Any, peer: PeerID, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        await self._serve(peer)
        return torch.zeros(*x.shape[:2], SPEC.model.n_embd)

    async def loss(self, p2p: Any, peer: PeerID, x: torch.Tensor, y: torch.Tensor, **kw: Any):
        await self._serve(peer)
        return torch.tensor(1.0), torch.zeros_like(x)

    async def backward(self, p2p: Any, peer: PeerID, x: torch.Tensor, g: torch.Tensor, **kw: Any):
        await self._serve(peer)
        return None if kw["stage"] == 0 else torch.zeros_like(x)


def _flooded_trainer(
    connected: bool, sybils: int, probe_s: float = 60.0
) -> tuple[Trainer, _Flooded, list[str]]:
    honest = [_peer_id(), _peer_id()]
    records = [peer_info(SPEC.run, p, stage=s) for s, p in enumerate(honest)]
    records += [
        peer_info(SPEC.run, _peer_id(), stage=i % 2, throughput=(1e9, 1e9)) for i in range(sybils)
    ]
    stages = _Flooded(set(honest))

    async def list_peers() -> list[Any]:
        return [SimpleNamespace(peer_id=PeerID.from_base58(p)) for p in honest] if connected else []

    p2p = SimpleNamespace(peer_id=PeerID.from_base58(_peer_id()), list_peers=list_peers)
    corpus = SimpleNamespace(train=torch.randint(256, (4 * SPEC.model.block_size,)))
    settings = TrainerSettings(in_flight=4, refresh_s=0.05, probe_s=probe_s)
    calls = StageCalls(forward=stages.forward, loss=stages.loss, backward=stages.backward)
    trainer = Trainer(_Counted(records), p2p, SPEC, corpus, settings, calls=calls)  # type: ignore[arg-type]
    return trainer, stages, honest


def test_a_flood_of_records_draws_no_training_call_once_a_peer_is_proven():
    """The connected peers are probed first; then unproven peers get only probes, off the
    micro-batches' path: the sybils fail those, and no training call."""
    trainer, stages, honest = _flooded_trainer(connected=True, sybils=1000, probe_s=0.001)
    asyncio.run(trainer.train(100))
    assert trainer.stats.micro_batches == 100
    assert sum(trainer.stats.rerouted.values()) == 0
    assert stages.failed > 0  # the probes went on meanwhile
    assert max(stages.by_peer.values()) == 1  # each sybil failed once: then a suspect
    assert all(len(stage) <= 1 + 16 for stage in trainer.view)  # 16 unproven kept at most
    # Each read checks the proven peers and a bounded sample of the others, not the flood.
    assert 0 < max(trainer.dht.returned) <= 2 + 2 * 16 * 2, trainer.dht.returned


def test_without_a_connected_peer_the_flood_is_probed_but_only_once_each():
    """Nothing tells the honest peer apart: sybils are probed until it is found, but a
    sybil that failed is a suspect, and not called again while it is one (calls already
    on their way to it, one per micro-batch in flight at most, fail too)."""
    trainer, stages, _ = _flooded_trainer(connected=False, sybils=200)
    asyncio.run(trainer.train(100))
    assert trainer.stats.micro_batches == 100
    assert max(stages.by_peer.values()) <= trainer.settings.in_flight


def test_a_trainer_without_relays_leaves_relayed_peers_out_and_says_so_once(event_log):
    """A trainer whose ``p2pd`` cannot dial through a relay (``--no-relay``) never calls a
    peer that serves through one (here: one that would fail every call, as such calls
    do), and emits ``route.out_of_reach`` once; a trainer with relays probes it."""
    honest = [_peer_id(), _peer_id()]
    relay = f"/ip4/44.77.0.2/tcp/4001/p2p/{_peer_id()}"
    relayed = _peer_id()
    records = [peer_info(SPEC.run, p, stage=s, reachable=True) for s, p in enumerate(honest)]
    records.append(peer_info(SPEC.run, relayed, stage=1, reachable=False, relay=relay))

    def run(dials_relays: bool) -> _Flooded:
        stages = _Flooded(set(honest))

        async def list_peers() -> list[Any]:
            return []

        p2p = SimpleNamespace(peer_id=PeerID.from_base58(_peer_id()), list_peers=list_peers)
        corpus = SimpleNamespace(train=torch.randint(256, (4 * SPEC.model.block_size,)))
        settings = TrainerSettings(
            in_flight=2, refresh_s=0.01, probe_s=0.001, dials_relays=dials_relays
        )
        calls = StageCalls(forward=stages.forward, loss=stages.loss, backward=stages.backward)
        trainer = Trainer(_Counted(records), p2p, SPEC, corpus, settings, calls=calls)  # type: ignore[arg-type]
        asyncio.run(trainer.train(40))
        assert trainer.stats.micro_batches == 40
        return stages

    assert run(dials_relays=False).by_peer[relayed] == 0
    (said,) = events.read_events(event_log, "route.out_of_reach")
    assert (said["count"], said["peers"]) == (1, [relayed]), said
    assert "--no-relay" in said["reason"]
    assert run(dials_relays=True).by_peer[relayed] > 0  # probed, and failed
    assert len(events.read_events(event_log, "route.out_of_reach")) == 1
