"""The pure parts of averaging: ``protocol.averaging`` (``decide``, ``robust_mean``), a
stage's state as it travels (``node.averaging.state``) and the digests that tell equal
copies from diverged ones (``node.averaging.digests``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.averaging.digests import EQUAL_DISTANCE, ParamDigest, compare_copies
from node.averaging.transport import process_settings
from protocol.averaging import (
    DRAIN_MARGIN,
    DRAIN_S,
    OPEN_S,
    Action,
    Held,
    Patience,
    Progress,
    ReturnedShare,
    check_returned,
    decide,
    download_patience_s,
    drain_wait_s,
    fork_lineage,
    reducer_shares,
    resync_source,
    robust_mean,
    tell_at_once,
)
from protocol.run_spec import AveragingSpec
from tests.averaging_peer import (
    CFG,
    STAGE,
    backward,
    make_spec,
)


def test_robust_mean_follows_honest_parts_and_bounds_a_wrong_one():
    g = torch.Generator().manual_seed(0)
    true = torch.randn(1000, generator=g)
    honest = [true + 0.3 * torch.randn(1000, generator=g) for _ in range(3)]
    mean = torch.stack(honest).mean(0)
    cos = torch.nn.functional.cosine_similarity

    # Honest parts alike: their weighted mean, as a plain average would give.
    assert torch.allclose(robust_mean(honest, [1, 1, 1]), mean, atol=1e-5)
    weighted = (honest[0] + 2 * honest[1] + honest[2]) / 4
    assert torch.allclose(robust_mean(honest, [1, 2, 1]), weighted, atol=1e-5)
    # A groupmate sending its gradient negated and scaled 100x, or claiming a huge sample
    # count: the plain mean turns against the truth, the robust one stays near the honest.
    for part, weight in [(-100 * true, 1.0), (-true, 1e9)]:
        parts, weights = [*honest, part], [1.0, 1.0, 1.0, weight]
        w = torch.tensor(weights)
        plain = (w @ torch.stack(parts)) / w.sum()
        assert float(cos(plain, true, dim=0)) < 0
        robust = robust_mean(parts, weights)
        assert float(cos(robust, true, dim=0)) > 0.9
        assert float((robust - mean).norm()) < 0.5 * float(true.norm())
    # Two parts: nobody can tell the wrong one; a part of weight 0 does not count.
    assert torch.allclose(
        robust_mean([honest[0], -100 * true], [1, 1]), (honest[0] - 100 * true) / 2
    )
    assert torch.allclose(
        robust_mean([*honest[:2], 100 * true], [1, 1, 0]),
        (honest[0] + honest[1]) / 2,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="not all 0"):
        robust_mean(honest, [0, 0, 0])


def test_patience_bounds_whom_a_due_step_waits_for():
    """Peers behind hold our step only inside the window after our epoch, and each for at
    most ``epochs`` of our epochs within the memory; a peer at or ahead of us never."""
    patience = Patience(epochs=2, memory_s=100.0, share=1.0)
    view = [Progress("a", 1, 0), Progress("b", 9, 0), Progress("c", 4, 0)]  # b: ahead
    assert patience.deserving(view, 5, now=0.0) == frozenset()  # no window yet
    patience.open(now=0.0, window_s=10.0)
    assert patience.deserving(view, 5, now=1.0) == {"a", "c"}
    assert patience.deserving(view, 5, now=10.0) == frozenset()  # the window closed
    patience.note(["a"], 5, now=1.0)
    patience.note(["a"], 5, now=2.0)  # the same epoch counts once
    patience.open(now=20.0, window_s=10.0)
    assert patience.deserving(view, 6, now=21.0) == {"a", "c"}
    patience.note(["a"], 6, now=21.0)
    assert "a" in patience.deserving(view, 6, now=22.0)  # its epoch, already counted
    patience.open(now=30.0, window_s=10.0)
    assert patience.deserving(view, 7, now=31.0) == {"c"}  # a had its two epochs
    patience.open(now=101.5, window_s=40.0)
    assert patience.deserving(view, 8, now=102.0) == {"a", "c"}  # its first wait forgotten
    patience.note(["c"], 8, now=200.0)
    assert set(patience._waits) == {"c"}  # old waits are dropped


def test_patience_says_how_long_a_wait_held_and_for_whom():
    patience = Patience()
    patience.open(now=0.0, window_s=30.0)
    assert patience.note([], 1, now=1.0) is None  # no wait
    assert patience.note(["b"], 1, now=2.0) is None
    assert patience.note(["a", "b"], 1, now=3.0) is None
    assert patience.note([], 1, now=4.5) == Held(1, 2.5, ("a", "b"))
    assert patience.note([], 1, now=5.0) is None  # told once


def test_patience_spends_at_most_its_share_of_time_waiting():
    """All peers behind together hold our steps at most ``share`` of the memory (new ids
    do not get around it), but at least one whole window."""
    patience = Patience(epochs=3, memory_s=100.0, share=0.2)  # 20 s in any 100 s
    for epoch, peer in enumerate(["x1", "x2", "x3"]):  # a fresh id behind at every epoch
        start = 30.0 * epoch
        patience.open(now=start, window_s=15.0)
        view = [Progress(peer, 0, 0)]
        waited = start
        while patience.deserving(view, epoch + 1, now=waited):
            patience.note([peer], epoch + 1, now=waited)
            waited += 1.0
        patience.note([], epoch + 1, now=waited)
        assert waited - start == (15.0 if epoch == 0 else 5.0 if epoch == 1 else 0.0)
    assert patience.spent_s(now=75.0) == 20.0
    assert patience.spent_s(now=150.0) == 0.0  # forgotten: waits may come again
    long = Patience(memory_s=100.0, share=0.2)
    behind = [Progress("a", 0, 0)]
    long.open(now=0.0, window_s=60.0, own_s=40.0)  # a download from us takes 40 s
    long.note(["a"], 1, now=0.0)
    assert long.spent_s(now=10.0) == 10.0  # a wait going on counts until now
    assert long.deserving(behind, 1, now=39.0) == {"a"}  # our own download, at least
    assert long.deserving(behind, 1, now=40.0) == frozenset()  # not a slower peer's claim
    # A download from us longer than the memory: the memory stretches, the share holds.
    huge = Patience(memory_s=100.0, share=0.25)
    for epoch in range(1, 6):
        start = 1000.0 * epoch
        huge.open(now=start, window_s=900.0, own_s=800.0)
        waited = start
        while huge.deserving(behind, epoch, now=waited):
            huge.note(["a"], epoch, now=waited)
            waited += 10.0
        huge.note([], epoch, now=waited)
    assert huge.memory == 3200.0 and huge.spent_s(now=6000.0) <= 800.0


def test_decide():
    def p(peer: str, epoch: int, samples: int) -> Progress:
        return Progress(peer, epoch, samples)

    assert decide("me", 3, 10, [], 16).action is Action.WAIT
    assert decide("me", 3, 16, [], 16).action is Action.STEP_ALONE
    assert decide("me", 3, 16, [p("me", 3, 99)], 16).action is Action.STEP_ALONE  # ours: ignored
    two = decide("me", 3, 10, [p("a", 3, 6), p("b", 2, 50)], 16)
    assert (two.action, two.samples, two.peers) == (Action.AVERAGE, 16, 1)
    assert decide("me", 3, 0, [p("a", 3, 16)], 16).action is Action.AVERAGE  # weight 0
    assert decide("me", 3, 10, [p("a", 4, 0)], 16).action is Action.CATCH_UP
    assert decide("me", 3, 16, [p("a", 4, 0)], 16, catch_up=False).action is Action.WAIT
    assert decide("me", 3, 1, [p("a", 3, 10**9)], 16).action is Action.AVERAGE  # capped
    joiner = [p("a", 1, 0)]  # behind, downloading the state: wait for it, if patient
    assert decide("me", 3, 16, joiner, 16).action is Action.STEP_ALONE
    waits = decide("me", 3, 16, joiner, 16, patient_for={"a"})
    assert (waits.action, waits.waiting_for) == (Action.WAIT, ("a",))
    assert decide("me", 3, 16, joiner, 16, patient_for={"x"}).action is Action.STEP_ALONE
    both = [p("a", 1, 0), p("b", 3, 0)]  # a frontier of two waits for the joiner too
    assert decide("me", 3, 16, both, 16).action is Action.AVERAGE
    assert decide("me", 3, 16, both, 16, patient_for={"a"}).waiting_for == ("a",)
    # Only a step that is due waits: short of the target, the decision is a plain WAIT.
    assert decide("me", 3, 1, both, 16, patient_for={"a"}).waiting_for == ()
    assert decide("me", 0, 20, [p("a", 0, 10)], 16, per_peer=True).action is Action.WAIT
    assert decide("me", 0, 20, [p("a", 0, 12)], 16, per_peer=True).action is Action.AVERAGE
    with pytest.raises(ValueError):
        decide("me", 0, 1, [], 0)


def test_a_count_is_told_at_once_only_where_it_may_make_the_round_due():
    def p(peer: str, samples: int) -> Progress:
        return Progress(peer, 0, samples)

    assert tell_at_once(1, [], 16, per_peer=False)  # a shared batch: every sample counts
    assert not tell_at_once(15, [p("a", 15), p("b", 0)], 16, per_peer=True)
    assert tell_at_once(16, [p("a", 0)], 16, per_peer=True)  # ours reached our share
    assert tell_at_once(1, [p("a", 16)], 16, per_peer=True)  # a peer's did: ours may fill it
    # Where it is not told at once, the round is due for nobody at our epoch, whatever
    # our count becomes below the target (so it can wait for the next report).
    target = 4
    for ours in range(target + 2):
        for a in range(2 * target + 2):
            for b in range(2 * target + 2):
                others = [p("a", a), p("b", b)]
                if tell_at_once(ours, others, target, per_peer=True):
                    continue
                for later in range(ours, target):
                    for me, mine, seen in (
                        ("me", later, others),
                        ("a", a, [p("me", later), p("b", b)]),
                        ("b", b, [p("me", later), p("a", a)]),
                    ):
                        decision = decide(me, 0, mine, seen, target, per_peer=True)
                        assert decision.action is Action.WAIT, (ours, a, b, later, me)


def test_a_round_drains_until_the_last_open_micro_batch_is_due_by_the_recent_trips():
    now = 100.0
    assert drain_wait_s([], [5.0], now, ceiling_s=10.0) == 0.0  # nothing open
    assert drain_wait_s([now], [], now, ceiling_s=10.0) == DRAIN_S  # no trip measured
    # A home link: trips of 4-6 s; the last micro-batch admitted 1 s ago is due in
    # DRAIN_MARGIN x 6 - 1 s.
    wait = drain_wait_s([now - 3.0, now - 1.0], [4.0, 6.0, 5.0], now, ceiling_s=10.0)
    assert wait == pytest.approx(DRAIN_MARGIN * 6.0 - 1.0)
    # Short trips (loopback) still wait the shortest drain; a lost micro-batch's trip
    # never makes a round wait past the ceiling.
    assert drain_wait_s([now], [0.3], now, ceiling_s=10.0) == DRAIN_S
    assert drain_wait_s([now], [60.0], now, ceiling_s=10.0) == 10.0
    assert drain_wait_s([now], [60.0], now, ceiling_s=1.0) == 1.0


def test_a_gradient_groupmate_may_start_sending_as_late_as_the_longest_drain():
    gradient = process_settings(AveragingSpec(chunk_timeout_s=5.0))
    assert gradient["next_chunk_timeout"] == 5.0  # downloads: as before
    assert gradient["sender_timeout"] == 5.0 + OPEN_S  # a groupmate still draining
    assert gradient["reducer_timeout"] > gradient["sender_timeout"]  # as hivemind wants
    diloco = process_settings(AveragingSpec(mode="diloco", chunk_timeout_s=5.0))
    assert diloco["sender_timeout"] == 5.0 and diloco["reducer_timeout"] == 10.0  # no drain


def test_a_download_waits_as_long_as_the_state_takes_at_the_announced_rate():
    # the small preset's stage over a home link: 66 MB at 50 Mbit/s take 10.6 s, which a
    # loaded relay stretched past the round's 15 s timeout
    small = 66_000_000
    assert download_patience_s(small, [50.0], floor_s=15.0) == pytest.approx(21.12)
    assert download_patience_s(small, [50.0, 12.0], floor_s=15.0) == pytest.approx(88.0)  # slowest
    assert download_patience_s(10_000, [50.0], floor_s=15.0) == 15.0  # a small state: the floor
    # not announced (0), or no source known: an assumed 10 Mbit/s
    assert download_patience_s(small, [0.0], floor_s=15.0) == pytest.approx(105.6)
    assert download_patience_s(small, [], floor_s=15.0) == pytest.approx(105.6)
    # claims are bounded: a tiny rate cannot make us wait without end, a huge one cannot
    # cut the wait below the floor
    assert download_patience_s(small, [1e-9], floor_s=15.0) == pytest.approx(1056.0)
    assert download_patience_s(small, [math.inf, 1e12], floor_s=15.0) == 15.0
    with pytest.raises(ValueError):
        download_patience_s(-1, [], floor_s=15.0)


def test_forked_copies_come_back_to_one_after_a_round():
    assert resync_source("a", {"a": 0, "b": 0}) is None  # one lineage: one copy
    # a one-sided failure: "b" fell back, "a" took the round's step: one of them takes the
    # other's copy, the same one on both sides
    fork = fork_lineage("b", 5)
    assert fork != fork_lineage("a", 5) and fork != fork_lineage("b", 6) and 0 < fork < 2**48
    sides = {me: resync_source(me, {"a": 0, "b": fork}) for me in "ab"}
    assert sides == {"a": None, "b": "a"}  # a tie: the lowest lineage (0) is kept
    # most copies agree: the others take the lowest peer id among them
    group = {"a": fork, "b": 7, "c": 7, "d": 0}
    assert {me: resync_source(me, group) for me in group} == {
        "a": "b",
        "b": None,
        "c": None,
        "d": "b",
    }
    # a joiner that downloaded a forked copy holds its lineage: nothing to take again
    assert resync_source("a", {"a": fork, "joiner": fork}) is None
    with pytest.raises(ValueError):
        resync_source("z", group)


def test_state_is_checked_before_it_replaces_anything():
    spec = make_spec("avg-state")
    donor = Stage(CFG, spec.stage_range(STAGE))
    opt = StageOptimizer(donor, spec.optim)
    opt.accumulated(backward(donor, 1))
    opt.step()
    metadata, tensors = stage_state.capture(donor, opt, epoch=1, mode="gradient", peer="p")
    joiner = Stage(CFG, spec.stage_range(STAGE))
    state = stage_state.parse(metadata, tensors, joiner, mode="gradient")
    joiner_opt = StageOptimizer(joiner, spec.optim)
    stage_state.apply(state, joiner, joiner_opt)
    assert joiner_opt.step_count == 1 and state.epoch == 1
    assert all(
        torch.equal(a, b) for a, b in zip(joiner.parameters(), donor.parameters(), strict=True)
    )

    def refused(metadata=metadata, tensors=tensors, mode="gradient") -> str:
        with pytest.raises(stage_state.StateError) as e:
            stage_state.parse(metadata, tensors, joiner, mode=mode)
        return str(e.value)

    assert "mode" in refused(mode="diloco")
    assert "tensors" in refused(tensors=tensors[:-1])
    bad = list(tensors)
    bad[0] = torch.full_like(bad[0], math.inf)
    assert "non-finite" in refused(tensors=bad)
    bad[0] = tensors[0][:1]
    assert "shape" in refused(tensors=bad)
    assert "epoch" in refused(metadata=metadata | {"epoch": -1})
    assert "names" in refused(metadata=metadata | {"names": ["x"]})
    assert "adamw" in refused(metadata=metadata | {"adamw": [[0, "bogus"], *metadata["adamw"][1:]]})


def test_digests_tell_equal_copies_from_diverged_ones():
    """Bitwise equal copies share a crc; copies apart by float rounding are within
    ``EQUAL_DISTANCE``, copies a step apart are far outside it; a digest round-trips
    through an ``averaging.round`` event's JSON into ``compare_copies``."""
    stage = Stage(CFG, make_spec("avg-digest").stage_range(STAGE))
    params = [p.detach().clone() for p in stage.parameters()]
    g = torch.Generator().manual_seed(0)
    rounding = [p * (1 + 1e-7 * torch.randn(p.shape, generator=g)) for p in params]
    step = [p + 1e-3 * torch.randn(p.shape, generator=g) for p in params]
    same, close, far = (ParamDigest.of(t) for t in (params, rounding, step))
    assert ParamDigest.of(params) == same and same.distance(same) == 0.0
    assert 1e-9 < same.distance(close) < EQUAL_DISTANCE < 10 * EQUAL_DISTANCE < same.distance(far)

    def rounds(*digests: ParamDigest, first: int = 0) -> list[dict]:
        """A peer's ``averaging.round`` events, as ``node.events.read_events`` gives them."""
        return [
            json.loads(
                json.dumps(
                    {
                        "event": "averaging.round",
                        "stage": STAGE,
                        "epoch": e,
                        "peers": 2,
                        "ok": True,
                        "how": "averaged",
                        "digest": d.fields(),
                    }  # fmt: skip
                )
            )
            for e, d in enumerate(digests, start=first)
        ]

    assert ParamDigest.from_fields(rounds(close)[0]["digest"]) == close
    check = compare_copies([rounds(same, same, same), rounds(same, close)], STAGE)
    assert (check.peers, check.common, check.bitwise, check.equal) == (2, 2, 1, True), check
    assert str(check).startswith("copies equal at 2 of 2 common epochs")
    check = compare_copies([rounds(same, same), rounds(same, far), rounds(same)], STAGE)
    assert (check.common, check.differ, check.equal) == (2, (1,), False), check
    assert str(check).startswith("COPIES DIFFER at 1 of 2")
    assert not compare_copies([rounds(same), rounds(same, first=1)], STAGE).equal  # never compared
    assert (
        compare_copies([rounds(same)], STAGE).equal and not compare_copies([rounds(same)], 0).peers
    )
    # Events without a digest, with a malformed one, or of another kind do not count.
    malformed = [
        {"event": "averaging.round", "stage": STAGE, "epoch": 0, "ok": False},
        {"event": "averaging.round", "stage": STAGE, "epoch": 0, "digest": {"hash": "zz"}},
        {"event": "stage.held", "stage": STAGE, "epoch": 0, "digest": same.fields()},
    ]
    assert compare_copies([rounds(same), malformed], STAGE).peers == 1
    with pytest.raises(ValueError):
        ParamDigest.from_fields({"hash": "0" * 8, "norm": 1.0, "sketch": [1.0, True, 0, 0]})


