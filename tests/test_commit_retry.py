"""A commit that fails on the coordinator's own disk (full) while a peer committed it is
retried on its own, with the same record, so the job's last steps still commit once
the disk has room (before: retried only when another prepare came, and with a rebuilt
record the peer refused)."""

from __future__ import annotations

import asyncio
import errno
import time

from stalwart.core.step_record import seal
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2


class Links:
    """Two daemons: n0 (the coordinator) with a full disk until `full` is cleared, n1
    that refuses a second, different record for a step it committed."""

    def __init__(self) -> None:
        self.full = True
        self.committed: dict[str, dict[int, manifest_pb2.StepRecord]] = {"n0": {}, "n1": {}}
        self.refused = 0
        self.full_refusals = 0  # commits n0's full disk failed

    def nodes(self) -> list[str]:
        return ["n0", "n1"]

    def holds_seat(self) -> bool:
        return True

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes
                          ) -> None:
        if isinstance(request, bytes):  # what goes to another daemon is sent as bytes
            request = peer_pb2.CommitStepRequest.FromString(request)
        record = request.record
        if node == "n0" and self.full:
            self.full_refusals += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        old = self.committed[node].get(record.step)
        if old is not None and old != record:
            self.refused += 1
            raise ValueError(f"step {record.step} is already committed with a different "
                             "record")
        self.committed[node][record.step] = record


def test_a_commit_that_failed_on_the_coordinators_full_disk_is_retried_unprompted() -> None:
    async def scenario() -> Links:
        links = Links()
        coordinator = Coordinator(
            node="n0", job_id="job", metrics=Metrics(), links=links,
            latest_committed=lambda: max(links.committed["n0"], default=None))
        await coordinator.prepared(peer_pb2.PrepareStepRequest(
            job_id="job", step=12, generation=1, node="n0",
            seal=seal("n0", [manifest_pb2.RankState(rank=0, node="n0")]),
            layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1)))
        assert 12 in links.committed["n1"] and not links.committed["n0"]
        deadline = time.monotonic() + 30.0
        while links.full_refusals < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert links.full_refusals >= 2, "the commit was not retried while the disk was full"
        links.full = False  # space freed; no further prepare will come
        while 12 not in links.committed["n0"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return links

    links = asyncio.run(scenario())
    assert 12 in links.committed["n0"], "the final step never committed on the coordinator"
    assert links.refused == 0
    assert links.committed["n0"][12] == links.committed["n1"][12]
