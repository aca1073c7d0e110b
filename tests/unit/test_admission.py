"""The admission policy of stage servers (``protocol.admission``): caps on requests and
bytes in flight, per caller and in total, the deadline for a request to arrive, and the
tally of refusals; and a trainer's answer to a peer that sheds its call."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from node import events
from node.pipeline.client import StageBusy
from protocol.admission import (
    MIB,
    AdmissionLimits,
    InFlight,
    Refusal,
    RefusalTally,
    Ticket,
    request_deadline_s,
)
from tests.unit.test_trainer import _Stages, _trainer


def test_a_caller_gets_its_share_and_others_still_get_in():
    flight = InFlight(AdmissionLimits(per_caller=3, total=5))
    mine = [flight.admit("attacker") for _ in range(3)]
    assert all(isinstance(t, Ticket) for t in mine)
    assert flight.admit("attacker") is Refusal.CALLER_REQUESTS
    assert isinstance(flight.admit("honest"), Ticket)
    assert isinstance(flight.admit("other"), Ticket)
    assert flight.admit("third") is Refusal.TOTAL_REQUESTS  # the node is full
    flight.release(mine[0])
    assert isinstance(flight.admit("attacker"), Ticket)  # one finished: one more
    assert flight.requests == 5


def test_release_is_idempotent_and_forgets_idle_callers():
    flight = InFlight(AdmissionLimits(per_caller=2, total=2))
    ticket = flight.admit("a")
    assert flight.charge(ticket, 100) is None
    assert flight.of("a") == (1, 100)
    flight.release(ticket)
    flight.release(ticket)
    assert (flight.requests, flight.nbytes, flight.of("a")) == (0, 0, (0, 0))
    assert flight._callers == {}
    with pytest.raises(ValueError, match="released"):
        flight.charge(ticket, 1)


def test_bytes_are_capped_per_caller_and_in_total_but_one_request_always_fits():
    limits = AdmissionLimits(per_caller=4, total=8, per_caller_bytes=10 * MIB, total_bytes=16 * MIB)
    flight = InFlight(limits)
    a1, a2, a3 = (flight.admit("a") for _ in range(3))
    assert flight.charge(a1, 64 * MIB) is None  # alone, a request over the caps fits
    assert flight.charge(a2, 1) is Refusal.CALLER_BYTES
    assert (a2.nbytes, flight.nbytes) == (0, 64 * MIB)  # nothing charged on refusal
    flight.release(a1)
    assert flight.charge(a2, 6 * MIB) is None
    assert flight.charge(a3, 5 * MIB) is Refusal.CALLER_BYTES  # 11 MiB > 10
    b1, _, c1 = flight.admit("b"), flight.admit("b"), flight.admit("c")
    assert flight.charge(b1, 8 * MIB) is None
    assert flight.charge(c1, 3 * MIB) is Refusal.TOTAL_BYTES  # 17 MiB > 16
    assert flight.nbytes == 14 * MIB
    assert "6291456 bytes in flight (limit 10485760)" in flight.reason(Refusal.CALLER_BYTES, "a")
    assert "2 requests in flight (limit 4)" in flight.reason(Refusal.CALLER_REQUESTS, "b")
    assert "5 requests in flight (limit 8)" in flight.reason(Refusal.TOTAL_REQUESTS, "d")


@pytest.mark.parametrize(
    "bad",
    [
        dict(per_caller=0),
        dict(per_caller=10, total=5),
        dict(total_bytes=0),
        dict(first_s=0),
        dict(slow_link_mbps=-1),
        dict(first_s=10, max_s=5),
    ],
)
def test_limits_are_checked(bad):
    with pytest.raises(ValueError):
        AdmissionLimits(**bad)


def test_the_deadline_scales_with_the_message_limit_and_the_download_bandwidth():
    limits = AdmissionLimits(first_s=5, slow_link_mbps=10, link_share=2, max_s=60)
    assert request_deadline_s(limits, 0) == 5
    # 1 MiB, two at once over a 10 Mbit/s link: 1.68 s more.
    assert request_deadline_s(limits, MIB) == pytest.approx(5 + 2 * MIB * 8 / 10e6)
    # A fast download does not shorten it below what a slow caller's link needs ...
    assert request_deadline_s(limits, MIB, download_mbps=1000) == request_deadline_s(limits, MIB)
    # ... and a slow one lengthens it.
    assert request_deadline_s(limits, MIB, download_mbps=1) == pytest.approx(5 + 2 * MIB * 8 / 1e6)
    assert request_deadline_s(limits, 2**30) == 60  # capped
    with pytest.raises(ValueError):
        request_deadline_s(limits, -1)


def test_the_tally_reports_the_first_refusal_then_one_a_second_with_the_count():
    tally = RefusalTally(every_s=1.0)
    assert tally.note("a", Refusal.CALLER_REQUESTS, 0.0) == 1
    assert tally.note("a", Refusal.CALLER_REQUESTS, 0.2) is None
    assert tally.note("a", Refusal.CALLER_REQUESTS, 0.5) is None
    assert tally.note("a", Refusal.SLOW, 0.6) == 1  # another reason: its own count
    assert tally.note("a", Refusal.CALLER_REQUESTS, 1.1) == 3
    assert tally.note("b", Refusal.CALLER_REQUESTS, 1.2) == 1
    assert tally.totals == {Refusal.CALLER_REQUESTS: 5, Refusal.SLOW: 1}


def test_the_tally_forgets_the_oldest_callers_first():
    tally = RefusalTally(max_keys=2)
    for caller in ("a", "b", "c"):
        tally.note(caller, Refusal.TOTAL_REQUESTS, 0.0)
    assert [k[0] for k in tally._pending] == ["b", "c"]
    assert tally.note("a", Refusal.TOTAL_REQUESTS, 0.1) == 1  # forgotten: reported afresh


def test_a_trainer_reroutes_a_call_shed_as_busy_without_dropping_the_busy_peer(
    event_log: Path,
) -> None:
    """A busy peer is full, not broken: the call goes to the stage's other peer, and the
    busy one stays in the view, left alone for ``busy_s`` only (not the 15 s ban)."""
    stages = _Stages(1, StageBusy, "8 requests in flight (limit 8)")
    trainer, peers = _trainer(stages, [0, 1, 1])
    asyncio.run(trainer.train(2))
    assert trainer.stats.micro_batches == 2
    (failed,) = events.read_events(event_log, "call.failed")
    (busy,) = stages.failed
    assert failed["error"].startswith("StageBusy") and failed["peer"] == busy
    (rerouted,) = events.read_events(event_log, "call.rerouted")
    assert rerouted["stage"] == 1 and rerouted["peer"] != busy
    assert busy in {c.peer_id for c in trainer.view[1]}
    until = trainer._bans.until(busy, time.monotonic())
    assert until is not None and until - time.monotonic() <= trainer.settings.busy_s
