"""The trainer's rerouting, driven without a swarm: the swarm view comes from a stub DHT and
the stage calls go through ``StageCalls`` stubs that fail as a test says. A failed call is
a ``call.failed`` event, its retry on another peer of the stage a ``call.rerouted``. The
router's inference pass (generation) takes the same routes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import PeerID

from node import events
from node.pipeline.client import StageCallError, StageRefused, StageUnavailable
from node.pipeline.server import HOLD_ROUND_S
from node.pipeline.trainer import (
    MAX_COUNTED_PEERS,
    OTHER_PEERS,
    StageCalls,
    StageRouter,
    Trainer,
    TrainerError,
    TrainerSettings,
    TrainerStats,
)
from protocol.identity import peer_id_of
from protocol.records import PeerInfo
from protocol.run_spec import make_run_spec
from protocol.stage_messages import WRONG_STAGE
from tests.records import peer_info

OWNER = peer_id_of(Ed25519PrivateKey.generate().public_key())
SPEC = make_run_spec("rerouted", "tiny", 2, owner=OWNER)


def _peer_id() -> str:
    return peer_id_of(Ed25519PrivateKey.generate().public_key())


@dataclass
class _DHT:
    """A swarm view that never changes."""

    infos: list[PeerInfo]

    async def peers(self, select=None) -> list[PeerInfo]:
        chosen = set(select([p.peer_id for p in self.infos])) if select else None
        return [p for p in self.infos if chosen is None or p.peer_id in chosen]


@dataclass
class _Stages:
    """Stage calls that compute nothing; the first call to ``failing_stage`` raises
    ``error(peer)``. Records who served what."""

    failing_stage: int
    error: type[StageCallError]
    reason: str = "gone"
    served: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, stage, peer)
    failed: list[str] = field(default_factory=list)
    flags: list[dict[str, Any]] = field(default_factory=list)  # each forward's train, infer
    inputs: list[torch.Tensor] = field(default_factory=list)  # of each stage-0 forward
    ids: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, stage, micro_batch)

    def calls(self) -> StageCalls:
        return StageCalls(
            forward=self.forward, loss=self.loss, backward=self.backward, logits=self.logits
        )

    def _serve(self, kind: str, peer: PeerID, stage: int) -> None:
        if stage == self.failing_stage and not self.failed:
            self.failed.append(peer.to_base58())
            raise self.error(peer, self.reason)
        self.served.append((kind, stage, peer.to_base58()))

    async def forward(self, p2p: Any, peer: PeerID, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        self._serve("forward", peer, kw["stage"])
        self.ids.append(("forward", kw["stage"], kw.get("micro_batch", 0)))
        self.flags.append({"train": kw["train"], "infer": kw["infer"]})
        if kw["stage"] == 0:
            self.inputs.append(x)
        return torch.zeros(*x.shape[:2], SPEC.model.n_embd)

    async def logits(self, p2p: Any, peer: PeerID, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        self._serve("logits", peer, kw["stage"])
        return torch.arange(float(kw["vocab_size"])).expand(len(x), -1)

    async def loss(self, p2p: Any, peer: PeerID, x: torch.Tensor, y: torch.Tensor, **kw: Any):
        self._serve("loss", peer, kw["stage"])
        self.ids.append(("loss", kw["stage"], kw.get("micro_batch", 0)))
        return torch.tensor(1.0), torch.zeros_like(x)

    async def backward(self, p2p: Any, peer: PeerID, x: torch.Tensor, g: torch.Tensor, **kw: Any):
        self._serve("backward", peer, kw["stage"])
        self.ids.append(("backward", kw["stage"], kw["micro_batch"]))
        return None if kw["stage"] == 0 else torch.zeros_like(x)


def _trainer(
    stages: _Stages, stage_of_peers: list[int], start: int = 0
) -> tuple[Trainer, list[str]]:
    peers = [_peer_id() for _ in stage_of_peers]
    dht = _DHT(
        [peer_info(SPEC.run, p, stage=s) for p, s in zip(peers, stage_of_peers, strict=True)]
    )
    p2p = SimpleNamespace(peer_id=PeerID.from_base58(_peer_id()))
    corpus = SimpleNamespace(train=torch.randint(256, (4 * SPEC.model.block_size,)))
    # the view: as the test leaves it
    settings = TrainerSettings(in_flight=1, refresh_s=60.0, start=start)
    trainer = Trainer(dht, p2p, SPEC, corpus, settings, calls=stages.calls())  # type: ignore[arg-type]
    return trainer, peers


def test_a_trainer_pointed_at_other_data_goes_on_at_its_position() -> None:
    stages = _Stages(failing_stage=-1, error=StageUnavailable)
    trainer, _ = _trainer(stages, [0, 1])
    asyncio.run(trainer.train(2))
    share = torch.full((4 * SPEC.model.block_size,), 7)  # a new share: every token is 7
    trainer.read_from(share)
    asyncio.run(trainer.train(3))
    assert trainer.data_position == 5
    assert all(bool((x == 7).all()) for x in stages.inputs[2:])
    assert not any(bool((x == 7).all()) for x in stages.inputs[:2])


@pytest.mark.parametrize("start", [0, 7])
def test_micro_batch_ids_go_on_across_train_calls_as_the_data_stream_does(start: int) -> None:
    """The node's trainer loop calls ``train`` again and again: the stage servers key a
    caller's micro-batches by their ids, which must not repeat over the trainer's life."""
    stages = _Stages(failing_stage=-1, error=StageUnavailable)
    trainer, _ = _trainer(stages, [0, 1], start=start)
    asyncio.run(trainer.train(2))
    asyncio.run(trainer.train(3))

    ids = list(range(start, start + 5))  # each micro-batch's place in the data stream
    assert [i for kind, _, i in stages.ids if kind == "forward"] == ids
    assert [i for kind, _, i in stages.ids if kind == "loss"] == ids
    assert [i for kind, _, i in stages.ids if kind == "backward"] == ids
    assert trainer.data_position == start + 5


@pytest.mark.parametrize("failing_stage", [0, 1])
@pytest.mark.parametrize(
    ("error", "reason"),
    [(StageUnavailable, "gone"), (StageRefused, f"{WRONG_STAGE}it serves stage 0 now")],
    ids=["unavailable", "moved"],
)
def test_a_failed_call_is_an_event_and_is_rerouted_to_the_stages_other_peer(
    event_log: Path, failing_stage: int, error: type[StageCallError], reason: str
) -> None:
    stages = _Stages(failing_stage, error, reason)
    trainer, peers = _trainer(stages, [0, 0, 1, 1])
    asyncio.run(trainer.train(2))

    assert trainer.stats.micro_batches == 2
    (failed,) = events.read_events(event_log, "call.failed")
    (bad,) = stages.failed
    assert failed["stage"] == failing_stage and failed["peer"] == bad
    assert failed["error"].startswith(error.__name__) and reason in failed["error"]
    (rerouted,) = events.read_events(event_log, "call.rerouted")
    same_stage = {p for p, s in zip(peers, [0, 0, 1, 1], strict=True) if s == failing_stage}
    assert rerouted["stage"] == failing_stage and rerouted["peer"] == (same_stage - {bad}).pop()
    assert bad not in {p for _, s, p in stages.served if s == failing_stage}, "banned since"
    assert [c.peer_id for c in trainer.view[failing_stage]] == [rerouted["peer"]]


def test_hidden_states_of_another_width_fail_their_peer_not_the_next_stage(
    event_log: Path,
) -> None:
    """Sent on, hidden states of the wrong width would make the next stage refuse the
    trainer; the stage-0 peer that answered them is failed and its micro-batch rerouted."""
    narrowed: list[str] = []  # the peer whose first answer was one value short

    @dataclass
    class _Narrow(_Stages):
        async def forward(self, p2p: Any, peer: PeerID, x: torch.Tensor, **kw: Any):
            hidden = await super().forward(p2p, peer, x, **kw)
            if kw["stage"] == 0 and not narrowed:
                narrowed.append(peer.to_base58())
                return hidden[..., :-1]
            return hidden

    stages = _Narrow(failing_stage=-1, error=StageUnavailable)
    trainer, peers = _trainer(stages, [0, 0, 1])
    asyncio.run(trainer.train(3))
    assert trainer.stats.micro_batches == 3
    (failed,) = events.read_events(event_log, "call.failed")
    assert failed["peer"] == narrowed[0] and failed["stage"] == 0 and "width" in failed["error"]
    (rerouted,) = events.read_events(event_log, "call.rerouted")
    assert rerouted["stage"] == 0 and rerouted["peer"] != narrowed[0]
    assert [c.peer_id for c in trainer.view[0]] == [rerouted["peer"]]


def test_a_refusal_that_is_no_peer_failure_is_an_event_and_stops_training(event_log: Path) -> None:
    stages = _Stages(1, StageRefused, "the request is malformed")
    trainer, _ = _trainer(stages, [0, 1, 1])
    with pytest.raises(TrainerError, match="refused our request"):
        asyncio.run(trainer.train(1))
    (failed,) = events.read_events(event_log, "call.failed")
    assert failed["stage"] == 1 and "malformed" in failed["error"]
    assert events.read_events(event_log, "call.rerouted") == []


def test_a_stage_whose_only_peer_failed_retries_that_peer(event_log: Path) -> None:
    """Banned, the stage's only peer is still called (rather than none): it may be back."""
    stages = _Stages(1, StageUnavailable)
    trainer, peers = _trainer(stages, [0, 1])
    asyncio.run(trainer.train(1))
    (failed,) = events.read_events(event_log, "call.failed")
    (rerouted,) = events.read_events(event_log, "call.rerouted")
    assert failed["peer"] == rerouted["peer"] == peers[1]
    assert ("loss", 1, peers[1]) in stages.served


