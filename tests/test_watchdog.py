"""Specification of the collective hang watchdog: an error no sooner than the deadline is
a hang, reported once; an earlier one is a lost peer; both come out typed. In process with
stand-in work handles and a real store, then real gloo groups in two processes."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fixtures_hostile import WAIT_S

from stalwart.client.parallel_dims import Group, ParallelDims
from stalwart.client.watchdog import (
    Abandoned,
    CollectiveHangError,
    GroupFailure,
    Watchdog,
    run_unless,
)
from stalwart.core.failures import Failure, FailureKind
from stalwart.core.layout import Layout


def fail(exc: BaseException) -> Callable[[], None]:
    """A call that fails with `exc`."""

    def call() -> None:
        raise exc
    return call


def test_a_call_that_finishes_returns_its_value_and_reports_nothing():
    reports: list[Failure] = []
    dog = Watchdog(reports.append, deadline_s=5.0)
    assert dog.run(lambda: 42, "all_reduce") == 42
    assert reports == []


def test_an_error_no_sooner_than_the_deadline_is_a_reported_hang():
    reports: list[Failure] = []
    dog = Watchdog(reports.append, deadline_s=0.5, subject="node-1/42", generation=7)
    with pytest.raises(CollectiveHangError, match="dp all_reduce .* 0.5 s deadline in "
                                                  "generation 7") as info:
        dog.run(fail(RuntimeError("Timed out waiting 500ms")), "dp all_reduce",
                started=time.monotonic() - 0.6)
    (failure,) = reports
    assert failure.kind is FailureKind.COLLECTIVE_HANG and failure.subject == "node-1/42"
    assert failure.generation == 7 and failure.details["op"] == "dp all_reduce"
    assert failure.details["waited_s"] >= 0.6 and "0.5 s" in failure.evidence
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_error_before_the_deadline_is_a_lost_peer_and_no_hang():
    reports: list[Failure] = []
    dog = Watchdog(reports.append, deadline_s=60.0, generation=3)
    with pytest.raises(GroupFailure, match="pp recv from 1 failed .* generation 3: "
                                           "Connection closed by peer") as info:
        dog.run(fail(RuntimeError("Connection closed by peer\nframe #0 ...")), "pp recv from 1")
    assert not isinstance(info.value, CollectiveHangError)
    assert reports == []


def test_an_error_that_is_not_the_groups_is_left_as_it_is():
    dog = Watchdog(lambda f: None, deadline_s=0.0)
    with pytest.raises(ValueError, match="backend"):
        dog.run(fail(ValueError("backend 'mpi' is not supported")), "building the dp group")


class FailingWork:
    """A work handle whose wait fails as gloo's does when the call gave up."""

    def wait(self) -> None:
        raise RuntimeError("Timed out waiting for send operation to complete")


def test_an_op_whose_start_already_fails_is_a_lost_peer_like_one_whose_wait_fails():
    # gloo raises from send/recv/all-reduce themselves once a peer's connection is gone.
    broken = fail(RuntimeError("Connection closed by peer [127.0.0.1]:49061"))
    pg = SimpleNamespace(send=lambda tensors, dst, tag: broken(),
                         recv=lambda tensors, src, tag: broken(),
                         allgather=lambda out, tensors: broken(), barrier=broken)
    group = Group("pp", (0, 1), 0, pg, watchdog=Watchdog(lambda f: None, deadline_s=60.0))
    calls = {"send": lambda: group.isend(torch.ones(2), 1, tag=0),
             "recv": lambda: group.recv(torch.ones(2), 1, tag=0),
             "all_gather": lambda: group.all_gather(torch.ones(2)),
             "barrier": group.barrier}
    for op, call in calls.items():
        with pytest.raises(GroupFailure, match=f"{op.replace('_', '.')}.*Connection closed"):
            call()


def test_a_send_counts_its_deadline_from_when_it_started_not_from_the_wait():
    reports: list[Failure] = []
    pg = SimpleNamespace(send=lambda tensors, dst, tag: FailingWork())
    group = Group("pp", (0, 1), 0, pg,
                  watchdog=Watchdog(reports.append, deadline_s=0.15, subject="r0"))
    sending = group.isend(torch.ones(2), 1, tag=0)
    time.sleep(0.2)  # the round's other work, before it waits for its sends
    with pytest.raises(CollectiveHangError):
        sending.wait()
    assert [f.details["op"] for f in reports] == ["pp send to 1"]


def test_building_a_group_whose_peer_never_comes_is_a_reported_hang():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    reports: list[Failure] = []
    dog = Watchdog(reports.append, deadline_s=1.0, subject="r0", generation=2)
    with pytest.raises(CollectiveHangError, match="building the dp group"):
        ParallelDims(Layout(dp=2)).build(store, 0, 2, timeout_s=1.0, watchdog=dog)
    assert [(f.kind, f.generation) for f in reports] == [(FailureKind.COLLECTIVE_HANG, 2)]



