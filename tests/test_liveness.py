"""Liveness rules and the rank registry, in-process with a hand-moved clock."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from stalwart.core.failures import RAISED_CHARS, FailureKind
from stalwart.core.generation import StaleGeneration
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery import registry as registry_module
from stalwart.daemon.recovery.liveness import (
    ALIVE,
    DEAD,
    LATE,
    ProcessIdentity,
    heartbeat_state,
    process_alive,
    process_identity,
)
from stalwart.daemon.recovery.membership import LOST, SUSPECT, UP, Membership
from stalwart.daemon.recovery.registry import RankFenced, Registry, UnknownRank
from stalwart.v1 import common_pb2, peer_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("age", "state"), [
    (0.0, ALIVE), (2.0, ALIVE), (2.01, LATE), (5.0, LATE), (5.01, DEAD),
])
def test_heartbeat_state_by_age(age: float, state: str) -> None:
    assert heartbeat_state(age, interval_s=1.0, timeout_s=5.0) == state


def registry(clock: Clock, metrics: Metrics | None = None) -> Registry:
    return Registry("n0", 1.0, 5.0, metrics or Metrics(), clock=clock)


def add_rank(reg: Registry, pid: int = 4242, watch_pid: bool = False,
             instance: str = "") -> str:
    return reg.register(pid=pid, rank=0, world_size=1, local_rank=0, hostname="h",
                        spare=False, device="cpu", watch_pid=watch_pid,
                        instance=instance).rank_id


def failures_of(metrics: Metrics, kind: str) -> float:
    return metrics.registry.get_sample_value("stalwart_failures_detected_total", {"kind": kind})


def test_silent_rank_goes_late_then_dead_once_with_a_heartbeat_missed_failure() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    seen = []
    reg.on_failure(seen.append)
    rank_id = add_rank(reg)
    clock.now += 2.5
    assert reg.check() == [] and reg.get(rank_id).state == LATE
    clock.now += 3.0
    [failure] = reg.check()
    assert failure.kind is FailureKind.HEARTBEAT_MISSED and failure.subject == rank_id
    assert "5.50 s" in failure.evidence
    assert reg.get(rank_id).state == DEAD and seen == [failure]
    clock.now += 10
    assert reg.check() == []  # reported once
    assert failures_of(metrics, "heartbeat_missed") == 1.0


def test_heartbeat_brings_a_late_rank_back_and_records_progress() -> None:
    clock = Clock()
    reg = registry(clock)
    rank_id = add_rank(reg)
    clock.now += 3
    reg.check()
    reg.heartbeat(rank_id, generation=1, step=7, step_time_s=0.25)
    record = reg.get(rank_id)
    assert (record.state, record.step, record.step_time_s) == (ALIVE, 7, 0.25)


def test_heartbeats_are_fenced_by_generation_death_and_registration() -> None:
    clock = Clock()
    reg = registry(clock)
    rank_id = add_rank(reg)
    reg.install_plan(common_pb2.Plan(generation=2, reason="test"))
    clock.now += 4  # late by now
    with pytest.raises(StaleGeneration, match="generation 1, but the job is at generation 2"):
        reg.heartbeat(rank_id, generation=1, step=7, step_time_s=0.1)
    # Refused, but proof of life: a rank catching up with the new plan is not lost.
    assert reg.check() == [] and reg.get(rank_id).state == ALIVE
    assert reg.get(rank_id).step == 0
    with pytest.raises(UnknownRank, match="register again"):
        reg.heartbeat("n0/1", generation=2, step=0, step_time_s=0)
    for _ in range(3):  # checks less than a timeout apart: the daemon was not paused
        clock.now += 2
        reg.check()
    with pytest.raises(RankFenced, match="declared dead"):
        reg.heartbeat(rank_id, generation=2, step=0, step_time_s=0)


def test_a_rank_that_leaves_cleanly_is_not_a_failure() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    rank_id = add_rank(reg)
    reg.heartbeat(rank_id, 1, 3, 0.1, leaving=True)
    clock.now += 60
    assert reg.check() == []
    assert reg.get(rank_id).shown_state == "left"
    assert failures_of(metrics, "heartbeat_missed") == 0.0


def test_an_older_plan_is_refused() -> None:
    reg = registry(Clock())
    reg.install_plan(common_pb2.Plan(generation=3))
    with pytest.raises(StaleGeneration):
        reg.install_plan(common_pb2.Plan(generation=3))
    assert reg.generation == 3


def test_plan_watchers_wake_on_a_new_generation() -> None:
    async def scenario() -> common_pb2.Plan | None:
        reg = registry(Clock())
        waiting = asyncio.create_task(reg.plan_after(1, timeout_s=10))
        await asyncio.sleep(0)
        reg.install_plan(common_pb2.Plan(generation=2, reason="spare in"))
        return await asyncio.wait_for(waiting, 5)

    plan = asyncio.run(scenario())
    assert plan is not None and plan.reason == "spare in"


def test_process_identity_of_a_live_and_an_exited_process() -> None:
    me = process_identity(os.getpid())
    assert me is not None and me.start_ticks > 0 and process_alive(me)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        identity = process_identity(child.pid)
        assert identity is not None
        child.kill()
        # Not reaped yet: a zombie counts as gone.
        from fixtures_daemon import wait_for
        wait_for(lambda: not process_alive(identity), 10, "the killed child to be seen gone")
    finally:
        child.wait(10)
    assert process_identity(child.pid) is None


def test_a_recycled_pid_is_not_the_same_process() -> None:
    me = process_identity(os.getpid())
    assert not process_alive(ProcessIdentity(me.pid, me.start_ticks + 1))


def test_registry_declares_an_exited_rank_process_dead() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    rank_id = add_rank(reg, pid=child.pid, watch_pid=True)
    child.wait(10)
    [failure] = reg.check()
    assert failure.kind is FailureKind.PROCESS_EXIT and failure.subject == rank_id
    assert failures_of(metrics, "process_exit") == 1.0


def test_the_exit_of_a_rank_that_told_what_it_raised_names_the_exception() -> None:
    reg = registry(Clock())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    rank_id = add_rank(reg, pid=child.pid, watch_pid=True)
    reg.heartbeat(rank_id, reg.generation, 3, 0.1, raised="ValueError: " + "x" * 1000)
    child.wait(10)
    [failure] = reg.check()
    assert failure.kind is FailureKind.PROCESS_EXIT
    assert failure.evidence.startswith(f"process {child.pid} exited after raising ValueError")
    assert failure.raised.startswith("ValueError: xxx") and len(failure.raised) == RAISED_CHARS


def test_peers_move_from_up_to_suspect_to_lost_with_one_failure() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    table = Membership("a", "h:1", 1.0, 5.0, metrics, reg.report, clock=clock)
    table.add_address("h:2")
    assert table.check() == [] and table.peers()[0].state == "unknown"
    table.observe(peer_pb2.PeerInfo(node="b", address="h:2"))
    assert table.peers()[0].state == UP and table.by_rule() == "a"
    clock.now += 3
    assert table.check() == [] and table.peers()[0].state == SUSPECT
    clock.now += 3
    [failure] = table.check()
    assert failure.kind is FailureKind.PEER_LOST and failure.subject == "b"
    assert table.peers()[0].state == LOST and failures_of(metrics, "peer_lost") == 1.0


@pytest.mark.parametrize(("wait", "early", "late"), [("until_lost", 3, 3),
                                                      ("until_silent", 1, 2)])
def test_a_wait_for_a_peer_ends_when_it_goes_lost_or_quiet_and_not_before(
        wait: str, early: float, late: float) -> None:
    # What a call to a frozen peer races against: its loss (a commit, a plan), or for
    # a shard put or a record copy, which have other homes, a suspicion (a heartbeat
    # overdue). The wait ends when the peer enters that state, at once while it is in
    # it, and waits again once the peer is heard from.
    async def main() -> list[bool]:
        clock = Clock()
        table = Membership("a", "h:1", 1.0, 5.0, Metrics(), lambda f: f, clock=clock)
        table.observe(peer_pb2.PeerInfo(node="b", address="h:2"))
        waiting = asyncio.ensure_future(getattr(table, wait)("b"))
        clock.now += early
        table.check()  # not yet
        await asyncio.sleep(0)
        seen = [waiting.done()]
        clock.now += late
        table.check()
        await asyncio.wait_for(waiting, 5)
        await asyncio.wait_for(getattr(table, wait)("b"), 5)  # in that state now: at once
        table.observe(peer_pb2.PeerInfo(node="b", address="h:2"))  # heard again
        again = asyncio.ensure_future(getattr(table, wait)("b"))
        await asyncio.sleep(0)
        seen.append(again.done())
        again.cancel()
        return seen

    assert asyncio.run(main()) == [False, False]


def test_a_seed_stays_a_target_and_its_responder_is_kept_under_its_own_address() -> None:
    table = Membership("a", "127.0.0.1:1", 1.0, 5.0, Metrics(), lambda f: f, clock=Clock(),
                       seeds=("peers.example:2", "127.0.0.1:1"))
    assert [p.address for p in table.peers()] == ["peers.example:2"]  # itself is not a peer
    reply = peer_pb2.Membership(peers=[peer_pb2.PeerInfo(node="b", address="127.0.0.1:2"),
                                       peer_pb2.PeerInfo(node="c", address="127.0.0.1:3")])
    table.learn(reply, contacted="peers.example:2")
    assert [(p.node, p.address, p.state) for p in table.peers()] == [
        ("b", "127.0.0.1:2", UP), ("", "127.0.0.1:3", "unknown")]
    assert table.targets() == ["peers.example:2", "127.0.0.1:2", "127.0.0.1:3"]


def test_a_gossip_reply_leaves_the_hearsay_out_for_a_caller_with_the_same_view() -> None:
    a = Membership("a", "h:1", 1.0, 5.0, Metrics(), lambda f: f, clock=Clock())
    b = Membership("b", "h:2", 1.0, 5.0, Metrics(), lambda f: f, clock=Clock())
    for table, others in ((a, [("b", "h:2"), ("c", "h:3")]), (b, [("a", "h:1"), ("c", "h:3")])):
        for node, address in others:
            table.observe(peer_pb2.PeerInfo(node=node, address=address))
    me = peer_pb2.PeerInfo(node="a", address="h:1")
    assert a.view() == b.view()  # both reached the same three daemons
    assert [p.node for p in a.to_proto(me, "a", b.view()).peers] == ["a"]
    assert [p.node for p in a.to_proto(me, "a", b"").peers] == ["a", "b", "c"]
    b.observe(peer_pb2.PeerInfo(node="d", address="h:4"))  # b learns of one more
    assert [p.node for p in a.to_proto(me, "a", b.view()).peers] == ["a", "b", "c"]


def test_a_daemon_back_from_a_pause_gives_its_ranks_a_fresh_deadline_once() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    rank_id = add_rank(reg)
    assert reg.check() == []
    clock.now += 20  # this daemon was frozen: its ranks' heartbeats queued behind it
    assert reg.check() == [] and reg.get(rank_id).state == ALIVE
    clock.now += 4.5  # and then the rank really is silent
    [failure] = reg.check()
    assert failure.kind is FailureKind.HEARTBEAT_MISSED and failure.subject == rank_id


def test_a_paused_daemon_declares_no_peer_lost_and_defers_until_it_heard_them() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    table = Membership("a", "h:1", 1.0, 5.0, metrics, reg.report, clock=clock)
    table.observe(peer_pb2.PeerInfo(node="b", address="h:2", generation=1))
    table.self_generation = lambda: 1
    assert table.check() == [] and table.by_rule() == "a"
    clock.now += 30
    assert table.check() == []  # b kept its place: this daemon was the one frozen
    assert table.peers()[0].state == UP and table.by_rule() == "b"
    clock.now += 0.5
    table.observe(peer_pb2.PeerInfo(node="b", address="h:2", generation=2))
    assert table.by_rule() == "b"  # heard from b, but b is a generation ahead
    table.self_generation = lambda: 2
    assert table.by_rule() == "a"  # caught up, and no plan names another coordinator


def test_the_coordinator_of_the_installed_plan_keeps_the_role_while_it_lives() -> None:
    clock, metrics = Clock(), Metrics()
    reg = registry(clock, metrics)
    table = Membership("c", "h:3", 1.0, 5.0, metrics, reg.report, clock=clock,
                       incumbent=lambda: "b")
    table.observe(peer_pb2.PeerInfo(node="a", address="h:1"))
    table.observe(peer_pb2.PeerInfo(node="b", address="h:2"))
    assert table.by_rule() == "b"  # a (smaller) came back; b decided the plan
    clock.now += 3
    table.observe(peer_pb2.PeerInfo(node="a", address="h:1"))
    clock.now += 3
    table.check()  # b is lost now
    assert table.by_rule() == "a"


def _plan(world_dp: int, rank_id: str) -> common_pb2.Plan:
    return common_pb2.Plan(generation=2, layout=common_pb2.ParallelLayout(dp=world_dp, pp=1,
                                                                         tp=1),
                           assignments=[common_pb2.RankAssignment(rank_id=rank_id, node="n0")])


def test_a_rank_alone_in_its_job_that_heartbeats_without_steps_is_stalled() -> None:
    clock = Clock()
    reg = registry(clock)
    rank_id = add_rank(reg)
    reg.install_plan(_plan(1, rank_id))
    for step in (1, 2):
        clock.now += 0.1
        reg.heartbeat(rank_id, 2, step=step, step_time_s=0.1)
    for _ in range(11):  # it keeps heartbeating, step 2 forever (a hang)
        clock.now += 1.0
        reg.heartbeat(rank_id, 2, step=2, step_time_s=0.1)
        found = reg.check()
    [failure] = found
    assert failure.kind is FailureKind.STALLED and failure.subject == rank_id
    assert "no step for 11.0 s after step 2" in failure.evidence


def test_a_rank_alone_whose_heartbeats_stop_is_left_to_the_heartbeat_timeout() -> None:
    # A paused rank (SIGSTOP) makes no step and sends no beat: it is not "heartbeating
    # without steps", and the heartbeat timeout (5 s here) is what judges it.
    clock = Clock()
    reg = registry(clock)
    rank_id = add_rank(reg)
    reg.install_plan(_plan(1, rank_id))
    reg.heartbeat(rank_id, 2, step=2, step_time_s=0.1)
    for _ in range(9):  # beats on, stuck at step 2, within the 10 s stall limit
        clock.now += 1.0
        reg.heartbeat(rank_id, 2, step=2, step_time_s=0.1)
        assert reg.check() == []
    clock.now += 4.5  # then silent, within the timeout, 13.5 s after its last step
    assert reg.check() == []
    clock.now += 1.0
    [failure] = reg.check()
    assert failure.kind is not FailureKind.STALLED and failure.subject == rank_id


def test_with_peers_a_slow_step_is_left_to_their_collective_timeouts() -> None:
    clock = Clock()
    reg = registry(clock)
    rank_id = add_rank(reg)
    reg.install_plan(_plan(4, rank_id))
    reg.heartbeat(rank_id, 2, step=1, step_time_s=0.1)
    for _ in range(60):
        clock.now += 1.0
        reg.heartbeat(rank_id, 2, step=1, step_time_s=0.1)
        assert reg.check() == []


def test_a_rank_that_leaves_a_stopped_job_is_reported_gone_but_not_after_completion() -> None:
    clock = Clock()
    reg = registry(clock)
    seen = []
    reg.on_failure(seen.append)
    stopped, done = add_rank(reg, pid=11), add_rank(reg, pid=12)
    reg.install_plan(common_pb2.Plan(generation=2, stop=True, stop_message="no spare"))
    reg.heartbeat(stopped, generation=2, step=3, step_time_s=0.1, leaving=True)
    assert [(f.kind, f.subject) for f in seen] == [(FailureKind.PROCESS_EXIT, stopped)]
    reg.install_plan(common_pb2.Plan(generation=3, stop=True, completed=True))
    reg.heartbeat(done, generation=3, step=9, step_time_s=0.1, leaving=True)
    assert len(seen) == 1  # leaving a completed job is the normal end


def test_a_process_with_the_pid_of_an_ended_rank_gets_an_id_of_its_own() -> None:
    # In a pid namespace of its own (a container started again), a new process has the
    # pid an ended one had; plans may still name the ended one by its id.
    reg = registry(Clock())
    first = add_rank(reg, pid=7)
    assert add_rank(reg, pid=7) == first  # the same process registering again
    reg.heartbeat(first, generation=1, step=3, step_time_s=0.1, leaving=True)
    second = add_rank(reg, pid=7)
    assert (first, second) == ("n0/7", "n0/7.2")
    assert reg.live_with_pid(7).rank_id == second  # what admission guards, not the first
    reg.heartbeat(second, generation=1, step=3, step_time_s=0.1, leaving=True)
    assert add_rank(reg, pid=7) == "n0/7.3"
    assert reg.get(first) is not None and reg.get(first).ended


def test_two_live_processes_with_one_pid_are_two_ranks() -> None:
    # Two pods on one node, each in a pid namespace of its own: their ranks can have the
    # same pid at once. Each process names itself (a random instance); only a process
    # registering again with its own name keeps its id.
    reg = registry(Clock())
    first = add_rank(reg, pid=15, instance="a1")
    second = add_rank(reg, pid=15, instance="b2")
    assert (first, second) == ("n0/15", "n0/15.2")
    assert add_rank(reg, pid=15, instance="b2") == second
    assert add_rank(reg, pid=15, instance="a1") == first
    assert not reg.get(first).ended and not reg.get(second).ended


def test_a_live_rank_keeps_its_id_after_the_remembered_ids_move_past_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "KEEP_ISSUED", 2)
    reg = registry(Clock())
    live = add_rank(reg, pid=15, instance="a")
    for pid in (16, 17, 18):  # the oldest remembered ids are forgotten
        add_rank(reg, pid=pid)
    assert add_rank(reg, pid=15, instance="b") == "n0/15.2"
    assert add_rank(reg, pid=15, instance="a") == live


def test_the_ids_a_plan_gives_this_nodes_ranks_are_not_given_again() -> None:
    # A daemon started again has not given them, but the coordinator's plan names them.
    reg = registry(Clock())
    reg.install_plan(common_pb2.Plan(generation=1, assignments=[
        common_pb2.RankAssignment(rank_id="n0/7", node="n0"),
        common_pb2.RankAssignment(rank_id="n1/8", node="n1")]))
    assert (add_rank(reg, pid=7), add_rank(reg, pid=8)) == ("n0/7.2", "n0/8")
