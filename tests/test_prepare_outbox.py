"""Phase one's outbox: a prepare the coordinator could not take is kept for the next
coordinator, unless a newer plan left its step behind (then it is dropped, quietly); and
a capture that a newer plan left behind fails to store quietly too."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from fixtures_hostile import config, run

from stalwart.core.generation import StaleGeneration, check_generation
from stalwart.daemon.snapshot.commit import PrepareOutbox
from stalwart.v1 import common_pb2, peer_pb2


class Coordinator:
    """Takes prepares of its generation or newer; refuses others as a coordinator does,
    or fails the way a lost one does."""

    def __init__(self, generation: int) -> None:
        self.generation, self.lost, self.taken = generation, False, []

    async def deliver(self, req: peer_pb2.PrepareStepRequest) -> None:
        if self.lost:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "connection refused")
        check_generation(req.generation, self.generation, f"prepare of step {req.step}")
        self.taken.append((req.step, req.generation))


def prepare(step: int, generation: int) -> peer_pb2.PrepareStepRequest:
    return peer_pb2.PrepareStepRequest(job_id="j", step=step, generation=generation,
                                       node="node-1")


def outbox(coordinator: Coordinator) -> PrepareOutbox:
    return PrepareOutbox(coordinator.deliver, lambda: 0, lambda: coordinator.generation)


def test_a_prepare_a_lost_coordinator_missed_goes_to_the_next(caplog) -> None:
    coordinator = Coordinator(generation=1)
    box = outbox(coordinator)
    coordinator.lost = True
    with caplog.at_level(logging.INFO, logger="stalwart.daemon.snapshot.commit"):
        asyncio.run(box.send(prepare(5, 1)))
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    coordinator.lost = False
    asyncio.run(box.resend())
    assert coordinator.taken == [(5, 1)]


@pytest.mark.parametrize("remote", [False, True])
def test_a_prepare_a_newer_plan_left_behind_is_dropped_without_alarm(caplog,
                                                                     remote: bool) -> None:
    coordinator = Coordinator(generation=2)
    if remote:  # another daemon's coordinator answers with the peer service's status
        local = coordinator.deliver

        async def deliver(req: peer_pb2.PrepareStepRequest) -> None:
            try:
                await local(req)
            except StaleGeneration as exc:
                raise grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), str(exc)) from None
        coordinator.deliver = deliver  # type: ignore[method-assign]
    box = outbox(coordinator)
    with caplog.at_level(logging.INFO, logger="stalwart.daemon.snapshot.commit"):
        asyncio.run(box.send(prepare(16, 1)))  # returns: nothing for the caller to retry
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "prepare dropped: a newer plan left its step behind")]
    asyncio.run(box.send(prepare(16, 2)))
    coordinator.taken.clear()
    asyncio.run(box.resend())  # the dropped one is not sent again
    assert coordinator.taken == [(16, 2)]


def test_a_store_that_a_newer_plan_left_behind_fails_quietly_and_a_current_one_loudly(
        tmp_path, caplog) -> None:
    """Adopting a plan removes the files of the steps it redoes; an older generation's
    write into them then fails (FileNotFoundError, as seen in a recovery trace): that is
    the plan at work, logged at info. The same failure in the current generation is an
    error that says the step will not commit."""
    async def body(daemon):
        path = daemon.job.snapshots
        daemon.registry.install_plan(common_pb2.Plan(generation=2))

        async def write_into_removed_step() -> None:
            raise FileNotFoundError(2, "No such file or directory",
                                    str(tmp_path / "steps/000000000016/r1/rank.pb.tmp"))

        with caplog.at_level(logging.INFO, logger="stalwart.daemon.snapshot.path"):
            left = await path._retrying(write_into_removed_step, 0.0, 1, 16, 1)
            current = await path._retrying(write_into_removed_step, 0.0, 2, 16, 1)
        return left, current

    left, current = run(config(tmp_path / "d"), body)
    assert (left, current) == (False, False)
    records = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records
               if r.name == "stalwart.daemon.snapshot.path"]
    assert records == [
        ("INFO", "capture not stored: a newer plan left its step behind", False),
        ("ERROR", "step could not be made durable; it will not commit", True)]