def test_a_build_that_a_newer_plan_supersedes_is_left_without_waiting_out_its_timeout():
    # The peer never comes and the groups' timeout is a minute; the rank learns of a newer
    # plan on the third check and must leave the build then, not a minute later, so it
    # can join the newer generation before that generation's members time out on it.
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    reports: list[Failure] = []
    dog = Watchdog(reports.append, deadline_s=60.0, subject="r0", generation=2)
    checks: list[float] = []

    def superseded() -> bool:
        checks.append(time.monotonic())
        return len(checks) >= 3

    start = time.monotonic()
    with pytest.raises(GroupFailure, match="building the tp group of generation 2 was left"):
        ParallelDims(Layout(tp=2)).build(store, 0, 2, timeout_s=60.0, watchdog=dog,
                                         superseded=superseded)
    assert len(checks) == 3
    assert time.monotonic() - start < 30.0  # left at the check, not at the 60 s timeout
    assert reports == []  # leaving a superseded build is no hang


def test_a_build_that_nothing_supersedes_returns_its_groups():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    dims = ParallelDims(Layout()).build(store, 0, 1, timeout_s=10.0, superseded=lambda: False)
    assert dims.world.pg.size() == 1
    dims.destroy()


def test_a_call_on_its_own_thread_gives_back_its_value_or_its_error_or_is_abandoned():
    assert run_unless(lambda: 7, lambda: False, "t-value") == 7
    with pytest.raises(ValueError, match="its own"):
        run_unless(fail(ValueError("its own")), lambda: False, "t-error")
    release = threading.Event()
    with pytest.raises(Abandoned):
        run_unless(lambda: release.wait(60), lambda: True, "t-left")  # never returns by itself
    release.set()


def test_a_call_is_abandoned_the_moment_its_news_tells_of_a_newer_plan(
        monkeypatch: pytest.MonkeyPatch):
    """With `news`, the give-up condition is looked at when told to, not on a poll: here
    the poll would come after a minute."""
    from stalwart.client import watchdog

    monkeypatch.setattr(watchdog, "GIVE_UP_POLL_S", 60.0)
    news, newer, release = threading.Condition(), threading.Event(), threading.Event()
    outcome: list[str] = []

    def waiter() -> None:
        try:
            run_unless(lambda: release.wait(120), newer.is_set, "t-news", news)
        except Abandoned:
            outcome.append("abandoned")

    thread = threading.Thread(target=waiter)
    thread.start()
    newer.set()
    with news:
        news.notify_all()
    thread.join(WAIT_S)
    release.set()
    assert outcome == ["abandoned"]


def hung_then_lost_peer(ctx) -> dict:
    """Rank 0 all-reduces; rank 1 first stays away (a hang), then leaves (a lost peer)."""
    wait = datetime.timedelta(seconds=60)
    reports: list[Failure] = []

    def build(generation: int) -> ParallelDims:
        # Both ranks arrive before the 1 s deadline starts: on a loaded machine one
        # rank's start-up (importing torch) can lag the other's by more than that.
        ctx.store.set(f"arrived{generation}/{ctx.rank}", "1")
        ctx.store.wait([f"arrived{generation}/{r}" for r in range(2)], wait)
        dog = Watchdog(reports.append, deadline_s=1.0, subject=f"r{ctx.rank}",
                       generation=generation)
        return ParallelDims(Layout(dp=2)).build(ctx.store, ctx.rank, generation, timeout_s=1.0,
                                        watchdog=dog)

    first = build(1)
    if ctx.rank == 1:
        ctx.store.wait(["hung"], wait)
        second = build(2)
        second.destroy()  # leaves: its connections close under rank 0's collective
        ctx.store.wait(["done"], wait)
        return {}
    out: dict = {}
    start = time.monotonic()
    try:
        first.dp_group.all_reduce(torch.ones(2))
    except GroupFailure as exc:
        out["hung"] = type(exc).__name__
    out["hung_after_s"] = time.monotonic() - start
    ctx.store.set("hung", "1")
    second = build(2)
    try:
        second.dp_group.all_reduce(torch.ones(2))
    except GroupFailure as exc:
        out["lost"] = type(exc).__name__
    out["reports"] = [(f.generation, f.details["op"]) for f in reports]
    ctx.store.set("done", "1")
    return out


@pytest.mark.multiprocess
def test_gloo_hangs_are_reported_and_lost_peers_are_not(run_ranks):
    result = run_ranks(hung_then_lost_peer, 2, timeout=90.0)[0]
    assert result["hung"] == "CollectiveHangError" and 1.0 <= result["hung_after_s"] < 10.0
    assert result["lost"] == "GroupFailure"
    assert result["reports"] == [[1, "dp all_reduce"]]  # the lost peer is no hang


def test_the_training_functions_own_collective_runs_under_the_watchdog():
    from stalwart.client.grad_average import GradAverage
    from stalwart.client.user_loop import Context

    reports: list[Failure] = []
    dp = Group("dp", (0, 1), 0, pg=None, watchdog=Watchdog(reports.append, deadline_s=60.0))
    gen = SimpleNamespace(dims=SimpleNamespace(dp_group=dp))
    grads = GradAverage([], [], torch.device("cpu"), bucket_bytes=1 << 20, overlap=True)
    ctx = Context(gen, program=SimpleNamespace(grads=grads), start=0)  # type: ignore[arg-type]
    assert ctx.collective(lambda: "summed") == "summed"
    with pytest.raises(GroupFailure, match="dp collective of the training function failed"):
        ctx.collective(fail(RuntimeError("Connection reset by peer")))
    assert reports == []
