"""A Stalwart cluster on one machine: N daemons standing for N nodes, rank processes
bound to them, one TCPStore for rendezvous. Used by `stalwart demo`, the recovery
benchmark and the end-to-end tests; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from stalwart.client.ports import free_port, free_ports, port_taken
from stalwart.client.rank_template import RankTemplate, TemplateProc
from stalwart.client.step_log import log_tails
from stalwart.daemon.config_schema import socket_in
from stalwart.v1 import operator_pb2, operator_pb2_grpc

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The local cluster could not start or a wait ran out; the message says which."""


def wait_until(check: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


@dataclass
class Node:
    name: str
    index: int
    address: str
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    metrics_port: int = 0

    @property
    def socket(self) -> Path:
        return Path(socket_in(self.data_dir))

    def status(self, timeout_s: float = 2.0) -> operator_pb2.StatusReply | None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                return operator_pb2_grpc.OperatorServiceStub(ch).Status(
                    operator_pb2.StatusRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class RankProc:
    rank: int  # torchrun RANK, -1 for a spare
    node: Node
    proc: subprocess.Popen[bytes] | TemplateProc
    result_path: Path
    log_path: Path

    def result(self) -> dict[str, Any] | None:
        if not self.result_path.exists():
            return None
        return json.loads(self.result_path.read_text())


@dataclass
class LocalCluster:
    """Start with `start_daemons()`, then `launch(spec, world, spares)`; `close()` ends all."""

    nodes: int = 2
    workdir: Path | None = None
    daemon_settings: dict[str, Any] = field(default_factory=dict)
    metrics: bool = False  # serve /metrics from every daemon on a free port
    env: dict[str, str] = field(default_factory=dict)
    daemons: list[Node] = field(default_factory=list)
    ranks: list[RankProc] = field(default_factory=list)
    argv: list[str] | None = None
    # True: fork ranks from a template process that has imported torch (see
    # rank_template), each starting in milliseconds instead of seconds, where no NVIDIA
    # driver is loaded (CUDA cannot be used in such a fork). False: each rank is a fresh
    # `python` process, as the launcher starts it.
    warm_ranks: bool = True
    _own_workdir: bool = False
    _template: RankTemplate | None = None

    def __post_init__(self) -> None:
        if self.workdir is None:
            # Short path: Unix socket paths are limited to 107 bytes.
            self.workdir = Path(tempfile.mkdtemp(prefix="stalwart-"))
            self._own_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        # One job token for every daemon and rank (peers authenticate each other with it).
        self.env.setdefault("STALWART_TOKEN", secrets.token_urlsafe(24))

    # daemons ------------------------------------------------------------------------

    def start_daemons(self, timeout_s: float = 60.0, attempts: int = 3) -> None:
        """Start one daemon per node and wait until they see each other and one of them
        coordinates. A port that another process took between its choice and the daemon's
        bind makes every daemon start again on new ports (up to `attempts` times); a
        daemon that exits for any other reason raises ClusterError with its last lines."""
        assert self.workdir is not None
        for attempt in range(1, attempts + 1):
            ports = free_ports(2 * self.nodes)  # listen addresses, then metrics ports
            addresses = [f"127.0.0.1:{p}" for p in ports[:self.nodes]]
            for i, address in enumerate(addresses):
                node = Node(f"node-{i}", i, address, self.workdir / f"node-{i}")
                node.data_dir.mkdir(parents=True, exist_ok=True)
                self.daemons.append(node)
                self._spawn_daemon(node, [a for a in addresses if a != address],
                                   ports[self.nodes + i] if self.metrics else 0)
            lost = [n for n in self.daemons
                    if wait_until(lambda n=n: self._answers(n), timeout_s,
                                  f"daemon {n.name} to answer on {n.address}") == "lost"]
            if not lost:
                break
            for node in self.daemons:
                self.kill_daemon(node)
            self.daemons = []
            if attempt == attempts:
                raise ClusterError(f"daemons could not start in {attempts} attempts: another "
                                   f"process took their ports ({lost[0].name} last)")
        if self.nodes > 1:
            wait_until(self._membership_agreed, timeout_s, "the daemons to see each other")
        wait_until(lambda: self.coordinator() is not None, timeout_s,
                   "a daemon to take the coordinator role")

    def _answers(self, node: Node) -> bool | str:
        """True once `node`'s own daemon answers; "lost" when it exited because another
        process holds its port; ClusterError when it exited for another reason."""
        if node.proc is not None and node.proc.poll() is not None:
            port = int(node.address.rpartition(":")[2])
            if port_taken(port) or (node.metrics_port and port_taken(node.metrics_port)):
                return "lost"
            tail = "\n".join(log_tails([node.log_path], 10)) if node.log_path else ""
            raise ClusterError(f"daemon {node.name} exited with code {node.proc.returncode} "
                               f"while starting:\n{tail}")
        st = node.status()
        # Another process's daemon may answer on a port taken from under this one.
        return st is not None and st.node == node.name

    def _spawn_daemon(self, node: Node, peers: list[str], metrics_port: int) -> None:
        node.metrics_port = metrics_port
        # No unix_socket: the daemon's default in data_dir is node.socket.
        cfg = {"node": node.name, "listen": node.address, "data_dir": str(node.data_dir),
               "metrics_port": node.metrics_port, "log_format": "json",
               "peers": peers, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0,
               **self.daemon_settings}
        config_path = node.data_dir / "stalwart.toml"
        config_path.write_text(to_toml(cfg))
        node.log_path = node.data_dir / "daemon.log"
        # Writing a spec such as "xid:79@1" here makes the daemon's GPU monitor see it.
        inject = {"STALWART_NVML_INJECT": str(node.data_dir / "nvml-inject")}
        with open(node.log_path, "ab") as log:
            node.proc = subprocess.Popen(
                [sys.executable, "-m", "stalwart.cli", "daemon", "--config", str(config_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env, **inject})

    def _membership_agreed(self) -> bool:
        for node in self.daemons:
            st = node.status()
            if st is None or sum(d.state == "up" for d in st.daemons) < self.nodes - 1:
                return False
        return True

    def coordinator(self) -> Node | None:
        """The live daemon that says it coordinates (elected through etcd, or by default
        the smallest live node name); None when no live daemon says so."""
        for node in self.daemons:
            st = node.status() if node.alive else None
            if st is not None and any(d.coordinator and d.node == st.node for d in st.daemons):
                return node
        return None

    def kill_daemon(self, node: Node) -> None:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(timeout=10)

    def restart_daemon(self, node: Node, timeout_s: float = 60.0) -> None:
        """SIGKILL `node`'s daemon and start it again on its data dir and address: what
        it held in memory (its RAM tier, its view of the job) is gone."""
        self.kill_daemon(node)
        self._spawn_daemon(node, [n.address for n in self.daemons if n is not node],
                           free_port() if self.metrics else 0)
        wait_until(lambda: node.status() is not None, timeout_s,
                   f"daemon {node.name} to answer again on {node.address}")

    # ranks --------------------------------------------------------------------------

    def launch(self, spec: dict[str, Any] | None, world: int, spares: int = 0,
               ranks_per_node: int | None = None, argv: list[str] | None = None,
               spare_group: int = 1) -> None:
        """Start `world` ranks (RANK 0..world-1, consecutive ranks share a node) and
        `spares` spare processes on the last nodes, `spare_group` to a node in turn (the
        TP degree, so that spares can take a TP group's place together), each running
        `python *argv` (a script written against the public API), by default the GPT
        example as `spec` says.
        No store is hosted here: each generation starts from one a rank of its plan serves,
        so this process is not needed by the job (as no host is on real ones)."""
        assert self.workdir is not None
        per_node = ranks_per_node or -(-world // self.nodes)
        if argv is None:
            argv, env = gpt_command(spec or {})
            self.env.update(env)
        self.argv = argv
        spec_path = self.workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        placements = [(r, self.daemons[min(r // per_node, self.nodes - 1)])
                      for r in range(world)]
        placements += [(-1, self.daemons[self.nodes - 1 - (j // spare_group % self.nodes)])
                       for j in range(spares)]
        for i, (rank, node) in enumerate(placements):
            self._start_rank(rank, node, world,
                             f"rank{rank}" if rank >= 0 else f"spare{i - world}")

    def _start_rank(self, rank: int, node: Node, world: int, name: str) -> None:
        local = sum(r.node is node for r in self.ranks)
        env = {**os.environ, **self.env, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(local),
               "STALWART_UNIX_SOCKET": str(node.socket),
               "STALWART_NODE_INDEX": str(node.index),
               "STALWART_DAEMON_PID": str(node.proc.pid if node.proc else 0),
               "STALWART_NVML_INJECT_FILE": str(node.data_dir / "nvml-inject"),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log_path = self.workdir / f"{name}.log"
        result_path = self.workdir / f"{name}.json"
        env.update(STALWART_RESULT_FILE=str(result_path), STALWART_STEP_LOG="1")
        proc: subprocess.Popen[bytes] | TemplateProc
        if self.warm_ranks and not Path("/proc/driver/nvidia").exists():
            if self._template is None:
                # A fork's /proc/PID/environ is the template's: naming the work dir
                # there lets a look at /proc tell this cluster's ranks, as it could
                # by their result file when each was started cold.
                self._template = RankTemplate({**os.environ, **self.env,
                                               "STALWART_CLUSTER_DIR": str(self.workdir),
                                               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
            proc = self._template.spawn(list(self.argv or []), env, str(log_path))
        else:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([sys.executable, *(self.argv or [])], stdout=log,
                                        stderr=subprocess.STDOUT, env=env)
        self.ranks.append(RankProc(rank, node, proc, result_path, log_path))

    def add_spares(self, count: int = 1, node: int | None = None) -> None:
        """Start `count` more spare processes (a node coming back, a rank joining late)."""
        assert self.workdir is not None and self.argv is not None, "launch() first"
        world = len([r for r in self.ranks if r.rank >= 0])
        for _ in range(count):
            target = self.daemons[self.nodes - 1 if node is None else node]
            self._start_rank(-1, target, world,
                             f"spare{sum(r.rank < 0 for r in self.ranks)}")

    def running(self) -> list[RankProc]:
        return [r for r in self.ranks if r.proc.poll() is None]

    # teardown -----------------------------------------------------------------------

    def close(self, keep_workdir: bool = False) -> None:
        """Stop every rank and daemon. Called while an exception propagates (a test's
        `finally`), it first prints each process's last log lines to stderr, so a failure
        on a machine whose work dirs are gone still says what each process was doing."""
        if sys.exc_info()[0] is not None:
            self._print_log_tails()
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.kill()
        for r in self.ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._template is not None:
            self._template.close()
            self._template = None
        for node in self.daemons:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.daemons:
            if node.proc is None:
                continue
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
        if self._own_workdir and not keep_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _print_log_tails(self) -> None:
        logs = [r.log_path for r in self.ranks] + [n.log_path for n in self.daemons
                                                    if n.log_path is not None]
        print(*log_tails(logs), sep="\n", file=sys.stderr)


def gpt_command(spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The GPT example's command line and environment for a demo spec (model, layout,
    train settings, steps, faults, timeouts)."""
    lay, train = spec.get("layout", {}), spec.get("train", {})
    argv = ["-m", "stalwart_examples.gpt.train", "--model", spec.get("model", "tiny"),
            "--model-overrides", json.dumps(spec.get("model_overrides", {})),
            "--steps", str(spec.get("steps", 40)), "--pp", str(lay.get("pp", 1)),
            "--tp", str(lay.get("tp", 1)), "--schedule", lay.get("schedule", "1f1b"),
            "--grad-accum", str(lay.get("grad_accum", 1)),
            "--collective-timeout", str(spec.get("collective_timeout_s", 10.0))]
    if lay.get("microbatches"):
        argv += ["--microbatches", str(lay["microbatches"])]
    if spec.get("flops_costs"):
        argv.append("--flops-costs")
    if lay.get("stages"):
        argv += ["--bounds", ",".join(f"{a}-{b}" for a, b in lay["stages"])]
    flags = {"global_batch": "--global-batch", "seed": "--seed", "corpus_bytes":
             "--corpus-bytes", "lr": "--lr", "precision": "--precision",
             "recompute": "--recompute", "grad_clip": "--grad-clip"}
    for key, value in train.items():
        if key not in flags:
            raise ValueError(f"train setting {key!r} is not one the GPT example takes "
                             f"({sorted(flags)})")
        argv += [flags[key], str(value)]
    env = {"STALWART_FAULTS": json.dumps(spec.get("faults", [])),
           "STALWART_PLAN_TIMEOUT_S": str(spec.get("plan_timeout_s", 120.0)),
           # Nobody adds spares to a local run unless the caller does: a stop ends it.
           "STALWART_RESUME_WAIT_S": str(spec.get("resume_wait_s", 0.0))}
    return argv, env


def to_toml(settings: dict[str, Any]) -> str:
    """A TOML document from {key: value, section: {key: value}} (enough for daemon configs)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))

    lines = [f"{k} = {value(v)}" for k, v in settings.items() if not isinstance(v, dict)]
    for section, table in settings.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]", *(f"{k} = {value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"
