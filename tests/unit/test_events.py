"""The structured event log (``node.events``): what is written is read back, a torn last
line or a failing disk costs events and never the caller; and the services' ban decision
is written as a ``peer.banned`` event."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2PContext, PeerID

from node import events
from node.rpc.service import NodeServicer
from protocol.identity import peer_id_of
from protocol.routing import BanList


def test_events_round_trip_with_their_fields(event_log: Path) -> None:
    events.emit("stage.held", stage=1, role="first", loaded="peers")
    events.emit("node.stopped")
    events.emit("checkpoint.written", stage=0, epoch=3, path=Path("/x/y"))  # str()'d
    all_events = events.read_events(event_log)
    assert [e["event"] for e in all_events] == ["stage.held", "node.stopped", "checkpoint.written"]
    (held,) = events.read_events(event_log, "stage.held")
    assert {k: held[k] for k in ("stage", "role", "loaded")} == {
        "stage": 1,
        "role": "first",
        "loaded": "peers",
    }
    assert isinstance(held["t"], float)
    assert events.read_events(event_log, "checkpoint.written")[0]["path"] == "/x/y"


def test_a_torn_last_line_and_a_missing_file_are_skipped(event_log: Path, tmp_path: Path) -> None:
    events.emit("node.state", state="serving")
    events.close_log()
    with event_log.open("a") as f:  # a writer killed mid-line
        f.write(json.dumps({"t": 1.0, "event": "node.state", "state": "leaving"})[:20])
    assert [e["state"] for e in events.read_events(event_log, "node.state")] == ["serving"]
    assert events.read_events(tmp_path / "never-written.jsonl") == []


def test_reopening_appends_and_a_new_log_gets_its_folders(event_log: Path) -> None:
    events.emit("node.started", run="r@x", peer="p", maddrs=[])
    events.open_log(event_log)  # a second open (a restart) keeps what is there
    events.emit("node.stopped")
    assert [e["event"] for e in events.read_events(event_log)] == ["node.started", "node.stopped"]
    elsewhere = event_log.parent / "run" / "events" / "peer.jsonl"
    events.open_log(elsewhere)  # the one open log: the previous one is closed
    events.emit("node.state", state="joining")
    assert [e["event"] for e in events.read_events(elsewhere)] == ["node.state"]
    assert len(events.read_events(event_log)) == 2


def test_emit_without_an_open_log_does_nothing(tmp_path: Path) -> None:
    events.close_log()
    events.emit("node.stopped", anything=object())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failing_write_never_raises() -> None:
    events.open_log(Path("/dev/full"))  # every write fails with ENOSPC
    try:
        events.emit("node.state", state="serving")
    finally:
        events.close_log()


class _Service(NodeServicer):
    service_name = "swarmtrain.test"


def _context(caller: PeerID) -> P2PContext:
    return P2PContext(handle_name="swarmtrain.test.rpc_x", local_id=caller, remote_id=caller)


def _peer() -> PeerID:
    return PeerID.from_base58(peer_id_of(Ed25519PrivateKey.generate().public_key()))


def test_a_caller_banned_by_a_service_is_one_peer_banned_event(event_log: Path) -> None:
    service = _Service()
    service.callers = BanList(duration_s=60, strikes=2, window_s=60)
    caller, other = _peer(), _peer()
    service.refused(_context(caller), "a request", "bad")
    service.refused(_context(other), "a request", "bad")
    assert events.read_events(event_log, "peer.banned") == [], "one refusal each bans nobody"
    service.refused(_context(caller), "a request", "bad again")
    service.refused(_context(caller), "a request", "banned already: no second event")
    (banned,) = events.read_events(event_log, "peer.banned")
    assert banned["peer"] == caller.to_base58() and banned["service"] == "swarmtrain.test"
    assert service.ban_refusal(_context(caller)) is not None
    assert service.ban_refusal(_context(other)) is None


def test_a_log_past_its_limit_keeps_one_older_copy_and_a_child_appends_on(
    event_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``MAX_LOG_BYTES`` the log is renamed to ``NAME.1`` and a new one opened: no
    event of the process is lost across one rotation, at most two files' worth is kept,
    and a forked child appends to the live log by its path, never rotating it."""
    monkeypatch.setattr(events, "MAX_LOG_BYTES", 2_000)
    for i in range(30):  # ~60 bytes each: one rotation
        events.emit("train.progress", micro_batches=i, loss=1.0)
    backup = event_log.with_name(event_log.name + ".1")
    kept = events.read_events(backup) + events.read_events(event_log)
    assert [e["micro_batches"] for e in kept] == list(range(30))
    assert 0 < event_log.stat().st_size < backup.stat().st_size <= 2_100
    for i in range(30, 100):  # more rotations: the oldest copies go
        events.emit("train.progress", micro_batches=i, loss=1.0)
    kept = events.read_events(backup) + events.read_events(event_log)
    assert [e["micro_batches"] for e in kept] == list(range(100 - len(kept), 100))
    assert sorted(p.name for p in event_log.parent.iterdir()) == [event_log.name, backup.name]

    # A forked child (another pid than the log's opener) appends to the file at the log's
    # path, the one the opener writes to since its last rotation, and never rotates.
    owner = events._owner
    monkeypatch.setattr(events, "_owner", os.getpid() + 1)
    for _ in range(40):
        events.emit("node.state", state="child")
    assert len(events.read_events(event_log, "node.state")) == 40
    assert event_log.stat().st_size > 2_000
    # The opener rotates at its next event; the child's next line goes to the new log.
    monkeypatch.setattr(events, "_owner", owner)
    events.emit("train.progress", micro_batches=100, loss=1.0)
    monkeypatch.setattr(events, "_owner", os.getpid() + 1)
    events.emit("node.state", state="after")
    assert [e["state"] for e in events.read_events(backup, "node.state")] == ["child"] * 40
    assert [e["state"] for e in events.read_events(event_log, "node.state")] == ["after"]
