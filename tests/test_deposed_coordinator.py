"""A coordinator whose etcd seat lapsed commits no more steps; its successor commits
them. Seen under load: a deposed coordinator went on committing for a second, leaving
steps committed on its own daemon alone, and the successor could never commit the later
steps whose deltas needed them. In-process coordinator over two daemons."""

from __future__ import annotations

import asyncio

from coordinator_links import Daemons

from stalwart.core.step_record import seal
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

LAYOUT = common_pb2.ParallelLayout(dp=2, pp=1, tp=1, schedule="1f1b", microbatches=1,
                                   grad_accum=1)


def prepares(step: int) -> list[peer_pb2.PrepareStepRequest]:
    """Both daemons' prepares of `step` (rank 0 on n0, rank 1 on n1)."""
    return [peer_pb2.PrepareStepRequest(
        job_id="job", step=step, generation=1, node=node, layout=LAYOUT,
        seal=seal(node, [manifest_pb2.RankState(rank=rank, node=node)]))
        for node, rank in (("n0", 0), ("n1", 1))]


def test_a_coordinator_that_lost_its_seat_commits_no_more_steps() -> None:
    async def main() -> tuple[list[int], list[int]]:
        daemons = Daemons()
        c = Coordinator(node="n0", job_id="job", metrics=Metrics(), links=daemons,
                        latest_committed=lambda: max(daemons.committed, default=None))
        for rank_id, node, rank in (("n0/1", "n0", 0), ("n1/2", "n1", 1)):
            await c.announce(peer_pb2.RankAnnouncement(
                node=node, rank_id=rank_id, rank=rank, world_size=2, layout=LAYOUT,
                generation=1))
        await c.prepared(*prepares(1))
        seated = list(daemons.committed)
        daemons.seated = False  # etcd did not renew the lease in time: deposed
        await c.prepared(*prepares(2))
        return seated, daemons.committed

    seated, after = asyncio.run(main())
    assert seated == [1]
    assert after == [1]  # step 2 waits for the successor
