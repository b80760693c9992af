"""Work a daemon starts and does not wait for (a commit passed down the tree, a batch of
prepares sent up it): the event loop keeps only weak references to its tasks, so each
one is held here until it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


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
