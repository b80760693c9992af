"""Work a daemon starts and does not wait for (a commit passed down the tree, a batch of
prepares sent up it): the event loop keeps only weak references to its tasks, so each
one is held here until it ends. And work that stops waiting at an event (`until`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Background:
    """Tasks in flight, each held until it is done."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `work` on the running loop without awaiting it."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait until no task is in flight, those the waited ones start included."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def cancel(self) -> None:
        """Cancel every task in flight and wait for them to end."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)


async def until(work: Awaitable[T], event: Awaitable[Any]) -> asyncio.Future[T]:
    """Runs `work` until it ends or `event` comes, whichever is first, and returns the
    work's future: done, or cancelled when the event came first. `event` is cancelled
    once work ends."""
    running = asyncio.ensure_future(work)
    came = asyncio.ensure_future(event)
    try:
        await asyncio.wait({running, came}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        came.cancel()
        if not running.done():
            running.cancel()
    await asyncio.gather(running, return_exceptions=True)  # until a cancelled one ends
    return running
