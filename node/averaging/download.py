"""A stage's state for a peer that takes the stage: downloaded from a peer of it, else
the newer of a state kept on disk and an archive's, else the initial weights
(``protocol.archive.start_from``).

Everything that arrives is checked against the local stage (``node.averaging.state``)
before it replaces anything. Peers' progress records are claims: only epochs consistent
with the stage's other peers count (``protocol.progress.believable_epochs``), a peer that
claims more is ignored for a while (``ProgressBoard.distrust``), and a downloaded state
further ahead than the believable epochs is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

import torch

from node import events
from node.averaging import state as stage_state
from node.averaging.progress import ProgressBoard
from node.averaging.state import StageState, StateError
from node.averaging.strategies import Strategy
from node.averaging.transport import HivemindTransport
from protocol.archive import Start, start_from
from protocol.progress import MAX_EPOCHS_AHEAD, believable_epochs

logger = logging.getLogger(__name__)

# A state kept on disk: its metadata, tensors, and where it was kept (for log lines).
Saved = tuple[dict, list[torch.Tensor], str]
DOUBTED_S = 60.0  # how long the progress of a peer far ahead of the others is ignored
REFUSED_SOURCE_S = 600.0  # how long a peer whose state did not fit hands over none


class StateDownloadError(RuntimeError):
    """Peers of the stage exist, but none of them handed over a usable state in time."""


@dataclass(frozen=True)
class LoadedState:
    origin: Start  # where the state came from (``protocol.archive.start_from``)
    step: int
    epoch: int
    source: str | None = None  # the peer (a stage peer or an archive), or the saved path

    @property
    def loaded(self) -> bool:
        """From a peer, an archive or disk; False: the initial weights."""
        return self.origin is not Start.INITIAL


async def download(
    transport: HivemindTransport,
    strategy: Strategy,
    timeout_s: float,
    *,
    name: str,
    only: Collection[str] | None = None,
) -> StageState | None:
    """A peer's state of the stage (from one of ``only``, if given), checked; None (logged)
    if none valid came in time. A peer whose state does not fit the stage hands over none
    for ``REFUSED_SOURCE_S``."""
    found = await transport.download(timeout_s, only=only)
    if found is None:
        return None
    metadata, tensors, source = found
    try:
        return stage_state.parse(
            metadata, tensors, strategy.module, mode=strategy.mode, source=source
        )
    except StateError as e:
        refuse(transport, source, REFUSED_SOURCE_S, f"{e}", name=name)
        return None


def refuse(transport: HivemindTransport, source: str, for_s: float, why: str, *, name: str) -> None:
    """Take no state from ``source`` for ``for_s`` seconds (logged, and emitted as
    ``averaging.state_refused``): it handed over one we refused, ``why``."""
    logger.warning(
        "%s: refused the state %s handed over (%s): no state is taken from it for %.0f s",
        name, source, why, for_s,
    )  # fmt: skip
    events.emit("averaging.state_refused", averager=name, source=source, reason=why[:200])
    transport.refuse_source(source, for_s)


async def initial_state(
    board: ProgressBoard,
    transport: HivemindTransport,
    strategy: Strategy,
    *,
    timeout_s: float,
    retry_s: float,
    saved: Saved | None,
    name: str,
    archived: Callable[[], Awaitable[dict[str, int]]] | None = None,
) -> LoadedState:
    """Load the state a copy starts from into ``strategy``, by ``start_from``'s rule over
    the live peers' progress records, ``saved`` (if it fits the stage) and what the
    archives hold (``archived()``: archive peer -> epoch of the stage).

    From live peers: download from one of them, trying again every ``retry_s``;
    ``StateDownloadError`` if none hands over a valid state within ``timeout_s``. From an
    archive: its claim is only a claim; the download is checked, and taken only if it is
    newer than ``saved``. A ``saved`` newer than every live peer's state is kept: they
    catch up from this copy."""
    kept = None
    if saved is not None:
        metadata, tensors, where = saved
        try:
            kept = stage_state.parse(metadata, tensors, strategy.module, mode=strategy.mode)
        except StateError as e:
            logger.warning("%s: cannot resume from %s: %s", name, where, e)
    kept_epoch = None if kept is None else kept.epoch
    deadline = time.monotonic() + timeout_s
    while True:
        others = await board.refresh()
        epochs = believable_epochs([p.epoch for p in others])
        if doubted := [p for p in others if p.epoch > max(epochs, default=0)]:
            logger.warning(
                "%s: ignoring the progress of %d peers far ahead of the others (%s at "
                "epoch %d; the others at most %d)",
                name, len(doubted), doubted[0].peer_id, doubted[0].epoch, max(epochs),
            )  # fmt: skip
            board.distrust([p.peer_id for p in doubted], DOUBTED_S)
            others = [p for p in others if p.epoch <= max(epochs, default=0)]
        archives = await archived() if archived is not None else {}
        start = start_from(epochs, kept_epoch, archives.values())
        if start not in (Start.PEERS, Start.ARCHIVE):
            break
        state = await download(
            transport, strategy, max(1.0, deadline - time.monotonic()), name=name
        )
        if state is not None and start is Start.PEERS and not _believable(state, epochs):
            near = max(epochs, default=0)
            why = f"epoch {state.epoch}, far ahead of the stage's peers (at most {near})"
            refuse(transport, state.source, DOUBTED_S, why, name=name)
            board.distrust([state.source], DOUBTED_S)
            state = None
        if state is not None and (
            start is Start.PEERS or kept_epoch is None or state.epoch > kept_epoch
        ):
            # The records of peers just killed outlive them: the state may be an archive's.
            origin = Start.ARCHIVE if state.source in archives else Start.PEERS
            why = "" if others else "no live peer holds it; "
            return await _take(strategy, state, origin, name, why)
        if start is Start.ARCHIVE:
            logger.warning(
                "%s: an archive holds epoch %d of it, but no newer state than ours came",
                name,
                max(archives.values()),
            )
            break
        if time.monotonic() > deadline:
            raise StateDownloadError(
                f"{name} has {len(others)} live peers, but none of them handed over a valid "
                f"state within {timeout_s:.0f} s"
            )
        await asyncio.sleep(retry_s)
    if kept is not None:
        why = "its peers are behind it; " if others else "no peer holds it; "
        return await _take(strategy, kept, Start.CHECKPOINT, name, why, saved[2])
    logger.info("%s: no peer holds it, starting from initial weights", name)
    return LoadedState(Start.INITIAL, strategy.optimizer.step_count, strategy.epoch)


def _believable(state: StageState, epochs: list[int]) -> bool:
    """Whether a state downloaded from a peer is at most ``MAX_EPOCHS_AHEAD`` past the
    stage's believable epochs (else its source lied, or ran on alone)."""
    return state.epoch <= max(epochs, default=0) + MAX_EPOCHS_AHEAD


async def _take(
    strategy: Strategy,
    state: StageState,
    origin: Start,
    name: str,
    why: str,
    where: str | None = None,
) -> LoadedState:
    await asyncio.to_thread(strategy.apply_state, state)
    source = where or state.source
    step, epoch = strategy.optimizer.step_count, strategy.epoch
    logger.info(
        "%s: %sloaded step %d (epoch %d) from %s %s", name, why, step, epoch, origin, source
    )
    return LoadedState(origin, step, epoch, source)
