"""The per-step commit with N simulated daemons: real gRPC, the real coordinator.

The bench process runs the coordinator's commit code (`StepCommits`) behind a gRPC
server; worker processes host the simulated daemons (`scale_daemons`), many per process
behind one server each (a request names its daemon in metadata). Every step, each daemon
sends one PrepareStep with the seal of its 8 ranks' records and takes the CommitStep
with the step's record, which it verifies as a daemon does (digest, every rank once, its
own seal, and the coordinator's signature when the commit came through another daemon),
then passes it on to its children in the commit tree (`commit_tree.pass_on`, the
daemon's own code). Nothing trains and no record travels: a daemon's records go to its m
ring successors, which costs the same bytes whatever N is; those bytes are counted from
a record of realistic size (`realistic_record`), measured, not sent.

Per N: commit latency (the step's last prepare in -> the last daemon committed it),
the coordinator's CPU per step (its process alone), each simulated daemon's CPU per
step, bytes per daemon per step (prepare out, record in and passed on, record copies
out and in) beside the old design's (every rank's record in the prepare, the whole
manifest back to every daemon), and the coordinator's memory. The workers' two cores
do the work of all N daemons, which real daemons do side by side: past a few hundred
daemons the measured latency is theirs, not the protocol's (`daemon_cpu_s_per_step`
x N / 2 cores bounds it from below).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import resource
import statistics
import time
from types import SimpleNamespace
from typing import Any

import grpc

from stalwart.bench import progress
from stalwart.bench.scale_daemons import (
    COORDINATOR,
    FANOUT,
    NODE_KEY,
    RANKS_PER_DAEMON,
    RPC_TIMEOUT_S,
    SINK,
    STOP_GRACE_S,
    Daemons,
    worker,
)
from stalwart.core import step_record as sr
from stalwart.daemon.links import CommitSender
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.step_commits import StepCommits
from stalwart.daemon.rpc import step_stream
from stalwart.daemon.security.prepare_rule import PrepareRule, seats_of
from stalwart.daemon.snapshot import commit_tree
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc

K, M = 4, 2
WORKERS = 2
HOPS = 5  # repetitions of the hop measurement

# A 70B model at TP 8 x PP 8: about 15 GB of parameters and AdamW state per rank in
# 4 MiB chunks, each in k + m shards, about 270 tensors.
RANK_STATE_BYTES = 15 << 30
CHUNK_BYTES = 4 << 20
TENSORS = 270


def realistic_record(rank: int = 0, step: int = 100) -> manifest_pb2.RankState:
    """One rank's record shaped like the 70B case: tensors, chunks, k + m shards each."""
    state = manifest_pb2.RankState(rank=rank, node=f"node-{rank // RANKS_PER_DAEMON:04d}",
                                   total_bytes=RANK_STATE_BYTES,
                                   coord=common_pb2.RankCoord(rank=rank))
    per_tensor = RANK_STATE_BYTES // TENSORS
    for t in range(TENSORS):
        state.tensors.add(name=f"model/layers.{t // 27}.block.weight_{t % 27}",
                          dtype=common_pb2.BFLOAT16, shape=[per_tensor // 2],
                          offset=t * per_tensor, nbytes=per_tensor - per_tensor % 2)
    for c in range(RANK_STATE_BYTES // CHUNK_BYTES):
        chunk = state.chunks.add(chunk_id=f"s{step}-r{rank}-c{c}", offset=c * CHUNK_BYTES,
                                 size=CHUNK_BYTES, stored_size=CHUNK_BYTES // 3,
                                 crc32c=0x9E3779B9 ^ c, stored_crc32c=0x7F4A7C15 ^ c,
                                 codec=manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2,
                                 base_step=step - 1, k=K, m=M)
        for i in range(K + M):
            chunk.shards.add(index=i, node=f"node-{(rank + 7 * c + i) % 2048:04d}",
                             location=f"{chunk.chunk_id}.{i}", size=CHUNK_BYTES // 3 // K,
                             crc32c=c * 31 + i)
    return state


# --- the coordinator (this process) --------------------------------------------------

class _Links:
    """StepCommits' outbound calls: CommitStep to each simulated daemon over gRPC."""

    def __init__(self, names: list[str], where: dict[str, grpc.aio.Channel]) -> None:
        self.names, self.where = names, where
        self.sender = CommitSender()  # the daemon's own: one serialisation per step

    def nodes(self) -> list[str]:
        return self.names

    def holds_seat(self) -> bool:
        return True

    async def install_plan(self, node: str, plan: common_pb2.Plan) -> None:
        raise NotImplementedError

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes
                          ) -> None:
        if node == COORDINATOR:
            # The coordinator's own commit, as its store checks and writes a record (the
            # records its ranks hold are not simulated, nor the disk).
            record = (request if isinstance(request, peer_pb2.CommitStepRequest)
                      else peer_pb2.CommitStepRequest.FromString(request)).record
            sr.verify(record)
            record.SerializeToString(deterministic=True)
            return
        await self.sender.send(self.where[node], request, RPC_TIMEOUT_S,
                               metadata=((NODE_KEY, node),))


class _Coordinator(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, commits: StepCommits, world: int) -> None:
        self.commits, self.world = commits, world
        # The plan as the prepare rule reads it, and the ranks it places on each daemon.
        self.plan = SimpleNamespace(generation=1, resume_step=0, layout=common_pb2.ParallelLayout(
            dp=world // RANKS_PER_DAEMON, pp=1, tp=RANKS_PER_DAEMON))
        self.ranks_of = {f"node-{d:04d}": frozenset(range(d * RANKS_PER_DAEMON,
                                                          (d + 1) * RANKS_PER_DAEMON))
                         for d in range(world // RANKS_PER_DAEMON)}
        self.seats = seats_of(self.ranks_of)
        self.last_in: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.ending = asyncio.Event()  # the bench is over: streams end, as a daemon's do

    def _rule(self) -> PrepareRule:
        """The coordinator's prepare rule, as JobGate makes it for each call."""
        return PrepareRule(self.plan, self.commits.latest_committed(),  # type: ignore[arg-type]
                           self.commits.steps, self.ranks_of, self.seats)

    def _arrived(self, step: int, prepares: int) -> None:
        self.count[step] = self.count.get(step, 0) + prepares
        if self.count[step] * RANKS_PER_DAEMON >= self.world:
            self.last_in[step] = time.perf_counter()

    async def PrepareStep(self, request, context):  # noqa: N802 - gRPC method name
        self._rule().check(request.node, request)
        self._arrived(request.step, 1)
        await self.commits.prepared(request)
        return peer_pb2.PrepareStepReply(
            ready=True, relay_key=self.commits.relay_keys.key_for(request.node))

    async def StepStream(self, requests, context):  # noqa: N802 - gRPC method name
        async for answer in step_stream.answers(requests, self._prepares, self.ending):
            yield answer

    async def _prepares(self, message: peer_pb2.StepMessage) -> tuple[grpc.StatusCode, str]:
        # as PeerServicer._relay and JobGate.relay_from, whose loop this is
        taken = self._rule().relayed(message.prepares, self.commits.relay_keys, "bench")
        for p in taken:
            self._arrived(p.step, len(p.seals))
        await self.commits.prepared(*taken)
        return grpc.StatusCode.OK, ""


async def _simulate(daemons: int, steps: int) -> dict[str, Any]:
    names = [f"node-{i:04d}" for i in range(daemons)]
    world = daemons * RANKS_PER_DAEMON
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    port = server.add_insecure_port("127.0.0.1:0")
    latest: list[int] = []

    def committed(generation: int) -> None:
        pass

    async def finished(step: int) -> None:
        pass

    channels, where, procs, pipes = [], {}, [], []
    links = _Links(names, where)
    commits = StepCommits(COORDINATOR, "bench", Metrics(), links,
                          latest_committed=lambda: latest[-1] if latest else None,
                          load_record=None, generation=lambda: 1, committed=committed,
                          finished=finished, fanout=FANOUT, keyed=True)
    servicer = _Coordinator(commits, world)
    peer_pb2_grpc.add_PeerServiceServicer_to_server(servicer, server)
    await server.start()
    original = commits._commit  # noqa: SLF001 - the bench records the real phase two

    async def recorded(step: int, pending: Any) -> bool:
        ok = await original(step, pending)
        if ok:
            latest.append(step)
        return ok

    commits._commit = recorded  # type: ignore[method-assign]  # noqa: SLF001
    ctx = multiprocessing.get_context("spawn")
    try:
        for w in range(WORKERS):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(names[w::WORKERS], f"127.0.0.1:{port}",
                                                     commits.key.public, theirs), daemon=True)
            proc.start()
            procs.append(proc)
            pipes.append(ours)
        loop = asyncio.get_running_loop()
        ports = [await loop.run_in_executor(None, pipe.recv) for pipe in pipes]
        for w, (pipe, worker_port) in enumerate(zip(pipes, ports, strict=True)):
            pipe.send(ports)
            pipe.send(names)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker_port}")
            channels.append(channel)
            where.update({n: channel for n in names[w::WORKERS]})
        latencies, cpu, loop_cpu, other_cpu, daemon_cpu = [], [], [], [], []
        prepare_bytes, received = 0.0, 0
        for step in range(1, steps + 2):  # the first step warms connections up
            cpu0, loop0 = time.process_time(), time.thread_time()
            for pipe in pipes:
                pipe.send((step, world))
            replies = [await loop.run_in_executor(None, p.recv) for p in pipes]
            spent, on_loop = time.process_time() - cpu0, time.thread_time() - loop0
            if step == 1:
                continue
            latencies.append(max(r[3] for r in replies) - servicer.last_in[step])
            cpu.append(spent)
            loop_cpu.append(on_loop)
            other_cpu.append(spent - on_loop)
            daemon_cpu.append(sum(r[4] for r in replies) / daemons)
            prepare_bytes = sum(r[0] for r in replies) / daemons
            received = sum(r[1] for r in replies)  # since the start, warm-up included
            assert all(r[2].get(step) for r in replies), "a daemon missed a commit"
        record_bytes = received / daemons / (steps + 1)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        hop, record_size = await _hop(commits, channels[0], names)
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(10)
        servicer.ending.set()
        for channel in channels:
            await channel.close()
        await server.stop(STOP_GRACE_S)
    latencies.sort()
    return {"latencies": latencies, "cpu": statistics.median(cpu),
            "loop_cpu": statistics.median(loop_cpu), "other_cpu": statistics.median(other_cpu),
            "daemon_cpu": statistics.median(daemon_cpu), "hop": hop,
            "record_size": record_size,
            "prepare_bytes": prepare_bytes,
            "record_bytes": record_bytes, "rss": rss}


async def _hop(commits: StepCommits, channel: grpc.aio.Channel, names: list[str]
               ) -> tuple[float, int]:
    """Seconds one daemon of the tree spends on a commit, on an otherwise idle machine:
    take the request, check it as a daemon does (digest, coverage, signature), find its
    children and pass it on to `FANOUT` of them (children that only answer), waiting for
    their answers. Only the tree's depth of these lies between the coordinator and the
    last daemon on a cluster whose daemons work side by side. Also the commit's size."""
    record = sr.build(job_id="bench", step=10**6, generation=1, base_step=10**6,
                      layout=common_pb2.ParallelLayout(dp=len(names), pp=1,
                                                       tp=RANKS_PER_DAEMON),
                      seals=[Daemons.seal_of(n) for n in names])
    data = peer_pb2.CommitStepRequest(record=record, fanout=FANOUT,
                                      signature=commits.key.sign(record)).SerializeToString()
    sender, took = CommitSender(), []
    for _ in range(HOPS):
        t0 = time.perf_counter()
        request = peer_pb2.CommitStepRequest.FromString(data)
        sr.verify(request.record)
        assert commit_tree.signed_by(commits.key.public, request.record, request.signature)
        nodes = commit_tree.nodes_of(request.record)
        targets = commit_tree.children(nodes, nodes[0], FANOUT) or [nodes[0]]
        out = request.SerializeToString()
        await asyncio.gather(*(sender.send(channel, out, RPC_TIMEOUT_S,
                                           metadata=((NODE_KEY, SINK),))
                               for _ in range(max(len(targets), min(FANOUT, len(names))))))
        took.append(time.perf_counter() - t0)
    return statistics.median(took), len(data)


def seal_check_us(daemons: int, repeats: int = 20) -> float:
    """Microseconds of the coordinator's Python per relayed seal: the prepare rule
    over `daemons` daemons' seals in `FANOUT` columns, as its children in the tree send
    them (a seal's seat, its bytes, its tag, then one parse per column)."""
    names = [f"node-{i:04d}" for i in range(daemons)]
    keys = commit_tree.RelayKeys()
    layout = common_pb2.ParallelLayout(dp=daemons, pp=1, tp=RANKS_PER_DAEMON)
    batches = [peer_pb2.PrepareBatch(job_id="bench") for _ in range(min(FANOUT, daemons))]
    for i, name in enumerate(names):
        one = commit_tree.column("bench", keys.key_for(name), peer_pb2.PrepareStepRequest(
            job_id="bench", step=5, generation=1, node=name, layout=layout,
            seal=Daemons.seal_of(name)))
        batch = batches[i % len(batches)]
        if batch.columns:
            commit_tree.append(batch.columns[0], one)
        else:
            batch.columns.append(one)
    ranks_of = {n: frozenset(range(i * RANKS_PER_DAEMON, (i + 1) * RANKS_PER_DAEMON))
                for i, n in enumerate(names)}
    plan = SimpleNamespace(generation=1, resume_step=0, layout=layout)
    rule = PrepareRule(plan, 4, (), ranks_of, seats_of(ranks_of))  # type: ignore[arg-type]
    t0 = time.process_time()
    for _ in range(repeats):
        taken = [rule.relayed(b, keys, "bench") for b in batches]
    spent = time.process_time() - t0
    assert sum(len(p.seals) for t in taken for p in t) == daemons, "a seal was refused"
    return spent / repeats / daemons * 1e6


def depth(daemons: int, fanout: int = FANOUT) -> int:
    """Levels of the commit tree below the coordinator (1: it sends to every daemon)."""
    levels, reach, width = 1, fanout, fanout
    while reach < daemons:
        width *= fanout
        reach += width
        levels += 1
    return levels


def points(sizes: tuple[int, ...], steps: int) -> dict[str, Any]:
    one = realistic_record().ByteSize()
    copies = 2 * M * RANKS_PER_DAEMON * one  # m copies out, m predecessors' copies in
    out = []
    for n in sizes:
        progress.say(f"commit with {n} simulated daemons ({n * RANKS_PER_DAEMON} ranks), "
                     f"{steps} steps")
        got = asyncio.run(_simulate(n, steps if n <= 256 else max(3, steps // 3)))
        lat = got["latencies"]
        protocol = got["prepare_bytes"] + got["record_bytes"]
        out.append({
            "daemons": n, "ranks": n * RANKS_PER_DAEMON,
            "commit_p50_s": round(statistics.median(lat), 5),
            "commit_p99_s": round(lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)], 5),
            "coordinator_cpu_s_per_step": round(got["cpu"], 5),
            # the event loop's thread (Python, and gRPC's per-call work there), and the
            # process's other threads (gRPC's own: sockets, HTTP/2; and the bench's
            # idle pipe readers), each the median over steps
            "coordinator_loop_cpu_s_per_step": round(got["loop_cpu"], 5),
            "coordinator_other_threads_cpu_s_per_step": round(got["other_cpu"], 5),
            "daemon_cpu_s_per_step": round(got["daemon_cpu"], 6),
            # The commit on a cluster whose daemons each have their own cores: the
            # coordinator's CPU for the whole step (an upper bound of its share of the
            # latency) plus one measured hop per level of the tree.
            "hop_s": round(got["hop"], 5), "tree_depth": depth(n),
            "commit_critical_path_s": round(got["cpu"] + depth(n) * got["hop"], 5),
            "protocol_bytes_per_daemon_per_step": int(protocol),
            "step_record_bytes": got["record_size"],
            "bytes_per_daemon_per_step": int(protocol + copies),
            "old_bytes_per_daemon_per_step": int(RANKS_PER_DAEMON * one * (n + 1)),
            "coordinator_rss_bytes": got["rss"],
        })
    return {"record_bytes_per_rank": one, "points": out,
            "seal_check_us_per_daemon": round(seal_check_us(max(sizes)), 2),
            "growth_exponent": {key: _slope(out, key) for key in (
                "bytes_per_daemon_per_step", "old_bytes_per_daemon_per_step",
                "protocol_bytes_per_daemon_per_step", "coordinator_cpu_s_per_step",
                "commit_p99_s", "commit_critical_path_s")},
            "commit_fanout": FANOUT, "workers": WORKERS, "cpus": os.cpu_count()}


def _slope(rows: list[dict], key: str) -> float:
    """Least-squares slope of log(value) over log(daemons): 0 flat, 1 linear."""
    xs = [math.log(r["daemons"]) for r in rows]
    ys = [math.log(max(r[key], 1e-12)) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den, 3) \
        if den else 0.0
