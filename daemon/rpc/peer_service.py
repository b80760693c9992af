"""PeerService: membership gossip between daemons, plan installs and failure reports.

Every daemon calls Gossip on each peer it knows once per heartbeat interval;
the callee records the caller and answers with its own view. Plans, commits,
prepares and announcements go to the job, which checks the caller's role.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, NoReturn, TypeVar

import grpc

from stalwart.core.failures import Failure
from stalwart.daemon.background import Background
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.membership import Membership
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.rpc import step_stream, validate
from stalwart.daemon.rpc.errors import TYPED, abort
from stalwart.daemon.rpc.validate import MAX_PEERS, admit
from stalwart.daemon.security.auth import Authenticator, Forbidden
from stalwart.daemon.security.roles import JobGate
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.rpc.peer_service")
T = TypeVar("T")
HELD_PIECE_BYTES = 1 << 20  # GetHeld message size


def _unheard(decision: asyncio.Task[None]) -> None:
    """Log what an announcement's decision raised: a caller that stopped waiting (its
    deadline passed, it died) would never hear it."""
    if not decision.cancelled() and (exc := decision.exception()) is not None:
        log.warning("announcement refused or failed", extra={"error": str(exc)})


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """Handlers of PeerService: every call authenticated as a daemon (auth.Authenticator),
    then handed to the job's role checks (`steps`), whose Forbidden becomes
    PERMISSION_DENIED."""

    def __init__(self, membership: Membership, registry: Registry,
                 me: Callable[[], peer_pb2.PeerInfo], auth: Authenticator, steps: JobGate,
                 leader: Callable[[], str], metrics: Metrics | None = None,
                 job_id: str = "", stopping: asyncio.Event | None = None) -> None:
        self.membership, self.registry, self.me = membership, registry, me
        self.auth = auth
        self.metrics = metrics or Metrics()  # counts refused requests
        self.job_id = job_id  # when set, step messages of other jobs are refused
        # Role checks, then plans, commits, announcements (security.roles.JobGate).
        self.steps, self.leader = steps, leader
        self.stopping = stopping  # set when this daemon stops: its step streams end
        self._decisions = Background()  # announcements decided past their caller's deadline

    async def _caller(self, context: grpc.aio.ServicerContext, request: Any) -> str:
        node = await self.auth.daemon(context)
        await admit(context, self.metrics, request)
        return node

    async def _forbidden(self, context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        await context.abort(*self._refused(exc))
        raise AssertionError("unreachable: abort raises")

    async def Gossip(self, request: peer_pb2.PeerInfo,
                     context: grpc.aio.ServicerContext) -> peer_pb2.Membership:
        caller = await self._caller(context, request)
        if request.node != caller:
            await self._forbidden(context, Forbidden(
                f"daemon {caller!r} gossiped as {request.node!r}; a daemon speaks for itself"))
        known = self.membership.addresses()
        if request.address not in known and len(known) >= MAX_PEERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this daemon already knows {MAX_PEERS} peers; a cluster that "
                                "large needs a seed list per rack")
        self.membership.observe(request)
        return self.membership.to_proto(self.me(), self.leader(), request.view)

    async def _for_daemon(self, context: grpc.aio.ServicerContext, request: Any,
                          act: Callable[[str], Awaitable[T]], job_id: str | None = None) -> T:
        """`act(caller)` for the authenticated daemon that called (of this job, where
        `job_id` is given); its Forbidden becomes PERMISSION_DENIED, a typed error its
        own code."""
        caller = await self._caller(context, request)
        if job_id is not None:
            await self._same_job(context, job_id)
        try:
            return await act(caller)
        except Forbidden as exc:
            await self._forbidden(context, exc)
        except TYPED as exc:
            await abort(context, exc)
        raise AssertionError("unreachable: abort raises")

    async def InstallPlan(self, request: common_pb2.Plan,
                          context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        return await self._for_daemon(context, request,
                                      partial(self.steps.install_from, plan=request))

    async def HurryStep(self, request: peer_pb2.HurryStepRequest,
                        context: grpc.aio.ServicerContext) -> peer_pb2.HurryStepReply:
        return await self._for_daemon(context, request,
                                      partial(self.steps.hurry_from, request=request),
                                      request.job_id)

    async def ReportFailure(self, request: common_pb2.FailureEvent,
                            context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        caller = await self._caller(context, request)
        try:
            failure = Failure.from_proto(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # A fact (a dead process, a lost GPU or node) seen in an older generation stays
        # true in this one: two ranks that die together are seen by their two daemons,
        # and the second report may arrive after the plan for the first was installed,
        # with its rank still in it. An observation (a hang, a late heartbeat) was about
        # groups that are gone.
        current = self.registry.generation
        if not (request.generation == current or
                (0 < request.generation < current and failure.kind.is_fact)):
            return common_pb2.Ack(
                accepted=False, message=f"report is for generation {request.generation}; "
                                        f"the job is at generation {current}")
        # The reporter is who called, whatever the report says.
        self.registry.report(replace(failure, reporter=caller))
        return common_pb2.Ack(accepted=True)

    async def Announce(self, request: peer_pb2.RankAnnouncement,
                       context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        caller = await self._caller(context, request)
        try:
            # Decided to the end even when the caller stops waiting (its deadline, its
            # death): a plan cut off while it is sent would reach some daemons only.
            decision = self._decisions.start(self.steps.announce_from(caller, request))
            decision.add_done_callback(_unheard)
            await asyncio.shield(decision)
        except Forbidden as exc:
            await self._forbidden(context, exc)
        return common_pb2.Ack(accepted=True)

    async def PrepareStep(self, request: peer_pb2.PrepareStepRequest,
                          context: grpc.aio.ServicerContext) -> peer_pb2.PrepareStepReply:
        caller = await self._caller(context, request)
        await self._same_job(context, request.job_id)
        try:
            await self.steps.prepare_from(caller, request)
        except Forbidden as exc:
            await self._forbidden(context, exc)
        except TYPED as exc:
            await abort(context, exc)
        return peer_pb2.PrepareStepReply(ready=True, relay_key=self.steps.relay_key(caller))

    async def RelayPrepares(self, request: peer_pb2.PrepareBatch,
                            context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        caller = await self._caller(context, request)
        code, details = await self._relay(caller, request)
        if code != grpc.StatusCode.OK:
            await context.abort(code, details)
        return common_pb2.Ack(accepted=True)

    async def CommitStep(self, request: peer_pb2.CommitStepRequest,
                         context: grpc.aio.ServicerContext) -> peer_pb2.CommitStepReply:
        caller = await self._caller(context, request)
        code, details = await self._commit(caller, request)
        if code != grpc.StatusCode.OK:
            await context.abort(code, details)
        return peer_pb2.CommitStepReply(committed=True)

    async def StepStream(self, requests: AsyncIterator[peer_pb2.StepMessage],
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[peer_pb2.StepAnswer]:
        caller = await self.auth.daemon(context)  # once: every message is the caller's
        async for answer in step_stream.answers(requests, partial(self._step, caller),
                                                self.stopping):
            yield answer

    async def _step(self, caller: str, message: peer_pb2.StepMessage
                    ) -> tuple[grpc.StatusCode, str]:
        """One StepStream message, answered as its unary call would end."""
        body = message.WhichOneof("body")
        if body is None:
            self.metrics.auth_refused.labels("invalid").inc()
            return grpc.StatusCode.INVALID_ARGUMENT, "a step message holds no body"
        inner = getattr(message, body)
        try:
            validate.request(inner)
        except validate.InvalidRequest as exc:
            self.metrics.auth_refused.labels("invalid").inc()
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if body == step_stream.COMMIT:
            return await self._commit(caller, inner)
        return await self._relay(caller, inner)

    async def _relay(self, caller: str, request: peer_pb2.PrepareBatch
                     ) -> tuple[grpc.StatusCode, str]:
        if (other := self._other_job(request.job_id)) is not None:
            return other
        try:
            await self.steps.relay_from(caller, request)
        except Forbidden as exc:
            return self._refused(exc)
        return grpc.StatusCode.OK, ""

    async def _commit(self, caller: str, request: peer_pb2.CommitStepRequest
                      ) -> tuple[grpc.StatusCode, str]:
        if (other := self._other_job(request.record.job_id)) is not None:
            return other
        try:
            await self.steps.commit_from(caller, request)
        except Forbidden as exc:
            return self._refused(exc)
        except ValueError as exc:
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        return grpc.StatusCode.OK, ""

    def _refused(self, exc: Exception) -> tuple[grpc.StatusCode, str]:
        self.metrics.auth_refused.labels("role").inc()
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)

    async def GetStepRecord(self, request: peer_pb2.GetStepRecordRequest,
                            context: grpc.aio.ServicerContext) -> manifest_pb2.StepRecord:
        return await self._for_daemon(context, request,
                                      partial(self.steps.record_for, step=request.step),
                                      request.job_id)

    async def PutRecords(self, request: manifest_pb2.RankRecords,
                         context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        await self._for_daemon(context, request,
                               partial(self.steps.records_from, message=request),
                               request.job_id)
        return common_pb2.Ack(accepted=True)

    async def GetRecords(self, request: peer_pb2.GetRecordsRequest,
                         context: grpc.aio.ServicerContext) -> manifest_pb2.RankRecords:
        return await self._for_daemon(context, request,
                                      partial(self.steps.records_for, request=request),
                                      request.job_id)

    async def GetHeld(self, request: peer_pb2.GetHeldRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[peer_pb2.HeldPiece]:
        regions = await self._for_daemon(context, request,
                                         partial(self.steps.held_for, request=request),
                                         request.job_id)
        for view in regions:
            for offset in range(0, len(view), HELD_PIECE_BYTES):
                yield peer_pb2.HeldPiece(data=bytes(view[offset:offset + HELD_PIECE_BYTES]))

    async def _same_job(self, context: grpc.aio.ServicerContext, job_id: str) -> None:
        if (other := self._other_job(job_id)) is not None:
            await context.abort(*other)

    def _other_job(self, job_id: str) -> tuple[grpc.StatusCode, str] | None:
        """The refusal of a step message of another job (None: this job's)."""
        if not self.job_id or job_id == self.job_id:
            return None
        self.metrics.auth_refused.labels("job").inc()
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"step message of job {job_id!r} sent to a daemon of job {self.job_id!r}; "
                "check the peers list: daemons of different jobs must not be peers")
