"""Every call a daemon makes to a peer on the step and recovery paths (plans, hurries,
commits, prepares) ends when membership declares that peer lost, over a real gRPC
channel to a peer that takes every call and never answers (what a SIGSTOPped daemon's
established connection does): not after the call's 10 s deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.links import Links
from stalwart.daemon.peers import Peer, PeerChannels, PeerLost
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2


class Frozen(grpc.GenericRpcHandler):
    """Takes every call, answers none."""

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        async def unary(request: bytes, context: Any) -> bytes:
            await asyncio.Event().wait()
            return b""

        async def stream(requests: Any, context: Any) -> Any:
            await asyncio.Event().wait()
            yield b""

        if details.method.endswith("/StepStream"):
            return grpc.stream_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)


@pytest.mark.parametrize("call", ["install_plan", "hurry_step", "commit_step",
                                  "relay_prepares"])
def test_a_call_to_a_frozen_peer_ends_at_its_loss(call: str) -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Frozen(),))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        declared = asyncio.Event()

        async def until_lost(node: str) -> None:
            await declared.wait()

        links = Links("a", lambda: [Peer("a", "127.0.0.1:1", {}), Peer("b", address, {})],
                      PeerChannels(DaemonConfig(node="a").tls), leadership=None,
                      adopt_plan=None, commit=None, hurry=None,  # type: ignore[arg-type]
                      until_lost=until_lost)
        request = {
            "install_plan": common_pb2.Plan(generation=2),
            "hurry_step": peer_pb2.HurryStepRequest(generation=2, step=5, wait_s=1.0),
            "commit_step": peer_pb2.CommitStepRequest(record=manifest_pb2.StepRecord(step=5)),
            "relay_prepares": peer_pb2.PrepareBatch(job_id="j"),
        }[call]
        calling = asyncio.ensure_future(getattr(links, call)("b", request))
        done, _ = await asyncio.wait({calling}, timeout=0.3)
        assert not done, "the call ended before the peer was lost"
        declared.set()
        try:
            with pytest.raises(PeerLost):
                await asyncio.wait_for(calling, 5)  # its deadline is 10 s
        finally:
            await server.stop(0)

    asyncio.run(scenario())
