"""Membership past `fanout` peers: each daemon calls its ring neighbours and a sample per
interval, and the job still learns of a loss in a few intervals, from the loss's
neighbours alone, with no live daemon ever taken for lost.

The real membership tables of 120 daemons gossip over an in-memory network (a call is the
callee's `observe` and the caller's `learn` of the callee's reply) on a shared clock;
the last test runs seven real daemons over gRPC and stops one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

from fixtures_hostile import config, until

from stalwart.core.failures import FailureKind
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.membership import LOST, RING, SUSPECT, UP, Membership
from stalwart.daemon.server import Daemon
from stalwart.v1 import peer_pb2

N, FANOUT, INTERVAL, TIMEOUT = 120, 8, 1.0, 5.0


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class Net:
    def __init__(self, n: int = N) -> None:
        self.clock = Clock()
        self.reports: list[tuple[str, str]] = []  # (reporter, subject)
        self.metrics = Metrics()
        self.tables = [self._table(i) for i in range(n)]
        self.by_address = {t.self_address: t for t in self.tables}
        self.alive = set(range(n))
        self.calls: list[int] = []  # calls made by one daemon in the last round, each

    def _table(self, i: int) -> Membership:
        node = f"n{i:03d}"

        def report(failure):
            self.reports.append((node, failure.subject))
            return failure

        return Membership(node, f"10.0.0.{i}:7070", INTERVAL, TIMEOUT, self.metrics, report,
                          clock=self.clock, wall=lambda: self.clock.now + 1.7e9,
                          seeds=("10.0.0.0:7070",), fanout=FANOUT, rng=random.Random(i))

    def info(self, t: Membership) -> peer_pb2.PeerInfo:
        return peer_pb2.PeerInfo(node=t.self_node, address=t.self_address,
                                 time_unix_ms=int((self.clock.now + 1.7e9) * 1000),
                                 view=t.view())

    def round(self) -> None:
        self.calls = []
        for i in sorted(self.alive):
            caller = self.tables[i]
            made = 0
            for address in caller.targets():
                made += 1
                callee = self.by_address.get(address)
                if callee is None or self.tables.index(callee) not in self.alive:
                    continue  # no answer
                me = self.info(caller)
                callee.observe(me)
                caller.learn(callee.to_proto(self.info(callee), "", me.view), address)
            self.calls.append(made)
        self.clock.now += INTERVAL
        for i in sorted(self.alive):
            self.tables[i].check()

    def states(self) -> dict[int, dict[int, str]]:
        """viewer -> subject -> the state the viewer holds it in, for every live viewer."""
        index = {t.self_address: i for i, t in enumerate(self.tables)}
        return {v: {index[p.address]: p.state for p in self.tables[v].peers()
                    if p.address in index} for v in self.alive}

    def live_taken_for_lost(self) -> list[tuple[int, int]]:
        return [(v, s) for v, seen in self.states().items() for s, state in seen.items()
                if s in self.alive and state == LOST]

    def holding(self, subject: int, state: str) -> set[int]:
        """The live daemons (not `subject`) that hold `subject` in `state`."""
        return {v for v, seen in self.states().items()
                if v != subject and seen.get(subject) == state}

    def converged(self, rounds: int = 40) -> None:
        for _ in range(rounds):
            self.round()
            if all(seen.get(s) == UP for v, seen in self.states().items()
                   for s in self.alive if s != v):
                return
        raise AssertionError("the daemons never all knew each other")


def neighbours(i: int, alive: set[int]) -> set[str]:
    ring = sorted(alive - {i})
    at = next(k for k, x in enumerate(ring) if x > i) if any(x > i for x in ring) else 0
    picks = {ring[(at + k) % len(ring)] for k in range(RING)} | {
        ring[(at - 1 - k) % len(ring)] for k in range(RING)}
    return {f"n{x:03d}" for x in picks}


def test_each_daemon_calls_fanout_peers_per_interval_however_large_the_job() -> None:
    net = Net()
    net.converged()
    assert all(t.sampled() for t in net.tables)
    for _ in range(3):
        net.round()
        assert max(net.calls) <= FANOUT  # not N - 1 = 119


def test_a_loss_is_told_by_its_neighbours_and_known_everywhere_in_a_few_intervals() -> None:
    net = Net()
    net.converged()
    dead = 50
    net.alive.discard(dead)
    rounds, known = 0, set()
    while len(known) < len(net.alive):
        net.round()
        rounds += 1
        assert rounds <= TIMEOUT / INTERVAL + 4, f"{len(known)} of {len(net.alive)} knew"
        known |= net.holding(dead, LOST)
        assert net.live_taken_for_lost() == []
    reporters = {r for r, subject in net.reports if subject == f"n{dead:03d}"}
    assert reporters and reporters <= neighbours(dead, net.alive | {dead})
    assert len(net.reports) == len(reporters)  # one report each, about the dead one only


def test_a_daemon_that_comes_back_is_known_up_again_everywhere() -> None:
    net = Net()
    net.converged()
    net.alive.discard(7)
    for _ in range(int(TIMEOUT / INTERVAL) + 12):
        net.round()
    assert net.holding(7, LOST) == net.alive
    net.alive.add(7)
    for _ in range(15):
        net.round()
        if net.holding(7, UP) == net.alive - {7}:
            break
    assert net.holding(7, UP) == net.alive - {7}
    assert net.live_taken_for_lost() == []


def test_a_suspicion_from_before_the_job_grew_past_fanout_clears_once_not_judged() -> None:
    # d judges a and b by age while the job is small; they fall behind and are suspect.
    # Then the job grows past fanout: a is no longer a ring neighbour of d, so d stops
    # judging it, and the neighbours' word (up or lost) is all d hears of it. A
    # suspicion left from d's own judging would never clear (seen with seven daemons).
    clock = Clock()
    table = Membership("d", "10.0.0.4:7070", 0.2, 2.0, Metrics(), lambda f: f, clock=clock,
                       wall=lambda: clock.now + 1.7e9, fanout=2, rng=random.Random(0))

    def hello(node: str, i: int) -> None:
        table.observe(peer_pb2.PeerInfo(node=node, address=f"10.0.0.{i}:7070",
                                        time_unix_ms=int((clock.now + 1.7e9) * 1000)))

    hello("a", 1)
    hello("b", 2)
    table.check()
    clock.now += 0.5  # over two intervals without a word: suspect
    table.check()
    assert {p.node: p.state for p in table.peers()} == {"a": SUSPECT, "b": SUSPECT}
    for node, i in (("c", 3), ("e", 5), ("f", 6), ("g", 7)):
        hello(node, i)
    assert table.sampled() and "10.0.0.1:7070" not in table.targets()  # a: not judged
    table.check()
    assert {p.node: p.state for p in table.peers()} == dict.fromkeys("abcefg", UP)
    clock.now += 10.0  # past the timeout: only the neighbours d judges can be lost
    table.check()
    assert table.peers()[0].state == UP


def test_seven_daemons_gossiping_with_two_each_learn_of_a_stopped_one(tmp_path: Path) -> None:
    # gossip_fanout 2 < 6 peers: each daemon judges its 4 ring neighbours itself and
    # learns of the other 2 second hand. d is stopped: b, c, e and f (its neighbours)
    # find it lost and report it; a and g are told.
    names = "abcdefg"

    async def main() -> dict[str, object]:
        daemons: dict[str, Daemon] = {}
        for name in names:
            seed = (daemons["a"].address,) if daemons else ()
            cfg = dataclasses.replace(config(tmp_path / name), node=name, peers=seed,
                                      gossip_fanout=2, heartbeat_timeout_s=2.0)
            daemons[name] = Daemon(cfg)
            await daemons[name].start()
        try:
            def state_of(viewer: str, subject: str) -> str:
                return next((p.state for p in daemons[viewer].membership.peers()
                             if p.node == subject), "unknown")

            def not_up() -> list[str]:
                return [f"{v} holds {s} {state_of(v, s)}" for v in names for s in names
                        if s != v and state_of(v, s) != UP]

            try:
                await until(lambda: not not_up(), "the seven daemons to know each other")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {', '.join(not_up())}") from None
            assert all(daemons[n].membership.sampled() for n in names)
            await daemons["d"].stop(grace_s=0)
            rest = [n for n in names if n != "d"]
            await until(lambda: all(state_of(v, "d") == LOST for v in rest),
                        "every daemon to hold d lost")
            found = {n for n in rest for f in daemons[n].registry.failures
                     if f.kind is FailureKind.PEER_LOST and f.reporter == n}
            return {"reported by": sorted(found),
                    "live taken for lost": [(v, s) for v in rest for s in rest
                                            if v != s and state_of(v, s) == LOST]}
        finally:
            for name in reversed(names):
                if name != "d":
                    await daemons[name].stop(grace_s=0)

    seen = asyncio.run(main())
    assert seen["reported by"] and set(seen["reported by"]) <= {"b", "c", "e", "f"}
    assert seen["live taken for lost"] == []
