"""The assignment and rebalancing rule (protocol/assignment.py), driven directly: no
network, no clock. Ends with a short run of the simulator (scripts/simulate_assignment.py)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import scipy.sparse as sp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from protocol.assignment import (
    DEFAULT_PARAMS,
    Claim,
    Move,
    Params,
    SwarmView,
    alarm,
    bottleneck,
    check_delay,
    choose_stage,
    decide_move,
    least_served_stage,
    max_min_lp,
    resume_stage,
    second_stage,
    smooth_bottleneck,
    stage_prices,
    stage_throughput,
    stage_values,
    view_from_peers,
)
from protocol.identity import peer_id_of
from protocol.records import PROTOCOL_VERSION, PeerInfo, PeerState
from protocol.routing import candidates_by_stage, second_stage_shares


def _view(totals, counts=None, serving=None, prices=None) -> SwarmView:
    counts = tuple(counts if counts is not None else [10] * len(totals))
    serving = tuple(serving if serving is not None else counts)
    return SwarmView(tuple(float(t) for t in totals), counts, serving, prices)


def _peer(seed: int, stage: int | None, throughput, state=PeerState.SERVING) -> PeerInfo:
    key = Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)
    return PeerInfo(
        peer_id=peer_id_of(key.public_key()),
        run="assign-test",
        version=PROTOCOL_VERSION,
        device="cpu",
        throughput=tuple(throughput),
        throughput_source="measured",
        bandwidth_up_mbps=10.0,
        bandwidth_down_mbps=10.0,
        bandwidth_source="measured",
        stage=stage,
        state=state,
        load=0,
        timestamp=0.0,
    )


# Joining.


def test_a_joiner_picks_the_bottleneck_stage():
    for seed in range(20):
        assert choose_stage(_view([100, 60, 100]), (1.0, 1.0, 1.0), seed) == 1
        assert choose_stage(_view([40, 100, 100, 100]), (1.0, 1.0, 1.0, 1.0), seed) == 0


def test_a_joiner_weighs_its_own_speed_for_each_stage():
    # Stages level; the joiner is three times faster on stage 2, so it adds most there.
    assert choose_stage(_view([100, 100, 100]), (1.0, 1.0, 3.0), "p") == 2
    # 1.5x faster there is not enough to pass over a real gap on stage 1 ...
    assert choose_stage(_view([100, 70, 100]), (1.0, 1.0, 1.5), "p") == 1
    # ... 3x is: joiners that lose less by it will fill the gap.
    assert choose_stage(_view([100, 70, 100]), (1.0, 1.0, 3.0), "p") == 2


def test_a_joiner_fills_a_small_gap_only_from_near_its_best_stage():
    # Stage 1 is 2% short. Within fit_band (5%) of its best, a joiner takes it; a joiner
    # 20% slower there goes where it is fast (a peer placed there would later be
    # misplaced at the prices). A 30% gap pulls both.
    small, large = _view([100, 98, 100, 100]), _view([100, 70, 100, 100])
    assert choose_stage(small, (1.0, 0.97, 1.0, 1.0), "j") == 1
    assert all(choose_stage(small, (1.0, 0.8, 1.0, 1.0), k) != 1 for k in range(50))
    assert choose_stage(large, (1.0, 0.97, 1.0, 1.0), "j") == 1
    assert choose_stage(large, (1.0, 0.8, 1.0, 1.0), "j") == 1


def test_a_joiner_follows_the_prices():
    # Level totals, equal speeds: the stage the optimum prices highest is the one to take.
    view = _view([100, 100, 100], prices=(0.2, 0.5, 0.3))
    assert choose_stage(view, (1.0, 1.0, 1.0), "p") == 1


def test_announced_intents_are_counted():
    claims = [
        Claim("a", 0, 10.0),
        Claim("b", 1, 5.0),
        Claim("c", 2, 10.0),
    ]
    without = SwarmView.from_claims(3, claims)
    assert choose_stage(without, (1.0, 1.0, 1.0), "joiner") == 1
    # Someone announced it takes stage 1: it is no longer the gap.
    with_intent = SwarmView.from_claims(3, [*claims, Claim("d", 1, 6.0, serving=False)])
    assert with_intent.totals == (10.0, 11.0, 10.0)
    assert with_intent.serving == (1, 1, 1) and with_intent.counts == (1, 2, 1)
    assert choose_stage(with_intent, (1.0, 1.0, 1.0), "joiner") != 1


def test_a_wave_of_simultaneous_joiners_into_an_empty_swarm_covers_every_stage():
    # 30 peers join at once: none has seen another's intent.
    empty = SwarmView.empty(3)
    picks = Counter(choose_stage(empty, (1.0, 1.0, 1.0), f"peer-{k}") for k in range(30))
    assert set(picks) == {0, 1, 2}
    assert min(picks.values()) >= 5, picks


def test_a_wave_of_joiners_that_see_each_other_spreads_evenly():
    # Each sees the intents announced before it: the stages fill one after another.
    claims: list[Claim] = []
    for k in range(30):
        view = SwarmView.from_claims(3, claims)
        stage = choose_stage(view, (1.0, 1.0, 1.0), f"peer-{k}")
        claims.append(Claim(f"peer-{k}", stage, 1.0, serving=False))
    assert SwarmView.from_claims(3, claims).counts == (10, 10, 10)


def test_a_joiner_that_piled_onto_a_stage_reconsiders_before_loading():
    # Twelve joiners took stage 0 at once; once the intents have arrived, some leave it.
    view = SwarmView((12.0, 0.0, 0.0), (12, 0, 0), (0, 0, 0))
    moves = [decide_move(view, 0, (1.0, 1.0, 1.0), f"j{k}", serving=False) for k in range(12)]
    targets = Counter(m.to_stage for m in moves if m is not None)
    assert targets.keys() == {1, 2}
    assert all(m.reason == "empty" for m in moves if m is not None)


def test_near_ties_are_broken_by_the_seed():
    view = _view([100, 100.1, 100])  # within the tolerance of each other for this joiner
    picks = {choose_stage(view, (1.0, 1.0, 1.0), f"s{k}") for k in range(40)}
    assert picks == {0, 1, 2}


# Rebalancing.


@settings(max_examples=300, deadline=None)
@given(
    totals=st.lists(st.floats(0.0, 1e4), min_size=2, max_size=6),
    own=st.lists(st.floats(0.0, 1e3), min_size=6, max_size=6),
    stage=st.integers(0, 5),
    seed=st.integers(0, 2**32),
    serving=st.booleans(),
)
def test_rebalancing_never_empties_a_stage(totals, own, stage, seed, serving):
    n = len(totals)
    stage %= n
    own = own[:n]
    totals[stage] += own[stage]  # the view counts the deciding peer
    counts = [3] * n
    counts[stage] = 1  # it alone holds its stage...
    on_duty = [3] * n
    on_duty[stage] = 1
    view = SwarmView(tuple(totals), tuple(counts), tuple(on_duty))
    assert decide_move(view, stage, own, seed, serving=serving) is None
    # ... and with a second holder that is not serving yet, a serving peer still stays.
    counts[stage] = 2
    view = SwarmView(tuple(totals), tuple(counts), tuple(on_duty))
    assert decide_move(view, stage, own, seed, serving=True) is None


def test_a_stage_with_nobody_is_refilled():
    view = _view([50.0, 50.0, 0.0], counts=[5, 5, 0])
    moves = [decide_move(view, 0, (10.0, 10.0, 10.0), k) for k in range(200)]
    made = [m for m in moves if m is not None]
    assert made and all(m.to_stage == 2 and m.reason == "empty" for m in made)
    assert all(m.gain == math.inf for m in made)


def test_hysteresis_no_move_for_a_gain_below_the_threshold():
    params = Params(hysteresis=0.05, price_hysteresis=0.05, min_gain=0.0)
    # The other stage would gain 3% more from this peer: inside the band, nobody moves.
    view = _view([101.0, 100.0], counts=[50, 50])
    for seed in range(200):
        assert decide_move(view, 0, (1.0, 1.03), seed, params) is None
    # 50% more, at the prices alone: a misplaced peer, moved for sure.
    for seed in range(20):
        move = decide_move(view, 0, (1.0, 1.5), seed, params)
        assert move == Move(0, 1, move.gain, 1.0, "price")
        assert move.gain > 0.05
    # No move toward a fuller stage, however much faster the peer would be there.
    lopsided = _view([100.0, 140.0], counts=[50, 50])
    assert all(decide_move(lopsided, 0, (1.0, 1.2), s, params) is None for s in range(50))


def test_a_move_must_be_worth_a_state_download():
    # Four stages of 1,000 peers, stage 1 short by 5%: enough for every peer of another
    # stage to pass the hysteresis, but a move by a peer of about the mean speed raises
    # the swarm's bottleneck by less than three joiners would: joiners close such gaps.
    view = _view([1000.0, 950.0, 1000.0, 1000.0], counts=[1000] * 4)
    for own in (1.0, 2.0):
        mine = view.add(Claim("me", 0, own))
        assert all(decide_move(mine, 0, (own,) * 4, k) is None for k in range(200))
    big = view.add(Claim("me", 0, 20.0))
    moves = [decide_move(big, 0, (20.0,) * 4, k) for k in range(200)]
    assert any(m is not None for m in moves)
    assert all(m.to_stage == 1 and m.reason == "imbalance" for m in moves if m is not None)


def test_where_nobody_joins_a_gap_is_closed_by_moves():
    # The gap of the test above, which joiners close where they keep arriving (at 0.1 per
    # peer-hour, the reference, or more): where nobody joins it would stay, so peers of
    # about the mean speed move into it (rationed), and the fewer the arrivals the sooner.
    view = _view([1000.0, 950.0, 1000.0, 1000.0], counts=[1000] * 4).add(Claim("me", 0, 2.0))
    own = (2.0,) * 4

    def moves(arrivals, view=view):
        made = [decide_move(view, 0, own, k, arrivals=arrivals) for k in range(400)]
        assert all(m.to_stage == 1 and m.reason == "imbalance" for m in made if m is not None)
        return sum(m is not None for m in made)

    assert moves(None) == moves(0.1) == moves(1.0) == 0
    assert moves(0.0) > 0 and moves(0.01) > 0
    # A gap inside the hysteresis (stage 1 worth about 15% more, not the 30% a move needs)
    # is left to joiners too, while they come.
    small = _view([1000.0, 985.0, 1000.0, 1000.0], counts=[1000] * 4).add(Claim("me", 0, 2.0))
    assert moves(None, small) == moves(0.1, small) == 0
    assert moves(0.0, small) > 0
    with pytest.raises(ValueError, match="arrivals must be a finite number >= 0"):
        decide_move(view, 0, own, 0, arrivals=-1.0)


def test_a_small_swarm_does_not_wait_for_joiners():
    # Six equal peers at 3-1-2: one move to 2-2-2 doubles the bottleneck. Three mean
    # joiners would add as much, but a swarm this small may not see any for hours.
    view = _view([3.0, 1.0, 2.0], counts=[3, 1, 2])
    moves = [decide_move(view, 0, (1.0, 1.0, 1.0), k) for k in range(50)]
    assert any(m is not None for m in moves)
    assert all(m.to_stage == 1 for m in moves if m is not None)
    assert all(decide_move(view, 2, (1.0, 1.0, 1.0), k) is None for k in range(50))


def test_larger_peers_fill_a_gap_first():
    # The chance of a move scales with the mover's speed (size_bias 1): the same inflow
    # in fewer moves.
    view = _view([1000.0, 900.0, 1000.0, 1000.0], counts=[1000] * 4)
    params = Params(urgency=0.5)

    def probability(own: float, params: Params) -> float:
        mine = view.add(Claim("me", 0, own))
        move = next(m for k in range(5000) if (m := decide_move(mine, 0, (own,) * 4, k, params)))
        assert move.reason == "imbalance"
        return move.probability

    p10, p20, p40 = (probability(own, params) for own in (10.0, 20.0, 40.0))
    assert 1.8 < p20 / p10 < 2.2 and 1.8 < p40 / p20 < 2.2
    # 10x the mean peer: ten times the chance it would have with no size bias.
    flat = probability(10.0, Params(urgency=0.5, size_bias=0.0))
    assert flat == pytest.approx(p10 / 10, rel=0.01)


def test_movers_are_rationed_to_what_the_gap_needs():
    # 100 identical peers on each of stages 0 and 2, 50 on stage 1: a gap of 50.
    params = Params(urgency=1.0)
    view = _view([100.0, 50.0, 100.0], counts=[100, 50, 100])
    moves = [decide_move(view, 0, (1.0, 1.0, 1.0), f"a{k}", params) for k in range(2000)]
    made = [m for m in moves if m is not None]
    assert all(m.to_stage == 1 and m.reason == "imbalance" for m in made)
    p = made[0].probability
    assert all(m.probability == p for m in made)
    assert abs(len(made) / len(moves) - p) < 0.05  # the draw follows the probability
    # Every peer of stages 0 and 2 may reach the same conclusion: 200 candidates, each
    # worth 1. Expected inflow in one round of checks: close to the gap, not 200.
    expected_inflow = 200 * p * 1.0
    assert 25 <= expected_inflow <= 60, expected_inflow


def test_peers_of_unequal_speeds_bring_the_inflow_that_equal_ones_would():
    # Stage 0 is 40 short. Stages 1 and 2 hold 100 each: 20 peers of 5, or 10 of 1 and
    # 10 of 9. Larger peers are likelier to move, and the sum of chance x speed (the
    # expected inflow of one round of checks) must not grow with the spread of speeds:
    # without the correction it would be 1.64x that of equal peers here.
    params = Params(urgency=0.5, min_gain=0.0)

    def inflow(speeds: list[float]) -> float:
        claims = [Claim(f"z{k}", 0, 1.0) for k in range(60)]
        claims += [Claim(f"s{s}-{k}", s, v) for s in (1, 2) for k, v in enumerate(speeds)]
        view = SwarmView.from_claims(3, claims)
        total = 0.0
        for v in speeds:
            move = next(m for k in range(20000) if (m := decide_move(view, 1, (v,) * 3, k, params)))
            assert move.to_stage == 0 and move.reason == "imbalance"
            total += 2 * move.probability * v  # the same on stage 2
        return total

    equal, unequal = inflow([5.0] * 20), inflow([1.0] * 10 + [9.0] * 10)
    assert 0.85 < unequal / equal < 1.15, (unequal, equal)


def test_an_alarm_is_raised_by_a_stage_that_lost_a_fifth_or_was_emptied():
    before = _view([100.0, 100.0, 100.0], counts=[10, 10, 10])
    assert alarm(before, _view([100.0, 81.0, 300.0], counts=[10, 9, 30])) is None  # churn
    assert alarm(before, _view([100.0, 79.0, 100.0], counts=[10, 8, 10])) == 1
    assert alarm(before, _view([100.0, 100.0, 0.0], counts=[10, 10, 0])) == 2
    # A stage nobody holds keeps alarming: a check that could not refill it is retried.
    assert alarm(_view([5.0, 5.0, 0.0], counts=[1, 1, 0]), _view([5.0, 5.0, 0.0], [1, 1, 0])) == 2
    assert alarm(before, _view([100.0, 50.0, 100.0]), Params(alarm_drop=0.6)) is None
    with pytest.raises(ValueError, match="views of 3 and 2 stages"):
        alarm(before, _view([1.0, 1.0]))


def test_a_peer_that_is_not_in_the_view_is_an_error():
    with pytest.raises(ValueError, match="must count the deciding peer on stage 1"):
        decide_move(_view([10, 0, 10], counts=[1, 0, 1]), 1, (1.0, 1.0, 1.0), 0)


def test_decisions_are_deterministic_given_the_seed():
    view = _view([100.0, 75.0, 100.0], counts=[100, 75, 100])
    own = (1.0, 1.0, 1.0)
    params = Params(min_gain=0.0)  # peers of the mean speed: let them move
    first = [decide_move(view, 0, own, f"x{k}", params) for k in range(100)]
    again = [decide_move(view, 0, own, f"x{k}", params) for k in range(100)]
    assert first == again
    assert any(m is None for m in first) and any(m is not None for m in first)
    tie = _view([100.0, 100.0, 100.0])
    assert [choose_stage(tie, own, k) for k in range(50)] == [
        choose_stage(tie, own, k) for k in range(50)
    ]
    assert len({choose_stage(tie, own, k) for k in range(50)}) == 3
    assert check_delay("p:1") == check_delay("p:1") != check_delay("p:2")


def test_check_delay_is_spread_around_the_mean():
    params = Params(mean_period_s=60.0, period_jitter=0.5)
    delays = [check_delay(f"peer:{k}", params) for k in range(2000)]
    assert min(delays) >= 30.0 and max(delays) <= 90.0
    assert abs(sum(delays) / len(delays) - 60.0) < 1.5


# Prices and the smooth bottleneck.


def _lp_optimum(t: np.ndarray) -> float:
    """max B s.t. every stage's total >= B, each peer split over stages: a direct LP."""
    n, s = t.shape
    c = np.zeros(n * s + 1)
    c[-1] = -1.0
    cols = np.arange(n * s)
    a_eq = sp.csr_matrix((np.ones(n * s), (np.repeat(np.arange(n), s), cols)), (n, n * s + 1))
    rows = np.r_[np.tile(np.arange(s), n), np.arange(s)]
    a_ub = sp.csr_matrix(
        (np.r_[-t.ravel(), np.ones(s)], (rows, np.r_[cols, np.full(s, n * s)])), (s, n * s + 1)
    )
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(s), A_eq=a_eq, b_eq=np.ones(n), method="highs")
    assert res.status == 0
    return -res.fun


