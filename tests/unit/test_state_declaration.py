"""How often a stage's averager declares its state's epoch in the DHT
(``HivemindTransport.sharing_epoch``): at once at most every ``DECLARE_EPOCH_S``, quietly
in between, so that the periodic declaration carries the newest epoch."""

from __future__ import annotations

import pytest

from node.averaging import transport
from node.averaging.transport import DECLARE_EPOCH_S, HivemindTransport
from protocol.run_spec import AveragingSpec


class _Process:
    """The part of ``StageAveragerProcess`` that ``sharing_epoch`` uses: hivemind's setter
    stores a declaration in the DHT when the priority changes (counted here)."""

    client_mode = False

    def __init__(self) -> None:
        self.allow_state_sharing = False
        self.priority = 0.0
        self.declared: list[float] = []

    @property
    def state_sharing_priority(self) -> float:
        return self.priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        if value != self.priority:
            self.declared.append(value)
        self.priority = value

    def set_state_priority_quietly(self, value: float) -> None:
        self.priority = value


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(transport.time, "monotonic", lambda: now[0])
    return now


def test_epochs_are_declared_at_once_at_most_every_declare_epoch_s(clock):
    process = _Process()
    t = HivemindTransport(process, [], AveragingSpec(), peer_id="me", name="test")  # type: ignore[arg-type]
    t.sharing_epoch(3)
    assert process.declared == []  # not sharing yet: nothing is declared
    t.share_state(4)
    assert process.declared == [4.0]
    for epoch in range(5, 13):  # four epochs a second (exact steps of the clock)
        clock[0] += 0.25
        t.sharing_epoch(epoch)
        assert process.priority == epoch  # the periodic declaration carries the newest
    # 2 s of epochs: the one that came 2 s after the last declaration is declared at once
    assert DECLARE_EPOCH_S == 2.0
    assert process.declared == [4.0, 12.0]
    clock[0] += 0.25
    t.sharing_epoch(13)
    assert process.declared == [4.0, 12.0] and process.priority == 13.0
