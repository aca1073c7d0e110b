"""A stage server's hold of training micro-batches (``max_staleness`` 0), driven without a
network: a micro-batch held past ``HOLD_S`` (``HOLD_ROUND_S`` while the round it waits for
is on its way) is admitted and says so (``on_overdue``), and one whose caller left while
it was held is dropped before it is computed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from models.stages import Stage
from models.training import StageOptimizer
from node import events
from node.pipeline import server as server_module
from node.pipeline.server import CallerGone, StageServer
from node.pipeline.wire import serialize, split_message
from protocol import averaging
from protocol.identity import peer_id_of
from protocol.stage_messages import FORWARD, StageContract, StageMeta
from tests.stage_rig import CFG, MAX_TOKENS, OPT, RUN, TWO, _batch, _run


class _Server(StageServer):
    """Counts the overdue holds it is told of."""

    overdue_calls = 0

    async def on_overdue(self) -> None:
        self.overdue_calls += 1


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(server_module, "HOLD_S", 0.2)  # the unit tier stays fast
    stage = Stage(CFG, TWO[0])
    contract = StageContract.for_stage(CFG, TWO[0], 0, max_tokens=MAX_TOKENS)
    server = _Server(stage, StageOptimizer(stage, OPT), contract, RUN)
    yield server
    _run(server.shutdown())


def _serve(server: StageServer, micro_batch: int, gone) -> object:
    caller = PeerID.from_base58(peer_id_of(Ed25519PrivateKey.generate().public_key()))
    context = P2PContext(handle_name="test", local_id=caller, remote_id=caller)
    x, _ = _batch()

    async def requests():
        meta = StageMeta(RUN, 0, FORWARD, micro_batch, train=True).encode()
        for message in split_message(runtime_pb2.ExpertRequest, meta, [serialize(x)]):
            yield message

    return _run(server._serve(FORWARD, requests(), context, gone))


def test_a_held_micro_batch_whose_caller_left_is_not_computed(server, event_log: Path):
    server.optimizer.accumulated(OPT.target_batch_size)  # the step's batch is in: hold
    with pytest.raises(CallerGone):
        _serve(server, 7, gone=lambda: True)
    counters = server.counters
    assert counters.held == 1 and counters.overdue == 1 and server.overdue_calls == 1
    assert counters.abandoned == 1 and counters.forward == 0  # dropped uncomputed
    assert server.open_samples() == 0  # and it holds no step back
    (dropped,) = events.read_events(event_log, "stage.abandoned")
    assert dropped["micro_batch"] == 7 and dropped["stage"] == 0 and dropped["train"]

    _serve(server, 8, gone=lambda: False)  # a caller still there: served late
    counters = server.counters
    assert counters.held == 2 and counters.overdue == 2 and counters.forward == 1
    assert counters.abandoned == 1 and server.open_samples() == _batch()[0].shape[0]


class _RoundServer(_Server):
    """A stage whose gradient round is in progress while ``on_way``."""

    on_way = False

    def round_on_way(self) -> bool:
        return self.on_way

    def land(self) -> None:
        """The round's step lands (its parameters do not matter here): the batch is
        cleared and the held micro-batches are told (from another thread, as the
        averager's step is)."""
        self.optimizer.samples = 0
        self.on_way = False
        self.gate_changed()


@pytest.fixture
def round_server(monkeypatch):
    monkeypatch.setattr(server_module, "HOLD_S", 0.2)
    monkeypatch.setattr(server_module, "HOLD_ROUND_S", 1.0)
    stage = Stage(CFG, TWO[0])
    contract = StageContract.for_stage(CFG, TWO[0], 0, max_tokens=MAX_TOKENS)
    server = _RoundServer(stage, StageOptimizer(stage, OPT), contract, RUN)
    yield server
    _run(server.shutdown())


def test_a_round_on_its_way_holds_past_the_short_hold_until_its_step(round_server):
    """While the round is on its way a micro-batch waits past ``HOLD_S`` and is admitted
    fresh when the step lands; a round that never lands holds it ``HOLD_ROUND_S``."""
    server = round_server
    server.optimizer.accumulated(OPT.target_batch_size)  # the step's batch is in: hold
    server.on_way = True
    threading.Timer(0.5, server.land).start()
    started = time.monotonic()
    _serve(server, 1, gone=lambda: False)
    assert 0.5 <= time.monotonic() - started < 1.0
    counters = server.counters
    assert (counters.held, counters.overdue, counters.forward) == (1, 0, 1)
    assert server.overdue_calls == 0

    server.optimizer.accumulated(OPT.target_batch_size)
    server.on_way = True  # and it never lands
    started = time.monotonic()
    _serve(server, 2, gone=lambda: False)
    assert 1.0 <= time.monotonic() - started < 2.0
    assert (server.counters.overdue, server.overdue_calls) == (1, 1)


def test_a_stage_drains_as_long_as_its_micro_batches_recently_took(server):
    """The trip of a micro-batch (admission to its gradients in ``.grad``) is measured,
    and a step waits for an open one as the longest recent trip says it takes."""
    assert server.drain_wait_s() == 0.0  # nothing open
    _serve(server, 1, gone=lambda: False)
    (key,) = server._open
    assert server.drain_wait_s() == averaging.DRAIN_S  # no trip measured yet
    time.sleep(0.2)
    with server.lock:
        server._accumulated(key, _batch()[0].shape[0])  # as the executor does on backward
    (trip,) = server._trips
    assert 0.2 <= trip < 1.0 and server.open_samples() == 0
    server._trips.append(4.0)  # a slow trip, as on a home link
    _serve(server, 2, gone=lambda: False)
    wait = server.drain_wait_s()
    assert averaging.DRAIN_MARGIN * 4.0 - 0.5 < wait <= averaging.DRAIN_MARGIN * 4.0


def test_a_micro_batch_whose_backward_never_came_stops_counting(server):
    """A forward admitted here whose backward went to another peer of the stage (or never
    came) counts toward the step's batch for ``OPEN_S`` at most, however the count is read:
    kept, it would fill the batch for good (a DiLoCo stage reads only this count)."""
    _serve(server, 1, gone=lambda: False)
    samples = _batch()[0].shape[0]
    assert server.committed_samples() == samples
    ((key, (n, admitted)),) = server._open.items()
    server._open[key] = (n, admitted - averaging.OPEN_S - 1.0)  # admitted that long ago
    assert server.committed_samples() == 0 and not server._open
