"""``ProgressInbox``: what a peer's push reaches, and what an invalid one costs its sender
(driven directly, without a daemon: ``tests/live/test_parity_live.py`` pushes for real)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from hivemind.proto import runtime_pb2

from node.averaging.progress_push import MAX_RECORD_BYTES, ProgressInbox
from protocol.records import RecordError
from protocol.routing import BanList

SENDER = "12D3KooWsender"


def _context() -> SimpleNamespace:
    return SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: SENDER))


def _push(inbox: ProgressInbox, stage: str, record: bytes) -> bytes:
    request = runtime_pb2.ExpertRequest(uid=stage, metadata=record)
    return asyncio.run(inbox.rpc_progress(request, _context())).metadata


def test_a_push_reaches_the_stage_it_names_from_the_peer_that_sent_it():
    taken: list[tuple[bytes, str]] = []

    def receiver(raw: bytes, sender: str) -> bool:
        taken.append((raw, sender))
        return raw == b"new"

    inbox = ProgressInbox()
    inbox.add(1, receiver)
    assert _push(inbox, "1", b"new") == b"1"
    assert _push(inbox, "1", b"old") == b""
    assert taken == [(b"new", SENDER), (b"old", SENDER)]
    for stage in ("0", "-1", "one", "9" * 40):  # a stage not held here, or not a stage
        assert _push(inbox, stage, b"new") == b""
    inbox.remove(1, receiver)
    assert _push(inbox, "1", b"new") == b"" and len(taken) == 2


def test_invalid_pushes_are_refused_and_get_their_sender_banned():
    seen: list[bytes] = []

    def receiver(raw: bytes, sender: str) -> bool:
        seen.append(raw)
        raise RecordError("not a progress record")

    callers = BanList(strikes=2)
    inbox = ProgressInbox(callers=callers)
    inbox.add(0, receiver)
    with pytest.raises(RecordError):
        _push(inbox, "0", b"x" * (MAX_RECORD_BYTES + 1))  # refused before it is decoded
    assert seen == [] and callers.until(SENDER, time.monotonic()) is None
    with pytest.raises(RecordError):
        _push(inbox, "0", b"garbage")
    assert seen == [b"garbage"] and callers.until(SENDER, time.monotonic()) is not None