@pytest.mark.parametrize("failing_stage", [0, 1])
def test_an_inference_pass_goes_through_every_stage_and_is_rerouted_alike(
    event_log: Path, failing_stage: int
) -> None:
    stages = _Stages(failing_stage, StageUnavailable)
    trainer, peers = _trainer(stages, [0, 0, 1, 1])
    router = StageRouter(trainer.dht, trainer.p2p, SPEC, trainer.settings, calls=stages.calls())
    tokens = torch.randint(256, (1, 5))
    logits = asyncio.run(router.logits(tokens))
    assert torch.equal(logits, torch.arange(float(SPEC.model.vocab_size)).unsqueeze(0))
    assert [(kind, stage) for kind, stage, _ in stages.served] == [("forward", 0), ("logits", 1)]
    assert stages.flags == [{"train": False, "infer": True}], "an inference forward"
    (rerouted,) = events.read_events(event_log, "call.rerouted")
    assert rerouted["stage"] == failing_stage and rerouted["peer"] != stages.failed[0]
    assert router.stats.rerouted[failing_stage] == 1 and router.stats.micro_batches == 0


def test_an_inference_pass_names_the_stage_that_has_no_peer(event_log: Path) -> None:
    stages = _Stages(-1, StageUnavailable)
    trainer, _ = _trainer(stages, [0, 0])
    settings = TrainerSettings(stage_wait_s=0.0)
    router = StageRouter(trainer.dht, trainer.p2p, SPEC, settings, calls=stages.calls())
    with pytest.raises(TrainerError, match="stage 1 has had no serving peer"):
        asyncio.run(router.logits(torch.randint(256, (1, 5))))
    assert [kind for kind, _, _ in stages.served] == ["forward"]


