"""The simulated daemons of `bench scale`'s commit measurement (`scale_commit`): many
per worker process behind one gRPC server, a request naming its daemon in metadata.
Each sends one PrepareStep a step with the seal of its ranks' records (up the commit
tree through the daemon's own `PrepareRelay` where the plan says so), and takes the
step's CommitStep as a daemon does: digest, its own seal, the coordinator's signature
when it came through another daemon, then passes it on to its children in the tree
(`commit_tree.pass_on`)."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

import grpc

from stalwart.core import step_record as sr
from stalwart.daemon.background import Background
from stalwart.daemon.config_schema import default
from stalwart.daemon.links import CommitSender
from stalwart.daemon.rpc import step_stream
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.prepare_relay import PrepareRelay
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc

RANKS_PER_DAEMON = 8
NODE_KEY = "stalwart-bench-node"  # the simulated daemon a request is for
FROM_KEY = "stalwart-bench-from"  # and the one it comes from: a stream each, as daemons have
RPC_TIMEOUT_S = 120.0
IN_FLIGHT = 128  # prepares one worker has in flight (its daemons send at once)
FANOUT = default("commit_fanout")  # the commit tree's, as a daemon has it by default
COORDINATOR = "coordinator"
STOP_GRACE_S = 2.0  # for the step streams to end before their server stops
SINK = "sink"  # a child that only acknowledges (the hop measurement)


class Daemons(peer_pb2_grpc.PeerServiceServicer):
    """The commit side of many simulated daemons behind one server."""

    def __init__(self, names: list[str], key: bytes, where: dict[str, grpc.aio.Channel]
                 ) -> None:
        self.seals = {name: self.seal_of(name) for name in names}
        self.key, self.where = key, where
        self.sender = CommitSender()
        self.committed: dict[int, int] = {}
        self.last_at: dict[int, float] = {}
        self.prepare_bytes = 0  # sent up by these daemons: their own and relayed ones
        self.coordinator: peer_pb2_grpc.PeerServiceStub | None = None
        self.coordinator_channel: grpc.aio.Channel | None = None
        plan = common_pb2.Plan(generation=1, coordinator=COORDINATOR, commit_fanout=FANOUT)
        self.plan = plan
        self.relays = {n: PrepareRelay(n, "bench", lambda: plan, partial(self._up, n))
                       for n in names}
        self.received = self.passed = 0
        self.all_in = asyncio.Condition()
        self.ending = asyncio.Event()  # the bench is over: streams end, as a daemon's do
        self.passing = Background()

    @staticmethod
    def seal_of(name: str) -> manifest_pb2.RankSeal:
        """The seal of simulated daemon `name`'s 8 ranks' records."""
        first = int(name.split("-")[1]) * RANKS_PER_DAEMON
        return sr.seal(name, [manifest_pb2.RankState(rank=first + r, node=name)
                              for r in range(RANKS_PER_DAEMON)])

    async def StepStream(self, requests, context):  # noqa: N802 - gRPC method name
        """A daemon's step stream: commits down, prepares up, as the daemon's own."""
        node = dict(context.invocation_metadata())[NODE_KEY]
        async for answer in step_stream.answers(requests, partial(self._step, node),
                                                self.ending):
            yield answer

    async def _step(self, node: str, message: peer_pb2.StepMessage
                    ) -> tuple[grpc.StatusCode, str]:
        if message.WhichOneof("body") == step_stream.PREPARES:
            self.relays[node].add(list(message.prepares.columns))
            return grpc.StatusCode.OK, ""
        if node == SINK:  # the hop measurement's children: they only answer
            return grpc.StatusCode.OK, ""
        request = message.commit
        record = request.record
        sr.verify(record)
        own = sr.seal_of(record, self.seals[node].ranks[0])
        if own.digest != self.seals[node].digest:
            return grpc.StatusCode.FAILED_PRECONDITION, "own seal differs"
        if request.fanout and not commit_tree.signed_by(self.key, record, request.signature):
            return grpc.StatusCode.PERMISSION_DENIED, "not the coordinator's"
        self.received += request.ByteSize()
        self.committed[record.step] = self.committed.get(record.step, 0) + 1
        self.last_at[record.step] = time.perf_counter()
        targets = commit_tree.children(commit_tree.nodes_of(record), node, request.fanout)
        if targets:  # as the daemon's Links.pass_on: in the background
            self.passed += len(targets) * request.ByteSize()
            self.passing.start(commit_tree.pass_on(request, targets, self._send))
        async with self.all_in:
            self.all_in.notify_all()
        return grpc.StatusCode.OK, ""

    async def _up(self, node: str, target: str | None, batch: peer_pb2.PrepareBatch) -> None:
        """A simulated daemon's batch of prepares to its parent or the coordinator, on
        its step stream there (as Links.relay_prepares)."""
        self.prepare_bytes += batch.ByteSize()
        assert self.coordinator_channel is not None
        channel = self.coordinator_channel if target is None else self.where[target]
        await self.sender.streams.send(channel, step_stream.PREPARES, batch.SerializeToString(),
                                       RPC_TIMEOUT_S, metadata=((NODE_KEY, target or ""),
                                                                (FROM_KEY, node)))

    async def prepare(self, room: asyncio.Semaphore, step: int, name: str,
                      layout: common_pb2.ParallelLayout) -> None:
        """One simulated daemon's phase one, as Job._deliver_prepare: up the tree once
        the coordinator gave it a key, else directly."""
        req = peer_pb2.PrepareStepRequest(job_id="bench", step=step, generation=1,
                                          node=name, layout=layout, seal=self.seals[name])
        relay = self.relays[name]
        if relay.usable(COORDINATOR):
            relay.own(req)
            return
        assert self.coordinator is not None
        async with room:
            reply = await self.coordinator.PrepareStep(req, timeout=RPC_TIMEOUT_S,
                                                       metadata=((NODE_KEY, name),))
        self.prepare_bytes += req.ByteSize()
        if reply.relay_key:
            relay.key = (COORDINATOR, reply.relay_key)

    async def _send(self, node: str, data: bytes) -> None:
        await self.sender.send(self.where[node], data, RPC_TIMEOUT_S,
                               metadata=((NODE_KEY, node),))

    async def wait_all(self, step: int) -> None:
        async with self.all_in:
            await asyncio.wait_for(self.all_in.wait_for(
                lambda: self.committed.get(step, 0) >= len(self.seals)), RPC_TIMEOUT_S)


def worker(names: list[str], coordinator: str, key: bytes, conn: Any) -> None:
    asyncio.run(_serve(names, coordinator, key, conn))


async def _serve(names: list[str], coordinator: str, key: bytes, conn: Any) -> None:
    where: dict[str, grpc.aio.Channel] = {}
    daemons = Daemons(names, key, where)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    peer_pb2_grpc.add_PeerServiceServicer_to_server(daemons, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    loop = asyncio.get_running_loop()
    # Every worker's port (its own included): a daemon passes commits on to any other.
    ports = await loop.run_in_executor(None, conn.recv)
    peers = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    everyone = await loop.run_in_executor(None, conn.recv)
    where.update({n: peers[i % len(peers)] for i, n in enumerate(everyone)})
    daemons.plan.assignments.extend(common_pb2.RankAssignment(node=n) for n in everyone)
    async with grpc.aio.insecure_channel(coordinator) as channel:
        daemons.coordinator = peer_pb2_grpc.PeerServiceStub(channel)
        daemons.coordinator_channel = channel
        layout = common_pb2.ParallelLayout(dp=len(names), pp=1, tp=RANKS_PER_DAEMON)
        while True:
            order = await loop.run_in_executor(None, conn.recv)
            if order is None:
                break
            step, world = order
            layout.dp = world // RANKS_PER_DAEMON
            room = asyncio.Semaphore(IN_FLIGHT)
            cpu0 = time.process_time()
            await asyncio.gather(*(daemons.prepare(room, step, name, layout)
                                   for name in names))
            await daemons.wait_all(step)
            sent, daemons.prepare_bytes = daemons.prepare_bytes, 0
            await daemons.passing.drain()  # its own relays finish this step
            conn.send((sent, daemons.received + daemons.passed, dict(daemons.committed),
                       daemons.last_at.get(step, 0.0), time.process_time() - cpu0))
    daemons.ending.set()
    for peer in peers:
        await peer.close()
    await server.stop(STOP_GRACE_S)
