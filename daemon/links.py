"""Calls from this daemon to another one (or to itself, without a socket).

The coordinator's `PeerLinks` (install a plan, commit a step on every daemon) and
the stubs that reach the coordinator (announcements, prepares, failure reports)
live here, over the daemon's one channel per peer. A call addressed to this very
daemon is handed to the local object instead of looping through gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from stalwart.core import step_record as sr
from stalwart.daemon.background import Background
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import Peer, PeerChannels, UntilLost, never_lost, unless_lost
from stalwart.daemon.recovery.election import Leadership
from stalwart.daemon.rpc.step_stream import COMMIT, PREPARES, StepStreams
from stalwart.daemon.snapshot import commit_tree
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.links")

RPC_TIMEOUT_S = 10.0


class CommitSender:
    """Phase two to many daemons with one serialisation: a step's CommitStep goes to
    every daemon as the same bytes, so it is encoded once per step, not once per daemon,
    and sent on the step stream to each (daemon/rpc/step_stream.py)."""

    def __init__(self, streams: StepStreams | None = None) -> None:
        self.streams = StepStreams() if streams is None else streams
        self._encoded: tuple[peer_pb2.CommitStepRequest | None, bytes] = (None, b"")

    def encoded(self, request: peer_pb2.CommitStepRequest) -> bytes:
        if self._encoded[0] is not request:
            self._encoded = (request, request.SerializeToString())
        return self._encoded[1]

    async def send(self, channel: grpc.aio.Channel, request: peer_pb2.CommitStepRequest | bytes,
                   timeout: float, metadata: tuple = ()) -> None:
        data = request if isinstance(request, bytes) else self.encoded(request)
        await self.streams.send(channel, COMMIT, data, timeout, metadata)


class Links:
    """This daemon's outbound calls to the daemons of the job."""

    def __init__(self, node: str, peers: Callable[[], list[Peer]], channels: PeerChannels,
                 leadership: Leadership,
                 adopt_plan: Callable[[common_pb2.Plan], common_pb2.Ack],
                 commit: Callable[[manifest_pb2.StepRecord], Awaitable[None]],
                 hurry: Callable[[int, int, float], Awaitable[bool]],
                 metrics: Metrics | None = None, until_lost: UntilLost = never_lost) -> None:
        self.node, self.peers, self.channels, self.leadership = node, peers, channels, leadership
        # Plans, hurries, commits and prepares to a peer declared lost are not waited for.
        self.until_lost = until_lost
        self.adopt_plan, self.commit, self.hurry = adopt_plan, commit, hurry
        self.streams = StepStreams()  # commits down and prepares up, per peer
        self.commits = CommitSender(self.streams)
        self.metrics = metrics
        self._told = -1  # the generation whose commit tree was last logged
        self._passing = Background()

    def nodes(self) -> list[str]:
        """Live daemons of the job, by node name (this one included)."""
        return [p.node for p in self.peers()]

    def holds_seat(self) -> bool:
        return self.leadership.holds_seat()

    def stub(self, node: str) -> peer_pb2_grpc.PeerServiceStub:
        """PeerService of a live daemon; LookupError when it is not one (or unknown)."""
        if not node:
            raise LookupError("no coordinator is known yet (the etcd seat is empty)")
        address = next((p.address for p in self.peers() if p.node == node), None)
        if address is None:
            raise LookupError(f"daemon {node} is not a live member of this job")
        return peer_pb2_grpc.PeerServiceStub(self.channels.get(address))

    def channel(self, node: str) -> grpc.aio.Channel:
        """The channel to a live daemon; LookupError when it is not one."""
        address = next((p.address for p in self.peers() if p.node == node), None)
        if address is None:
            raise LookupError(f"daemon {node} is not a live member of this job")
        return self.channels.get(address)

    def coordinator(self) -> peer_pb2_grpc.PeerServiceStub:
        return self.stub(self.leadership.leader())

    async def install_plan(self, node: str, plan: common_pb2.Plan) -> None:
        if node == self.node:
            ack = self.adopt_plan(plan)
            if not ack.accepted:
                log.info("plan not installed here: %s", ack.message)
            return
        ack = await unless_lost(self.stub(node).InstallPlan(plan, timeout=RPC_TIMEOUT_S), node,
                                self.until_lost)
        if not ack.accepted:
            log.warning("plan refused", extra={"node": node, "why": ack.message})

    async def hurry_step(self, node: str, request: peer_pb2.HurryStepRequest) -> bool:
        if node == self.node:
            return await self.hurry(request.generation, request.step, request.wait_s)
        reply = await unless_lost(self.stub(node).HurryStep(request, timeout=RPC_TIMEOUT_S),
                                  node, self.until_lost)
        if not reply.accepted:
            log.info("hurry not taken", extra={"node": node, "why": reply.message})
        return reply.accepted and reply.holding

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes) -> None:
        """Phase two on `node`: here, the record is committed in-process."""
        if node == self.node:
            if isinstance(request, bytes):
                request = peer_pb2.CommitStepRequest.FromString(request)
            await self.commit(request.record)
            return
        await unless_lost(self.commits.send(self.channel(node), request, RPC_TIMEOUT_S), node,
                          self.until_lost)

    async def take_commit(self, node: str, job_id: str, step: int) -> None:
        """Commit here the committed `step` that daemon `node` holds, its record checked
        first. Raises LookupError (`node` is no live member), grpc.aio.AioRpcError
        (NOT_FOUND: not committed there) or ValueError (not that step's record, or one
        that fails its check)."""
        record = await self.stub(node).GetStepRecord(
            peer_pb2.GetStepRecordRequest(job_id=job_id, step=step), timeout=RPC_TIMEOUT_S)
        if record.step != step or record.job_id != job_id:
            raise ValueError(f"{node} answered with step {record.step} of job "
                             f"{record.job_id!r}")
        sr.verify(record)
        await self.commit(record, verified=True)

    async def relay_prepares(self, node: str, batch: peer_pb2.PrepareBatch) -> None:
        """A batch of prepares to `node` (a daemon, or the coordinator) on the step
        stream; LookupError when it is not a live member, AioRpcError when refused,
        PeerLost when it is declared lost before it answers."""
        if not node:
            raise LookupError("no coordinator is known yet (the etcd seat is empty)")
        await unless_lost(self.streams.send(self.channel(node), PREPARES,
                                            batch.SerializeToString(), RPC_TIMEOUT_S),
                          node, self.until_lost)

    def pass_on(self, request: peer_pb2.CommitStepRequest) -> None:
        """A commit that reached this daemon through the commit tree goes on to this
        daemon's children in it, in the background (the sender is not kept waiting)."""
        nodes = commit_tree.nodes_of(request.record)
        targets = commit_tree.children(nodes, self.node, request.fanout)
        if targets:
            if self.metrics is not None:
                self.metrics.commit_tree.labels("down").inc(len(targets))
            if self._told != request.record.generation:
                self._told = request.record.generation
                log.info("commits go on down the commit tree",
                         extra={"generation": self._told, "children": targets})
            self._passing.start(commit_tree.pass_on(request, targets, self.commit_step, nodes))
