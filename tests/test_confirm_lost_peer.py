"""Confirming another daemon's report that a peer is lost (`JobGate._silent`): the
report stands once this daemon's own heartbeat timeout declares the peer lost, without
waiting for the Gossip a frozen peer (SIGSTOP) never answers. A real membership table on
a hand-moved clock; the Gossip call is a stand-in."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.membership import Membership
from stalwart.daemon.security.roles import JobGate
from stalwart.v1 import peer_pb2


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _gate(answer: asyncio.Future) -> tuple[SimpleNamespace, Clock]:
    """A gate whose membership has heard from node-1 just now (heartbeat every 1 s,
    lost after 5 s), and whose Gossip to it answers with `answer`."""
    clock = Clock()
    table = Membership("node-0", "h:1", 1.0, 5.0, Metrics(), lambda f: f, clock=clock)
    table.observe(peer_pb2.PeerInfo(node="node-1", address="h:2"))

    async def alive_ranks(node: str):
        return await answer

    gate = SimpleNamespace(membership=table, _alive_ranks=alive_ranks)
    gate._lost_here = lambda node: JobGate._lost_here(gate, node)
    return gate, clock


def test_a_frozen_peer_is_confirmed_lost_once_this_daemon_times_it_out_too():
    async def scenario() -> None:
        frozen = asyncio.get_running_loop().create_future()  # Gossip: never answered
        gate, clock = _gate(frozen)
        clock.now += 3
        gate.membership.check()  # suspect here; another daemon already reports it lost
        confirming = asyncio.ensure_future(JobGate._silent(gate, "node-1"))
        await asyncio.sleep(0)  # one turn of the loop: the Gossip is asked
        assert not confirming.done()
        clock.now += 3
        gate.membership.check()  # this daemon's own heartbeat timeout, a moment later
        assert await asyncio.wait_for(confirming, 5) is True  # not CONFIRM_TIMEOUT_S
        assert frozen.cancelled()  # the unanswered Gossip is given up

    asyncio.run(scenario())


def test_a_peer_that_answers_is_not_silent():
    async def scenario() -> None:
        answer = asyncio.get_running_loop().create_future()
        answer.set_result({"node-1/7"})  # it vouches for its ranks: alive
        gate, _ = _gate(answer)
        assert await JobGate._silent(gate, "node-1") is False

    asyncio.run(scenario())
