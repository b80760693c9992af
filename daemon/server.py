"""The daemon process: one grpc.aio server on TCP (peers, operators) and a Unix socket (ranks).

It wires the services to the shared state, serves Prometheus /metrics over
HTTP, runs the detectors and gossip in the background, and on SIGTERM/SIGINT
stops taking calls, gives in-flight calls a grace period and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.data_lock import DataDirBusy, DataDirLock
from stalwart.daemon.job import Job
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import PeerChannels
from stalwart.daemon.recovery.exits import ExitWatch
from stalwart.daemon.recovery.gossip import gossip_forever
from stalwart.daemon.recovery.membership import Membership
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.rpc.guard import Guard
from stalwart.daemon.rpc.operator_service import OperatorServicer
from stalwart.daemon.rpc.peer_service import PeerServicer
from stalwart.daemon.rpc.rank_service import RankServicer
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.security.auth import Authenticator, job_token, stamp
from stalwart.daemon.security.tls import ReloadingServerCredentials, TlsError
from stalwart.daemon.security.tls import enabled as tls_enabled
from stalwart.daemon.snapshot import codecs
from stalwart.v1 import operator_pb2, operator_pb2_grpc, peer_pb2, peer_pb2_grpc, rank_pb2_grpc

log = logging.getLogger("stalwart.daemon")

GRACE_S = 3.0  # in-flight RPCs get this long after SIGTERM before they are cancelled
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # shards travel in ~1 MiB pieces; this leaves room
ENDPOINT_FILE = "daemon.json"  # in data_dir: where a running daemon can be reached
SERVICES = (
    "stalwart.v1.RankService",
    "stalwart.v1.PeerService",
    "stalwart.v1.OperatorService",
)
# The ranks' Unix socket serves only what ranks (and `stalwart status` on the node) call.
UNIX_SERVICES = ("stalwart.v1.RankService", "stalwart.v1.OperatorService")
UMASK = 0o027  # files 0640, folders 0750 at most, whatever umask the daemon was started with
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Without this a second daemon could silently share the port (SO_REUSEPORT).
    ("grpc.so_reuseport", 0),
]


class DaemonStartError(RuntimeError):
    """The daemon cannot start; the message says which setting to change."""


class Daemon:
    """One daemon: its configuration, state, servicers and the gRPC server."""

    def __init__(self, config: DaemonConfig) -> None:
        os.umask(os.umask(UMASK) | UMASK)  # never looser than UMASK, keep what is stricter
        self.config = config
        self.metrics = Metrics()
        self.stopping = asyncio.Event()
        self.data_dir = Path(config.data_dir).resolve()
        self.unix_socket = Path(config.unix_socket).resolve()
        self.address = config.listen  # advertised HOST:PORT, fixed once the port is bound
        self.registry = Registry(config.node, config.heartbeat_interval_s,
                                 config.heartbeat_timeout_s, self.metrics)
        self.membership = Membership(config.node, self.address, config.heartbeat_interval_s,
                                     config.heartbeat_timeout_s, self.metrics,
                                     self.registry.report, seeds=config.peers,
                                     fanout=config.gossip_fanout)
        self.health = health.aio.HealthServicer()
        self.channels = PeerChannels(config.tls)
        self.job = Job(config, self.registry, self.membership, self.metrics, self.data_dir,
                       lambda: self.address, self.channels)
        self.operator = OperatorServicer(config.node, self.address, self.registry,
                                         self.membership, self.job.leadership.leader)
        self.job.me = self.peer_info
        self.operator.decorators.append(self.job.decorate_status)
        self._server: grpc.aio.Server | None = None
        self._unix_server: grpc.aio.Server | None = None
        self.auth: Authenticator | None = None
        self._metrics_http: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.tls: ReloadingServerCredentials | None = None
        self.data_lock = DataDirLock(self.data_dir)
        self._unix_bound = False  # only a socket this daemon bound is removed at stop

    # lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Bind every endpoint and start serving; raises DaemonStartError naming the setting."""
        cfg = self.config
        _make_dir(self.data_dir, "data_dir")
        try:
            self.data_lock.acquire()
        except DataDirBusy as e:
            raise DaemonStartError(
                f"data_dir: {e}; stop that daemon or choose another data_dir") from None
        except OSError as e:
            raise DaemonStartError(
                f"data_dir: cannot lock {self.data_dir} ({e.strerror}); "
                "make it writable or choose another data_dir") from None
        _make_dir(self.unix_socket.parent, "unix_socket")
        _clear_stale_socket(self.unix_socket)
        try:
            token = job_token(cfg.token, self.data_dir)
        except OSError as e:
            raise DaemonStartError(
                f"token: cannot keep the job secret in {self.data_dir} ({e.strerror}); "
                "set token or make data_dir writable") from None
        if not cfg.token and not tls_enabled(cfg.tls) and (cfg.peers or cfg.etcd):
            log.warning("no token configured: this daemon made its own job secret in %s; "
                        "daemons of one job refuse each other unless they share a token "
                        "(set token) or use mutual TLS", self.data_dir / "job.token")
        self.config = cfg = replace(cfg, token=token)
        self.job.snapshots.pool.token = token
        self.auth = Authenticator(token, tls_enabled(cfg.tls), self.metrics)
        self.channels.interceptors = stamp(token, cfg.node)
        if tls_enabled(cfg.tls):
            try:
                self.tls = ReloadingServerCredentials(cfg.tls)
            except TlsError as e:
                raise DaemonStartError(str(e)) from None
        # The health servicer starts with "" SERVING; a probe must not see ready before
        # the job and /metrics are up, so it says NOT_SERVING until the end of start().
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[Guard()])
        unix_server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[Guard()])
        self._server, self._unix_server = server, unix_server
        rank = RankServicer(cfg, self.registry, self.metrics, self.stopping, self.auth,
                            snapshots=self.job.snapshots,
                            on_register=self.job.announcer.on_register)
        for s in (server, unix_server):
            rank_pb2_grpc.add_RankServiceServicer_to_server(rank, s)
            operator_pb2_grpc.add_OperatorServiceServicer_to_server(self.operator, s)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, s)
        peer_pb2_grpc.add_PeerServiceServicer_to_server(
            PeerServicer(self.membership, self.registry, self.peer_info, self.auth,
                         self.job.gate, self.job.leadership.leader, metrics=self.metrics,
                         job_id=cfg.job_id, stopping=self.stopping), server)
        names = [*SERVICES, "stalwart.v1.ShardService"]
        shard = ShardServicer(self.data_dir / "shards", self.metrics, auth=self.auth,
                              quota=self.job.snapshots.quota, policy=self.job.gate,
                              sync=self.job.snapshots.disk_sync)
        peer_pb2_grpc.add_ShardServiceServicer_to_server(shard, server)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        reflection.enable_server_reflection(
            [*UNIX_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME], unix_server)

        port = _bind(server, cfg.listen, "listen",
                     self.tls.credentials if self.tls is not None else None)
        host = cfg.listen.rpartition(":")[0]
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = socket.gethostname()  # peers cannot dial a wildcard address
        self.address = self.membership.self_address = self.operator.address = f"{host}:{port}"
        _bind(unix_server, f"unix:{self.unix_socket}", "unix_socket")
        self._unix_bound = True
        # The kernel lets only this uid and group (and root) connect; the deployment puts
        # the ranks in the daemon's group. Other users never reach the RPCs.
        os.chmod(self.unix_socket, 0o660)
        self.job.snapshots.fd_server.metrics = self.metrics
        self.job.snapshots.fd_server.owner_check = self.job.processes.slot_caller
        await server.start()
        await unix_server.start()
        await self.job.start()

        if cfg.metrics_port:
            try:
                self._metrics_http, _ = start_http_server(
                    cfg.metrics_port, addr=cfg.listen_host, registry=self.metrics.registry)
            except OSError as e:
                raise DaemonStartError(
                    f"metrics_port: cannot serve /metrics on {cfg.listen_host}:"
                    f"{cfg.metrics_port} ({e.strerror}); choose a free port or 0 to turn off"
                ) from None
        self.metrics.generation.set(self.registry.generation)
        for name in ("", *names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks = [
            asyncio.create_task(self._detect_forever(), name="detect"),
            asyncio.create_task(self._watch_protection_forever(), name="protection"),
            asyncio.create_task(gossip_forever(
                self.membership, self.peer_info, self.channels.get, cfg.heartbeat_interval_s,
                self.stopping), name="gossip"),
        ]
        self._write_endpoint_file()

    async def stop(self, grace_s: float = GRACE_S) -> None:
        """Stop taking calls, let in-flight ones finish for grace_s seconds, free every port.

        A daemon refused at start (its data dir locked by another) started nothing and
        touches nothing: the sockets and files there are the other daemon's."""
        self.stopping.set()
        if not self.data_lock.held:
            await self.channels.close()
            return
        await self.health.enter_graceful_shutdown()
        self.registry.wake_watchers()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.stop(grace_s) for s in (self._server, self._unix_server)
                               if s is not None))
        await self.job.stop()
        await self.channels.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self._unix_bound:
            with contextlib.suppress(FileNotFoundError):
                self.unix_socket.unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / ENDPOINT_FILE).unlink()
        self.data_lock.release()

    # background ----------------------------------------------------------

    async def _detect_forever(self) -> None:
        """Apply the liveness rules every tick (~0.1 s), and at once when a watched rank
        process exits (ExitWatch)."""
        tick_s = min(0.1, self.config.heartbeat_interval_s / 4)
        exits = ExitWatch(self._check_ranks)
        try:
            while not self.stopping.is_set():
                self._check_ranks()
                try:
                    self.membership.check()
                    exits.follow(r.pid for r in self.registry.ranks()
                                 if r.process is not None and not r.ended)
                except Exception:  # a detector bug must not stop detection of the rest
                    log.exception("liveness check failed")
                await asyncio.sleep(tick_s)
        finally:
            exits.close()

    def _check_ranks(self) -> None:
        try:
            self.registry.check()
        except Exception:  # a detector bug must not stop detection of everything else
            log.exception("liveness check failed")

    async def _watch_protection_forever(self) -> None:
        """Recount shards and the protection margin once per heartbeat interval."""
        while not self.stopping.is_set():
            try:
                self.job.snapshots.protection.update()
            except Exception:  # a counting bug must not stop the daemon
                log.exception("protection census failed")
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def peer_info(self) -> peer_pb2.PeerInfo:
        """How this daemon describes itself to peers."""
        return peer_pb2.PeerInfo(
            node=self.config.node, address=self.address, labels=self.config.labels.as_dict(),
            generation=self.registry.generation, time_unix_ms=int(time.time() * 1000),
            rank_ids=self.registry.live_rank_ids(),
            latest_committed=self.job.snapshots.store.latest_committed() or 0)

    def status(self) -> operator_pb2.StatusReply:
        return self.operator.status()

    def _write_endpoint_file(self) -> None:
        """Record where this daemon listens, for tools on this node (atomic replace)."""
        info = {"node": self.config.node, "pid": os.getpid(), "address": self.address,
                "unix_socket": str(self.unix_socket), "metrics_port": self.config.metrics_port}
        tmp = self.data_dir / f".{ENDPOINT_FILE}.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        tmp.replace(self.data_dir / ENDPOINT_FILE)


