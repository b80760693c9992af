"""What a coordinator's server pays per step for its children's columns of seals: 24
unary calls against 24 messages on 16 client streams held open, same bytes, one
server process (real gRPC over TCP; the handlers only read).

    .venv/bin/python scripts/grpc_calls_vs_stream.py [ROUNDS] [GAP_MS]   # prints JSON

The server's CPU is read from /proc, the client's from its own process time. Rounds run
back to back unless GAP_MS paces them as steps would (a stream's messages then arrive
one round at a time instead of bunching up). A call gets a reply; a message does not.
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

from stalwart.v1 import common_pb2, peer_pb2

CALLS, STREAMS = 24, 16  # batches a step at 2,048 daemons; the coordinator's children
SERVICE = "bench.Relay"


def _serve(conn: Any) -> None:
    async def serve() -> None:
        async def unary(batch: peer_pb2.PrepareBatch, context: Any) -> common_pb2.Ack:
            return common_pb2.Ack(accepted=True)

        async def streamed(batches: Any, context: Any) -> common_pb2.Ack:
            async for _ in batches:
                pass
            return common_pb2.Ack(accepted=True)

        parse, write = peer_pb2.PrepareBatch.FromString, common_pb2.Ack.SerializeToString
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, parse, write),
            "Stream": grpc.stream_unary_rpc_method_handler(streamed, parse, write)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()
    asyncio.run(serve())


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(port: int, pid: int, rounds: int, gap_s: float) -> dict[str, float]:
    batch = peer_pb2.PrepareBatch(job_id="bench", columns=[peer_pb2.SealColumn(
        step=1, seals=[bytes(70)] * 128, tags=bytes(16 * 128))])
    out = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", peer_pb2.PrepareBatch.SerializeToString,
                                    common_pb2.Ack.FromString)
        stream = channel.stream_unary(f"/{SERVICE}/Stream",
                                      peer_pb2.PrepareBatch.SerializeToString,
                                      common_pb2.Ack.FromString)
        calls = [stream() for _ in range(STREAMS)]

        async def by_calls() -> None:
            await asyncio.gather(*(unary(batch) for _ in range(CALLS)))

        async def by_streams() -> None:
            async def write(call: Any, n: int) -> None:
                for _ in range(n):  # one write at a time on a stream
                    await call.write(batch)
            extra = CALLS - STREAMS
            await asyncio.gather(*(write(c, 2 if i < extra else 1)
                                   for i, c in enumerate(calls)))

        for name, one_round in (("calls", by_calls), ("streams", by_streams)):
            for _ in range(10):  # warm up
                await one_round()
            server0, client0 = _cpu_s(pid), time.process_time()
            for _ in range(rounds):
                await one_round()
                if gap_s:
                    await asyncio.sleep(gap_s)  # the pace of steps, not a wait for an event
            out[f"{name}_server_ms_per_step"] = round((_cpu_s(pid) - server0) / rounds * 1e3, 2)
            out[f"{name}_client_ms_per_step"] = round(
                (time.process_time() - client0) / rounds * 1e3, 2)
        for call in calls:
            await call.done_writing()
            await call
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
    got["server_calls_over_streams"] = round(
        got["calls_server_ms_per_step"] / got["streams_server_ms_per_step"], 1)
    print(json.dumps({"calls": CALLS, "streams": STREAMS, "rounds": rounds, "gap_ms": gap_ms,
                      **got}))


if __name__ == "__main__":
    main()
