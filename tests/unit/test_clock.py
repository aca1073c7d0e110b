"""The clock check (``protocol.clock``): the stage peers' clock offset from ours, from the
records they push, is the median over peers of each one's least-delayed record, and it is
warned about once it reaches ``WARN_S``, then at most every ``REPEAT_S``."""

from __future__ import annotations

import math

from protocol.clock import CHECK_S, REPEAT_S, WARN_S, WINDOW_S, ClockCheck


def test_the_least_delayed_record_estimates_a_peer_and_the_median_the_stage() -> None:
    check = ClockCheck()
    for i, delay in enumerate([0.3, 0.01, 0.2]):  # peer a: 1.0 s ahead, records delayed
        check.observe("a", sent=190.0 + i + 1.0, received=190.0 + i + delay)
    check.observe("b", sent=200.0, received=200.0)  # in step with us
    check.observe("c", sent=200.0 + 1.2, received=200.0)
    skew = check.skew(now=200.0)
    assert skew is not None and skew.peers == 3
    assert math.isclose(skew.offset_s, 0.99)  # a's best record: 1.0 s less 0.01 in transit
    check.observe("d", sent=200.0 - 30.0, received=200.0)  # one liar far behind
    assert math.isclose(check.skew(now=200.0).offset_s, (0.99 + 0.0) / 2)


def test_a_skew_is_warned_once_then_every_repeat_and_old_records_stop_counting() -> None:
    check = ClockCheck()
    assert check.verdict(now=0.0) is None  # nobody observed
    check.observe("a", sent=10.0 - WARN_S / 2, received=10.0)
    assert check.verdict(now=10.0) is None  # within the tolerance
    t = 10.0 + CHECK_S
    check.observe("a", sent=t - 1.0 + 2 * WARN_S, received=t - 1.0)
    assert check.verdict(now=t - 1.0) is None  # looked less than CHECK_S ago
    first = check.verdict(now=t)
    assert first is not None and first.offset_s == 2 * WARN_S and first.peers == 1
    assert "ahead of this machine's" in first.line() and "timedatectl" in first.line()
    check.observe("a", sent=t + CHECK_S + 2 * WARN_S, received=t + CHECK_S)
    assert check.verdict(now=t + CHECK_S) is None  # warned already
    late = t + REPEAT_S
    assert check.skew(now=late) is None  # the observations are older than the window
    assert not check._seen  # and the peers that made them are forgotten
    check.observe("a", sent=late - 2 * WARN_S, received=late)
    again = check.verdict(now=late)
    assert again is not None and "behind this machine's" in again.line()
    assert WINDOW_S < REPEAT_S


def test_non_finite_times_are_ignored() -> None:
    check = ClockCheck()
    check.observe("a", sent=math.inf, received=1.0)
    check.observe("a", sent=math.nan, received=1.0)
    assert check.skew(now=1.0) is None
