"""What the coordinator of 2,048 daemons pays per step for its children in the commit
tree, as unary calls against the step streams it uses (daemon/rpc/step_stream.py):
same bytes, real gRPC over TCP, the peers in another process.

    .venv/bin/python scripts/grpc_calls_vs_stream.py [ROUNDS] [GAP_MS]   # prints JSON

- up: 24 batches of a 128-seal column from 16 children (some send two, as a batch split
  by a late prepare does); the coordinator is the server, its CPU read from /proc.
- down: the step's 133 KB commit to each of 16 children; the coordinator is the client,
  its CPU its own process time.

Each message is answered in both ways: a call by its reply, a stream message by its
StepAnswer. Rounds run back to back unless GAP_MS paces them as steps would.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
import time
from typing import Any

import grpc

from stalwart.daemon.rpc import step_stream
from stalwart.daemon.rpc.step_stream import COMMIT, PREPARES, StepStreams
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

BATCHES, CHILDREN = 24, 16  # a step at 2,048 daemons: the coordinator's children
SEALS, RECORD_BYTES = 128, 133_133
SERVICE = "stalwart.v1.PeerService"


def _serve(conn: Any) -> None:
    """The peer: unary RelayPrepares and CommitStep, and StepStream, that only answer."""
    async def serve() -> None:
        async def relay(batch: bytes, context: Any) -> common_pb2.Ack:
            peer_pb2.PrepareBatch.FromString(batch)
            return common_pb2.Ack(accepted=True)

        async def commit(request: bytes, context: Any) -> peer_pb2.CommitStepReply:
            peer_pb2.CommitStepRequest.FromString(request)
            return peer_pb2.CommitStepReply(committed=True)

        async def taken(message: peer_pb2.StepMessage) -> tuple[grpc.StatusCode, str]:
            return grpc.StatusCode.OK, ""

        async def stream(requests: Any, context: Any) -> Any:
            async for answer in step_stream.answers(requests, taken):
                yield answer

        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "RelayPrepares": grpc.unary_unary_rpc_method_handler(
                relay, None, common_pb2.Ack.SerializeToString),
            "CommitStep": grpc.unary_unary_rpc_method_handler(
                commit, None, peer_pb2.CommitStepReply.SerializeToString),
            "StepStream": grpc.stream_stream_rpc_method_handler(
                stream, peer_pb2.StepMessage.FromString, peer_pb2.StepAnswer.SerializeToString)})
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()
    asyncio.run(serve())


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _messages() -> tuple[bytes, bytes]:
    seal = manifest_pb2.RankSeal(node="node-0000", ranks=range(8), digest=bytes(32))
    batch = peer_pb2.PrepareBatch(job_id="bench", columns=[peer_pb2.SealColumn(
        step=1, seals=[seal.SerializeToString()] * SEALS, tags=bytes(16 * SEALS))])
    record = manifest_pb2.StepRecord(job_id="bench", step=1, digest=os.urandom(RECORD_BYTES))
    return batch.SerializeToString(), peer_pb2.CommitStepRequest(record=record).SerializeToString()


async def _measure(port: int, pid: int, rounds: int, gap_s: float) -> dict[str, float]:
    batch, commit = _messages()
    # One channel per child, as a daemon has one per peer.
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHILDREN)]
    streams = StepStreams()
    relay = [c.unary_unary(f"/{SERVICE}/RelayPrepares") for c in channels]
    commit_call = [c.unary_unary(f"/{SERVICE}/CommitStep") for c in channels]
    ways = {
        ("up", "calls"): lambda: asyncio.gather(*(
            relay[i % CHILDREN](batch, timeout=30) for i in range(BATCHES))),
        ("up", "streams"): lambda: asyncio.gather(*(
            streams.send(channels[i % CHILDREN], PREPARES, batch, 30) for i in range(BATCHES))),
        ("down", "calls"): lambda: asyncio.gather(*(
            call(commit, timeout=30) for call in commit_call)),
        ("down", "streams"): lambda: asyncio.gather(*(
            streams.send(c, COMMIT, commit, 30) for c in channels)),
    }
    out: dict[str, float] = {}
    for (direction, way), one_round in ways.items():
        for _ in range(10):  # warm up: connections, streams
            await one_round()
        server0, client0 = _cpu_s(pid), time.process_time()
        for _ in range(rounds):
            await one_round()
            if gap_s:
                await asyncio.sleep(gap_s)  # the pace of steps, not a wait for an event
        side = "server" if direction == "up" else "client"
        spent = (_cpu_s(pid) - server0) if side == "server" else time.process_time() - client0
        out[f"{direction}_{way}_coordinator_ms_per_step"] = round(spent / rounds * 1e3, 2)
    streams.close()
    for channel in channels:
        await channel.close()
    for direction in ("up", "down"):
        out[f"{direction}_calls_over_streams"] = round(
            out[f"{direction}_calls_coordinator_ms_per_step"]
            / out[f"{direction}_streams_coordinator_ms_per_step"], 1)
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    gap_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(theirs,), daemon=True)
    server.start()
    try:
        got = asyncio.run(_measure(ours.recv(), server.pid, rounds, gap_ms / 1000))
    finally:
        server.kill()
    print(json.dumps({"batches_up": BATCHES, "children": CHILDREN, "rounds": rounds,
                      "gap_ms": gap_ms, **got}))


if __name__ == "__main__":
    main()
