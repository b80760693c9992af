"""One daemon's part of the job, wired: the snapshot path and the recovery path.

Snapshot path (`daemon/snapshot/`): captures from this node's ranks become
durable shards; phase one goes to the coordinator, commits come back. Recovery
path (`daemon/recovery/`): failures seen here go to the coordinator (which may be
this daemon); its plans come back, are installed and fence the ranks they drop.
`Leadership` answers "who leads" for both; `Links` carries their calls to peers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.background import Background
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.links import Links
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import Peer, PeerChannels
from stalwart.daemon.recovery.announce import Announcer
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.daemon.recovery.election import Leadership
from stalwart.daemon.recovery.fencing import RankProcesses
from stalwart.daemon.recovery.gpu_health import GpuHealthMonitor
from stalwart.daemon.recovery.membership import SUSPECT, UP, Membership
from stalwart.daemon.recovery.plans import Plans
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.recovery.reports import RPC_TIMEOUT_S, FailureReports
from stalwart.daemon.security.roles import JobGate
from stalwart.daemon.snapshot.commit import PrepareOutbox
from stalwart.daemon.snapshot.path import SnapshotPath
from stalwart.daemon.snapshot.prepare_relay import PrepareRelay
from stalwart.v1 import operator_pb2, peer_pb2

log = logging.getLogger("stalwart.daemon.job")

DIRECT_AFTER_S = 5.0  # a prepare sent up the commit tree and not committed by then goes direct


class Job:
    """The job as one daemon sees it."""

    def __init__(self, config: DaemonConfig, registry: Registry, membership: Membership,
                 metrics: Metrics, data_dir: Path, address: Callable[[], str],
                 channels: PeerChannels) -> None:
        self.config, self.registry, self.membership = config, registry, membership
        self.metrics, self.address, self.channels = metrics, address, channels
        self.node = config.node
        # How this daemon describes itself to peers (the Daemon's peer_info).
        self.me: Callable[[], peer_pb2.PeerInfo] = lambda: peer_pb2.PeerInfo(node=self.node)
        self.leadership = Leadership(config, membership)
        membership.self_generation = lambda: registry.generation
        membership.incumbent = lambda: registry.current_plan().coordinator
        self.outbox = PrepareOutbox(self._deliver_prepare, self._latest_committed,
                                    lambda: registry.generation)
        self._spawned = Background()
        self.relay = PrepareRelay(self.node, config.job_id, registry.current_plan,
                                  self._send_batch, metrics)
        self.snapshots = SnapshotPath(config, registry, metrics, data_dir, self.peers,
                                      channels, self.outbox.send, self.leadership.is_leader,
                                      membership.until_silent, membership.quiet)
        store = self.snapshots.store
        self.processes = RankProcesses(registry)  # which local ranks may be fenced
        self.plans = Plans(registry, self.processes, store.discard_after,
                           self.leadership.is_leader, config.heartbeat_interval_s)
        self.links = Links(self.node, self.peers, channels, self.leadership, self.plans.adopt,
                           self.snapshots.committer.commit, self.snapshots.intake.hurry_step,
                           metrics, membership.until_lost)
        self.plans.send = self.links.install_plan
        membership.on_peer_up = self.plans.on_peer_up
        self.coordinator = Coordinator(config.node, config.job_id, metrics, self.links,
                                       store.latest_committed, load_record=store.load_record,
                                       elastic=config.elastic,
                                       commit_fanout=config.commit_fanout)
        self.gate = JobGate(node=self.node, registry=registry, membership=membership,
                            leadership=self.leadership, coordinator=self.coordinator,
                            store=store, adopt_plan=self.plans.adopt,
                            commit=self.snapshots.committer.commit,
                            records=self.snapshots.records, nodes=self.links.nodes,
                            stub=self.links.stub, me=lambda: self.me(),
                            pass_on=self.links.pass_on, take_commit=self.links.take_commit,
                            relay=self.relay,
                            hurry=self.snapshots.intake.hurry_step)
        self.reports = FailureReports(self.coordinator, registry, metrics,
                                      self.leadership.is_leader, self.links.coordinator,
                                      self.gate.confirmed, self._catch_up,
                                      config.heartbeat_interval_s, self._live_ranks)
        self.announcer = Announcer(self.node, registry, self.leadership, self.coordinator,
                                   address, self.links.stub, self._redeliver,
                                   config.heartbeat_interval_s)
        self.leadership.on_won = self._won_seat
        self.gpus = GpuHealthMonitor(registry.report, node=config.node,
                                     device_ranks=self._ranks_on_device,
                                     generation=lambda: registry.generation,
                                     poll_interval_s=min(2.0, config.heartbeat_interval_s))
        registry.on_failure(self._on_failure)
        # A rank that left cleanly has its capture slots freed too, as a dead one has.
        registry.on_leave(lambda rank_id: self._spawned.start(
            self.snapshots.intake.forget_rank(rank_id)))
        registry.on_leave(lambda rank_id: self._spawned.start(
            self.announcer.finished(rank_id)))
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.processes.loop = asyncio.get_running_loop()
        await self.snapshots.start()
        await self.gpus.start()
        self._tasks = [asyncio.create_task(self.reports.forever(), name="failures"),
                       asyncio.create_task(self.announcer.follow(), name="follow")]
        await self.leadership.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.leadership.stop()
        await self.gpus.stop()
        await self.snapshots.stop()

    def peers(self) -> list[Peer]:
        """Live daemons, this one included."""
        out = [Peer(self.node, self.address(), self.config.labels.as_dict())]
        out += [Peer(p.node, p.address, dict(p.labels)) for p in self.membership.peers()
                if p.node and p.state in (UP, SUSPECT)]
        return out

    def _live_ranks(self) -> set[str]:
        """The live ranks of this node and of the live peers (as their heartbeats say)."""
        out = set(self.registry.live_rank_ids())
        for p in self.membership.peers():
            if p.node and p.state in (UP, SUSPECT):
                out.update(p.rank_ids)
        return out

    def _latest_committed(self) -> int | None:
        return self.snapshots.store.latest_committed()

    def _ranks_on_device(self, index: int) -> list[str]:
        """rank_ids of live local ranks on NVML's GPU `index`: a rank names its GPU by UUID
        ("cuda:GPU-..."), else by NVML index ("cuda:3"); one that names neither ("cuda")
        is taken to be on the GPU of its local rank."""
        out = []
        uuid = self.gpus.uuid(index)
        for r in self.registry.ranks():
            which = r.device.partition(":")[2]
            if which.lower().startswith("gpu-"):
                on = which.lower() == uuid
            else:
                on = int(which) == index if which.isdigit() else r.local_rank == index
            if on and r.state != "dead":
                out.append(r.rank_id)
        return out

    def _on_failure(self, failure: Failure) -> None:
        self.reports.put(failure)
        if failure.kind is FailureKind.PEER_LOST:
            self._spawned.start(self.snapshots.on_peer_lost(failure.subject))
        elif (record := self.registry.get(failure.subject)) is not None and record.ended:
            # A local rank declared dead: its capture slots go back to the budget.
            self._spawned.start(self.snapshots.intake.forget_rank(record.rank_id))

    def _won_seat(self) -> None:
        # Lost and won back between two looks of the announcer, the seat shows no change
        # there: what went undelivered meanwhile is sent to ourselves here.
        self._spawned.start(self._redeliver())

    async def _redeliver(self) -> None:
        self.reports.redeliver()
        await self.outbox.resend()

    async def _deliver_prepare(self, req: peer_pb2.PrepareStepRequest) -> None:
        if self.leadership.is_leader():
            self.coordinator.prepared_soon(req)
            return
        leader = self.leadership.leader()
        if self.relay.usable(leader):
            self.relay.own(req)  # up the commit tree, batched with the daemons below
            # A daemon on the way may drop it: uncommitted by then, it goes directly.
            asyncio.get_running_loop().call_later(
                DIRECT_AFTER_S, lambda: self._spawned.start(self._direct_if_uncommitted(req)))
            return
        reply = await self.links.coordinator().PrepareStep(req, timeout=RPC_TIMEOUT_S)
        if reply.relay_key:
            self.relay.key = (leader, reply.relay_key)

    async def _direct_if_uncommitted(self, req: peer_pb2.PrepareStepRequest) -> None:
        if ((self._latest_committed() or 0) >= req.step
                or req.generation != self.registry.generation):
            return
        log.warning("prepare sent up the commit tree not committed; sending it directly",
                    extra={"step": req.step, "after_s": DIRECT_AFTER_S})
        try:
            await self.links.coordinator().PrepareStep(req, timeout=RPC_TIMEOUT_S)
        except (grpc.aio.AioRpcError, LookupError) as exc:
            log.warning("prepare not delivered", extra={"step": req.step, "error": str(exc)})

    async def _send_batch(self, node: str | None, batch: peer_pb2.PrepareBatch) -> None:
        """A batch of prepares to `node` in the prepare tree (None: the coordinator)."""
        if node is None and self.leadership.is_leader():
            await self.gate.relay_from(self.node, batch)
            return
        await self.links.relay_prepares(self.leadership.leader() if node is None else node,
                                        batch)

    async def _catch_up(self) -> None:
        """Before deciding, a new coordinator takes the commits its predecessor did not
        finish sending: phase two reached some daemons (they gossip their newest step)
        but not this one. Each step it lacks comes from the live daemon that has it, in
        order, so the plan resumes from the newest step committed anywhere."""
        own = self.snapshots.store.latest_committed() or 0
        ahead = [p for p in self.membership.peers()
                 if p.node and p.state in (UP, SUSPECT) and p.latest_committed > own]
        if not ahead:
            return
        source = max(ahead, key=lambda p: p.latest_committed)
        first = max(own + 1, source.latest_committed - self.config.snapshot.retain + 1)
        for step in range(first, source.latest_committed + 1):
            try:
                await self.links.take_commit(source.node, self.config.job_id, step)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # skipped there too (its prepares were lost)
                log.warning("commit not caught up", extra={"step": step, "from": source.node,
                                                           "error": exc.details()})
                return
            except (LookupError, ValueError) as exc:
                log.warning("commit not caught up", extra={"step": step, "from": source.node,
                                                           "error": str(exc)})
                return
            except OSError as exc:
                # This daemon's own store cannot take it (a full disk): the plan resumes
                # from the newest step committed here, and the other daemons drop the
                # steps after it when they adopt that plan. Not deciding at all would
                # leave the job waiting for a plan that frees nothing.
                log.error("commit not caught up: this daemon's store refused it; the plan "
                          "resumes from the newest step committed here",
                          extra={"step": step, "from": source.node, "error": str(exc)})
                return
            log.warning("caught up on a commit the old coordinator did not finish sending",
                        extra={"step": step, "from": source.node})

    def decorate_status(self, reply: operator_pb2.StatusReply) -> None:
        store = self.snapshots.store
        reply.latest_committed_step = store.latest_committed() or 0
        reply.storage["local"] = (f"committed steps {store.committed_steps()[-5:]}"
                                  f", ram {store.ram_used()} bytes")
        reply.storage.update(self.snapshots.status_storage())
        if self.leadership.is_leader():
            for r in self.coordinator.recoveries[-10:]:
                reply.plan_changes.add(reason=f"{r.kind}: {r.message}",
                                       time_unix_ms=int(r.detected_unix * 1000))
