"""A flood of distinct log lines (a thousand sybils joining, a thousand records refused)
costs a few lines and one summary a minute: ``LogBudget``, and ``Members`` using it."""

from __future__ import annotations

import logging

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node import events
from node.daemon.watch import Members
from node.log_budget import LogBudget
from protocol.identity import peer_id_of
from tests.records import peer_info


def test_a_budget_passes_the_first_lines_of_a_window_and_summarizes_the_rest(caplog):
    budget, log = LogBudget("things", per_window=3, window_s=60.0), logging.getLogger("t")
    with caplog.at_level(logging.INFO, logger="t"):
        assert [budget.take(float(t), log) for t in range(10)] == [True] * 3 + [False] * 7
        assert budget.held(59.0) == 0 and not caplog.records  # the window is not over
        budget.flush(59.0, log)
        assert not caplog.records
        assert budget.take(61.0, log)  # a new window, after the old one's summary
    assert [r.getMessage() for r in caplog.records] == [
        "7 more things in the last 60 s (not logged one by one)"
    ]
    budget.flush(200.0, log)  # nothing was held in the new window: nothing to say
    assert len(caplog.records) == 1


@pytest.mark.parametrize("per_window, window_s", [(0, 60.0), (3, 0.0)])
def test_a_budget_refuses_a_meaningless_setting(per_window, window_s):
    with pytest.raises(ValueError, match="per_window"):
        LogBudget("x", per_window=per_window, window_s=window_s)


def test_a_thousand_joins_are_a_thousand_events_and_a_few_log_lines(tmp_path, caplog):
    me, run = peer_id_of(Ed25519PrivateKey.generate().public_key()), "watch"
    sybils = [peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(1000)]
    log = tmp_path / "events.jsonl"
    events.open_log(log)
    try:
        members = Members(me, grace_s=10.0)
        members.update([], now=0.0)
        members.report(first=True, now=0.0)
        with caplog.at_level(logging.INFO, logger="node.daemon.watch"):
            members.update([peer_info(run, p) for p in sybils], now=1.0)
            members.report(first=False, now=1.0)
            members.update([peer_info(run, p) for p in sybils], now=70.0)
            members.report(first=False, now=70.0)
    finally:
        events.close_log()
    assert len(events.read_events(log, "peer.joined")) == 1000
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 11, lines
    assert lines[-1] == "990 more peers joined in the last 60 s (not logged one by one)"
