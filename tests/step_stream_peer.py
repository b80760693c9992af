"""A peer for tests/test_step_stream.py, in its own process so a test can kill or stop it:
it serves StepStream through daemon/rpc/step_stream.py's `answers` (or, with
--unary-only, only the unary CommitStep, as an older daemon would), answers each commit
by its record's step, and reports what it saw on /test.Peer/Stats.

    python tests/step_stream_peer.py PORT [--unary-only]   # prints "ready PORT"

Steps: 2 is refused (PERMISSION_DENIED), 3 is held until the peer dies, 4 waits until
5 has been answered, 8 is answered with bytes that are not a StepAnswer; any other is
taken.
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc

from stalwart.daemon.rpc import step_stream
from stalwart.v1 import peer_pb2

SERVICE = "stalwart.v1.PeerService"
GARBLED = "garbled"  # an answer whose bytes go out as no StepAnswer at all


def answer_bytes(answer: peer_pb2.StepAnswer) -> bytes:
    return b"\xff\xff\xff" if answer.details == GARBLED else answer.SerializeToString()


async def serve(port: int, unary_only: bool) -> None:
    seen = {"streams": 0, "unary": 0, "held": 0, "answered": []}
    five = asyncio.Event()

    async def take(step: int) -> tuple[grpc.StatusCode, str]:
        if step == 2:
            return grpc.StatusCode.PERMISSION_DENIED, "step 2 is refused here"
        if step == 3:
            seen["held"] += 1
            await asyncio.Event().wait()
        if step == 4:
            await five.wait()
        seen["answered"].append(step)
        if step == 5:
            five.set()
        return grpc.StatusCode.OK, GARBLED if step == 8 else ""

    async def stream(requests, context):
        seen["streams"] += 1
        async def handle(message: peer_pb2.StepMessage) -> tuple[grpc.StatusCode, str]:
            return await take(message.commit.record.step)
        async for answer in step_stream.answers(requests, handle):
            yield answer

    async def commit(request: peer_pb2.CommitStepRequest, context) -> peer_pb2.CommitStepReply:
        seen["unary"] += 1
        code, details = await take(request.record.step)
        if code != grpc.StatusCode.OK:
            await context.abort(code, details)
        return peer_pb2.CommitStepReply(committed=True)

    async def stats(request: bytes, context) -> bytes:
        return json.dumps(seen).encode()

    methods = {"CommitStep": grpc.unary_unary_rpc_method_handler(
        commit, peer_pb2.CommitStepRequest.FromString,
        peer_pb2.CommitStepReply.SerializeToString)}
    if not unary_only:
        methods["StepStream"] = grpc.stream_stream_rpc_method_handler(
            stream, peer_pb2.StepMessage.FromString, answer_bytes)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(SERVICE, methods),
        grpc.method_handlers_generic_handler("test.Peer", {
            "Stats": grpc.unary_unary_rpc_method_handler(stats)})))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"ready {bound}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), "--unary-only" in sys.argv[2:]))
