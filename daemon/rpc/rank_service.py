"""RankService: what the daemon offers the training ranks of its node (over the Unix socket).

Registration, heartbeats, plan watching and client-side failure reports live
here. The snapshot calls (OpenSlot, Capture, WaitCommitted, Restore) go to the
snapshot path's intake, committer and restorer; their typed errors become statuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial

import grpc

from stalwart.core.failures import Failure
from stalwart.core.generation import StaleGeneration, check_generation
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.registry import RankRecord, Registry
from stalwart.daemon.rpc.errors import TYPED, abort
from stalwart.daemon.rpc.streams import send_within
from stalwart.daemon.rpc.validate import (
    MAX_COLLECTIVES,
    admit,
)
from stalwart.daemon.security.admission import RankAdmission
from stalwart.daemon.security.auth import Authenticator
from stalwart.daemon.snapshot.path import SnapshotPath
from stalwart.daemon.snapshot.selection import Layers
from stalwart.v1 import common_pb2, rank_pb2, rank_pb2_grpc

log = logging.getLogger("stalwart.daemon.rpc.rank_service")

WATCH_WAKE_S = 5.0  # WatchPlan re-checks for shutdown at least this often (seconds)
RESTORE_IDLE_S = 60.0  # a Restore reader that takes no piece this long is let go (seconds)


class RankServicer(rank_pb2_grpc.RankServiceServicer):
    """Handlers of RankService; state lives in the Registry."""

    def __init__(self, config: DaemonConfig, registry: Registry, metrics: Metrics,
                 stopping: asyncio.Event, auth: Authenticator, snapshots: SnapshotPath,
                 on_register: Callable[[RankRecord, common_pb2.ParallelLayout,
                                        common_pb2.LayerProfile, tuple[str, int] | None],
                                       Awaitable[None]]
                 | None = None) -> None:
        self.config, self.registry, self.metrics = config, registry, metrics
        self.stopping, self.auth = stopping, auth
        self.admission = RankAdmission(config, registry, metrics)
        # Tells the coordinator (through the job) that a rank or spare is here.
        self.on_register = on_register
        self.snapshots = snapshots
        self._collectives: set[str] = set()  # label values of stalwart_link_bytes_total

    async def Register(self, request: rank_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> rank_pb2.RegisterReply:
        await self.auth.token_holder(context, request.token, f"rank pid {request.pid}")
        await admit(context, self.metrics, request)
        try:
            watch = await self.admission.admit(request, context.peer().startswith("unix:"))
        except TYPED as exc:
            await abort(context, exc)
        record = self.registry.register(
            pid=request.pid, rank=request.rank, world_size=request.world_size,
            local_rank=request.local_rank, hostname=request.hostname,
            spare=request.spare or request.rank < 0, device=request.device,
            # Only a pid proven to be the caller's is watched (exit detection, fencing).
            watch_pid=watch, instance=request.instance)
        if self.on_register is not None:
            # Announced to the coordinator now, or, while a coordinator does not answer,
            # again later; only a job with no coordinator at all, or a refusal for good,
            # is the rank's to hear.
            store = (request.store_host, request.store_port) if request.store_port else None
            try:
                await self.on_register(record, request.layout, request.profile, store)
            except (grpc.aio.AioRpcError, LookupError) as e:
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                # Not UNAVAILABLE: this daemon answers, and the rank's client reads that
                # code as "no daemon here".
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"registered with {self.config.node}, but the coordinator could not be "
                    f"told ({detail}); retry when the job's daemons see each other")
        return rank_pb2.RegisterReply(
            rank_id=record.rank_id, node=self.config.node, generation=self.registry.generation,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            plan=self.registry.current_plan())

    async def Heartbeat(self, request: rank_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> rank_pb2.HeartbeatReply:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        try:
            self.registry.heartbeat(request.rank_id, request.generation, request.step,
                                    request.step_time_s, leaving=request.leaving,
                                    raised=request.raised,
                                    recovery_phases=dict(request.recovery_phase_s),
                                    finished_at=request.finished_at)
        except TYPED as exc:
            await abort(context, exc)
        self._count_link_bytes(request.link_bytes)
        return rank_pb2.HeartbeatReply(generation=self.registry.generation)

    def _count_link_bytes(self, sent: Iterable[rank_pb2.LinkBytesSent]) -> None:
        """Add ranks' link bytes to the metric; at most MAX_COLLECTIVES label values ever."""
        for s in sent:
            if s.collective not in self._collectives:
                if len(self._collectives) >= MAX_COLLECTIVES:
                    continue  # validated per request; this bounds them across requests
                self._collectives.add(s.collective)
            self.metrics.link_bytes.labels(link=s.link, collective=s.collective).inc(s.bytes)

    async def WatchPlan(self, request: rank_pb2.WatchPlanRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[rank_pb2.PlanEvent]:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        known = request.known_generation
        while not self.stopping.is_set():
            plan = await self.registry.plan_after(known, WATCH_WAKE_S)
            if plan is None:
                continue
            previous = self.registry.previous_plan or common_pb2.Plan()
            yield rank_pb2.PlanEvent(plan=plan, previous=previous)
            known = plan.generation

    async def ReportFailure(self, request: common_pb2.FailureEvent,
                            context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        try:
            check_generation(request.generation or self.registry.generation,
                             self.registry.generation, "failure report")
        except StaleGeneration as exc:
            return common_pb2.Ack(accepted=False, message=str(exc))
        if request.kind == common_pb2.FailureEvent.KIND_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "failure report needs a kind (FailureEvent.Kind)")
        failure = Failure.from_proto(request)
        # This node saw it, in the generation the rank is in (it may not know the number).
        mine = failure.reporter.startswith(f"{self.config.node}/")  # a rank of this node
        self.registry.report(replace(failure, reporter=failure.reporter if mine
                                     else self.config.node,
                                     generation=failure.generation or self.registry.generation))
        return common_pb2.Ack(accepted=True)

    # Snapshot path: the daemon's SnapshotPath (intake, commit, restore) does the work.

    async def OpenSlot(self, request: rank_pb2.OpenSlotRequest,
                       context: grpc.aio.ServicerContext) -> rank_pb2.OpenSlotReply:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        try:
            return await self.snapshots.intake.open_slot(request)
        except TYPED as exc:
            await abort(context, exc)

    async def Capture(self, request: rank_pb2.CaptureRequest,
                      context: grpc.aio.ServicerContext) -> rank_pb2.CaptureReply:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        try:
            await self.snapshots.intake.capture(request)
        except TYPED as exc:
            await abort(context, exc)
        return rank_pb2.CaptureReply(accepted=True)

    async def WaitCommitted(self, request: rank_pb2.WaitCommittedRequest,
                            context: grpc.aio.ServicerContext) -> rank_pb2.WaitCommittedReply:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        return await self.snapshots.committer.wait_committed(request.step, request.timeout_s)

    async def Restore(self, request: rank_pb2.RestoreRequest,
                      context: grpc.aio.ServicerContext) -> None:
        await self.auth.token_holder(context)
        await admit(context, self.metrics, request)
        try:
            into = partial(self.snapshots.intake.restore_slot, request.rank_id) \
                if request.into_slot else None
            layers = (Layers(request.layers.first, request.layers.last)
                      if request.HasField("layers") else None)
            async for piece in self.snapshots.restorer.restore(request.step, request.rank,
                                                               into, layers):
                if not await send_within(context, piece, RESTORE_IDLE_S):
                    if piece.slot_id:
                        self.snapshots.intake.forget_slot(piece.slot_id)
                    log.warning("restore reader cut off: it took no piece for %g s",
                                RESTORE_IDLE_S, extra={"rank_id": request.rank_id})
                    return
        except TYPED as exc:
            await abort(context, exc)
