"""Ownership of a node's background tasks: ``Owned`` starts them in a task group and
cancels them together; ``until_stopped`` runs one piece of work unless a stop comes
first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine

from node.aio import cancel_and_wait

UNWIND_S = 30.0  # work cut short by a stop unwinds within this, or is left behind


class Owned:
    """The background tasks a node starts in ``tasks`` (an ``asyncio.TaskGroup``), which it
    cancels together when it stops (the group then awaits them)."""

    def __init__(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = tasks
        self._owned: list[asyncio.Task[None]] = []

    def __call__(self, work: Coroutine[object, object, None], name: str) -> None:
        """Start ``work`` as task ``name``."""
        self._owned.append(self._tasks.create_task(work, name=name))

    def cancel(self) -> None:
        """Cancel every task started here."""
        for task in self._owned:
            task.cancel()


async def until_stopped(stop: asyncio.Event, work: Awaitable[object]) -> bool:
    """Await ``work`` unless ``stop`` is set first (then cancel it and wait at most
    ``UNWIND_S`` for it to unwind). True if the work finished; its exception, if it raised
    one, propagates. A cancellation of the caller propagates too (the work cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        await cancel_and_wait(task, UNWIND_S, "work cut short by the node's stop")
    if not task.done() or task.cancelled():
        return False
    task.result()
    return True