@dataclass
class _TimedStages(_Stages):
    """``_Stages`` that record each call's kind, whether it trains, and its timeout."""

    timeouts: list[tuple[str, bool, float]] = field(default_factory=list)

    async def forward(self, p2p: Any, peer: PeerID, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.timeouts.append(("forward", kw["train"], kw["timeout"]))
        return await super().forward(p2p, peer, x, **kw)

    async def loss(self, p2p: Any, peer: PeerID, x: torch.Tensor, y: torch.Tensor, **kw: Any):
        self.timeouts.append(("loss", kw["train"], kw["timeout"]))
        return await super().loss(p2p, peer, x, y, **kw)

    async def backward(self, p2p: Any, peer: PeerID, x: torch.Tensor, g: torch.Tensor, **kw: Any):
        self.timeouts.append(("backward", False, kw["timeout"]))
        return await super().backward(p2p, peer, x, g, **kw)


def test_a_training_call_that_a_stage_may_hold_gets_the_hold_on_top_of_its_timeout() -> None:
    stages = _TimedStages(failing_stage=-1, error=StageUnavailable)
    trainer, _ = _trainer(stages, [0, 1])
    settings = trainer.settings
    asyncio.run(trainer.train(3))
    trainer.corpus.val = trainer.corpus.train
    asyncio.run(trainer.evaluate(1))
    floor, ceiling = settings.min_call_timeout_s, settings.call_timeout_s
    for kind, train, timeout in stages.timeouts:
        if train:  # a stage may hold it for a step: HOLD_ROUND_S more than its stage's timeout
            assert timeout in (floor + HOLD_ROUND_S, ceiling + HOLD_ROUND_S), (kind, timeout)
        else:  # backwards and evaluations are never held
            assert timeout in (floor, ceiling), (kind, timeout)
    trained = [t for _, train, t in stages.timeouts if train]
    assert len(trained) == 6 and trained[-2:] == [floor + HOLD_ROUND_S] * 2  # fast calls: the floor


@dataclass
class _SlowLoss(_Stages):
    """``_Stages`` whose last stage takes ``loss_s`` for its loss call."""

    loss_s: float = 0.2  # far above what a call that computes nothing takes

    async def loss(self, p2p: Any, peer: PeerID, x: torch.Tensor, y: torch.Tensor, **kw: Any):
        await asyncio.sleep(self.loss_s)
        return await super().loss(p2p, peer, x, y, **kw)


def test_a_result_times_each_call_in_the_order_made() -> None:
    """``call_s``: stage 0's forward, stage 1's loss, stage 0's backward (2 stages)."""
    stages = _SlowLoss(failing_stage=-1, error=StageUnavailable)
    trainer, _ = _trainer(stages, [0, 1])
    results = []
    asyncio.run(trainer.train(2, results.append))
    for r in results:
        forward, loss, backward = r.call_s
        assert loss >= stages.loss_s
        assert forward < stages.loss_s and backward < stages.loss_s


def test_call_counts_stay_bounded_and_keep_each_stages_total():
    """A trainer meets peers without end in a public run: past ``MAX_COUNTED_PEERS`` the
    peers that served fewest calls are counted together, and each stage's total stays."""
    stats = TrainerStats()
    for i in range(3 * MAX_COUNTED_PEERS):
        stats.called(i % 2, f"peer{i}")
    stats.called(0, "busy")
    stats.called(0, "busy")
    assert len(stats.calls) <= MAX_COUNTED_PEERS + 2
    totals = {s: sum(n for (st, _), n in stats.calls.items() if st == s) for s in (0, 1)}
    assert totals == {0: 3 * MAX_COUNTED_PEERS // 2 + 2, 1: 3 * MAX_COUNTED_PEERS // 2}
    assert stats.calls[(0, "busy")] == 2 and stats.calls[(1, OTHER_PEERS)] > 0
