"""A node's task ownership (``node.daemon.tasks``): tasks cancelled together, and work
that a stop cuts short."""

from __future__ import annotations

import asyncio

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
