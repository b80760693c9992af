"""A rank that registers with its daemon is announced to the coordinator. One that
registers while the coordinator does not answer stays registered, and its daemon
announces it again, backing off, until a coordinator takes it; a refusal no retry can get
past, or a job with no coordinator at all, is the rank's to hear."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest
from fixtures_daemon import DaemonFactory, DaemonHandle, free_port, wait_for

from stalwart.client.daemon_client import DaemonClient
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.announce import Announcer
from stalwart.daemon.recovery.registry import RankRecord, Registry
from stalwart.v1 import common_pb2, peer_pb2

INTERVAL_S = 0.01
LAYOUT = common_pb2.ParallelLayout()


class Peer:
    """The coordinator's Announce as another daemon serves it: refuses with each of
    `refusals` in turn (or with `always`), then takes every announcement."""

    def __init__(self, *refusals: grpc.StatusCode, always: grpc.StatusCode | None = None
                 ) -> None:
        self.refusals, self.always = list(refusals), always
        self.calls: list[str] = []
        self.taken: list[str] = []

    async def Announce(self, a: peer_pb2.RankAnnouncement, timeout: float) -> common_pb2.Ack:
        self.calls.append(a.rank_id)
        code = self.refusals.pop(0) if self.refusals else self.always
        if code is not None:
            raise grpc.aio.AioRpcError(code, details=f"refused: {code.name}")
        self.taken.append(a.rank_id)
        return common_pb2.Ack(accepted=True)


class Leadership:
    def __init__(self, leader: str) -> None:
        self.name = leader

    def leader(self) -> str:
        return self.name

    async def known(self) -> str:
        if not self.name:
            raise LookupError("no coordinator is elected")
        return self.name


class OwnCoordinator:
    """This daemon's own coordinator, whose decision takes until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.decided: list[str] = []

    def take_over(self, installed: common_pb2.Plan) -> bool:
        return False

    async def announce(self, a: peer_pb2.RankAnnouncement) -> None:
        await self.release.wait()
        self.decided.append(a.rank_id)


def announcer(peer: Peer, leader: str = "n0", coordinator: object = None
              ) -> tuple[Announcer, Registry]:
    registry = Registry(node="n1", heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0,
                        metrics=Metrics())
    a = Announcer("n1", registry, Leadership(leader), coordinator,  # type: ignore[arg-type]
                  lambda: "127.0.0.1:1", lambda node: peer, redeliver=_nothing,
                  interval_s=INTERVAL_S)
    return a, registry


async def _nothing() -> None:
    return None


def spare(registry: Registry, pid: int) -> RankRecord:
    return registry.register(pid=pid, rank=-1, world_size=1, local_rank=0, hostname="h",
                             spare=True, device="cpu", watch_pid=False)


async def until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(INTERVAL_S)


async def following(a: Announcer, seconds: float) -> None:
    """Let `a` follow the coordinator for `seconds`."""
    task = asyncio.create_task(a.follow())
    await asyncio.sleep(seconds)
    task.cancel()


def test_an_announcement_the_coordinator_cannot_take_yet_is_sent_again_until_taken() -> None:
    async def main() -> Peer:
        peer = Peer(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.PERMISSION_DENIED)  # the last: not a member yet
        a, registry = announcer(peer)
        await a.on_register(spare(registry, 101), LAYOUT)  # no error for the rank
        follow = asyncio.create_task(a.follow())
        try:
            await until(lambda: peer.taken, 30, "the announcement to be taken")
            await asyncio.sleep(20 * INTERVAL_S)  # once taken, nothing more is sent
        finally:
            follow.cancel()
        return peer

    peer = asyncio.run(main())
    assert peer.taken == ["n1/101"] and peer.calls == ["n1/101"] * 4


def test_retries_back_off_while_the_coordinator_does_not_answer() -> None:
    async def main() -> Peer:
        peer = Peer(always=grpc.StatusCode.UNAVAILABLE)
        a, registry = announcer(peer)
        await a.on_register(spare(registry, 101), LAYOUT)
        await following(a, 100 * INTERVAL_S)
        return peer

    peer = asyncio.run(main())
    # A try every interval would be ~100; doubling gaps from one interval allow ~8.
    assert 2 <= len(peer.calls) <= 12 and peer.taken == []


def test_a_refusal_for_good_is_the_ranks_to_hear_and_not_sent_again() -> None:
    async def main() -> tuple[Peer, grpc.aio.AioRpcError]:
        peer = Peer(grpc.StatusCode.UNAUTHENTICATED)
        a, registry = announcer(peer)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await a.on_register(spare(registry, 101), LAYOUT)
        await following(a, 20 * INTERVAL_S)
        return peer, refused.value

    peer, refused = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert peer.calls == ["n1/101"] and peer.taken == []