def _make_dir(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DaemonStartError(
            f"{key}: cannot create directory {path} ({e.strerror}); choose another path") from None


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket left by a crashed daemon; refuse if a live daemon still answers on it."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise DaemonStartError(
        f"unix_socket: another daemon is serving on {path}; stop it or choose another path")


def _bind(server: grpc.aio.Server, target: str, key: str,
          credentials: grpc.ServerCredentials | None = None) -> int:
    """Add an endpoint (TLS when credentials are given); returns the bound TCP port
    (1 for a Unix socket)."""
    try:
        if credentials is None:
            port = server.add_insecure_port(target)
        else:
            port = server.add_secure_port(target, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise DaemonStartError(
            f"{key}: cannot listen on {target.removeprefix('unix:')} (address in use, not on "
            "this host, or path too long); choose another one")
    return port


async def serve(config: DaemonConfig) -> int:
    """Run a daemon until SIGTERM or SIGINT; returns the process exit code."""
    begun = time.monotonic()
    # Handlers first: a SIGTERM that lands while the daemon starts still stops it cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    daemon = Daemon(config)
    try:
        await daemon.start()
    except DaemonStartError as e:
        log.error(str(e))
        await daemon.stop(grace_s=0)
        return 1
    log.info("daemon ready", extra={
        "node": config.node, "address": daemon.address, "unix_socket": str(daemon.unix_socket),
        "metrics_port": config.metrics_port, "peers": list(config.peers),
        "startup_s": round(time.monotonic() - begun, 3),
        "encode_loops": "C" if codecs.native is not None else "numpy"})
    if codecs.native is None:
        log.warning("daemon/snapshot/_kernels.c was not built where stalwart was installed "
                    "(no C compiler?): snapshots are encoded with numpy, "
                    "more slowly; reinstall with a C compiler to get the C loops")
    await stop.wait()
    log.info("daemon stopping", extra={"grace_s": GRACE_S})
    await daemon.stop()
    log.info("daemon stopped")
    return 0
