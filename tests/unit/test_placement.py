"""The placement state machine (protocol/placement.py) driven directly, and one event
trace through both of its drivers: the node's runner (node/placement/runner.py, with a
fake clock and view source) and the simulator's loop (scripts/simulate_assignment.py,
with its views replaced). Same environment, same actions at the same times."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest

from node import events
from node.placement.runner import PlacementRunner
from protocol.assignment import Params, SwarmView
from protocol.placement import (
    Alarmed,
    Announce,
    AwaitSecond,
    Chose,
    Declined,
    HoldSecond,
    Join,
    Load,
    Loaded,
    Look,
    Moved,
    Moving,
    PeerPlacement,
    Phase,
    PlacementError,
    Stay,
    Timer,
    Wake,
    settle_period,
)
from protocol.records import PeerState

NO_SECOND = Params(two_stage_reserve=0.0, urgency=1e6)


def _view(totals, counts, serving=None) -> SwarmView:
    serving = counts if serving is None else serving
    return SwarmView(tuple(map(float, totals)), tuple(counts), tuple(serving))


def _wake(actions) -> float:
    (wake,) = [a for a in actions if isinstance(a, Wake)]
    return wake.at


def _joined(params: Params = NO_SECOND, view=None) -> tuple[PeerPlacement, float]:
    """A machine that joined stage 1 of 2 and serves it; the time of its first check."""
    view = view or _view([50, 20], [5, 2])
    m = PeerPlacement("peer", (10.0, 10.0), params, settle_s=5.0)
    t = _wake(m.handle(Join(0.0)))
    t = _wake(m.handle(Timer(t, view)))
    (load,) = [a for a in m.handle(Timer(t, view)) if isinstance(a, Load)]
    assert load.stage == 1
    return m, _wake(m.handle(Loaded(t + 30.0, view)))


def test_a_joiner_listens_chooses_announces_reconsiders_then_loads():
    m = PeerPlacement("peer", (10.0, 10.0), NO_SECOND, settle_s=5.0)
    listen = _wake(m.handle(Join(100.0)))
    assert 102.5 <= listen <= 107.5  # 0.5-1.5 settle periods
    view = _view([50, 20], [5, 2])
    chose = m.handle(Timer(listen, view))
    assert chose[:2] == [Chose(1, view.totals), Announce("join", 1)]
    assert m.phase is Phase.CHOSEN and listen + 2.5 <= _wake(chose) <= listen + 7.5
    # Others' intents arrived meanwhile: 60 more on stage 1. It changes its mind for free.
    crowded = _view([50, 80], [5, 8], [5, 2])
    actions = m.handle(Timer(_wake(chose), crowded))
    assert actions == [
        Chose(0, (50.0, 90.0), revised=True),
        Announce("join", 0),
        Load(0),
    ]
    with pytest.raises(PlacementError, match="Join in phase loading"):
        m.handle(Join(200.0))


def test_a_peer_with_a_checkpoint_takes_its_stage_at_once_and_then_checks_as_usual():
    m = PeerPlacement("peer", (10.0, 10.0), NO_SECOND, settle_s=5.0)
    assert m.handle(Join(0.0, kept=(0,))) == [
        Chose(0, (0.0, 0.0), resumed=True),
        Announce("join", 0),
        Load(0),
    ]
    view = _view([50, 20], [5, 2])
    loaded = m.handle(Loaded(30.0, view))
    assert loaded[0] == Announce("serving", 0) and m.phase is Phase.SERVING
    assert _wake(loaded) > 30.0  # a periodic check
    with pytest.raises(PlacementError, match="kept stage must be an integer in"):
        PeerPlacement("p", (10.0, 10.0), NO_SECOND, settle_s=5.0).handle(Join(0.0, kept=(2,)))


def test_a_restarted_peer_takes_the_kept_stage_that_nobody_holds():
    """Its checkpoint of a stage nobody holds may be the only copy of that training."""
    m = PeerPlacement("peer", (10.0, 10.0), NO_SECOND, settle_s=5.0)
    others = _view([10, 0], [1, 0])  # a peer back before it resumed stage 0
    actions = m.handle(Join(0.0, kept=(0, 1), view=others))  # stage 0 written last
    assert actions[0] == Chose(1, (10.0, 0.0), resumed=True) and actions[-1] == Load(1)


def _resumed_alone(params: Params) -> tuple[PeerPlacement, list]:
    """A peer restarted alone with a checkpoint of stage 0 only; its actions once loaded."""
    m = PeerPlacement("peer", (10.0, 10.0), params, settle_s=5.0)
    m.handle(Join(0.0, kept=(0,)))
    return m, m.handle(Loaded(10.0, SwarmView.empty(2)))


def test_a_restarted_peer_waits_for_the_state_of_a_second_stage_that_nobody_serves():
    """Alone, the rule asks it to take stage 1 as well; it kept no state of it and
    nobody serves it, so it waits for the peer that did, and never moves meanwhile."""
    m, actions = _resumed_alone(Params(resume_hold_s=100.0))
    assert actions[0] == Announce("serving", 0)
    assert actions[1] == AwaitSecond(1, 100.0) and _wake(actions) == 15.0
    assert m.phase is Phase.AWAITING_SECOND
    # Still nobody on stage 1: it waits on, and says so only once.
    assert m.handle(Timer(15.0, SwarmView.empty(2))) == [Wake(20.0)]
    # A peer that kept stage 1 is back and serves it: that state is loaded from it.
    assert m.handle(Timer(20.0, _view([0, 10], [0, 1]))) == [HoldSecond(1, 0.0, (10.0, 10.0))]
    assert m.phase is Phase.TWO_STAGE
    # Or it took stage 0 and stage 1 as its second: then the rule asks for none here.
    m, _ = _resumed_alone(Params(resume_hold_s=100.0))
    two = SwarmView((0.0, 0.0), (1, 1), (1, 1), two_stage=10.0)  # its claims: no throughput
    waited = m.handle(Timer(15.0, two))
    assert m.phase is Phase.SERVING and _wake(waited) > 15.0


def test_a_restarted_peer_takes_a_second_stage_from_scratch_once_its_hold_is_over():
    m, actions = _resumed_alone(Params(resume_hold_s=12.0))
    assert _wake(actions) == 12.0  # the hold's end comes before a settle period
    assert m.handle(Timer(12.0, SwarmView.empty(2))) == [HoldSecond(1, 0.0, (10.0, 0.0))]
    # Without a hold (or from the start, a fresh peer) it takes it at once.
    m, actions = _resumed_alone(Params(resume_hold_s=0.0))
    assert actions[1] == HoldSecond(1, 0.0, (10.0, 0.0))


def test_a_restarted_peer_does_not_move_during_its_hold():
    """Stage 1 is empty and its stage 0 crowded: a fresh peer would move at once."""
    crowded = _view([50, 0], [5, 0])
    for hold, moves in ((100.0, False), (0.0, True)):
        m = PeerPlacement("peer", (10.0, 10.0), replace(NO_SECOND, resume_hold_s=hold),
                          settle_s=5.0)  # fmt: skip
        m.handle(Join(0.0, kept=(0,)))
        check = _wake(m.handle(Loaded(10.0, crowded)))
        assert check < 100.0
        actions = m.handle(Timer(check, crowded))
        assert any(isinstance(a, Moving) for a in actions) is moves, (hold, actions)
        if not moves:  # after the hold it checks as usual
            later = m.handle(Timer(100.0, crowded))
            assert isinstance(later[0], Moving) and later[0].move.to_stage == 1


def test_a_fast_joiner_takes_a_second_stage_and_then_never_checks():
    m = PeerPlacement("peer", (10.0, 10.0), Params(), settle_s=5.0)
    view = _view([50, 20], [5, 2])
    m.handle(Join(0.0))
    m.handle(Timer(5.0, view))
    m.handle(Timer(10.0, view))
    actions = m.handle(Loaded(40.0, view))
    assert actions[0] == Announce("serving", 1)
    assert isinstance(actions[1], HoldSecond) and actions[1].stage == 0
    assert m.phase is Phase.TWO_STAGE
    assert m.handle(Look(50.0, _view([0, 20], [0, 2]))) == []
    # The node could not load it (no memory): it serves one stage and checks.
    assert 70.0 <= _wake(m.handle(Declined(40.0))) <= 130.0 and m.phase is Phase.SERVING


def test_a_move_is_announced_and_carried_out_only_if_the_stage_keeps_a_server():
    m, check = _joined()
    crowded = _view([50, 80], [5, 8])  # stage 1 got crowded: move to 0
    actions = m.handle(Timer(check, crowded))
    assert isinstance(actions[0], Moving) and actions[0].move.to_stage == 0
    assert actions[1] == Announce("move", 1, 0) and _wake(actions) == check + 5.0
    assert m.announcement(1, PeerState.SERVING) == Announce("move", 1, 0)  # until confirmed
    # A settle period later nobody else serves stage 1 any more: it stays.
    emptied = _view([50, 80], [5, 8], [5, 0])
    stay = m.handle(Timer(check + 5.0, emptied))
    assert isinstance(stay[0], Stay) and stay[1] == Announce("serving", 1)
    assert m.phase is Phase.SERVING and m.stage == 1 and _wake(stay) > check + 5.0
    # Next time it does move.
    actions = m.handle(Timer(_wake(stay), crowded))
    moved = m.handle(Timer(_wake(actions), crowded))
    assert moved == [Moved(actions[0].move), Announce("join", 0)]
    assert m.phase is Phase.LOADING and m.stage == 0
    # A peer that moved takes no second stage.
    after = m.handle(Loaded(_wake(actions) + 30.0, _view([50, 80], [5, 8])))
    assert not any(isinstance(a, HoldSecond) for a in after)


def test_a_stage_that_lost_a_fifth_brings_the_check_forward_once():
    m, check = _joined(view=_view([50, 40], [5, 4]))  # with its own: 50 and 50
    assert m.handle(Look(check - 20.0, _view([50, 35], [5, 4]))) == []  # 10% less
    actions = m.handle(Look(check - 20.0, _view([30, 40], [3, 4])))
    assert actions[0] == Alarmed(0, 50.0, 30.0, (30.0, 50.0))
    assert check - 20.0 <= _wake(actions) <= check - 10.0  # within two settle periods
    assert m.handle(Look(check - 19.0, _view([0, 40], [0, 4]))) == []  # one alarm per check
    assert m.handle(Look(check + 1.0, _view([0, 40], [0, 4]))) == []  # past due: no look


def test_announcements_say_where_the_peer_is():
    m = PeerPlacement("peer", (10.0, 10.0), NO_SECOND, settle_s=5.0)
    assert m.announcement(None, PeerState.JOINING) is None
    assert m.announcement(1, PeerState.LOADING) == Announce("join", 1)
    assert m.announcement(1, PeerState.SERVING) == Announce("serving", 1)
    assert m.announcement(1, PeerState.SERVING) == Announce("load", 1)
    assert m.announcement(1, PeerState.LEAVING) == Announce("leaving", 1)
    with pytest.raises(ValueError, match="settle_s"):
        PeerPlacement("peer", (1.0,), NO_SECOND, settle_s=0.0)
    assert settle_period(1.0) == 2.0 and settle_period(5.0) == 5.0


# One trace, two drivers.

LOAD_S, END_S, UPDATE_S = 30.0, 500.0, 5.0
THROUGHPUT = (10.0, 10.0)


def _environment(t: float, i: int = 0) -> SwarmView:
    """The others as every read shows them: stage 1 short, then (from 150 s) crowded,
    without any stage losing throughput (which a node's looks would see as an alarm
    between the simulator's looks)."""
    return _view([50, 20], [5, 2]) if t < 150.0 else _view([50, 80], [5, 8])


class _TraceEnds(Exception):
    pass


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep_until(self, when: float) -> None:
        if when > END_S:
            raise _TraceEnds
        self.t = max(self.t, when)
        await asyncio.sleep(0)


class FakeSource:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    async def read(self) -> SwarmView:
        return _environment(self.clock.now())

    def cached(self) -> SwarmView:
        return _environment(self.clock.now())

    def arrivals(self) -> float | None:
        return None  # the simulator's count is None too before 600 s


def _node_trace(params: Params, tmp_path) -> tuple[list, list, list[dict]]:
    """The node's runner, playing the daemon: join, load, second stage, then move while
    checks say so, each load taking ``LOAD_S``."""
    clock = FakeClock()
    machine = PeerPlacement("0:0", THROUGHPUT, params, settle_s=settle_period(UPDATE_S))
    trace, sent = [], []

    async def send(said: Announce) -> None:
        sent.append(said)

    runner = PlacementRunner(
        machine,
        clock,
        FakeSource(clock),
        send,
        update_period_s=UPDATE_S,
        on_action=lambda t, a: trace.append((t, a)),
    )

    async def daemon() -> None:
        await runner.join(lambda stage: None)
        await clock.sleep_until(clock.now() + LOAD_S)
        assert await runner.loaded(second=True) is None
        while True:
            await runner.next_move()
            if await runner.confirm_move():
                await clock.sleep_until(clock.now() + LOAD_S)

    events.open_log(tmp_path / "events.jsonl")
    try:
        with pytest.raises(_TraceEnds):
            asyncio.run(daemon())
    finally:
        events.close_log()
    return trace, sent, events.read_events(tmp_path / "events.jsonl")


def _sim_trace(params: Params) -> list:
    from scripts import simulate_assignment as sim

    cfg = sim.Config(
        stages=2,
        duration=END_S,
        churn=0.0,
        wave=0.0,
        update_period=UPDATE_S,
        two_stage_reserve=params.two_stage_reserve,
        urgency=params.urgency,
    )
    assert cfg.params() == params
    one = sim.Population(
        arrive=np.array([0.0]),
        depart=np.array([math.inf]),
        killed=np.array([False]),
        thr=np.array([THROUGHPUT]),
        load=np.array([LOAD_S]),
    )
    run = sim.Sim(cfg, one, "ours", views=_environment)
    run.trace = []
    run.run()
    return [(t, a) for t, i, a in run.trace]


def test_one_trace_gives_the_same_actions_from_the_node_and_the_simulator(tmp_path):
    params = Params(two_stage_reserve=0.0, urgency=1e6)
    node, sent, logged = _node_trace(params, tmp_path)
    simulated = _sim_trace(params)
    assert node == simulated
    kinds = [type(a).__name__ for _, a in node]
    # It chose stage 1, loaded it, checked until stage 1 was crowded, moved to 0.
    assert kinds[:4] == ["Wake", "Chose", "Announce", "Wake"] and Moved in map(
        type, [a for _, a in node]
    )
    assert [a for _, a in node if isinstance(a, Moved)][0].move.to_stage == 0
    assert [a for _, a in node if isinstance(a, Announce)] == sent
    assert [
        (e["event"], e.get("stage"), e.get("from"), e.get("to"))
        for e in logged
        if e["event"] != "placement.checked"
    ] == [
        ("placement.chose", 1, None, None),
        ("placement.moved", None, 1, 0),
    ]


def test_the_runner_keeps_a_restarted_node_waiting_for_its_second_stage_state():
    """``PlacementRunner.loaded`` returns only once the wait ends: here when the peer
    that kept stage 1 serves it, a few settle periods in (fake clock, changing view)."""
    clock = FakeClock()

    class Returning(FakeSource):
        async def read(self) -> SwarmView:
            back = self.clock.now() >= 12.0
            return _view([0, 10], [0, 1]) if back else SwarmView.empty(2)

    machine = PeerPlacement("peer", (10.0, 10.0), Params(resume_hold_s=100.0), settle_s=5.0)
    trace: list = []

    async def send(said: Announce) -> None:
        trace.append(said)

    runner = PlacementRunner(machine, clock, Returning(clock), send, update_period_s=5.0)

    async def daemon() -> int | None:
        assert await runner.join(lambda stage: None, kept=[0]) == 0
        return await runner.loaded(second=True)

    assert asyncio.run(daemon()) == 1
    assert clock.now() == 15.0 and machine.phase is Phase.TWO_STAGE
    assert trace == [Announce("join", 0), Announce("serving", 0)]
