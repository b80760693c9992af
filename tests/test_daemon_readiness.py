"""A daemon says SERVING only once everything it serves is up: a probe (the test
fixtures, a Kubernetes readiness check, the launcher) that sees SERVING may use the
job and /metrics at once. The job's start is held open here to look inside the window."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from pathlib import Path

import grpc
from fixtures_daemon import free_port
from fixtures_hostile import config, until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stalwart.daemon.server import Daemon


async def health_of(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def metrics_answer(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.status


def test_health_is_not_serving_until_the_job_and_metrics_are_up(tmp_path: Path) -> None:
    metrics_port = free_port()
    daemon = Daemon(dataclasses.replace(config(tmp_path), metrics_port=metrics_port))
    release = asyncio.Event()
    job_start = daemon.job.start

    async def held_start() -> None:
        await release.wait()
        await job_start()

    daemon.job.start = held_start  # type: ignore[method-assign]

    async def main() -> tuple[str, str, int]:
        starting = asyncio.create_task(daemon.start())
        await until(lambda: not daemon.address.endswith(":0"), "the TCP port to be bound")
        await until(lambda: daemon._server is not None, "the gRPC server to exist")
        # The port answers while the job is still starting: it must not claim ready.
        while True:
            try:
                during = await health_of(daemon.address)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.02)
        release.set()
        await starting
        try:
            after = await health_of(daemon.address)
            status = await asyncio.to_thread(metrics_answer, metrics_port)
        finally:
            await daemon.stop(grace_s=0)
        return during, after, status

    during, after, status = asyncio.run(main())
    assert during == "NOT_SERVING"
    assert (after, status) == ("SERVING", 200)
