"""A node's task ownership (``node.daemon.tasks``): tasks cancelled together, and work
that a stop cuts short."""

from __future__ import annotations

import asyncio
import contextlib
import time

from node.daemon.tasks import Owned, until_stopped


def test_owned_tasks_are_cancelled_together_and_awaited_by_their_group():
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    async def main() -> None:
        async with asyncio.TaskGroup() as tasks:
            own = Owned(tasks)
            own(forever("a"), "a")
            own(forever("b"), "b")
            await asyncio.sleep(0)
            own.cancel()
        assert sorted(ended) == ["a", "b"]  # the group awaited both

    asyncio.run(main())


def test_until_stopped_returns_whether_the_work_finished():
    async def main() -> None:
        stop = asyncio.Event()
        assert await until_stopped(stop, asyncio.sleep(0)) is True
        unwound = asyncio.Event()

        async def slow() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                unwound.set()

        stop.set()
        assert await until_stopped(stop, slow()) is False
        assert unwound.is_set()  # cancelled and awaited, not left running

    asyncio.run(main())


def test_until_stopped_passes_on_the_work_s_exception():
    async def fails() -> None:
        raise ValueError("bad")

    async def main() -> None:
        try:
            await until_stopped(asyncio.Event(), fails())
        except ValueError as e:
            assert str(e) == "bad"
        else:
            raise AssertionError("the exception was swallowed")

    asyncio.run(main())


def test_until_stopped_ends_work_that_absorbs_a_cancellation_and_passes_on_its_own():
    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # as a wait_for racing a result
            await asyncio.Event().wait()
        await asyncio.Event().wait()

    async def main() -> None:
        stop = asyncio.Event()
        stop.set()
        async with asyncio.timeout(5):  # a single cancellation would leave it waiting
            assert await until_stopped(stop, stubborn()) is False
        outer = asyncio.ensure_future(until_stopped(asyncio.Event(), stubborn()))
        await asyncio.sleep(0.01)
        outer.cancel()
        try:
            await asyncio.wait_for(outer, 5)
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the caller's cancellation was swallowed")

    asyncio.run(main())


def test_a_loop_stall_watch_counts_from_the_last_tick():
    """``LoopStallWatch`` names a stall once the loop has not ticked for ``stall_s``."""
    from node.daemon.tasks import LoopStallWatch

    watch = LoopStallWatch(60.0)
    try:
        watch.ticked()
        now = time.monotonic()
        assert watch.stalled_for(now) is None and watch.stalled_for(now + 59.0) is None
        assert watch.stalled_for(now + 61.0) >= 60.0
        watch.ticked()
        assert watch.stalled_for(now + 1.0) is None
    finally:
        watch.stop()
