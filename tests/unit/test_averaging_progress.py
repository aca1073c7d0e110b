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


def test_a_claim_of_being_ahead_that_was_not_proven_is_ignored_for_a_while():
    board, now = _board()
    board.records = [Progress("a", 3, 5), Progress("liar", 2**50, 0)]
    assert board.ahead(3) == ["liar"]
    board.distrust(["liar"], 60.0)  # asked for its state, it handed over none
    assert board.view() == [Progress("a", 3, 5)] and not board.ahead_of(3)
    board.records = [Progress("a", 3, 5), Progress("liar", 2**50, 0)]  # read again
    board.learn({"liar": 2**51})  # or said so in a round
    assert board.view() == [Progress("a", 3, 5)]
    now[0] += 60.0  # once the time is up, a new claim is heard (and must be proven again)
    assert board.ahead(3) == ["liar"]
