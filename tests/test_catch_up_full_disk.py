"""A coordinator whose own store cannot take a commit its peers hold (a full disk) still
decides: its catch-up before a decision gives up on that step instead of failing the
decision, which would leave the job waiting for a plan (`Job._catch_up`). Pure logic
with stand-ins for the store, the membership and the links."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from stalwart.daemon.job import Job
from stalwart.daemon.recovery.membership import UP


def test_a_commit_this_daemons_full_disk_refuses_ends_the_catch_up_without_raising():
    taken: list[int] = []

    async def take_commit(node: str, job_id: str, step: int) -> None:
        taken.append(step)
        raise OSError(28, "No space left on device")

    job = SimpleNamespace(
        snapshots=SimpleNamespace(store=SimpleNamespace(latest_committed=lambda: 2)),
        membership=SimpleNamespace(peers=lambda: [
            SimpleNamespace(node="node-1", state=UP, latest_committed=4)]),
        config=SimpleNamespace(job_id="job", snapshot=SimpleNamespace(retain=8)),
        links=SimpleNamespace(take_commit=take_commit))
    asyncio.run(Job._catch_up(job))  # returns: the decision goes on from step 2
    assert taken == [3]  # and the steps after the refused one are not tried
