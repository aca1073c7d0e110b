"""``ProgressBoard``'s view of the other peers' progress, driven with a virtual clock and
records set by hand (``refresh`` is the only part that reads the DHT)."""

from __future__ import annotations

from types import SimpleNamespace

from node.averaging.progress import ProgressBoard
from protocol.averaging import Progress
from tests.averaging_peer import make_spec

TTL = 2.0


def _board() -> tuple[ProgressBoard, list[float]]:
    now = [100.0]
    dht = SimpleNamespace(peer_id="me")  # only its peer id is read outside refresh/publish
    board = ProgressBoard(
        dht, make_spec("progress"), 1, ttl_s=TTL, name="stage 1", clock=lambda: now[0]
    )
    return board, now


def test_a_peer_missing_from_a_read_stays_for_the_time_to_live():
    board, now = _board()
    assert board.alone and board.peers == 0
    board.records = [Progress("a", 3, 5)]
    assert board.view() == [Progress("a", 3, 5)] and not board.alone
    board.records = []  # one read missed it
    now[0] += TTL - 0.5
    assert board.view() == [Progress("a", 3, 5)] and board.peers == 1
    now[0] += 1.0
    assert board.view() == [] and board.peers == 0 and board.alone


def test_an_epoch_never_goes_down_and_groupmates_are_learned():
    board, now = _board()
    board.records = [Progress("a", 3, 5)]
    board.view()
    board.records = [Progress("a", 2, 9)]  # an older copy of a's record
    assert board.view() == [Progress("a", 3, 0)]
    board.learn({"b": 4})  # a groupmate the reads do not show (yet)
    assert Progress("b", 4, 0) in board.view()
    assert board.ahead_of(3) and not board.ahead_of(4)
