"""node.aio: a loop that waits on an event ends when cancelled, however the cancellation
lines up with the event; a task that absorbs a cancellation still ends."""

import asyncio
import contextlib
import time

from node.aio import cancel_and_wait, wait_event


async def _loop_on(event: asyncio.Event, woken: list[int]) -> None:
    while True:
        event.clear()
        await wait_event(event, 10.0)
        woken.append(1)


def test_a_cancellation_in_the_iteration_the_event_is_set_ends_the_loop():
    async def body() -> bool:
        event, woken = asyncio.Event(), []
        task = asyncio.create_task(_loop_on(event, woken))
        await asyncio.sleep(0.01)
        event.set()
        await asyncio.sleep(0)  # the event's waiter is done; the loop has not resumed yet
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        return bool(done) and task.cancelled()

    assert asyncio.run(body())


def test_wait_event_says_whether_the_event_came():
    async def body() -> tuple[bool, bool]:
        event = asyncio.Event()
        late = await wait_event(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return late, await wait_event(event, 5.0)

    assert asyncio.run(body()) == (False, True)


async def _absorbs(cancellations: int, released: asyncio.Event | None = None) -> None:
    """Absorbs this many cancellations (all, until ``released``), then ends at the next."""
    while cancellations > 0 and not (released is not None and released.is_set()):
        cancellations -= 1
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
    await asyncio.sleep(3600)


def test_a_task_that_absorbs_a_cancellation_is_cancelled_again_until_it_ends():
    async def body() -> tuple[bool, bool]:
        task = asyncio.create_task(_absorbs(2))
        await asyncio.sleep(0)
        return await cancel_and_wait(task, 5.0, "absorber"), task.cancelled()

    assert asyncio.run(body()) == (True, True)


def test_a_task_that_never_ends_is_given_up_after_the_timeout():
    async def body() -> tuple[bool, float]:
        released = asyncio.Event()
        task = asyncio.create_task(_absorbs(10**6, released))
        await asyncio.sleep(0)
        started = time.monotonic()
        ended = await cancel_and_wait(task, 0.3, "stubborn")
        took = time.monotonic() - started
        released.set()
        await cancel_and_wait(task, 5.0, "released")
        return ended, took

    ended, took = asyncio.run(body())
    assert not ended and 0.25 < took < 2.0


def test_the_callers_cancellation_propagates():
    async def body() -> bool:
        released = asyncio.Event()
        task = asyncio.create_task(_absorbs(10**6, released))
        await asyncio.sleep(0)
        stopper = asyncio.create_task(cancel_and_wait(task, 60.0, "stubborn"))
        await asyncio.sleep(0.05)
        stopper.cancel()
        done, _ = await asyncio.wait({stopper}, timeout=1.0)
        released.set()
        await cancel_and_wait(task, 5.0, "released")
        return bool(done) and stopper.cancelled()

    assert asyncio.run(body())
