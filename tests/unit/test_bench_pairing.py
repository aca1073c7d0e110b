"""The NAT benchmark's paired windows (``scripts.bench_swarm``) and the trainer's phases
(``scripts.swarm_bench.worker``)."""

from __future__ import annotations

import argparse

import pytest

from scripts.bench_swarm import nat_turns, paired_ratios
from scripts.swarm_bench.worker import _phase


def test_turns_are_abba_blocks_so_a_linear_drift_weighs_on_both_alike():
    turns = nat_turns(2)
    assert turns == ["public", "nat", "nat", "public"] * 2
    # a load that grows by 1 per window: both variants' windows add up to the same load
    load = {v: sum(k for k, w in enumerate(turns) if w == v) for v in ("public", "nat")}
    assert load["public"] == load["nat"]


def test_paired_ratios_divide_each_adjacent_pair_nat_by_public():
    turns = nat_turns(1)
    assert paired_ratios(turns, [10.0, 5.0, 6.0, 3.0]) == [0.5, 2.0]
    with pytest.raises(ValueError, match="not one of each"):
        paired_ratios(["nat", "nat"], [1.0, 1.0])


def test_an_idle_phase_lasts_seconds():
    assert _phase("w0:idle:10") == ("w0", "idle", 10.0)
    assert _phase("m:stochastic:20mb") == ("m", "stochastic", 20)
    with pytest.raises(argparse.ArgumentTypeError, match="seconds"):
        _phase("w0:idle:20mb")
    with pytest.raises(argparse.ArgumentTypeError, match="wiring"):
        _phase("w0:sideways:10")
