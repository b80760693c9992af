"""Specification of the collective hang watchdog: in-process deadlines, then real gloo hangs."""

from __future__ import annotations

import threading

import pytest

from stalwart.client.watchdog import CollectiveHangError, Watchdog
from stalwart.core.failures import Failure, FailureKind

WAIT_S = 30.0  # generous bound for waits on a loaded 2-core machine


def test_a_call_that_finishes_in_time_reports_nothing():
    reports: list[Failure] = []
    dog = Watchdog(reports.append, deadline_s=5.0, abort=None)
    with dog.guard("all_reduce"):
        pass
    dog.close()
    assert reports == []


def test_a_call_past_its_deadline_is_reported_aborted_and_raised():
    fired = threading.Event()
    reports: list[Failure] = []
    aborted: list[object] = []

    def on_hang(f: Failure) -> None:
        reports.append(f)
        fired.set()

    dog = Watchdog(on_hang, deadline_s=0.2, subject="r3", reporter="n1", generation=lambda: 7,
                   abort=aborted.append)
    group = object()
    with pytest.raises(CollectiveHangError, match="recv from stage 2.*generation 7"):
        with dog.guard("recv from stage 2", group=group):
            assert fired.wait(WAIT_S)  # the hung call: wakes only when the watchdog fires
    dog.close()
    (failure,) = reports
    assert failure.kind is FailureKind.COLLECTIVE_HANG and failure.subject == "r3"
    assert failure.generation == 7 and failure.reporter == "n1"
    assert failure.details["waited_s"] >= 0.2 and "0.2 s" in failure.evidence
    assert aborted == [group]


def test_the_guard_works_as_a_decorator_with_its_own_deadline():
    fired = threading.Event()
    dog = Watchdog(lambda f: fired.set(), deadline_s=60.0, abort=None)

    @dog.guard("send", deadline_s=0.1)
    def send() -> bool:
        return fired.wait(WAIT_S)

    with pytest.raises(CollectiveHangError):
        send()
    dog.close()


def test_many_guarded_calls_share_one_watchdog_thread():
    before = threading.active_count()
    dog = Watchdog(lambda f: None, deadline_s=30.0, abort=None)
    guards = [dog.guard(f"op{i}") for i in range(50)]
    for g in guards:
        g.__enter__()
    assert threading.active_count() == before + 1
    for g in guards:
        g.__exit__(None, None, None)
    dog.close()


def test_the_error_of_the_hung_call_is_chained():
    dog = Watchdog(lambda f: None, deadline_s=0.05, abort=None)
    fired = threading.Event()
    dog.on_hang = lambda f: fired.set()
    with pytest.raises(CollectiveHangError) as info:
        with dog.guard("all_gather"):
            fired.wait(WAIT_S)
            raise ConnectionError("peer closed")
    assert isinstance(info.value.__cause__, ConnectionError)
    dog.close()


def gloo_hang_scenarios(ctx) -> dict:
    """Rank 0 runs guarded collectives; rank 1 stays away until told to join."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=ctx.store, rank=ctx.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=15))
    wait = datetime.timedelta(seconds=60)
    if ctx.rank == 1:
        ctx.store.wait(["fired"], wait)  # joins only after rank 0's watchdog fired
        dist.all_reduce(torch.ones(2))
        ctx.store.wait(["done"], wait)  # joins the second one only after rank 0 gave up,
        dist.all_reduce(torch.ones(2))  # so the abandoned operation ends and both exit cleanly
        return {}
    out: dict = {}
    reports: list[Failure] = []

    def on_hang(f: Failure) -> None:
        reports.append(f)
        out.setdefault("fired_after_s", time.monotonic() - start)
        ctx.store.set("fired", "1")

    dog = Watchdog(on_hang, deadline_s=1.0, subject="r0", abort=None)
    start = time.monotonic()
    try:
        with dog.guard("all_reduce"):
            dist.all_reduce(torch.ones(2))
    except CollectiveHangError as exc:
        out["guard_error"] = str(exc)
    out["kind"] = reports[0].kind.name

    # Async work on gloo: the wait itself times out, so the rank moves on at its deadline.
    dog2 = Watchdog(reports.append, deadline_s=1.0, subject="r0")
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(2), async_op=True)
    try:
        dog2.wait(work, "all_reduce #2")
    except CollectiveHangError:
        out["wait_raised_after_s"] = time.monotonic() - start
    out["second_report"] = reports[-1].details["op"]
    ctx.store.set("done", "1")
    dog.close()
    dog2.close()
    return out


@pytest.mark.multiprocess
def test_a_gloo_collective_whose_peer_never_joins_fires_the_watchdog(run_ranks):
    result = run_ranks(gloo_hang_scenarios, 2, timeout=90.0)[0]
    assert result["kind"] == "COLLECTIVE_HANG"
    assert 1.0 <= result["fired_after_s"] < 1.0 + WAIT_S
    assert "all_reduce passed its 1.0 s deadline" in result["guard_error"]
    assert 1.0 <= result["wait_raised_after_s"] < 1.0 + WAIT_S
    assert result["second_report"] == "all_reduce #2"
