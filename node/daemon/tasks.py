"""Ownership of a node's background tasks: ``Owned`` starts them in a task group and
cancels them together; ``until_stopped`` runs one piece of work unless a stop comes
first; ``LoopStallWatch`` ends the process when its event loop stops running."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
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


class LoopStallWatch:
    """A daemon thread that ends the process when the event loop stops running: the loop
    calls ``ticked`` every few seconds, and past ``stall_s`` seconds without a tick the
    thread prints the node's one-line error and exits with status 2 (a service manager
    restarts the node; its children die with it). For a call that blocks the loop for good
    (a child process stuck, a pipe to it full): no task of the node, its watchdog
    included, runs again, and nothing short of this ends it. ``stop`` ends the thread."""

    def __init__(self, stall_s: float, check_s: float = 5.0) -> None:
        self.stall_s = stall_s
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._check_s = check_s
        threading.Thread(target=self._watch, name="loop-stall-watch", daemon=True).start()

    def ticked(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def stalled_for(self, now: float) -> float | None:
        """Seconds the loop has not ticked, once that is past ``stall_s``; else None."""
        idle = now - self._last
        return idle if idle >= self.stall_s else None

    def _watch(self) -> None:
        while not self._stopped.wait(self._check_s):
            if (idle := self.stalled_for(time.monotonic())) is not None:
                sys.stderr.write(
                    f"swarmtrain node: error: this node's event loop has not run for "
                    f"{idle:.0f} s (a call into a stuck process?): stopping\n"
                )
                sys.stderr.flush()
                os._exit(2)
