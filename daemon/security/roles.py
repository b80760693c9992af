"""Who may do what to the job: the role checks behind every PeerService call.

Only the coordinator (the etcd seat holder, or the smallest live node name) installs
plans and commits new steps, for generations at most MAX_GENERATION_JUMP ahead; a
daemon announces and prepares only ranks of its own node; a death reported by one
node for a rank of another is believed once that rank's daemon does not vouch for it.
Callers are already authenticated (daemon/security/auth.py); refusals raise Forbidden.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from stalwart.core.decide import PlanState
from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.errors import NotFound
from stalwart.daemon.peers import PeerLost, unless_lost
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.daemon.recovery.election import Leadership
from stalwart.daemon.recovery.membership import LOST, Membership
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.rpc.validate import MAX_LIVE_RANKS_PER_NODE, process_part
from stalwart.daemon.security.auth import Forbidden
from stalwart.daemon.security.prepare_rule import (
    MAX_STEPS_AHEAD,
    PrepareRule,
    Seat,
    ranks_by_node,
    seats_of,
)
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.prepare_relay import PrepareRelay
from stalwart.daemon.snapshot.records import RecordHolders
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.security.roles")

MAX_GENERATION_JUMP = 64   # a plan or commit may be at most this many generations ahead
CONFIRM_TIMEOUT_S = 2.0    # how long the subject's daemon gets to vouch for its rank
_CONFIRMED_BY_LIVENESS = (FailureKind.PROCESS_EXIT, FailureKind.HEARTBEAT_MISSED)


def node_of(name: str) -> str:
    """The node of a rank id "<node>/<pid>[.<n>]", or the name itself (a node)."""
    node, sep, pid = name.rpartition("/")
    return node if sep and process_part(pid) else name


class JobGate:
    """The job as PeerService sees it: each call checked against the caller's role, then
    done by the part of the daemon it is for. The caller is the authenticated node name."""

    def __init__(self, *, node: str, registry: Registry, membership: Membership,
                 leadership: Leadership, coordinator: Coordinator, store: LocalStore,
                 adopt_plan: Callable[[common_pb2.Plan], common_pb2.Ack],
                 commit: Callable[..., Awaitable[None]],
                 records: RecordHolders, nodes: Callable[[], list[str]],
                 stub: Callable[[str], peer_pb2_grpc.PeerServiceStub],
                 me: Callable[[], peer_pb2.PeerInfo],
                 pass_on: Callable[[peer_pb2.CommitStepRequest], None],
                 take_commit: Callable[[str, str, int], Awaitable[None]],
                 relay: PrepareRelay,
                 hurry: Callable[[int, int, float], Awaitable[bool]]) -> None:
        self.node, self.registry, self.membership = node, registry, membership
        self.leadership, self.coordinator, self.store = leadership, coordinator, store
        self.adopt_plan, self.commit, self.nodes = adopt_plan, commit, nodes
        self.records = records
        self.stub, self.me, self.pass_on, self.relay = stub, me, pass_on, relay
        self.take_commit = take_commit
        self.hurry = hurry
        # The plan the prepare rule last derived from, its ranks by node and their seats.
        self._placed: tuple[PlanState | None, dict[str, frozenset[int]], dict[bytes, Seat]] = (
            None, {}, {})

    async def _coordinator(self, caller: str, what: str) -> None:
        if not await self.leadership.confirm(caller):
            raise Forbidden(f"{what} comes only from the coordinator "
                            f"({self.leadership.leader() or 'none known'}), not from "
                            f"daemon {caller}")

    def _generation_bound(self, generation: int, what: str) -> None:
        current = self.registry.generation
        if generation > current + MAX_GENERATION_JUMP:
            raise Forbidden(f"{what} of generation {generation} jumps more than "
                            f"{MAX_GENERATION_JUMP} generations past {current}")

    async def install_from(self, caller: str, plan: common_pb2.Plan) -> common_pb2.Ack:
        await self._coordinator(caller, "a plan")
        self._generation_bound(plan.generation, "plan")
        await self._take_resume_step(caller, plan)
        return self.adopt_plan(plan)

    async def _take_resume_step(self, coordinator: str, plan: common_pb2.Plan) -> None:
        """The step `plan` resumes from, committed here before the plan is adopted (this
        node's ranks restore from it): a coordinator that died while sending its phase
        two left it on some daemons only, and a daemon that was away missed it. The
        coordinator has it (it catches up before deciding); only a daemon without it
        asks, so a plan reaches the daemons that have it (nearly always all) without a
        round trip more."""
        step = plan.resume_step
        if plan.stop or step <= 0 or step in self.store.committed_steps():
            return
        try:
            await self.take_commit(coordinator, self.store.job_id, step)
        except (grpc.aio.AioRpcError, LookupError, ValueError, OSError) as exc:
            # OSError: this disk refused the record (full). The plan is adopted all the
            # same: refusing it would leave this node's ranks, a spare given a role here
            # included, out of the plan, and the others waiting for them in group builds.
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.error("plan adopted without the step it resumes from: ranks of this node "
                      "cannot restore until it is committed here",
                      extra={"step": step, "coordinator": coordinator, "error": details})
            return
        log.warning("took the committed step a plan resumes from, which this daemon missed",
                    extra={"step": step, "coordinator": coordinator})

    async def hurry_from(self, caller: str, request: peer_pb2.HurryStepRequest
                         ) -> peer_pb2.HurryStepReply:
        """The coordinator waits for `request.step` to commit before it re-plans: the
        captures of earlier steps that wait here are dropped, and the answer says whether
        this node holds its ranks' captures of that step."""
        await self._coordinator(caller, "a hurried step")
        if request.generation != self.registry.generation:
            return peer_pb2.HurryStepReply(accepted=False, message=(
                f"hurry is for generation {request.generation}; this daemon is at "
                f"generation {self.registry.generation}"))
        holding = await self.hurry(request.generation, request.step, request.wait_s)
        return peer_pb2.HurryStepReply(accepted=True, holding=holding)

    async def commit_from(self, caller: str, request: peer_pb2.CommitStepRequest) -> None:
        """Phase two: from the coordinator, or through the commit tree from any daemon
        with the coordinator's signature; a commit new here goes on down the tree."""
        record = request.record
        new = record.step not in self.store.committed_steps()
        if new:
            if not self._signed_by_coordinator(request):
                await self._coordinator(caller, f"the commit of step {record.step}")
            elif caller not in self.nodes():
                raise Forbidden(f"daemon {caller} passed on a commit but is not a live "
                                "member of this job")
            self._generation_bound(record.generation, "commit")
        elif caller not in self.nodes():
            # The same commit again (a new coordinator re-sending phase two; the store
            # refuses a different one) from a live daemon of the job.
            raise Forbidden(f"daemon {caller} is not a live member of this job")
        await self.commit(record, verified=True)  # by the RPC's check (validate.step_record)
        if new and request.fanout:
            self.pass_on(request)

    def _signed_by_coordinator(self, request: peer_pb2.CommitStepRequest) -> bool:
        """Whether the plan's coordinator, still the one this daemon knows, signed it."""
        plan = self.registry.current_plan()
        return (plan is not None and bool(plan.coordinator)
                and plan.coordinator == self.leadership.leader()
                and commit_tree.signed_by(plan.commit_key, request.record, request.signature))

    async def records_from(self, caller: str, message: manifest_pb2.RankRecords) -> None:
        """Copies of a peer's ranks' records (this daemon is one of their holders), or
        repaired ones; the records checker refuses what would replace a good record."""
        if caller not in self.nodes():
            raise Forbidden(f"daemon {caller} is not a live member of this job")
        latest = self.store.latest_committed() or 0
        if message.step > latest + MAX_STEPS_AHEAD:
            raise Forbidden(f"records of step {message.step} are more than "
                            f"{MAX_STEPS_AHEAD} steps past the last committed step {latest}")
        try:
            await asyncio.to_thread(self.records.accept, message)
        except (ValueError, LookupError) as exc:
            raise Forbidden(str(exc)) from None

    async def records_for(self, caller: str, request: peer_pb2.GetRecordsRequest
                          ) -> manifest_pb2.RankRecords:
        if caller not in self.nodes():
            raise Forbidden(f"daemon {caller} is not a live member of this job")
        try:
            return await asyncio.to_thread(self.records.held, request)
        except LookupError as exc:
            raise NotFound(str(exc)) from None

    async def held_for(self, caller: str, request: peer_pb2.GetHeldRequest
                       ) -> list[memoryview]:
        """The decoded chunks of a rank's committed step this daemon captured and holds,
        for a live daemon of the job restoring that rank; NotFound when none is held."""
        if caller not in self.nodes():
            raise Forbidden(f"daemon {caller} is not a live member of this job")
        data = await asyncio.to_thread(self.store.reader.held_regions, request.step,
                                       request.rank, list(request.chunks))
        if data is None:
            raise NotFound(f"step {request.step} of rank {request.rank} is not held decoded "
                           f"on {self.node}; read its chain")
        return data

    async def prepare_from(self, caller: str, req: peer_pb2.PrepareStepRequest) -> None:
        self._admit(caller, req)
        self.coordinator.prepared_soon(req)

    def _admit(self, caller: str, req: peer_pb2.PrepareStepRequest) -> None:
        """Raise unless `caller` may prepare what `req` names (see PrepareRule)."""
        if req.node != caller:
            raise Forbidden(f"daemon {caller} sent a prepare for node {req.node!r}")
        self._rule().check(caller, req)

    def _rule(self) -> PrepareRule:
        """The prepare rule now, on this daemon as coordinator (its plan derived once)."""
        coordinator = self.coordinator
        if self.leadership.is_leader():
            coordinator.take_over(self.registry.current_plan())
        plan = coordinator.plan
        if plan is not None and self._placed[0] is not plan:
            ranks_of = ranks_by_node(plan)
            self._placed = (plan, ranks_of, seats_of(ranks_of))
        return PrepareRule(plan, self.store.latest_committed(), coordinator.commits.steps,
                           self._placed[1], self._placed[2])

    def relay_key(self, caller: str) -> bytes:
        """The key `caller` tags its prepares with on their way up the commit tree, from
        the coordinator only (the reply to a prepare it sent directly)."""
        if not self.leadership.is_leader():
            return b""
        return self.coordinator.commits.relay_keys.key_for(caller)

    async def relay_from(self, caller: str, batch: peer_pb2.PrepareBatch) -> None:
        """Prepares on their way up the commit tree from a daemon of the job: passed on
        up, or (on the coordinator) each seal checked against its own daemon's tag and
        role, then taken as that daemon's prepare. One bad seal does not refuse the
        others."""
        if caller not in self.nodes():
            raise Forbidden(f"daemon {caller} is not a live member of this job")
        if not self.leadership.is_leader():
            self.relay.relay(list(batch.columns))
            return
        taken = self._rule().relayed(batch, self.coordinator.commits.relay_keys, caller)
        self.coordinator.prepared_soon(*taken)

    async def announce_from(self, caller: str, a: peer_pb2.RankAnnouncement) -> None:
        if a.node != caller:
            raise Forbidden(f"daemon {caller} announced a rank of node {a.node!r}; a daemon "
                            "announces only its own ranks")
        if caller not in self.nodes():
            raise Forbidden(f"daemon {caller} is not a live member of this job yet; it "
                            "announces its ranks once gossip has seen it")
        announced = self.coordinator.announced
        mine = sum(1 for x in announced.values() if x.node == caller)
        if a.rank_id not in announced and mine >= MAX_LIVE_RANKS_PER_NODE:
            raise Forbidden(f"daemon {caller} already announced {mine} ranks")
        if self.leadership.is_leader():  # a peer may see this daemon's seat before it does
            self.coordinator.take_over(self.registry.current_plan())
        await self.coordinator.announce(a)

    async def record_for(self, caller: str, step: int) -> manifest_pb2.StepRecord:
        """A committed step's record, for a live daemon of the job (a new coordinator
        catching up on a commit its predecessor did not finish sending)."""
        if caller not in self.nodes():
            raise Forbidden(f"daemon {caller} is not a live member of this job")
        if step not in self.store.committed_steps():
            raise NotFound(f"step {step} is not committed on {self.node}")
        return await asyncio.to_thread(self.store.load_record, step)

    def may_delete(self, caller: str, owner: str, step: int) -> str:
        """Why `caller` may not delete a shard of `step` stored for `owner` ("" if it may):
        only the coordinator or the owner, and never a step retention keeps, the newest
        committed step, or one still in flight."""
        coordinator = self.leadership.leader()
        if caller not in (coordinator, owner):
            return (f"shards are deleted only by their owner ({owner or 'unknown'}) or the "
                    f"coordinator ({coordinator or 'none known'}), not by daemon {caller}")
        store = self.store
        latest = store.latest_committed()
        if latest is None or step >= latest or step in store.committed_steps():
            return (f"step {step} is kept (retention keeps {store.committed_steps()[-5:]}, "
                    f"newest committed {latest})")
        return ""

    # failures -------------------------------------------------------------------

    async def confirmed(self, failure: Failure) -> bool:
        """False for a death reported by one node about a rank of another that the rank's
        own daemon still reports alive; its silence (or its own report) confirms."""
        subject = node_of(failure.subject)
        reporter = node_of(failure.reporter)
        if not failure.subject or reporter == subject:
            return True
        if failure.kind is FailureKind.PEER_LOST:
            return await self._silent(subject)
        if failure.kind not in _CONFIRMED_BY_LIVENESS:
            return True
        if subject == self.node:
            record = self.registry.get(failure.subject)
            return record is None or record.state == "dead"
        alive = await self._alive_ranks(subject)
        return alive is None or failure.subject not in alive

    async def _silent(self, node: str) -> bool:
        """Whether `node` is silent: lost here too, or no answer to a Gossip. Another
        daemon's timeout usually runs out a few milliseconds before this one's, and a
        frozen node (SIGSTOP) holds the Gossip until its deadline: this daemon's own
        verdict, the moment it comes, ends the wait."""
        if self._lost_here(node):
            return True
        try:
            return await unless_lost(self._alive_ranks(node), node,
                                     self.membership.until_lost) is None
        except PeerLost:
            return True

    def _lost_here(self, node: str) -> bool:
        peer = next((p for p in self.membership.peers() if p.node == node), None)
        return peer is None or peer.state == LOST

    async def _alive_ranks(self, node: str) -> set[str] | None:
        """The live rank ids `node`'s daemon reports now, None when it does not answer."""
        try:
            reply = await self.stub(node).Gossip(self.me(), timeout=CONFIRM_TIMEOUT_S)
        except (grpc.aio.AioRpcError, LookupError):  # not a live member, or no answer
            return None
        first = reply.peers[0] if reply.peers else None
        if first is None or first.node != node:
            return None
        return set(first.rank_ids)
