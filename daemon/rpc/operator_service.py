"""OperatorService: the daemon's view of the job for `stalwart status` and dashboards.

Other parts add their own fields (storage, committed step) by registering a
decorator that edits the reply, so this file does not grow with each of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from stalwart import __version__
from stalwart.daemon.recovery.membership import Membership
from stalwart.daemon.recovery.registry import Registry
from stalwart.v1 import operator_pb2, operator_pb2_grpc

RECENT_FAILURES = 20


@dataclass
class OperatorServicer(operator_pb2_grpc.OperatorServiceServicer):
    node: str
    address: str
    registry: Registry
    membership: Membership
    leader: Callable[[], str]  # the coordinator's node name (election.Leadership.leader)
    started: float = field(default_factory=time.monotonic)
    decorators: list[Callable[[operator_pb2.StatusReply], None]] = field(default_factory=list)

    async def Status(self, request: operator_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext) -> operator_pb2.StatusReply:
        return self.status()

    def status(self) -> operator_pb2.StatusReply:
        reg = self.registry
        coordinator = self.leader()
        reply = operator_pb2.StatusReply(
            node=self.node, version=__version__, uptime_s=time.monotonic() - self.started,
            generation=reg.generation, plan=reg.current_plan(),
            recent_failures=[f.to_proto() for f in list(reg.failures)[-RECENT_FAILURES:]])
        reply.daemons.add(node=self.node, address=self.address, state="up",
                          coordinator=coordinator == self.node)
        for peer in self.membership.peers():
            reply.daemons.add(node=peer.node, address=peer.address, state=peer.state,
                              last_seen_age_s=self.membership.age_s(peer),
                              coordinator=bool(peer.node) and coordinator == peer.node)
        for r in reg.ranks():
            reply.ranks.add(rank_id=r.rank_id, node=self.node, pid=r.pid, rank=r.rank,
                            spare=r.spare, step=r.step, step_time_s=r.step_time_s,
                            last_heartbeat_age_s=reg.heartbeat_age_s(r), state=r.shown_state)
        for decorate in self.decorators:
            decorate(reply)
        return reply