def test_prices_are_the_dual_of_the_max_min_assignment():
    rng = np.random.default_rng(5)
    t = np.exp(rng.standard_normal((300, 1)) + 0.4 * rng.standard_normal((300, 4)))
    prices = np.array(stage_prices(t))
    assert abs(prices.sum() - 1.0) < 1e-9 and (prices > 0).all()
    dual_value = (t * prices).max(1).sum()  # any prices bound the optimum from above
    optimum = _lp_optimum(t)
    assert optimum <= dual_value * (1 + 1e-9)
    assert dual_value <= optimum * (1 + 1e-3)


def test_prices_of_a_swarm_that_is_twice_as_fast_on_one_stage():
    # Stage 1 needs half the peers stage 0 needs: stage 0's capacity is worth twice as much.
    t = np.array([[1.0, 2.0]] * 50)
    assert stage_prices(t) == pytest.approx((2 / 3, 1 / 3), rel=1e-3)
    # Speeds that do not depend on the stage: equal prices.
    assert stage_prices(np.array([[3.0] * 4, [1.0] * 4])) == pytest.approx((0.25,) * 4)
    assert stage_prices(np.zeros((0, 3))) == pytest.approx((1 / 3,) * 3)


def test_smooth_bottleneck_lies_between_the_least_and_the_largest_total():
    assert smooth_bottleneck([5.0, 5.0, 5.0], 8.0) == pytest.approx(5.0)
    m = smooth_bottleneck([4.0, 5.0, 9.0], 8.0)
    assert bottleneck([4.0, 5.0, 9.0]) == 4.0 < m < 5.0
    assert smooth_bottleneck([4.0, 5.0, 9.0], 64.0) < m  # sharper: closer to the minimum
    assert smooth_bottleneck([0.0, 0.0], 8.0) == 0.0
    values = stage_values(_view([4.0, 5.0, 9.0]), (1.0, 1.0, 1.0), DEFAULT_PARAMS)
    assert values[0] > values[1] > values[2] > 0


