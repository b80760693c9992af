"""Fixture `daemon_factory`: real `stalwart daemon` processes on free ports, stopped after the test.

Each daemon gets its own data directory (short, under /tmp, so the Unix socket
path fits) and a text log file; a start waits for gRPC health SERVING over TCP.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stalwart.client.local_cluster import ClusterError, to_toml, wait_until
from stalwart.client.ports import free_port
from stalwart.daemon.config_schema import socket_in
from stalwart.v1 import operator_pb2, operator_pb2_grpc

T = TypeVar("T")
START_TIMEOUT_S = 20.0  # generous: other helpers' tests load the same 2 cores
STOP_TIMEOUT_S = 10.0


def wait_for(check: Callable[[], T], timeout_s: float, what: str,
             every_s: float = 0.05) -> T:
    """Poll `check` until it returns something truthy; fail naming `what` after timeout_s."""
    try:
        return wait_until(check, timeout_s, what, every_s)
    except ClusterError as e:
        raise AssertionError(str(e)) from None


@dataclass
class DaemonHandle:
    """One running daemon process and where to reach it."""

    node: str
    address: str  # HOST:PORT of the TCP endpoint
    metrics_port: int
    data_dir: Path
    unix_socket: Path
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def socket_target(self) -> str:
        return f"unix:{self.unix_socket}"

    @property
    def token(self) -> str:
        """The job token this daemon checks (kept in its data dir)."""
        return (self.data_dir / "job.token").read_text().strip()

    @property
    def token_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("stalwart-token", self.token),)

    def status(self, timeout_s: float = 5.0) -> operator_pb2.StatusReply:
        with grpc.insecure_channel(self.address) as channel:
            return operator_pb2_grpc.OperatorServiceStub(channel).Status(
                operator_pb2.StatusRequest(), timeout=timeout_s)

    def metrics(self, timeout_s: float = 5.0) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode()

    def rank(self, rank_id: str) -> operator_pb2.RankStatus | None:
        return next((r for r in self.status().ranks if r.rank_id == rank_id), None)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send `sig` and return the exit code; kills and fails if it outlives timeout_s."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)
            raise AssertionError(
                f"daemon {self.node} ignored signal {sig} for {timeout_s:g} s; log:\n{self.log()}"
            ) from None


def health_status(target: str, timeout_s: float = 1.0) -> str:
    """The gRPC health status name at `target` ("SERVING", ...), or the RPC error code name."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code().name  # type: ignore[attr-defined]
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def daemon_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without STALWART_* settings that would leak into a daemon."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    env.update(extra or {})
    return env


class DaemonFactory:
    """Starts daemons under `base_dir` and stops every one of them at the end."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.daemons: list[DaemonHandle] = []
        self.token = secrets.token_urlsafe(16)  # one job: its daemons share the token

    def start(self, node: str = "n0", *, port: int | None = None, peers: tuple[str, ...] = (),
              settings: Mapping[str, Any] | None = None, args: tuple[str, ...] = (),
              env: Mapping[str, str] | None = None,
              start_timeout_s: float = START_TIMEOUT_S) -> DaemonHandle:
        """Run `stalwart daemon` as node `node` and wait until it is SERVING over TCP.

        `settings` go into a TOML config file; `port` fixes the TCP port (so peers can
        name it before it starts); `args` are extra command-line flags.
        """
        data_dir = self.base_dir / node
        data_dir.mkdir(parents=True, exist_ok=True)
        if "token" not in (settings or {}):
            env = {"STALWART_TOKEN": self.token, **(env or {})}
        port = port or free_port()
        metrics_port = free_port()
        cmd = [sys.executable, "-m", "stalwart.cli", "daemon", "--node", node,
               "--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port),
               "--data-dir", str(data_dir), "--log-format", "text"]
        if peers:
            cmd += ["--peers", ",".join(peers)]
        if settings:
            config = data_dir / "stalwart.toml"
            config.write_text(to_toml(settings))
            cmd += ["--config", str(config)]
        log_path = data_dir / "daemon.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT,
                                       env=daemon_env(env), cwd=data_dir)
        handle = DaemonHandle(node, f"127.0.0.1:{port}", metrics_port, data_dir,
                              Path(socket_in(data_dir)), log_path, process)
        self.daemons.append(handle)

        def serving() -> bool:
            if process.poll() is not None:
                raise AssertionError(
                    f"daemon {node} exited with {process.returncode} while starting; "
                    f"log:\n{handle.log()}")
            return health_status(handle.address, timeout_s=0.5) == "SERVING"

        wait_for(serving, start_timeout_s, f"daemon {node} to report SERVING")
        return handle

    def stop_all(self) -> None:
        for handle in self.daemons:
            if handle.process.poll() is None:
                try:
                    handle.stop()
                except AssertionError:
                    pass  # already killed; the test itself reports real shutdown failures


@pytest.fixture
def daemon_factory() -> Iterator[DaemonFactory]:
    """Start daemons with `daemon_factory.start(node, ...)`; all are stopped afterwards."""
    base = Path(tempfile.mkdtemp(prefix="stw-", dir="/tmp"))
    factory = DaemonFactory(base)
    try:
        yield factory
    finally:
        factory.stop_all()
        shutil.rmtree(base, ignore_errors=True)
