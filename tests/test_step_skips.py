"""The coordinator skips what can never commit and goes on: a step whose prepares were
lost (a later step is complete), and a step whose deltas apply to a skipped one (a
capture may delta against the previous step before that commits). Pure logic: the
real Coordinator with stand-in links that record what was committed where."""

from __future__ import annotations

import asyncio

import pytest

from stalwart.core.step_record import seal
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

LAYOUT = common_pb2.ParallelLayout(dp=2, pp=1, tp=1)


class Links:
    def __init__(self) -> None:
        self.committed: dict[str, list[int]] = {"n0": [], "n1": []}

    def nodes(self) -> list[str]:
        return ["n0", "n1"]

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes
                          ) -> None:
        if isinstance(request, bytes):
            request = peer_pb2.CommitStepRequest.FromString(request)
        self.committed[node].append(request.record.step)


def prepare(step: int, node: str, rank: int, base: int | None = None
            ) -> peer_pb2.PrepareStepRequest:
    """`node`'s prepare of its one rank, a delta against `base` when given."""
    chunks = [] if base is None else [manifest_pb2.ChunkRecord(
        chunk_id=f"s{step}-r{rank}-c0", base_step=base, codec=manifest_pb2.XOR_DELTA_ZSTD)]
    state = manifest_pb2.RankState(rank=rank, node=node, chunks=chunks)
    return peer_pb2.PrepareStepRequest(job_id="job", step=step, generation=1, node=node,
                                       seal=seal(node, [state]), layout=LAYOUT)


def test_a_step_whose_deltas_apply_to_a_skipped_step_is_skipped_and_the_job_goes_on():
    async def scenario() -> Links:
        links = Links()
        coordinator = Coordinator(
            node="n0", job_id="job", metrics=Metrics(), links=links,
            latest_committed=lambda: max(links.committed["n0"], default=None))
        await coordinator.prepared(prepare(4, "n0", 0))
        await coordinator.prepared(prepare(4, "n1", 1))
        await coordinator.prepared(prepare(5, "n0", 0, base=4))  # n1's prepare of 5 is lost
        await coordinator.prepared(prepare(6, "n0", 0, base=5))
        await coordinator.prepared(prepare(6, "n1", 1, base=5))  # complete, on a lost step
        await coordinator.prepared(prepare(7, "n0", 0, base=4))
        await coordinator.prepared(prepare(7, "n1", 1, base=4))
        return links

    links = asyncio.run(scenario())
    assert links.committed == {"n0": [4, 7], "n1": [4, 7]}


def test_a_commit_that_arrives_before_the_commit_of_its_base_waits_for_it(tmp_path) -> None:
    """The commits of two steps travel the commit tree side by side: a daemon can get
    step 3, a delta against step 2, before step 2. It waits for step 2 instead of
    refusing step 3 (which would leave it short of every later step)."""
    from snapshot_states import state, tensors

    from stalwart.core.manifest import build_manifest
    from stalwart.core.step_record import split
    from stalwart.daemon.snapshot.commit import Committer
    from stalwart.daemon.snapshot.local_store import LocalStore

    store = LocalStore(tmp_path, chunk_bytes=8192)
    layout = common_pb2.ParallelLayout(dp=1, pp=1, tp=1)

    def record(step: int) -> manifest_pb2.StepRecord:
        prepared = store.encode(step, 0, state(step), tensors(), node="n0")
        rank = store.prepare(step, prepared)
        return split(build_manifest(job_id=store.job_id, step=step, generation=1,
                                    layout=layout, ranks=[rank]))

    store.commit(record(1))
    second, third = record(2), record(3)
    assert third.base_step == 2  # a delta against step 2, not yet committed

    async def out_of_order() -> None:
        committer = Committer("n0", store, None, lambda: False)
        try:
            await asyncio.gather(committer.commit(third), committer.commit(second))
        finally:
            committer.stop()

    asyncio.run(out_of_order())
    assert store.committed_steps() == [1, 2, 3]
    assert store.read_rank(3, 0) == state(3)


def test_a_daemon_far_behind_refuses_a_commit_at_once_instead_of_waiting(
        tmp_path, monkeypatch) -> None:
    """Only the next commit due can be on its way: a daemon that was away (its newest
    commit long before the base) refuses at once, so the coordinator is not held up."""
    from snapshot_states import state, tensors

    from stalwart.core.manifest import ManifestError, build_manifest
    from stalwart.core.step_record import split
    from stalwart.daemon.snapshot import commit
    from stalwart.daemon.snapshot.local_store import LocalStore

    monkeypatch.setattr(commit, "BASE_WAIT_S", 600.0)
    captured = LocalStore(tmp_path / "n0", chunk_bytes=8192)  # the daemon of the rank
    layout = common_pb2.ParallelLayout(dp=1, pp=1, tp=1)
    records = {}
    for step in (1, 2, 3):
        prepared = captured.encode(step, 0, state(step), tensors(), node="n0")
        records[step] = split(build_manifest(job_id=captured.job_id, step=step, generation=1,
                                             layout=layout,
                                             ranks=[captured.prepare(step, prepared)]))
        captured.commit(records[step])
    assert records[3].base_step == 2
    away = LocalStore(tmp_path / "n1", chunk_bytes=8192)  # a daemon that missed 1 and 2

    async def refused() -> None:
        committer = commit.Committer("n1", away, None, lambda: False)
        try:
            await asyncio.wait_for(committer.commit(records[3]), 60)
        finally:
            committer.stop()

    with pytest.raises(ManifestError, match="needs step 2"):
        asyncio.run(refused())
