"""Wires one daemon's job-level parts together: snapshot path, coordinator, fencing.

Ranks register here (announced to the coordinator), captures flow into the
snapshot path, prepares go to the coordinator, commits and plans come back.
Failures seen by this daemon go to the coordinator, which may be this daemon.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import Coordinator, StaleStep
from stalwart.daemon.recovery.election import EtcdElection
from stalwart.daemon.recovery.fencing import RankProcesses
from stalwart.daemon.recovery.gpu_health import GpuHealthMonitor
from stalwart.daemon.recovery.liveness import process_alive
from stalwart.daemon.recovery.membership import SUSPECT, UP, Membership
from stalwart.daemon.recovery.registry import RankRecord, Registry, StaleGeneration
from stalwart.daemon.security.roles import JobGate
from stalwart.daemon.snapshot.path import Peer, SnapshotPath
from stalwart.v1 import common_pb2, manifest_pb2, operator_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.job")

RPC_TIMEOUT_S = 10.0
HANG_WINDOW_S = 1.5   # collect hang reports this long before deciding (seconds)
STOP_GRACE_S = 5.0    # after a stop plan, ranks still running this long are ended
RESEND_TRIES = 10     # a returning daemon gets the current plan within this many beats
FACT_WINDOW_S = 0.2   # a dead process often takes its peers' reports with it


class Job:
    """The job as one daemon sees it."""

    def __init__(self, config: DaemonConfig, registry: Registry, membership: Membership,
                 metrics: Metrics, data_dir: Path, address: Callable[[], str],
                 channel: Callable[[str], grpc.aio.Channel]) -> None:
        self.config, self.registry, self.membership = config, registry, membership
        membership.self_generation = lambda: registry.generation
        membership.incumbent = lambda: registry.current_plan().coordinator
        membership.on_peer_up = self._on_peer_up
        self.metrics, self.address, self._channel = metrics, address, channel
        self.node = config.node
        # How this daemon describes itself to peers (the Daemon's peer_info).
        self.me: Callable[[], peer_pb2.PeerInfo] = lambda: peer_pb2.PeerInfo(node=self.node)
        # Outbound interceptors that carry this daemon's token and node (auth.stamp).
        self.auth_stamp: list[grpc.aio.ClientInterceptor] = []
        self.gate = JobGate(self)  # PeerService's view: every call checked by role
        self.snapshots = SnapshotPath(config, registry, metrics, data_dir, self.peers,
                                      self._send_prepare)
        self.coordinator = Coordinator(config.node, config.job_id, metrics, self,
                                       self.snapshots.store.latest_committed,
                                       load_manifest=self.snapshots.store.load_manifest,
                                       elastic=config.elastic)
        self._failures: asyncio.Queue[Failure] = asyncio.Queue()
        self.processes = RankProcesses(registry)  # which local ranks may be fenced
        self._tasks: list[asyncio.Task[None]] = []
        self._coordinator_seen = ""
        self._had_coordinator = False
        self._unsent: list[Failure] = []  # reports the coordinator never received
        # rank_id -> (layout, layer profile, store (host, port)) each local rank registered
        self._registered: dict[str, tuple[common_pb2.ParallelLayout,
                                          common_pb2.LayerProfile | None,
                                          tuple[str, int] | None]] = {}
        # Prepares of steps not yet committed here, by step: sent again to a new
        # coordinator, since the old one may have died with them.
        self._prepares: dict[int, list[peer_pb2.PrepareStepRequest]] = {}
        self.gpus = GpuHealthMonitor(registry.report, node=config.node,
                                     device_ranks=self._ranks_on_device,
                                     generation=lambda: registry.generation,
                                     poll_interval_s=min(2.0, config.heartbeat_interval_s))
        registry.on_failure(self._on_failure)
        self.election: EtcdElection | None = None
        self._seat_task: asyncio.Task[None] | None = None
        if config.etcd:
            membership.elected = True
            self.election = EtcdElection(config.node, endpoint=config.etcd,
                                         job_id=config.job_id, ttl_s=config.etcd_lease_s,
                                         on_elected=self._won_seat, on_lost=self._lost_seat)

    async def start(self) -> None:
        self.processes.loop = asyncio.get_running_loop()
        await self.snapshots.start()
        await self.gpus.start()
        self._tasks = [asyncio.create_task(self._decide_forever(), name="coordinator"),
                       asyncio.create_task(self._follow_coordinator(), name="follow")]
        if self.election is not None:
            await self.election.start()
            self._tasks.append(asyncio.create_task(self._track_seat(), name="seat"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.election is not None:
            await self.election.stop()  # a leader resigns: a successor need not wait
        await self.gpus.stop()
        await self.snapshots.stop()

    # the etcd seat (when `etcd` is configured) ----------------------------------

    def _won_seat(self, term: int) -> None:
        log.warning("this daemon coordinates the job (etcd term %d)", term)
        self.membership.seat = self.node
        # Lost and won back between two looks of _follow_coordinator, the seat shows no
        # change there: what went undelivered meanwhile is sent to ourselves here.
        self._seat_task = asyncio.get_running_loop().create_task(self._redeliver())

    async def _redeliver(self) -> None:
        unsent, self._unsent = self._unsent, []
        for failure in unsent:
            self._failures.put_nowait(failure)
        await self._resend_prepares()

    def _lost_seat(self, reason: str) -> None:
        log.error("this daemon no longer coordinates: %s", reason)
        if self.membership.seat == self.node:
            self.membership.seat = ""

    async def _track_seat(self) -> None:
        """Learn who holds the seat when it is not this daemon (read once per heartbeat);
        the last holder seen stays the answer while the seat is empty between leaders."""
        assert self.election is not None
        interval, complained = self.config.heartbeat_interval_s, False
        while True:
            if not self.election.is_leader:
                try:
                    holder = await self.election.leader()
                    complained = False
                except Exception as exc:  # etcd down: keep the last holder, say so once
                    if not complained:
                        log.error("cannot read the coordinator seat from etcd at %s: %s",
                                  self.config.etcd, exc)
                    complained, holder = True, None
                if holder and holder != self.membership.seat:
                    self.membership.seat = holder
            await asyncio.sleep(interval)

    async def _seat_known(self) -> str:
        """The coordinator's name, waiting up to one lease time for a first election
        (within a rank's registration deadline, so it gets this error, not a timeout)."""
        deadline = time.monotonic() + self.config.etcd_lease_s
        while not (holder := self.membership.coordinator()) and time.monotonic() < deadline:
            await asyncio.sleep(self.config.heartbeat_interval_s / 4)
        if not holder:
            raise LookupError(f"no coordinator is elected in etcd at {self.config.etcd}: is "
                              "etcd up and reachable from every daemon (see the daemon log)?")
        return holder

    def _ranks_on_device(self, index: int) -> list[str]:
        """rank_ids of live local ranks on GPU `index` (by device, else by local rank)."""
        out = []
        for r in self.registry.ranks():
            device = r.device.split(":")
            on = int(device[1]) == index if len(device) == 2 and device[1].isdigit() \
                else r.local_rank == index
            if on and r.state != "dead":
                out.append(r.rank_id)
        return out

    async def _follow_coordinator(self) -> None:
        """When the coordinator changes, tell the new one about this node's ranks."""
        interval = self.config.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            current = self.membership.coordinator()
            if current == self._coordinator_seen:
                continue
            self._coordinator_seen = current
            if not current:
                continue  # the etcd seat is empty: wait for its next holder
            if not self._had_coordinator:
                self._had_coordinator = True
                continue  # the first coordinator this daemon sees: nothing to hand over
            log.warning("coordinator changed", extra={"coordinator": current})
            if current == self.node:
                self.coordinator.take_over(self.registry.current_plan())
            await self._redeliver()
            for record in self.registry.ranks():
                if record.state in ("alive", "late"):
                    try:
                        await self.on_register(record, *self._registered.get(
                            record.rank_id, (common_pb2.ParallelLayout(), None, None)))
                    except (grpc.aio.AioRpcError, LookupError) as exc:
                        log.warning("re-announce failed: %s", exc)

    # who is who -----------------------------------------------------------------

    def peers(self) -> list[Peer]:
        """Live daemons, this one included."""
        labels = {k: v for k, v in (("rack", self.config.labels.rack),
                                    ("zone", self.config.labels.zone)) if v}
        out = [Peer(self.node, self.address(), labels)]
        out += [Peer(p.node, p.address, dict(p.labels)) for p in self.membership.peers()
                if p.node and p.state in (UP, SUSPECT)]
        return out

    def nodes(self) -> list[str]:
        return [p.node for p in self.peers()]

    def is_coordinator(self) -> bool:
        return self.membership.coordinator() == self.node

    def holds_seat(self) -> bool:
        return self.election is None or self.election.is_leader

    def peer_stub(self, node: str) -> peer_pb2_grpc.PeerServiceStub:
        if not node:
            raise LookupError("no coordinator is known yet (the etcd seat is empty)")
        address = next((p.address for p in self.peers() if p.node == node), None)
        if address is None:
            raise LookupError(f"daemon {node} is not a live member of this job")
        return peer_pb2_grpc.PeerServiceStub(self._channel(address))

    def _on_peer_up(self, node: str) -> None:
        """A daemon that was lost answers again (a pause, a partition that healed): the
        coordinator hands it the current plan, so it stops acting on the old generation
        (and fences its ranks the plan left out)."""
        if not self.is_coordinator():
            return
        plan = self.registry.current_plan()
        if not plan.assignments and not plan.stop:
            return  # no plan yet

        async def send() -> None:
            for attempt in range(RESEND_TRIES):
                try:
                    await self.install_plan(node, self.registry.current_plan())
                    return
                except (grpc.aio.AioRpcError, LookupError) as exc:
                    if attempt == RESEND_TRIES - 1:
                        log.warning("current plan not re-sent",
                                    extra={"node": node, "error": str(exc)})
                    else:  # its channel may still be reconnecting
                        await asyncio.sleep(self.config.heartbeat_interval_s)
        asyncio.get_running_loop().create_task(send())

    # PeerLinks (the coordinator's outbound calls) ---------------------------------

    async def install_plan(self, node: str, plan: common_pb2.Plan) -> None:
        if node == self.node:
            ack = self.adopt_plan(plan)
            if not ack.accepted:
                log.info("plan not installed here: %s", ack.message)
            return
        ack = await self.peer_stub(node).InstallPlan(plan, timeout=RPC_TIMEOUT_S)
        if not ack.accepted:
            log.warning("plan refused", extra={"node": node, "why": ack.message})

    async def commit_step(self, node: str, manifest: manifest_pb2.Manifest) -> None:
        if node == self.node:
            await self.snapshots.commit(manifest)
            return
        await self.peer_stub(node).CommitStep(
            peer_pb2.CommitStepRequest(manifest=manifest), timeout=RPC_TIMEOUT_S)

    # plans ------------------------------------------------------------------------

    def adopt_plan(self, plan: common_pb2.Plan) -> common_pb2.Ack:
        """Install a plan here and end local ranks it left out (fencing)."""
        previous = self.registry.current_plan()
        try:
            self.registry.install_plan(plan)
        except StaleGeneration as exc:
            return common_pb2.Ack(accepted=False, message=str(exc))
        if previous.assignments:
            # The new generation re-captures the steps after resume_step: what the old one
            # prepared for them must not become a delta base.
            dropped = self.snapshots.store.discard_after(plan.resume_step)
            if dropped:
                log.warning("discarded committed steps past the resume point",
                            extra={"steps": dropped, "resume_step": plan.resume_step})
        if plan.stop and not plan.completed:
            # Every process of a stopped job ends: ranks leave on their own when they see
            # the stop; one that is hung (or never answers) is ended after a grace period.
            asyncio.get_running_loop().call_later(STOP_GRACE_S, self._fence_all_local)
        kept = {a.rank_id for a in plan.assignments}
        for a in previous.assignments:
            if a.spare or a.rank_id in kept or plan.stop:
                continue
            record = self.registry.get(a.rank_id)
            if record is not None and (record.state != "dead" or (
                    record.process is not None and process_alive(record.process))):
                self.processes.fence(record)  # a rank declared dead may still run (hung)
        return common_pb2.Ack(accepted=True)

    def _fence_all_local(self) -> None:
        for record in self.registry.ranks():
            if record.state in ("alive", "late") and record.process is not None \
                    and process_alive(record.process):
                self.processes.fence(record)

    # registrations ----------------------------------------------------------------

    async def on_register(self, record: RankRecord, layout: common_pb2.ParallelLayout,
                          profile: common_pb2.LayerProfile | None = None,
                          store: tuple[str, int] | None = None) -> None:
        # Kept for a later coordinator: without the layer profile it could not shrink.
        self._registered[record.rank_id] = (layout, profile, store)
        endpoint = ""
        if store is not None:  # the rank's own host, else this daemon's (the same node)
            endpoint = f"{store[0] or self.address().rpartition(':')[0]}:{store[1]}"
        announcement = peer_pb2.RankAnnouncement(
            node=self.node, rank_id=record.rank_id, rank=-1 if record.spare else record.rank,
            world_size=record.world_size, layout=layout, generation=self.registry.generation,
            profile=profile, store=endpoint)
        await self.announce(announcement)

    async def announce(self, a: peer_pb2.RankAnnouncement) -> None:
        coordinator = await self._seat_known()
        if coordinator == self.node:
            self.coordinator.take_over(self.registry.current_plan())
            await self.coordinator.announce(a)
            return
        await self.peer_stub(coordinator).Announce(a, timeout=RPC_TIMEOUT_S)

    # failures ---------------------------------------------------------------------

    def _on_failure(self, failure: Failure) -> None:
        self._failures.put_nowait(failure)
        if failure.kind is FailureKind.PEER_LOST:
            asyncio.get_running_loop().create_task(self.snapshots.on_peer_lost(failure.subject))

    async def _decide_forever(self) -> None:
        while True:
            first = await self._failures.get()
            if not self.is_coordinator():
                # Only the coordinator batches: a second window here would deliver these
                # reports after the coordinator's own window closed, and a hang it sees
                # reported by fewer ranks blames every silent one.
                await self._handle([first])
                continue
            batch = [first]
            window = HANG_WINDOW_S if first.kind is FailureKind.COLLECTIVE_HANG else FACT_WINDOW_S
            loop = asyncio.get_running_loop()
            end = loop.time() + window
            while (left := end - loop.time()) > 0:
                try:
                    batch.append(await asyncio.wait_for(self._failures.get(), left))
                except TimeoutError:
                    break
            try:
                await self._handle(batch)
            except Exception:
                log.exception("failure handling failed",
                              extra={"failures": [f.describe() for f in batch]})

    async def _handle(self, failures: list[Failure]) -> None:
        if self.is_coordinator():
            failures = [f for f in failures if await self._believed(f)]
            if not failures:
                return
            self.coordinator.take_over(self.registry.current_plan())
            # A new coordinator knows only the installed plan: give the other daemons a
            # few heartbeats to re-announce their spares before deciding.
            settle = self.coordinator.took_over_at + 3 * self.config.heartbeat_interval_s
            if (wait := settle - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            await self.coordinator.on_failures(failures)
            return
        for i, f in enumerate(failures):
            try:
                await self.peer_stub(self.membership.coordinator()).ReportFailure(
                    f.to_proto(), timeout=RPC_TIMEOUT_S)
            except (grpc.aio.AioRpcError, LookupError) as exc:
                # The coordinator may be the thing that died: resend to its successor.
                log.warning("failure report not delivered; will resend to the next "
                            "coordinator: %s", exc)
                self._unsent.extend(failures[i:])
                return

    # phase one --------------------------------------------------------------------

    async def _send_prepare(self, req: peer_pb2.PrepareStepRequest) -> None:
        latest = self.snapshots.store.latest_committed() or 0
        for step in [s for s in self._prepares if s <= latest]:
            del self._prepares[step]
        self._prepares.setdefault(req.step, []).append(req)
        try:
            await self._deliver_prepare(req)
        except (grpc.aio.AioRpcError, LookupError) as exc:
            # The coordinator may be the thing that died: its successor gets it.
            log.warning("prepare not delivered; will resend to the next coordinator",
                        extra={"step": req.step, "error": str(exc)})

    async def _deliver_prepare(self, req: peer_pb2.PrepareStepRequest) -> None:
        if self.is_coordinator():
            await self.coordinator.prepared(req)
            return
        await self.peer_stub(self.membership.coordinator()).PrepareStep(
            req, timeout=RPC_TIMEOUT_S)

    async def _resend_prepares(self) -> None:
        """Phase one again, for a new coordinator: every step this daemon prepared that it
        has not seen committed (a coordinator that already committed one sends the commit
        back instead)."""
        latest = self.snapshots.store.latest_committed() or 0
        generation = self.registry.generation
        for step in sorted(self._prepares):
            for req in self._prepares[step]:
                if step <= latest or req.generation < generation:
                    continue
                try:
                    await self._deliver_prepare(req)
                except (grpc.aio.AioRpcError, LookupError, StaleStep) as exc:
                    log.warning("prepare not resent", extra={"step": step, "error": str(exc)})

    async def _believed(self, failure: Failure) -> bool:
        if await self.gate.confirmed(failure):
            return True
        self.metrics.auth_refused.labels("unconfirmed").inc()
        log.warning("failure report not believed: the subject's daemon reports it alive",
                    extra={"failure": failure.describe()})
        return False

    # status -----------------------------------------------------------------------

    def decorate_status(self, reply: operator_pb2.StatusReply) -> None:
        latest = self.snapshots.store.latest_committed()
        reply.latest_committed_step = latest or 0
        reply.storage["local"] = (f"committed steps {self.snapshots.store.committed_steps()[-5:]}"
                                  f", ram {self.snapshots.store.ram_used()} bytes")
        reply.storage.update(self.snapshots.status_storage())
        if self.is_coordinator():
            for r in self.coordinator.recoveries[-10:]:
                reply.plan_changes.add(reason=f"{r.kind}: {r.message}",
                                       time_unix_ms=int(r.detected_unix * 1000))
