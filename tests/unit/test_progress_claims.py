"""A joiner's download of a stage's state trusts the stage's peers as a whole, not whoever
claims to be furthest ahead: ``protocol.progress.believable_epochs`` and its use in
``node.averaging.download.initial_state``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node.averaging.download import StateDownloadError, initial_state
from protocol.progress import MAX_EPOCHS_AHEAD, Progress, believable_epochs

LIAR = 2**50


def test_a_claim_far_past_the_median_is_not_believed():
    assert believable_epochs([]) == []
    assert believable_epochs([LIAR]) == [LIAR]  # alone: nothing to compare with
    assert believable_epochs([37, LIAR]) == [37]  # the lower median is the honest one
    assert believable_epochs([37, 36, LIAR, LIAR]) == [37, 36]
    assert believable_epochs([37, 37 + MAX_EPOCHS_AHEAD, 30]) == [37, 37 + MAX_EPOCHS_AHEAD, 30]
    assert believable_epochs([LIAR, LIAR, 37]) == [LIAR, LIAR, 37]  # a majority of liars wins
    with pytest.raises(ValueError, match="max_ahead"):
        believable_epochs([1], max_ahead=-1)


class _Board:
    """A stage's progress as read: an honest peer, and one that claims epoch 2^50."""

    def __init__(self) -> None:
        self.distrusted: list[str] = []

    async def refresh(self) -> list[Progress]:
        return [Progress("honest", 37, 0), Progress("liar", LIAR, 0)]

    def distrust(self, peers: list[str], for_s: float) -> None:
        self.distrusted += peers


class _NoState:
    """A transport through which no state comes."""

    async def download(self, timeout_s: float, *, only: object = None) -> None:
        return None


def test_a_joiner_ignores_the_peer_far_ahead_and_downloads_for_the_others_epoch():
    board = _Board()
    strategy = SimpleNamespace(optimizer=SimpleNamespace(step_count=0), epoch=0)
    with pytest.raises(StateDownloadError, match="1 live peers"):
        asyncio.run(
            initial_state(
                board, _NoState(), strategy, timeout_s=0.0, retry_s=0.0, saved=None, name="t"
            )  # type: ignore[arg-type]
        )
    assert board.distrusted == ["liar"]
