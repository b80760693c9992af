"""PeerService: membership gossip between daemons, plan installs and failure reports.

Every daemon calls Gossip on each peer it knows once per heartbeat interval;
the callee records the caller and answers with its own view. The two-phase
commit calls (PrepareStep, CommitStep) are forwarded to the commit path when the
server is given one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

import grpc

from stalwart.core.failures import Failure
from stalwart.daemon.membership import Membership
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.registry import Registry, StaleGeneration
from stalwart.daemon.validate import MAX_PEERS, admit
from stalwart.v1 import common_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.peer_service")


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, membership: Membership, registry: Registry,
                 me: Callable[[], peer_pb2.PeerInfo], steps: Any = None,
                 metrics: Metrics | None = None, job_id: str = "") -> None:
        self.membership, self.registry, self.me = membership, registry, me
        self.metrics = metrics or Metrics()  # counts refused requests
        self.job_id = job_id  # when set, step messages of other jobs are refused
        # Object with async PrepareStep/CommitStep(request, context): the commit path.
        self.steps = steps

    async def Gossip(self, request: peer_pb2.PeerInfo,
                     context: grpc.aio.ServicerContext) -> peer_pb2.Membership:
        await admit(context, self.metrics, request)
        targets = self.membership.targets()
        if request.address not in targets and len(targets) >= MAX_PEERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this daemon already knows {MAX_PEERS} peers; a cluster that "
                                "large needs a seed list per rack")
        self.membership.observe(request)
        return self.membership.to_proto(self.me())

    async def InstallPlan(self, request: common_pb2.Plan,
                          context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        await admit(context, self.metrics, request)
        if self.steps is not None:  # the job fences left-out ranks and drops stale captures
            return self.steps.adopt_plan(request)
        try:
            self.registry.install_plan(request)
        except StaleGeneration as e:
            return common_pb2.Ack(accepted=False, message=str(e))
        return common_pb2.Ack(accepted=True)

    async def ReportFailure(self, request: common_pb2.FailureEvent,
                            context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        await admit(context, self.metrics, request)
        if request.generation and request.generation < self.registry.generation:
            return common_pb2.Ack(
                accepted=False, message=f"report is from generation {request.generation}; "
                                        f"the job is at generation {self.registry.generation}")
        try:
            failure = Failure.from_proto(request)
        except ValueError as e:
            return common_pb2.Ack(accepted=False, message=str(e))
        self.registry.report(replace(failure, reporter=failure.reporter or context.peer()))
        return common_pb2.Ack(accepted=True)

    async def Announce(self, request: peer_pb2.RankAnnouncement,
                       context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        await admit(context, self.metrics, request)
        if self.steps is None:
            await _not_here(context, "Announce")
        return await self.steps.Announce(request, context)

    async def PrepareStep(self, request: peer_pb2.PrepareStepRequest,
                          context: grpc.aio.ServicerContext) -> peer_pb2.PrepareStepReply:
        await admit(context, self.metrics, request)
        await self._same_job(context, request.job_id)
        if self.steps is None:
            await _not_here(context, "PrepareStep")
        return await self.steps.PrepareStep(request, context)

    async def CommitStep(self, request: peer_pb2.CommitStepRequest,
                         context: grpc.aio.ServicerContext) -> peer_pb2.CommitStepReply:
        await admit(context, self.metrics, request)
        await self._same_job(context, request.manifest.job_id)
        if self.steps is None:
            await _not_here(context, "CommitStep")
        return await self.steps.CommitStep(request, context)

    async def _same_job(self, context: grpc.aio.ServicerContext, job_id: str) -> None:
        if self.job_id and job_id != self.job_id:
            self.metrics.auth_refused.labels("job").inc()
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"step message of job {job_id!r} sent to a daemon of job {self.job_id!r}; "
                "check the peers list: daemons of different jobs must not be peers")


async def _not_here(context: grpc.aio.ServicerContext, method: str) -> NoReturn:
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED,
        f"PeerService.{method}: this daemon has no step commit yet; run daemons of one version")
    raise AssertionError("unreachable: abort raises")


async def gossip_forever(membership: Membership, me: Callable[[], peer_pb2.PeerInfo],
                         channel: Callable[[str], grpc.aio.Channel], interval_s: float,
                         stopping: asyncio.Event) -> None:
    """Call Gossip on every known peer each interval (seconds) until `stopping` is set."""
    while not stopping.is_set():
        started = time.monotonic()
        addresses = membership.targets()
        await asyncio.gather(*(_gossip_once(a, membership, me, channel, interval_s)
                               for a in addresses))
        try:
            await asyncio.wait_for(stopping.wait(),
                                   max(0.0, interval_s - (time.monotonic() - started)))
        except TimeoutError:
            pass


async def _gossip_once(address: str, membership: Membership,
                       me: Callable[[], peer_pb2.PeerInfo],
                       channel: Callable[[str], grpc.aio.Channel], timeout_s: float) -> None:
    stub = peer_pb2_grpc.PeerServiceStub(channel(address))
    try:
        reply = await stub.Gossip(me(), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        # Unreachable peers are expected while a cluster starts; loss is judged by age.
        log.debug("gossip failed", extra={"peer": address, "code": e.code().name})
        return
    membership.learn(reply, contacted=address)