def _gradients(peers: int, seeds_per_peer: list[int]) -> list[torch.Tensor]:
    """Each peer's mean gradient (flat) of the last stage of ``CFG``, fed different
    micro-batches (``seeds_per_peer[i]`` of them for peer ``i``)."""
    grads, seed = [], 0
    for k in range(peers):
        stage = Stage(CFG, make_spec("returned").stage_range(STAGE))
        optimizer = StageOptimizer(stage, make_spec("returned").optim)
        for _ in range(seeds_per_peer[k]):
            seed += 1
            optimizer.accumulated(backward(stage, seed))
        flat = torch.cat([p.grad.reshape(-1) for p in stage.parameters()])
        grads.append(flat / optimizer.samples)
    return grads


def _share(mine: torch.Tensor, averaged: torch.Tensor) -> ReturnedShare:
    share = ReturnedShare()
    for x, r in zip(mine.split(1000), averaged.split(1000), strict=True):  # part by part
        share.add(x, r)
    return share


def test_a_returned_mean_is_checked_against_our_own_part():
    """Four groupmates (1 to 4 micro-batches each) split the vector into four shares.
    For every share and every groupmate, the robust mean of the four parts passes the
    check; the mean negated (any factor), or scaled 100x up, fails it for every groupmate;
    a groupmate with no samples (zeros) cannot judge."""
    grads = _gradients(4, [1, 2, 3, 4])
    weights = [4.0, 8.0, 12.0, 16.0]
    shares = [torch.tensor_split(g, 4) for g in grads]
    for s in range(4):
        mean = robust_mean([parts[s] for parts in shares], weights)
        for parts in shares:
            mine = parts[s]
            assert check_returned(_share(mine, mean)) is None
            for wrong, why in [(-100 * mean, "norms"), (-mean, "against"), (100 * mean, "norms")]:
                assert why in check_returned(_share(mine, wrong)).reason
            assert (
                "non-finite" in check_returned(_share(mine, torch.full_like(mean, math.nan))).reason
            )
        assert check_returned(_share(torch.zeros_like(mean), -100 * mean)) is None


def test_a_small_part_of_ours_is_judged_by_the_share_we_reduced():
    """A DiLoCo delta of few inner steps is small beside the mean: the honest mean of
    another share lies many of its norms away, as the mean of the share we reduced
    ourselves does, which allows it; 100x that mean does not pass."""
    g = torch.Generator().manual_seed(1)
    common = torch.randn(4000, generator=g)
    mine = 0.1 * common + 0.01 * torch.randn(4000, generator=g)  # 1 inner step to their 10
    mean = common + 0.1 * torch.randn(4000, generator=g)
    own = _share(mine[:2000], mean[:2000])
    other = _share(mine[2000:], mean[2000:])
    assert "norms" in check_returned(other).reason  # without the yardstick, it looks too far
    assert check_returned(other, own) is None
    assert "norms" in check_returned(_share(mine[2000:], 100 * mean[2000:]), own).reason


def test_shares_are_equal_whatever_bandwidth_is_claimed():
    assert reducer_shares([False, False, False]) == (1.0, 1.0, 1.0)
    assert reducer_shares([False, True, False]) == (1.0, 0.0, 1.0)  # a client reduces nothing
    with pytest.raises(ValueError):
        reducer_shares([True, True])
