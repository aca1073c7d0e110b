"""When a stage's progress is read next (``node.averaging.progress``): soon while a round
waits only on the other peers' last samples, at the report period otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.averaging.progress import (
    FAST_READ_S,
    FAST_READS,
    ProgressBoard,
    ReadCadence,
    waiting_on_others,
)
from protocol.progress import Progress
from tests.averaging_peer import make_spec

PERIOD = 0.5


def test_we_wait_on_the_others_once_our_share_is_in_and_the_batch_is_not():
    others = [Progress("a", 3, 8)]
    assert waiting_on_others("me", 3, 16, others, 32, per_peer=False)  # our 16 of 32
    assert not waiting_on_others("me", 3, 8, others, 32, per_peer=False)  # ours not in yet
    assert not waiting_on_others("me", 3, 24, others, 32, per_peer=False)  # due: no wait
    assert not waiting_on_others("me", 3, 32, [], 32, per_peer=False)  # alone: ours decide
    # a peer at another epoch does not share the batch
    assert not waiting_on_others("me", 3, 16, [Progress("a", 2, 8)], 32, per_peer=False)


def test_per_peer_targets_wait_once_ours_make_up_our_own_target():
    others = [Progress("a", 0, 100), Progress("b", 0, 0)]
    assert waiting_on_others("me", 0, 320, others, 320, per_peer=True)
    assert not waiting_on_others("me", 0, 319, others, 320, per_peer=True)


def test_reads_come_fast_for_a_bounded_number_of_reads_then_at_the_period():
    cadence = ReadCadence()
    assert cadence.delay(False, PERIOD) == PERIOD
    delays = [cadence.delay(True, PERIOD) for _ in range(FAST_READS + 3)]
    assert delays == [FAST_READ_S] * FAST_READS + [PERIOD] * 3
    assert cadence.delay(False, PERIOD) == PERIOD
    assert cadence.delay(True, PERIOD) == FAST_READ_S  # a new wait starts fast again


def test_a_period_shorter_than_the_fast_read_wins():
    assert ReadCadence().delay(True, 0.01) == 0.01
    with pytest.raises(ValueError, match="fast"):
        ReadCadence(0.0)


def test_the_board_reads_soon_while_the_others_hold_the_round():
    dht = SimpleNamespace(peer_id="me")
    board = ProgressBoard(dht, make_spec("cadence"), 0, ttl_s=2.0, name="stage 0")
    board.records = [Progress("a", 1, 8)]
    assert board.next_read(1, 16, 32, per_peer=False, period=PERIOD) == FAST_READ_S
    assert board.next_read(1, 8, 32, per_peer=False, period=PERIOD) == PERIOD
