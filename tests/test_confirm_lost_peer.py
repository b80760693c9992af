"""Confirming another daemon's report that a peer is lost (`JobGate._silent`): the
report stands once this daemon's own heartbeat timeout declares the peer lost, without
waiting for the Gossip a frozen peer (SIGSTOP) never answers. Pure logic with stand-ins
for the membership and the Gossip call."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from stalwart.daemon.recovery.membership import LOST, SUSPECT, UP
from stalwart.daemon.security.roles import JobGate


def _gate(peer: SimpleNamespace, answer: asyncio.Future) -> SimpleNamespace:
    async def alive_ranks(node: str):
        return await answer

    gate = SimpleNamespace(membership=SimpleNamespace(peers=lambda: [peer]),
                           _alive_ranks=alive_ranks)
    gate._lost_here = lambda node: JobGate._lost_here(gate, node)
    return gate


def test_a_frozen_peer_is_confirmed_lost_once_this_daemon_times_it_out_too():
    async def scenario() -> None:
        frozen = asyncio.get_running_loop().create_future()  # Gossip: never answered
        peer = SimpleNamespace(node="node-1", state=SUSPECT)
        confirming = asyncio.ensure_future(JobGate._silent(_gate(peer, frozen), "node-1"))
        await asyncio.sleep(0)  # one turn of the loop: the Gossip is asked
        assert not confirming.done()
        peer.state = LOST  # this daemon's own heartbeat timeout, a moment later
        assert await asyncio.wait_for(confirming, 5) is True  # not CONFIRM_TIMEOUT_S
        assert frozen.cancelled()  # the unanswered Gossip is given up

    asyncio.run(scenario())


def test_a_peer_that_answers_is_not_silent():
    async def scenario() -> None:
        answer = asyncio.get_running_loop().create_future()
        answer.set_result({"node-1/7"})  # it vouches for its ranks: alive
        peer = SimpleNamespace(node="node-1", state=UP)
        assert await JobGate._silent(_gate(peer, answer), "node-1") is False

    asyncio.run(scenario())