def test_a_job_with_no_coordinator_elected_is_the_ranks_to_hear_and_not_announced_later(
        ) -> None:
    async def main() -> Peer:
        peer = Peer()
        a, registry = announcer(peer, leader="")
        with pytest.raises(LookupError, match="no coordinator is elected"):
            await a.on_register(spare(registry, 101), LAYOUT)
        # One is elected later: the refused rank has ended, and nobody announces it.
        a.leadership.name = "n0"  # type: ignore[attr-defined]
        await following(a, 20 * INTERVAL_S)
        return peer

    assert asyncio.run(main()).calls == []


def test_a_rank_that_ends_before_any_coordinator_took_it_is_not_announced() -> None:
    async def main() -> Peer:
        peer = Peer(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
        a, registry = announcer(peer)
        gone, staying = spare(registry, 101), spare(registry, 102)
        await a.on_register(gone, LAYOUT)
        await a.on_register(staying, LAYOUT)
        registry.heartbeat(gone.rank_id, registry.generation, 0, 0.0, leaving=True)
        follow = asyncio.create_task(a.follow())
        try:
            await until(lambda: peer.taken, 30, "the staying rank to be announced")
            await asyncio.sleep(20 * INTERVAL_S)
        finally:
            follow.cancel()
        return peer

    assert asyncio.run(main()).taken == ["n1/102"]


def test_this_daemons_own_coordinator_decides_to_the_end_when_the_rank_stops_waiting(
        ) -> None:
    async def main() -> OwnCoordinator:
        own = OwnCoordinator()
        a, registry = announcer(Peer(), leader="n1", coordinator=own)
        # The decision outlasts a try: the Register call returns, the rank is registered.
        await a.on_register(spare(registry, 101), LAYOUT)
        # A caller that gives up (its deadline) does not cut the decision short either.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(a.on_register(spare(registry, 102), LAYOUT), 0.01)
        own.release.set()
        await until(lambda: len(own.decided) == 2, 30, "both decisions to end")
        return own

    assert sorted(asyncio.run(main()).decided) == ["n1/101", "n1/102"]


# Gossip every 0.2 s; a silent daemon is lost after 10 s, so the registration below
# surely lands while the dead coordinator is still the one its peers know.
SETTINGS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0}

RANK = """
import sys
from stalwart.client.daemon_client import DaemonClient
client = DaemonClient(sys.argv[1])
print(client.register(env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}).rank_id,
      flush=True)
client.start_heartbeats()
sys.stdin.read()
"""


def coordinators(d: DaemonHandle) -> list[str]:
    return [x.node for x in d.status().daemons if x.coordinator]


@pytest.mark.multiprocess
def test_a_spare_registering_while_the_coordinator_is_dead_is_used_by_the_next(
        daemon_factory: DaemonFactory) -> None:
    ports = {n: free_port() for n in "abc"}
    daemons = {n: daemon_factory.start(
        n, port=ports[n], settings=SETTINGS,
        peers=tuple(f"127.0.0.1:{p}" for m, p in ports.items() if m != n)) for n in "abc"}
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    wait_for(lambda: all(coordinators(d) == ["a"] and all(x.state == "up" for x in
                                                         d.status().daemons)
                         for d in daemons.values()), 20, "the three daemons to agree on a")
    rank = subprocess.Popen([sys.executable, "-c", RANK, c.socket_target],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spare = DaemonClient(b.socket_target)
    try:
        rank_id = rank.stdout.readline().strip()
        wait_for(lambda: any(x.rank_id == rank_id and x.coord.rank == 0
                             for x in b.status().plan.assignments), 20,
                 "the first plan to place the rank")
        a.stop(signal.SIGKILL)  # the fault: the coordinator's daemon dies

        spare_id = spare.register(spare=True).rank_id  # refused before: nobody to tell
        spare.start_heartbeats()
        assert coordinators(b) == ["a"], "the spare registered after b saw a lost"
        wait_for(lambda: coordinators(b) == ["b"], 30, "b to take over from the lost a")

        rank.kill()  # the rank dies: only a spare its daemon kept can take its role
        plan = wait_for(lambda: (p := b.status().plan) and any(
            x.rank_id == spare_id and not x.spare and x.coord.rank == 0
            for x in p.assignments) and p, 30, "the spare to take rank 0's role")
        assert plan.generation >= 2
    finally:
        spare.close()
        if rank.poll() is None:
            rank.kill()
        rank.wait(10)
