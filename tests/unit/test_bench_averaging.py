"""The arithmetic of ``scripts/bench_averaging.py``'s gradient vs DiLoCo comparison: the
rounds the schedule makes due, the figures each run gives against the same repeat's
gradient and dense DiLoCo runs, and the median [range] of the summary (no swarm)."""

from __future__ import annotations

import math

import pytest

from protocol import sparsify
from protocol.run_spec import AveragingSpec
from scripts import bench_averaging as bench

GRADIENT = AveragingSpec(compression="none")
DILOCO = AveragingSpec(mode="diloco", inner_steps=50)


def test_the_schedule_makes_a_round_due_per_target_batch_or_per_outer_step():
    # Gradient mode: each stage averages every 32 of its samples, a peer-round per peer.
    assert bench.rounds_due(GRADIENT, 32, n_stages=2, peers=2) == 2 * 2 / 32
    # DiLoCo: every 50 inner steps of 32 of each peer's own samples: 3,200 of the stage's.
    assert bench.rounds_due(DILOCO, 32, n_stages=2, peers=2) == 2 * 2 / 3200
    ratio = bench.rounds_due(GRADIENT, 32, 2, 2) / bench.rounds_due(DILOCO, 32, 2, 2)
    assert ratio == 100  # H x peers: gradient mode's rounds per DiLoCo round
    assert bench.outer_steps_due(DILOCO, 32, 2, samples=14_400) == 4
    assert bench.outer_steps_due(DILOCO, 32, 2, samples=12_799) == 3


def test_a_comparison_with_fewer_than_four_outer_steps_due_says_so():
    (line,) = bench.few_outer_steps(1500, [50, 20])
    assert "3 outer steps per stage due at H = 50" in line and "need 1600" in line
    assert bench.few_outer_steps(1600, [50, 20]) == []
    assert bench.few_outer_steps(0, [50]) == []  # no comparison


def test_a_peer_sends_its_groupmates_shares_in_eight_bit_blocks():
    values, part = bench.shares(
        AveragingSpec(mode="diloco", density=0.1, compression="uint8"), 1000, 2
    )
    assert values == sparsify.sent_count(1000, 0.1) / 2 == 50
    assert part == 50 + 2 * 50 / sparsify.CODEC_BLOCK
    assert bench.shares(GRADIENT, 1000, 4) == (750, None)  # float32: no 8-bit parts


def _run(label: str, *, rounds: int, sent: int, val: float, due: float, **kw) -> bench.Trained:
    return bench.Trained(
        label=label,
        samples=3200,
        seconds=10.0,
        val=(5.0, val),
        val_other=val,
        epochs=[4, 4],
        rounds=rounds,
        alone=kw.get("alone", 0),
        fallbacks=0,
        discarded=kw.get("discarded", 0),
        averaging_bytes=sent,
        computed_bytes=None,
        loopback_bytes=0,
        distance=[0.0, 0.0],
        due_per_sample=due,
        sent_values=kw.get("values", 1.0),
        part_bytes=kw.get("part"),
    )


def test_figures_compare_bytes_as_scheduled_and_loss_against_dense_diloco_at_the_same_h():
    # 3,200 samples: 400 peer-rounds due in gradient mode, 4 in DiLoCo; half of the sparse
    # run's failed (stepped alone): its counted bytes halve, the scheduled ones do not.
    gradient_due, diloco_due = 4 / 32, 4 / 3200
    results = [
        _run("gradient", rounds=400, sent=400 * 500_000, val=3.0, due=gradient_due),
        _run("diloco H=50", rounds=4, sent=4 * 500_000, val=2.0, due=diloco_due),
        _run(
            "H=50 d=0.1 uint8",
            rounds=2,
            sent=2 * 15_000,
            val=2.1,
            due=diloco_due,
            alone=2,
            discarded=1,
            values=6_000,
            part=6_200,
        ),  # fmt: skip
    ]
    table = bench.figures(results)
    dense, sparse = table["diloco H=50"], table["H=50 d=0.1 uint8"]
    assert dense.vs_gradient == pytest.approx(100)
    assert sparse.per_round == 15_000
    assert sparse.scheduled == pytest.approx(15_000 * diloco_due)
    assert sparse.vs_gradient == pytest.approx(100 * 500_000 / 15_000)
    assert sparse.vs_gradient_counted == pytest.approx(2 * sparse.vs_gradient)
    assert sparse.vs_loss == pytest.approx(2.1 / 2.0) and dense.vs_loss == 1.0
    assert math.isnan(table["gradient"].vs_loss)
    assert sparse.failed == 3 and sparse.epochs == 4
    assert sparse.returned == pytest.approx((15_000 - 6_200) / 6_000)
    assert math.isnan(dense.returned)  # float32: no 8-bit parts to tell apart
    nothing = _run("diloco H=20", rounds=0, sent=0, val=2.0, due=diloco_due)
    assert math.isnan(bench.figures([results[0], nothing])["diloco H=20"].vs_gradient)


def test_the_summary_gives_the_median_and_range_of_the_finite_values():
    assert bench.spread([3.0, 1.0, 2.0, 10.0, 4.0]) == "3 [1-10]"
    assert bench.spread([1.5, math.nan, 2.5], ".2f") == "2.00 [1.50-2.50]"
    assert bench.spread([math.nan]) == "-"