# Views.


def test_view_from_peer_records_and_intents():
    a = _peer(1, 0, (10.0, 20.0))
    b = _peer(2, 1, (10.0, 20.0), PeerState.LOADING)
    c = _peer(3, 1, (10.0, 20.0), PeerState.LEAVING)  # leaving: not counted
    d = _peer(4, None, (10.0, 20.0), PeerState.JOINING)  # no stage yet
    view = view_from_peers([a, b, c, d], 2, priced=False)
    assert view.totals == (10.0, 20.0) and view.counts == (1, 1) and view.serving == (1, 0)
    # d announced an intent on stage 0; a announced it moves to stage 1.
    intents = [Claim(d.peer_id, 0, 10.0, serving=False), Claim(a.peer_id, 1, 20.0, False)]
    view = view_from_peers([a, b, c, d], 2, intents, priced=False)
    assert view.totals == (10.0, 40.0) and view.counts == (1, 2) and view.serving == (0, 0)
    view = view_from_peers([a, b, c, d], 2, exclude={a.peer_id}, own=(10.0, 20.0))
    assert view.totals == (0.0, 20.0)
    assert view.prices == pytest.approx((2 / 3, 1 / 3), rel=1e-3)


def test_a_second_stage_is_held_with_no_throughput_and_routed_to_once_served():
    one = _peer(1, 0, (10.0, 20.0))
    two = _peer(2, 1, (30.0, 40.0)).model_copy(update={"second_stage": 0})
    view = view_from_peers([one, two], 2, priced=False)
    assert view.totals == (10.0, 40.0) and view.counts == (2, 1) and view.serving == (1, 1)
    assert view.two_stage == 40.0
    assert [len(c) for c in candidates_by_stage([one, two], 2)] == [1, 1]
    two = two.model_copy(update={"second_serving": True})
    view = view_from_peers([one, two], 2, priced=False)
    assert view.counts == (2, 1) and view.serving == (2, 1)
    assert view_from_peers([one, two], 2, exclude={two.peer_id}, priced=False).two_stage == 0.0
    # Routing offers it on both, at the speed its share of time there gives: levelled,
    # 10 + 30 f = 40 (1 - f), so f = 3/7 of its time on stage 0.
    by_stage = candidates_by_stage([one, two], 2)
    on_0 = {c.peer_id: c.throughput for c in by_stage[0]}
    assert on_0 == {one.peer_id: 10.0, two.peer_id: pytest.approx(30.0 * 3 / 7)}
    assert [(c.peer_id, c.throughput) for c in by_stage[1]] == [
        (two.peer_id, pytest.approx(40.0 * 4 / 7))
    ]


