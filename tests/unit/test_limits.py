"""The token bucket behind ``--max-upload-mbps`` / ``--max-download-mbps``, driven with a
virtual clock; and ``Traffic``'s counters and waits (its sharing with the averager
processes: tests/live/test_limits.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from node.limits import (
    ACTIVATIONS,
    AVERAGING,
    PURPOSE,
    RECEIVED,
    SENT,
    STATE,
    TokenBucket,
    Traffic,
    burst_for,
    current_purpose,
    mbps_to_bytes,
)


def test_a_full_bucket_lets_its_burst_through_at_once_then_holds_the_rate():
    b = TokenBucket.full(rate=1000.0, burst=500.0, now=0.0)
    assert b.take(500, 0.0) == 0.0
    assert b.take(100, 0.0) == pytest.approx(0.1)  # 100 bytes at 1000 B/s
    assert b.take(100, 0.0) == pytest.approx(0.2)  # waits for the one before it too
    assert b.take(0, 0.2) == 0.0  # the debt is paid off by then


def test_over_a_long_run_the_bytes_granted_follow_the_rate():
    """Takes as fast as the bucket allows, for 100 virtual seconds: what went through is
    rate x time plus at most one burst."""
    rate, burst = 1e6, 2.5e5
    b = TokenBucket.full(rate, burst, 0.0)
    now, sent = 0.0, 0
    while now < 100.0:
        now += b.take(65_536, now)  # the caller sleeps the wait, then sends
        sent += 65_536
    assert rate * now <= sent <= rate * now + burst + 65_536


def test_an_idle_bucket_saves_at_most_its_burst():
    b = TokenBucket.full(rate=100.0, burst=50.0, now=0.0)
    b.take(50, 0.0)
    b.refill(1000.0)
    assert b.tokens == 50.0
    assert b.take(60, 1000.0) == pytest.approx(0.1)


def test_a_message_larger_than_the_burst_still_goes():
    b = TokenBucket.full(rate=10.0, burst=1.0, now=0.0)
    assert b.take(101, 0.0) == pytest.approx(10.0)


def test_a_clock_that_goes_back_refills_nothing():
    b = TokenBucket(rate=10.0, burst=100.0, tokens=0.0, at=5.0)
    b.refill(4.0)
    assert b.tokens == 0.0 and b.at == 5.0


@pytest.mark.parametrize("rate, burst", [(0.0, 1.0), (1.0, 0.0), (-1.0, 5.0)])
def test_a_bucket_needs_a_positive_rate_and_burst(rate, burst):
    with pytest.raises(ValueError, match="must be > 0"):
        TokenBucket(rate, burst, 0.0, 0.0)


def test_a_negative_take_is_refused():
    with pytest.raises(ValueError, match="cannot take -1 bytes"):
        TokenBucket.full(1.0, 1.0, 0.0).take(-1, 0.0)


def test_units():
    assert mbps_to_bytes(8) == 1e6
    assert burst_for(mbps_to_bytes(8)) == 250_000
    assert burst_for(1.0) == 2**16


def test_traffic_counts_by_purpose_and_direction_and_waits_for_its_limit():
    t = Traffic()
    t.set_limits(up_mbps=8.0, down_mbps=None)  # 1e6 B/s, a burst of 250,000 bytes

    async def body() -> float:
        started = time.monotonic()
        await t.send(250_000, ACTIVATIONS)  # the burst: no wait
        await t.send(200_000, AVERAGING)  # 0.2 s
        await t.receive(10**9, STATE)  # no download limit: no wait
        return time.monotonic() - started

    elapsed = asyncio.run(body())
    assert 0.18 <= elapsed < 2.0
    c = t.counts()
    assert c.bytes[(ACTIVATIONS, SENT)] == 250_000
    assert c.bytes[(AVERAGING, SENT)] == 200_000
    assert c.bytes[(STATE, RECEIVED)] == 10**9
    assert c.total(SENT) == 450_000 and c.total(RECEIVED) == 10**9
    assert c.waited_s[SENT] == pytest.approx(0.2, abs=0.05) and c.waited_s[RECEIVED] == 0
    assert c.limits == {SENT: 1e6, RECEIVED: None}


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="more than 0 Mbit/s, got 0"):
        Traffic().set_limits(0, None)


def test_the_purpose_is_the_context_s_else_the_default():
    assert current_purpose() == "other"
    token = PURPOSE.set(STATE)
    try:
        assert current_purpose() == STATE
    finally:
        PURPOSE.reset(token)
