"""``averager._Timeline``: the parts of a round's time in its ``averaging.round`` event."""

from __future__ import annotations

import pytest

from node.averaging.averager import ROUND_PARTS, _Timeline


def test_each_part_runs_from_the_mark_before_it():
    timeline = _Timeline(10.0)
    for part, at in zip(ROUND_PARTS, (10.3, 10.302, 10.31, 10.39, 10.394), strict=True):
        timeline.mark(part, at)
    fields = timeline.fields()
    assert list(fields) == [f"{p}_s" for p in ROUND_PARTS]
    expected = {"drain_s": 0.3, "begin_s": 0.002, "match_s": 0.008, "allreduce_s": 0.08}
    assert fields == pytest.approx(expected | {"finish_s": 0.004})
    assert sum(fields.values()) == pytest.approx(0.394)  # they add up to trigger -> step


def test_a_part_not_reached_is_left_out_and_the_next_counts_from_the_last_mark():
    timeline = _Timeline(10.0)
    timeline.mark("drain", 10.2)
    timeline.mark("begin", 10.25)
    assert timeline.fields() == pytest.approx({"drain_s": 0.2, "begin_s": 0.05})
    timeline.mark("finish", 10.5)  # no all-reduce marked: the finish spans from the begin
    assert timeline.fields()["finish_s"] == pytest.approx(0.25)


def test_a_mark_before_the_last_one_counts_zero():
    timeline = _Timeline(10.0)
    timeline.mark("begin", 10.2)
    timeline.mark("match", 10.1)  # marked at a time taken elsewhere, before the begin
    timeline.mark("allreduce", 10.3)
    fields = timeline.fields()
    assert fields["match_s"] == 0.0 and fields["allreduce_s"] == pytest.approx(0.1)