def test_a_record_for_another_layout_is_dropped_not_trusted():
    odd = _peer(5, 2, (1.0, 1.0, 1.0))
    assert view_from_peers([odd], 2, priced=False) == SwarmView.empty(2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SwarmView((1.0, 2.0), (1,), (1,)), "one entry per stage: got 2, 1 and 1"),
        (lambda: SwarmView((1.0, -2.0), (1, 1), (1, 1)), "total of stage 1 .* got -2.0"),
        (lambda: SwarmView((1.0, math.nan), (1, 1), (1, 1)), "total of stage 1"),
        (lambda: SwarmView((1.0, 2.0), (1, 1), (1, 2)), "got 2 serving of 1"),
        (lambda: SwarmView((), (), ()), "1 to 256 stages, got 0"),
        (lambda: SwarmView((1.0,), (1,), (1,), (0.5, 0.5)), "2 prices for 1 stages"),
        (lambda: SwarmView((1.0,), (1,), (1,), None, (1.0, 1.0)), "2 squared sums for 1"),
        (lambda: SwarmView((1.0,), (1,), (1,), None, (-1.0,)), "squared sum of stage 0"),
        (lambda: Claim("p", 0, -1.0), "throughput of peer p .* got -1.0"),
        (
            lambda: SwarmView.from_claims(2, [Claim("p", 0, 1.0), Claim("p", 1, 1.0)]),
            "peer p has more than one claim",
        ),
        (lambda: SwarmView.from_claims(2, [Claim("p", 3, 1.0)]), "stage 3, out of range for 2"),
        (lambda: choose_stage(SwarmView.empty(3), (1.0, 1.0), 0), "2 entries for 3 stages"),
        (lambda: choose_stage(SwarmView.empty(2), (1.0, math.inf), 0), "stage 1 .* got inf"),
        (lambda: choose_stage(SwarmView.empty(2), (1.0, 1.0), 1.5), "seed must be str"),
        (lambda: Params(hysteresis=-0.1), "hysteresis must be in"),
        (lambda: Params(sharpness=0.0), "sharpness must be in"),
        (lambda: Params(min_gain=-1.0), "min_gain must be in"),
        (lambda: Params(fit_band=-1.0), "fit_band must be in"),
        (lambda: Params(size_bias=9.0), "size_bias must be in"),
        (lambda: Params(alarm_drop=1.5), "alarm_drop must be in"),
        (lambda: Params(two_stage_reserve=-1.0), "two_stage_reserve must be in"),
        (lambda: SwarmView((1.0,), (1,), (1,), None, None, math.nan), "two-stage throughput"),
        (lambda: stage_prices(np.ones(3)), "peers x stages table, got shape"),
        (lambda: stage_prices(-np.ones((2, 2))), "finite and >= 0"),
    ],
)
def test_bad_arguments_are_value_errors_that_carry_the_numbers(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_first_rule_still_serves_its_callers():
    peers = [_peer(1, 0, (5.0, 1.0)), _peer(2, 1, (1.0, 2.0)), _peer(3, 1, (1.0, 2.0))]
    assert stage_throughput(peers, 2) == [5.0, 4.0]
    assert least_served_stage(peers, 2, seed="x") == 1
    with pytest.raises(ValueError, match="n_stages must be >= 1, got 0"):
        least_served_stage(peers, 0, seed="x")


# Two-stage peers.


def test_a_fast_joiner_takes_the_stage_it_is_next_best_at_while_the_reserve_is_short():
    # 4 stages of 10 peers, 100 each: the mean claim is 10, the mean stage total 100.
    view = _view([100.0] * 4, prices=(0.1, 0.2, 0.3, 0.4))
    on = Params(two_stage_reserve=0.5, two_stage_min=2.0)
    fast = (20.0, 20.0, 30.0, 10.0)  # priced: 2, 4, 9, 4; it serves stage 2
    assert second_stage(view, 2, fast, Params(two_stage_reserve=0.0)) is None  # none wanted
    assert second_stage(view, 2, fast) == 1  # by default, one mean stage total is wanted
    assert second_stage(view, 2, fast, on) == 1  # ties go to the lower stage
    assert second_stage(view, 2, (20.0, 20.0, 30.0, 12.0), on) == 3  # priced 4.8 beats 4
    assert second_stage(view, 0, (19.0,) * 4, on) is None  # slower than twice the mean
    full = SwarmView(view.totals, view.counts, view.serving, view.prices, None, 50.0)
    assert second_stage(full, 2, fast, on) is None  # the reserve holds half a stage already
    short = SwarmView(view.totals, view.counts, view.serving, view.prices, None, 49.0)
    assert second_stage(short, 2, fast, on) == 1
    with pytest.raises(ValueError, match="stage must be"):
        second_stage(view, 4, fast, on)


def test_a_joiner_on_a_crowded_stage_stays_free_to_move_and_takes_no_second_stage():
    # 6 equal peers at 3-2-1 (two of stage 0 still loading): a peer holding two stages
    # never moves, so one of stage 0's three must not lock itself in; the others may.
    view = _view([3.0, 2.0, 1.0], counts=[3, 2, 1], serving=[1, 2, 1])
    equal = (1.0, 1.0, 1.0)
    assert decide_move(view, 0, equal, "x") is None  # the only one serving: stays
    assert second_stage(view, 0, equal) is None  # but once they serve, it may move
    assert second_stage(view, 1, equal) == 0  # leaving 1 for 2 would gain nothing
    assert second_stage(view, 2, equal) == 0
    balanced = _view([2.0, 2.0, 2.0], counts=[2, 2, 2])
    assert [second_stage(balanced, s, equal) for s in range(3)] == [1, 0, 0]


# The simulator.


@pytest.fixture(scope="module")
def sim():
    from scripts import simulate_assignment

    return simulate_assignment


# A small swarm that still shows every effect the tests below assert: the joining burst, the
# wave that arrives and leaves, the stage loss, and the gaps two-stage peers close.
SMALL_SWARM = dict(peers=120, stages=3, duration=1800.0, seed=1, settle=300.0)


@pytest.fixture(scope="module")
def small_swarm(sim):
    """The small swarm simulated under every rule (ours with two-stage peers, the default):
    its config and each rule's result, shared by the tests that read them."""
    cfg = sim.Config(**SMALL_SWARM)
    return cfg, {rule: sim.simulate(cfg, rule) for rule in sim.RULES}


def test_the_simulators_bound_is_the_linear_programmes_optimum(sim):
    rng = np.random.default_rng(3)
    t = np.exp(rng.standard_normal((200, 1)) + 0.5 * rng.standard_normal((200, 3)))
    bound, lam = max_min_lp(t, tol=1e-6)
    assert bound == pytest.approx(_lp_optimum(t), rel=1e-5)
    integer = sim.integer_assignment(t, lam)
    assert 0.98 * bound <= integer <= bound * (1 + 1e-9)


def test_the_simulators_integer_assignment_deals_out_peers_alike_on_every_stage(sim):
    # Every peer as fast on every stage (the last 1.5x slower): the prices tie every
    # stage for every peer, and a start that puts each where its price is highest puts
    # them all on one stage; dealt out, they reach the bound.
    t = np.exp(np.random.default_rng(4).standard_normal((400, 1))) * [1, 1, 1, 1 / 1.5]
    bound, lam = max_min_lp(t, tol=1e-6)
    assert 0.99 * bound <= sim.integer_assignment(t, lam) <= bound * (1 + 1e-9)


def test_simulator_smoke(sim, small_swarm):
    cfg, results = small_swarm
    ours, petals = (sim.summary(cfg, results[rule]) for rule in sim.RULES)
    assert ours["steady_mean"] > 0.9, ours
    assert ours["steady_mean"] > petals["steady_mean"], (ours, petals)
    for figures in (ours, petals):
        assert figures["empty_held_s"] == 0.0 and figures["empty_serving_samples"] == 0
        assert figures["tightness"] <= 1.0 + 1e-9
    assert ours["recovery_s"] < 600.0, ours
    # The three factors multiply to the ratio at every sample where they are defined.
    for r in results.values():
        product = [a * b * c for a, b, c in r.factors]
        defined = ~np.isnan(product)
        assert defined.sum() > 0.9 * len(product)
        np.testing.assert_allclose(np.array(product)[defined], np.array(r.ratio)[defined])
    assert 0.9 < ours["balance"] <= 1.0 and ours["placement"] > petals["placement"], ours
    text = sim.report(cfg, results)
    assert "UPPER BOUND" in text and "moves per peer-hour" in text


def test_two_stage_peers_give_their_second_stage_the_time_that_raises_the_least_total():
    fast, slow = (0, 1, 4.0, 4.0), (0, 1, 4.0, 2.0)  # first, second, speed on each
    # Stage totals of the one-stage peers first; the shares of each two-stage peer next.
    assert second_stage_shares([16.0, 14.0, 30.0], []) == []
    # One peer levels stages 0 and 1 at 17: 3/4 of its time on stage 1.
    assert second_stage_shares([16.0, 14.0, 30.0], [fast]) == pytest.approx([0.75])
    # A gap larger than it can fill: all its time goes there.
    assert second_stage_shares([16.0, 0.0, 30.0], [fast]) == pytest.approx([1.0])
    # The half-as-fast peer is lent only after the fast one: here the fast one alone
    # levels stages 0 and 1 at 16 (they start at 20 and 12 with both on stage 0).
    assert second_stage_shares([12.0, 12.0, 30.0], [fast, slow]) == pytest.approx([1.0, 0.0])
    assert second_stage_shares([32.0, 10.0, 50.0], [fast, slow]) == pytest.approx([1.0, 1.0])
    # The least total is stage 2, which neither serves: both stay on their first stage.
    assert second_stage_shares([12.0, 15.0, 10.0], [fast, slow]) == pytest.approx([0.0, 0.0])


def test_simulator_two_stage_peers_close_the_gaps_that_joiners_leave(sim, small_swarm):
    one = sim.Config(**SMALL_SWARM, two_stage_reserve=0.0)
    plain = sim.summary(one, sim.simulate(one, "ours"))
    cfg, results = small_swarm  # two-stage peers: the default
    r = results["ours"]
    two = sim.summary(cfg, r)
    assert r.two_stage > 0
    assert two["balance"] > plain["balance"] and two["steady_mean"] > plain["steady_mean"]
    assert two["empty_held_s"] == 0.0 and two["empty_serving_samples"] == 0
    product = np.array([a * b * c for a, b, c in r.factors])
    defined = ~np.isnan(product)
    np.testing.assert_allclose(product[defined], np.array(r.ratio)[defined])


def test_peers_that_lose_least_by_moving_fill_a_gap_first():
    view = _view([100.0, 60.0, 100.0], counts=[100, 60, 100])
    params = Params(urgency=0.5, min_gain=0.0)  # peers of the mean speed: let them move
    suited = decide_move(view, 0, (1.0, 1.0, 1.0), "always", Params(urgency=1e6, min_gain=0.0))
    assert suited is not None and suited.reason == "imbalance"

    def chance(own) -> float:
        made = [decide_move(view, 0, own, f"s{k}", params) for k in range(3000)]
        return sum(m is not None for m in made) / len(made)

    # All would rather be on stage 1 now; those slower there are sent less often.
    assert chance((1.0, 1.0, 1.0)) > chance((1.0, 0.8, 1.0)) > chance((1.0, 0.7, 1.0)) > 0
    assert chance((1.0, 1.0, 1.0)) > 3 * chance((1.0, 0.7, 1.0))


def test_a_restarted_peer_resumes_the_kept_stage_fewest_others_hold():
    nobody = SwarmView.empty(3)
    assert resume_stage(nobody, [2, 0]) == 2  # the most recent on a tie
    held = SwarmView((10.0, 0.0, 10.0), (1, 0, 1), (1, 0, 1))
    assert resume_stage(held, [2, 1, 0]) == 1  # nobody holds stage 1: maybe the only copy
    assert resume_stage(held, [0]) == 0  # a stage others hold too: still its own
    with pytest.raises(ValueError, match="at least one kept stage"):
        resume_stage(held, [])
    with pytest.raises(ValueError, match=r"kept stage must be an integer in \[0, 3\), got 3"):
        resume_stage(held, [3])
