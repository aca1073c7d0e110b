"""A stage's state for a peer that takes the stage: downloaded from a peer of it, else
resumed from a state kept on disk, else the initial weights.

Everything that arrives is checked against the local stage (``node.averaging.state``)
before it replaces anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from node.averaging import state as stage_state
from node.averaging.progress import ProgressBoard
from node.averaging.state import StageState, StateError
from node.averaging.strategies import Strategy
from node.averaging.transport import HivemindTransport

logger = logging.getLogger(__name__)

# A state kept on disk: its metadata, tensors, and where it was kept (for log lines).
Saved = tuple[dict, list[torch.Tensor], str]


class StateDownloadError(RuntimeError):
    """Peers of the stage exist, but none of them handed over a usable state in time."""


@dataclass(frozen=True)
class LoadedState:
    loaded: bool  # from a peer or from disk; False: the initial weights
    step: int
    epoch: int
    source: str | None = None  # the peer, or the path of the saved state


async def download(
    transport: HivemindTransport, strategy: Strategy, timeout_s: float, *, name: str
) -> StageState | None:
    """A peer's state of the stage, checked; None (logged) if none valid came in time."""
    found = await transport.download(timeout_s)
    if found is None:
        return None
    try:
        return stage_state.parse(*found, strategy.module, mode=strategy.mode)
    except StateError as e:
        logger.warning("%s: refused a downloaded state: %s", name, e)
        return None


async def initial_state(
    board: ProgressBoard,
    transport: HivemindTransport,
    strategy: Strategy,
    *,
    timeout_s: float,
    retry_s: float,
    saved: Saved | None,
    name: str,
) -> LoadedState:
    """Load the state a copy starts from into ``strategy``.

    While the stage has live peers (progress records), download from one of them, trying
    again every ``retry_s``; ``StateDownloadError`` if none hands over a valid state within
    ``timeout_s``. With no live peer, start from ``saved`` if it fits the stage, else keep
    the initial weights."""
    deadline = time.monotonic() + timeout_s
    while others := await board.refresh():
        state = await download(
            transport, strategy, max(1.0, deadline - time.monotonic()), name=name
        )
        if state is not None:
            await asyncio.to_thread(strategy.apply_state, state)
            logger.info(
                "%s: loaded step %d (epoch %d) from %s",
                name,
                strategy.optimizer.step_count,
                strategy.epoch,
                state.source,
            )
            return LoadedState(True, strategy.optimizer.step_count, strategy.epoch, state.source)
        if time.monotonic() > deadline:
            raise StateDownloadError(
                f"{name} has {len(others)} live peers, but none of them handed over a valid "
                f"state within {timeout_s:.0f} s"
            )
        await asyncio.sleep(retry_s)
    if saved is not None:
        metadata, tensors, where = saved
        try:
            state = stage_state.parse(metadata, tensors, strategy.module, mode=strategy.mode)
        except StateError as e:
            logger.warning("%s: cannot resume from %s: %s", name, where, e)
        else:
            await asyncio.to_thread(strategy.apply_state, state)
            logger.info(
                "%s: no peer holds it, resumed step %d (epoch %d) from %s",
                name,
                strategy.optimizer.step_count,
                strategy.epoch,
                where,
            )
            return LoadedState(True, strategy.optimizer.step_count, strategy.epoch, where)
    logger.info("%s: no peer holds it, starting from initial weights", name)
    return LoadedState(False, strategy.optimizer.step_count, strategy.epoch)
