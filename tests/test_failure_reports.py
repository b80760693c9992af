"""How failures reach the coordinator's decision (`daemon/recovery/reports.py`): facts
are decided on at once, with whatever else was already queued; a fact that comes later
gets a decision of its own; hang reports wait a window for every rank's word. Pure
logic with stand-ins for the coordinator and the registry."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery import reports
from stalwart.daemon.recovery.reports import FailureReports
from stalwart.v1 import common_pb2


class Coordinator(SimpleNamespace):
    """Records each decision it is asked for."""

    def __init__(self) -> None:
        super().__init__(took_over_at=float("-inf"), decided=[], deciding=asyncio.Event())

    def take_over(self, plan: common_pb2.Plan) -> bool:
        return False

    def failure_queued(self) -> None:
        pass

    async def on_failures(self, failures: list[Failure]) -> None:
        self.decided.append([f.subject for f in failures])
        self.deciding.set()


def _reports() -> tuple[FailureReports, Coordinator]:
    coordinator = Coordinator()

    async def believed(_: Failure) -> bool:
        return True

    async def nothing_to_catch_up() -> None:
        return None

    registry = SimpleNamespace(current_plan=lambda: common_pb2.Plan(generation=1))
    out = FailureReports(coordinator, registry, Metrics(), is_leader=lambda: True,
                         stub=lambda: None, confirmed=believed,
                         catch_up=nothing_to_catch_up, heartbeat_interval_s=0.5)
    return out, coordinator


@contextlib.asynccontextmanager
async def _handling(failures: FailureReports) -> AsyncIterator[None]:
    """`failures.forever()` running for the block's length."""
    task = asyncio.create_task(failures.forever())
    try:
        yield
    finally:
        task.cancel()


def exit_of(subject: str) -> Failure:
    return Failure(FailureKind.PROCESS_EXIT, subject, "process exited", generation=1)


async def _turns(n: int) -> None:
    """`n` passes of the event loop: no timer can fire in them."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_fact_is_decided_on_at_once_with_what_was_queued_beside_it():
    asyncio.run(_decided_at_once())


async def _decided_at_once() -> None:
    failures, coordinator = _reports()
    async with _handling(failures):
        failures.put(exit_of("node-0/1"))
        failures.put(exit_of("node-0/2"))  # the same liveness check found both
        await _turns(10)
        assert coordinator.decided == [["node-0/1", "node-0/2"]]
        failures.put(exit_of("node-1/7"))  # later: a decision (a plan) of its own
        await _turns(10)
        assert coordinator.decided == [["node-0/1", "node-0/2"], ["node-1/7"]]


def test_hang_reports_wait_their_window_for_every_ranks_word(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(reports, "HANG_WINDOW_S", 0.2)
    asyncio.run(_hangs_wait())


async def _hangs_wait() -> None:
    failures, coordinator = _reports()
    async with _handling(failures):
        failures.put(Failure(FailureKind.COLLECTIVE_HANG, "node-0/1", "dp all_reduce hung",
                             generation=1))
        await _turns(10)
        assert coordinator.decided == []
        failures.put(Failure(FailureKind.COLLECTIVE_HANG, "node-1/7", "dp all_reduce hung",
                             generation=1))
        await asyncio.wait_for(coordinator.deciding.wait(), 30)
        assert coordinator.decided == [["node-0/1", "node-1/7"]]


def test_a_report_held_by_a_frozen_coordinator_goes_to_its_successor():
    asyncio.run(_frozen_coordinator())


async def _frozen_coordinator() -> None:
    # A SIGSTOPped coordinator accepts the call and never answers: the report must not
    # wait for that call's deadline, nor hold up the reports queued behind it.
    failures, coordinator = _reports()
    leader = {"here": False}
    frozen = asyncio.Event()  # never set: the old coordinator's answer
    calls: list[str] = []

    async def report_failure(proto, timeout: float) -> None:
        calls.append(proto.subject)
        await frozen.wait()

    failures.is_leader = lambda: leader["here"]
    failures.stub = lambda: SimpleNamespace(ReportFailure=report_failure)
    async with _handling(failures):
        failures.put(exit_of("node-0/1"))
        failures.put(exit_of("node-0/2"))
        await _turns(10)
        assert calls == ["node-0/1", "node-0/2"]  # each on its way, neither waits for the other
        leader["here"] = True  # the seat moved to this daemon
        failures.redeliver()
        await asyncio.wait_for(coordinator.deciding.wait(), 30)
        assert sorted(s for batch in coordinator.decided for s in batch) == [
            "node-0/1", "node-0/2"]


def test_a_new_coordinator_decides_once_the_live_ranks_are_announced_again():
    asyncio.run(_settles_on_announcements())


async def _settles_on_announcements() -> None:
    # A new coordinator knows only the installed plan; the other daemons re-announce
    # their live ranks (spares the plan does not name, the stores ranks serve) within a
    # heartbeat of seeing the seat move. It decides once they have, not after a fixed
    # wait (three heartbeats at most: 30 s here).
    failures, coordinator = _reports()
    failures.interval_s = 10.0
    failures.live_ranks = lambda: {"node-1/1", "node-2/2"}
    coordinator.took_over_at = time.monotonic()
    coordinator.announced, coordinator.heard = {}, asyncio.Event()
    async with _handling(failures):
        failures.put(exit_of("node-0/1"))
        await _turns(10)
        coordinator.announced["node-1/1"] = object()
        coordinator.heard.set()
        await _turns(10)
        assert coordinator.decided == []  # node-2's spare is still to come
        coordinator.announced["node-2/2"] = object()
        coordinator.heard.set()
        await asyncio.wait_for(coordinator.deciding.wait(), 5)
        assert coordinator.decided == [["node-0/1"]]


def test_a_batch_whose_handling_failed_is_handled_again_not_dropped():
    asyncio.run(_handled_again())


async def _handled_again() -> None:
    failures, coordinator = _reports()
    failures.interval_s = 0.01  # the first pause before trying again
    tries = []

    async def catch_up() -> None:
        tries.append(1)
        if len(tries) == 1:
            raise OSError(28, "No space left on device")

    failures.catch_up = catch_up
    async with _handling(failures):
        failures.put(exit_of("node-0/1"))
        await asyncio.wait_for(coordinator.deciding.wait(), 30)
        assert coordinator.decided == [["node-0/1"]] and len(tries) == 2
