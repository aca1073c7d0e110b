"""asyncio helpers that never swallow a cancellation.

Python 3.11's ``asyncio.wait_for`` returns the inner result when the task that awaits it
is cancelled in the same loop iteration as the inner awaitable completes: the
cancellation is lost, and a loop around it runs on after its owner cancelled it. So a
timed wait here is ``asyncio.timeout``, and a task is stopped by ``cancel_and_wait``.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)

RECANCEL_S = 0.5  # a task that has not ended is cancelled again this often


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; whether it is set. A cancellation of the
    caller propagates."""
    try:
        async with asyncio.timeout(max(timeout_s, 0.0)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def cancel_and_wait(task: asyncio.Future, timeout_s: float, what: str) -> bool:
    """Cancel ``task`` and wait for it to end, cancelling it again every ``RECANCEL_S``
    (a task may absorb one cancellation); give up after ``timeout_s`` (logged). True if it
    ended. Its result or exception is dropped; a cancellation of the caller propagates
    (after the task is cancelled)."""
    end = time.monotonic() + timeout_s
    while not task.done():
        task.cancel()
        remaining = end - time.monotonic()
        if remaining <= 0:
            logger.error("%s did not end within %.0f s of its cancellation", what, timeout_s)
            return False
        await asyncio.wait({task}, timeout=min(RECANCEL_S, remaining))
    if not task.cancelled() and task.exception() is not None:
        logger.debug("%s ended with %r", what, task.exception())
    return True
