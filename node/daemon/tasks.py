"""Ownership of a node's background tasks: ``Owned`` starts them in a task group and
cancels them together; ``until_stopped`` runs one piece of work unless a stop comes
first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Coroutine


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
    """Await ``work`` unless ``stop`` is set first (then cancel it and wait for it to
    unwind). True if the work finished; its exception, if it raised one, propagates."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True
