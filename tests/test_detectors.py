"""Specification of the daemon's detectors: real processes for exits, a fake clock for deadlines."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.recovery.detectors import HeartbeatMonitor, PeerMonitor, PidWatcher

DEADLINE_S = 10.0  # generous: other helpers' tests load the same two cores


def spawn_sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


async def first_failure(watcher_kwargs: dict, start, act) -> Failure:
    """Watch the process `start()` gives, run `act(proc)`, return the first failure."""
    got: asyncio.Queue[Failure] = asyncio.Queue()
    watcher = PidWatcher(got.put_nowait, reporter="n0", generation=lambda: 3, **watcher_kwargs)
    proc = start()
    try:
        watcher.watch("r1", proc.pid)
        act(proc)
        return await asyncio.wait_for(got.get(), DEADLINE_S)
    finally:
        watcher.close()
        proc.kill()
        proc.wait(timeout=DEADLINE_S)


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "proc-polling"])
def test_sigkilled_rank_is_reported_as_process_exit_with_the_signal(use_pidfd):
    failure = asyncio.run(first_failure(
        {"use_pidfd": use_pidfd, "poll_interval_s": 0.05}, spawn_sleeper,
        lambda p: os.kill(p.pid, signal.SIGKILL)))
    assert failure.kind is FailureKind.PROCESS_EXIT and failure.subject == "r1"
    assert "signal 9 (SIGKILL)" in failure.evidence
    assert failure.details["signal"] == signal.SIGKILL
    assert failure.generation == 3 and failure.reporter == "n0"


def test_a_rank_that_exits_by_itself_reports_its_exit_code():
    def start():
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); "
                                 "sys.exit(3)"], stdin=subprocess.PIPE)

    failure = asyncio.run(first_failure({}, start, lambda p: p.stdin.close()))
    assert failure.details["exit_code"] == 3 and "exited with code 3" in failure.evidence


def test_a_rank_that_is_not_the_daemons_child_is_still_seen_dying():
    # bash is the parent of the watched process and reaps it, as torchrun would.
    def start():
        return subprocess.Popen(["bash", "-c", "sleep 120 & echo $!; wait"],
                                stdout=subprocess.PIPE, text=True)

    async def scenario() -> Failure:
        got: asyncio.Queue[Failure] = asyncio.Queue()
        watcher = PidWatcher(got.put_nowait)
        shell = start()
        try:
            grandchild = int(shell.stdout.readline())
            watcher.watch("r7", grandchild)
            os.kill(grandchild, signal.SIGKILL)
            return await asyncio.wait_for(got.get(), DEADLINE_S)
        finally:
            watcher.close()
            shell.wait(timeout=DEADLINE_S)

    failure = asyncio.run(scenario())
    assert failure.kind is FailureKind.PROCESS_EXIT and failure.subject == "r7"
    assert str(failure.details["pid"]) in failure.evidence


def test_watching_a_pid_that_is_already_gone_reports_at_once():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=DEADLINE_S)

    async def scenario() -> list[Failure]:
        seen: list[Failure] = []
        watcher = PidWatcher(seen.append)
        watcher.watch("r2", proc.pid)
        watcher.close()
        return seen

    (failure,) = asyncio.run(scenario())
    assert "not running" in failure.evidence


@dataclass
class FakeRank:
    rank_id: str
    pid: int
    last_heartbeat: float


@dataclass
class FakeRegistry:
    entries: list[FakeRank] = field(default_factory=list)

    def ranks(self):
        return list(self.entries)


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_missed_heartbeat_deadline_is_reported_once_with_how_late():
    clock = FakeClock()
    registry = FakeRegistry([FakeRank("r0", 11, 100.0), FakeRank("r1", 12, 100.0)])
    mon = HeartbeatMonitor(registry, 5.0, lambda f: None, clock=clock, generation=lambda: 2)
    clock.now = 104.9
    assert mon.check() == []
    registry.entries[0].last_heartbeat = 104.9
    clock.now = 105.5
    (late,) = mon.check()
    assert late.kind is FailureKind.HEARTBEAT_MISSED and late.subject == "r1"
    assert "5.5 s" in late.evidence and "pid 12" in late.evidence and late.generation == 2
    clock.now = 107.0
    assert mon.check() == []  # once per silence


def test_a_rank_that_heartbeats_again_is_re_armed():
    clock = FakeClock()
    registry = FakeRegistry([FakeRank("r0", 11, 100.0)])
    mon = HeartbeatMonitor(registry, 1.0, lambda f: None, clock=clock)
    clock.now = 102.0
    assert len(mon.check()) == 1
    registry.entries[0].last_heartbeat = 102.0
    clock.now = 103.5
    assert [f.subject for f in mon.check()] == ["r0"]


def test_the_heartbeat_monitor_loop_delivers_to_a_coroutine_callback():
    clock = FakeClock()
    registry = FakeRegistry([FakeRank("r3", 13, 100.0)])

    async def scenario() -> Failure:
        got: asyncio.Queue[Failure] = asyncio.Queue()

        async def sink(f: Failure) -> None:
            await got.put(f)

        mon = HeartbeatMonitor(registry, 2.0, sink, clock=clock, interval_s=0.01)
        task = asyncio.create_task(mon.run())
        try:
            clock.now = 103.0
            return await asyncio.wait_for(got.get(), DEADLINE_S)
        finally:
            task.cancel()

    assert asyncio.run(scenario()).subject == "r3"


@dataclass
class FakePeer:
    node: str
    last_seen: float


@dataclass
class FakePeers:
    entries: list[FakePeer]

    def peers(self):
        return list(self.entries)


def test_a_peer_daemon_that_stops_gossiping_is_reported_lost():
    clock = FakeClock()
    table = FakePeers([FakePeer("n1", 100.0), FakePeer("n2", 100.0)])
    mon = PeerMonitor(table, 3.0, lambda f: None, clock=clock, reporter="n0")
    table.entries[1].last_seen = 103.0
    clock.now = 103.5
    (lost,) = mon.check()
    assert lost.kind is FailureKind.PEER_LOST and lost.subject == "n1" and lost.names_node
    assert "no gossip" in lost.evidence and lost.reporter == "n0"
