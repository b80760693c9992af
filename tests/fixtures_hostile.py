"""Helpers of the hostile-caller suites: an in-process daemon on real sockets, callers
that hold (or lack) the job token and claim a node, and waits with a deadline."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc

from stalwart.daemon.config import DaemonConfig, SnapshotConfig
from stalwart.daemon.server import Daemon
from stalwart.v1 import common_pb2, rank_pb2, rank_pb2_grpc

TOKEN = "hostile-test-token"
WAIT_S = 30.0  # deadline of every wait: generous for a loaded 2-core machine


def config(data_dir: Path, **kw) -> DaemonConfig:
    kw.setdefault("snapshot", SnapshotConfig(chunk_bytes=8192))
    kw.setdefault("token", TOKEN)
    return DaemonConfig(node="n1", listen="127.0.0.1:0", metrics_port=0, data_dir=str(data_dir),
                        unix_socket=str(data_dir / "d.sock"), heartbeat_interval_s=0.2,
                        heartbeat_timeout_s=60.0, **kw)


def run(cfg: DaemonConfig, body):
    async def main():
        daemon = Daemon(cfg)
        await daemon.start()
        try:
            return await body(daemon)
        finally:
            await daemon.stop(grace_s=0)
    return asyncio.run(main())


def as_node(node: str, token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    """Metadata of a caller that holds `token` and claims to be daemon `node`."""
    return (("stalwart-token", token), ("stalwart-node", node))


async def code_of(call) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


async def until(check, what: str) -> None:
    """Wait for `check()` to be true, polling; fail naming `what` after WAIT_S."""
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out after {WAIT_S:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def refused(daemon: Daemon, reason: str) -> float:
    return daemon.metrics.registry.get_sample_value(
        "stalwart_auth_refused_total", {"reason": reason}) or 0.0


async def register_self(daemon: Daemon) -> str:
    """Register this test process as rank 0 of a world of 1 (the first plan forms)."""
    async with grpc.aio.insecure_channel(f"unix:{daemon.unix_socket}") as ch:
        reply = await rank_pb2_grpc.RankServiceStub(ch).Register(
            rank_pb2.RegisterRequest(pid=os.getpid(), rank=0, world_size=1, job_id="default",
                                     layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1)),
            metadata=(("stalwart-token", TOKEN),), timeout=10)
    await until(lambda: daemon.registry.plan is not None, "the first plan")
    return reply.rank_id
