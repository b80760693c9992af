"""A job across emulated hosts: each host its own network namespace and address (or,
where namespaces are unavailable, its own loopback ports, said in the skip reason of
the partition case), its own daemon and its own `stalwart run` of the classifier
example; etcd for the coordinator seat on a host of its own; one standby host of
spares. Each fault, one run: every process of the host of global rank 0, of the host
of the coordinator seat, an iptables DROP that cuts a host off, and a lost host that
comes back and is re-admitted. Each run loses no committed step and ends with the
failure-free run's parameter digest (the standby keeps the layout)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from processes import processes_naming

from bench.netns_cluster import emulated_cluster, netns_unavailable
from stalwart.client.local_cluster import ClusterError, wait_until
from stalwart.client.ports import free_port
from stalwart.v1 import operator_pb2, operator_pb2_grpc

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples/classifier/train.py")
TOKEN = "multihost-job-token"
TRAINING, STEPS = 3, 150  # long enough for a returning host to join before the end
NETNS = netns_unavailable() is None and shutil.which("iptables") is not None
FIGURES: dict[str, float] = {}


@dataclass
class Host:
    name: str
    index: int
    address: str  # HOST:PORT its daemon listens on
    folder: Path
    netns: str = ""
    ifname: str = ""  # the host's interface: gloo binds to it (GLOO_SOCKET_IFNAME)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.folder / "daemon.sock"

    def exec(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)

    def status(self) -> operator_pb2.StatusReply | None:
        try:
            with grpc.insecure_channel(f"unix:{self.socket}") as ch:
                return operator_pb2_grpc.OperatorServiceStub(ch).Status(
                    operator_pb2.StatusRequest(), timeout=2.0)
        except grpc.RpcError:
            return None

    def pids(self) -> list[int]:
        """Every live process of this host: its daemon, launcher, ranks and spares."""
        return processes_naming(self.folder)

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def hosts(tmp_path: Path, count: int) -> Iterator[tuple[list[Host], Host]]:
    """`count` job hosts plus a host for etcd (its address is HOST:2379)."""
    if NETNS:
        with emulated_cluster(count + 1, rate_mbit=1000) as nets:
            out = [Host(f"host-{i}", i, f"{n.addr}:7070", tmp_path / f"host-{i}", n.netns,
                        n.ifname) for i, n in enumerate(nets)]
            yield out[:count], out[count]
    else:
        out = [Host(f"host-{i}", i, f"127.0.0.1:{free_port()}", tmp_path / f"host-{i}")
               for i in range(count + 1)]
        out[count].address = f"127.0.0.1:{free_port()}"
        yield out[:count], out[count]


def start_etcd(tmp_path: Path, at: Host) -> str:
    """etcd on host `at`; returns its client endpoint once it answers."""
    host = at.address.rsplit(":", 1)[0]
    client, peer = f"{host}:{free_port()}", f"http://{host}:{free_port()}"
    at.procs.append(subprocess.Popen(at.exec(
        shutil.which("etcd") or "etcd", "--name", "e", "--data-dir", str(tmp_path / "etcd"),
        "--listen-client-urls", f"http://{client}", "--advertise-client-urls",
        f"http://{client}", "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"e={peer}"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL))
    probe = f"import urllib.request; urllib.request.urlopen('http://{client}/health', timeout=1)"
    wait_until(lambda: subprocess.run(at.exec(sys.executable, "-c", probe),
                                      capture_output=True).returncode == 0, 60,
               "etcd to answer")
    return client


def start_daemon(host: Host, peers: list[str], etcd: str) -> None:
    host.folder.mkdir(parents=True, exist_ok=True)
    config = host.folder / "stalwart.toml"
    settings = {"node": host.name, "listen": host.address, "data_dir": str(host.folder),
                "unix_socket": str(host.socket), "metrics_port": 0, "log_format": "json",
                "peers": peers, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0,
                "token": TOKEN, "etcd": etcd}
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    with open(host.folder / "daemon.log", "ab") as log:
        host.procs.append(subprocess.Popen(
            host.exec(sys.executable, "-m", "stalwart.cli", "daemon", "--config", str(config)),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def start_launcher(host: Host, *, standby: bool) -> subprocess.Popen:
    role = ["--standby"] if standby else ["--node-rank", str(host.index), "--spares", "0"]
    with open(host.folder / "run.log", "ab") as log:
        proc = subprocess.Popen(
            host.exec(sys.executable, "-m", "stalwart.cli", "run", "--nnodes", str(TRAINING),
                      "--nproc-per-node", "1", *role, "--socket", str(host.socket), SCRIPT,
                      "--steps", str(STEPS), "--global-batch", "12"),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "STALWART_TOKEN": TOKEN, "STALWART_STEP_LOG": "1",
                 "OMP_NUM_THREADS": "1",
                 "STALWART_ADVERTISE_HOST": host.address.rsplit(":", 1)[0],
                 **({"GLOO_SOCKET_IFNAME": host.ifname} if host.ifname else {})})
    host.procs.append(proc)
    return proc


def coordinator_of(job: list[Host]) -> str:
    for h in job:
        st = h.status()
        for d in (st.daemons if st else []):
            if d.coordinator:
                return d.node
    return ""


def newest(job: list[Host]) -> operator_pb2.StatusReply | None:
    statuses = [st for h in job if (st := h.status()) is not None]
    return max(statuses, key=lambda s: s.generation, default=None)


def run_job(tmp_path: Path, fault: str | None) -> dict:
    """The job on TRAINING hosts plus a standby, with one fault; what the test checks."""
    with hosts(tmp_path, TRAINING + 1) as (job, etcd_host):
        launchers: dict[str, subprocess.Popen] = {}
        try:
            etcd = start_etcd(tmp_path, etcd_host)
            for h in job:
                start_daemon(h, [o.address for o in job if o is not h], etcd)
            wait_until(lambda: all(h.status() is not None for h in job), 60,
                       "every daemon to answer")
            wait_until(lambda: coordinator_of(job), 60, "a coordinator elected in etcd")
            for h in job:
                launchers[h.name] = start_launcher(h, standby=h.index == TRAINING)
            out = {"fault": fault}
            if fault is not None:
                out.update(inject(fault, job, launchers, etcd))
            for proc in launchers.values():
                if proc.poll() is None:
                    proc.wait(timeout=300)
            out["codes"] = {n: p.returncode for n, p in launchers.items()}
            out["digests"] = {m for h in job if (h.folder / "run.log").exists() for m in
                              re.findall(r"param_digest ([0-9a-f]{64})",
                                         (h.folder / "run.log").read_text())}
            out["logs"] = "\n".join((h.folder / "run.log").read_text()[-1500:] for h in job
                                    if (h.folder / "run.log").exists())
            return out
        finally:
            for h in [*job, etcd_host]:
                h.kill_all()
                for p in h.procs:
                    if p.poll() is None:
                        p.kill()


def inject(fault: str, job: list[Host], launchers: dict[str, subprocess.Popen],
           etcd: str) -> dict:
    def stepped(n: int) -> bool:
        st = newest(job)
        return st is not None and st.latest_committed_step >= n

    wait_until(lambda: stepped(10), 180, "the job to commit 10 steps")
    before = newest(job)
    if fault == "rank0-host":
        victim = job[0]
    elif fault == "coordinator-host":
        victim = next(h for h in job if h.name == coordinator_of(job))
    else:
        victim = job[1]
    survivors = [h for h in job if h is not victim]
    t0 = time.monotonic()
    if fault == "partition":
        for chain in ("INPUT", "OUTPUT"):  # all but loopback: its own ranks still reach it
            subprocess.run(victim.exec("iptables", "-A", chain, "!", "-i" if chain == "INPUT"
                                       else "-o", "lo", "-j", "DROP"), check=True)
    else:
        victim.kill_all()
    # What the fault could lose: read again after it (a step may commit in between),
    # from the survivors still in the plan of before (a new plan's commits do not count).
    committed = max((st.latest_committed_step for h in survivors
                     if (st := h.status()) is not None and st.generation == before.generation),
                    default=before.latest_committed_step)
    out: dict = {"victim": victim.name, "committed_at_fault": committed}

    def replanned() -> operator_pb2.StatusReply | None:
        st = newest(survivors)
        return st if (st is not None and st.generation > before.generation
                      and not st.plan.completed) else None

    if any(not a.spare and a.node == victim.name for a in before.plan.assignments):
        plan = wait_until(replanned, 120, "a plan without the lost host").plan
    else:  # the seat holder held only spares: the job goes on in its plan
        plan = before.plan
    out["resume_step"] = max(plan.resume_step, committed) if plan is before.plan \
        else plan.resume_step
    out["layout"] = (plan.layout.dp, plan.layout.pp, plan.layout.tp)

    def stepped_on() -> bool:
        statuses = [h.status() for h in survivors]
        return any(r.step > out["resume_step"] for st in statuses if st for r in st.ranks)

    wait_until(stepped_on, 120, "the first step after the fault")
    out["fault_to_first_step_s"] = round(time.monotonic() - t0, 2)
    if fault == "returns":  # the same host, its data dir kept, comes back with spares
        victim.procs.clear()
        start_daemon(victim, [o.address for o in survivors], etcd)
        launchers[victim.name] = start_launcher(victim, standby=True)

        def readmitted() -> bool:
            mine, theirs = victim.status(), newest(survivors)
            # Its spare waits for a role, or (on a loaded machine the job can end first)
            # left when the job's completion reached its daemon.
            return (mine is not None and theirs is not None
                    and any(r.spare and (r.state == "spare" or r.state == "left"
                                         and theirs.plan.completed) for r in mine.ranks)
                    and mine.generation == theirs.generation  # it installed the plan
                    and any(d.node == victim.name and d.state == "up" for d in theirs.daemons))
        try:
            wait_until(readmitted, 120, "the returning host's spare to be admitted")
        except ClusterError as exc:  # say which condition did not hold, and what it logged
            mine, theirs = victim.status(), newest(survivors)
            seen = {"mine": None if mine is None else (
                        mine.generation, [(r.rank_id, r.spare, r.state) for r in mine.ranks]),
                    "theirs": None if theirs is None else (
                        theirs.generation, [(d.node, d.state) for d in theirs.daemons])}
            logs = "".join(f"\n--- {victim.name}/{name}\n" + (victim.folder / name).read_text(
                errors="replace")[-4000:] for name in ("daemon.log", "run.log")
                if (victim.folder / name).exists())
            raise AssertionError(f"{exc}: {seen}{logs}") from None
        out["readmitted"] = True
    if fault == "partition":
        def done() -> bool:
            st = newest(survivors)
            return st is not None and st.plan.completed

        wait_until(done, 300, "the job to finish without the cut-off host")
        for chain in ("INPUT", "OUTPUT"):  # the partition heals: the host learns the end
            subprocess.run(victim.exec("iptables", "-D", chain, "!", "-i" if chain == "INPUT"
                                       else "-o", "lo", "-j", "DROP"), check=True)
    if fault in ("rank0-host", "coordinator-host"):
        launchers.pop(victim.name)  # ended with its host
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed: run scripts/install-system-deps.sh")
    out = run_job(tmp_path_factory.mktemp("base"), None)
    assert set(out["codes"].values()) == {0} and len(out["digests"]) == 1, out["logs"]
    return out


@pytest.mark.parametrize("fault", [
    "rank0-host", "coordinator-host",
    pytest.param("partition", marks=pytest.mark.skipif(
        not NETNS, reason="an iptables DROP needs a network namespace per host (root, ip "
                          "netns, iptables): the loopback fallback cannot cut one host off")),
    "returns"])
def test_the_job_survives_the_loss_of_a_host(tmp_path: Path, baseline: dict, fault: str,
                                             capsys: pytest.CaptureFixture) -> None:
    out = run_job(tmp_path, fault)
    assert out["resume_step"] >= out["committed_at_fault"], out  # 0 committed steps lost
    assert out["layout"] == (TRAINING, 1, 1)  # the standby's spare took the lost role
    assert set(out["codes"].values()) == {0}, out["codes"]
    assert out["digests"] == baseline["digests"], out["logs"]
    FIGURES[fault] = out["fault_to_first_step_s"]
    with capsys.disabled():
        where = "network namespaces" if NETNS else "loopback hosts (no network namespaces)"
        print(f"\n[multihost over {where}] {fault}: fault to first step "
              f"{out['fault_to_first_step_s']} s, resumed at step {out['resume_step']}")
