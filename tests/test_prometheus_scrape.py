"""A real Prometheus scrapes a real `stalwart daemon`; every dashboard query returns data.

The test plays the part of the ranks over the daemon's Unix socket (register,
heartbeat, a rank whose process dies, a caller of the wrong job) and of a peer
storing a shard, then asks Prometheus's HTTP API for each panel's query.
Panels in NEEDS_TRAINING only get data from captures, commits, recoveries and
S3, i.e. from a real training run (the demo), and are listed for the integrator.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from dashboard_queries import DASHBOARDS, ROOT, PanelQuery, concrete, panel_queries

from stalwart.daemon.shard_client import ShardClient
from stalwart.v1 import rank_pb2, rank_pb2_grpc

DEADLINE_S = 30.0
WINDOW = "10s"  # rate windows: ten 1 s scrapes
STEP_TIMES_S = {0: 0.05, 1: 0.06}
# (dashboard, panel title) -> what produces its data. Each needs a training run.
NEEDS_TRAINING = {
    ("overview", "Capture stall p50 / p99"): "captures",
    ("overview", "Capture-to-commit latency p50 / p99"): "commits",
    ("faults", "Recoveries by outcome"): "a recovery",
    ("faults", "Recovery phase p90"): "a recovery",
    ("faults", "Mean phase duration over the time range"): "a recovery",
    ("faults", "Plan changes by kind"): "a plan change",
    ("faults", "Straggler flags"): "straggler detection over several ranks",
    ("storage", "Shards by state"): "committed steps",
    ("storage", "Coder throughput"): "erasure coding of captures",
    ("storage", "Coder speed while busy"): "erasure coding of captures",
    ("storage", "S3 latency p50 / p99 by operation"): "parity_to = s3",
    ("storage", "S3 errors by operation and code"): "a failing S3 request",
    ("storage", "Peer transfer errors"): "a failing peer transfer",
}
# Queries of a multi-query panel that need the same (the panel itself has data).
NEEDS_TRAINING_QUERIES = {
    ("storage", "Shards repaired and scrub errors", "B"): "a checksum mismatch",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], object], deadline_s: float = DEADLINE_S) -> object:
    """Poll `check` until it returns something truthy, or fail naming `what`."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            result = check()
        except (OSError, urllib.error.URLError, grpc.RpcError):
            result = None
        if result:
            return result
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(0.2)  # polling interval of a deadline-bound wait, not synchronisation


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def daemon() -> Iterator[dict]:
    """A `stalwart daemon` process on free loopback ports."""
    root = Path(tempfile.mkdtemp(prefix="stw-", dir="/tmp"))  # short: Unix socket path limit
    grpc_port, metrics_port = free_port(), free_port()
    stalwart = shutil.which("stalwart", path=str(Path(sys.executable).parent)) or "stalwart"
    process = subprocess.Popen(
        [stalwart, "daemon", "--listen", f"127.0.0.1:{grpc_port}",
         "--metrics-port", str(metrics_port), "--data-dir", str(root / "data"),
         "--node", "scrape-test", "--log-format", "text"],
        stdout=subprocess.DEVNULL, stderr=open(root / "daemon.log", "w"))  # noqa: SIM115
    info = {"address": f"127.0.0.1:{grpc_port}", "metrics": f"127.0.0.1:{metrics_port}",
            "socket": root / "data" / "daemon.sock", "log": root / "daemon.log"}
    try:
        wait_for("the daemon's /metrics endpoint", lambda: urllib.request.urlopen(
            f"http://{info['metrics']}/metrics", timeout=2).status == 200)
        yield info
    finally:
        stop(process)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus(daemon: dict) -> Iterator[str]:
    """A Prometheus server scraping the daemon every second; yields its base URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed; run scripts/install-system-deps.sh")
    root = Path(tempfile.mkdtemp(prefix="stw-prom-"))
    (root / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "stalwart",
                            "static_configs": [{"targets": [daemon["metrics"]]}]}],
    }))
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={root / 'prometheus.yml'}",
         f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(root / "prometheus.log", "w"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("Prometheus to become ready",
                 lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200)
        yield url
    finally:
        stop(process)
        shutil.rmtree(root, ignore_errors=True)


def query(url: str, expr: str) -> list[dict]:
    """Instant query; the series that carry a number (NaN is no data for a panel)."""
    body = get_json(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", body
    return [s for s in body["data"]["result"] if not math.isnan(float(s["value"][1]))]


@pytest.fixture(scope="module")
def ranks(daemon: dict) -> Iterator[None]:
    """Two ranks heartbeating from a thread, a third whose process died, a refused caller."""
    channel = grpc.insecure_channel(f"unix:{daemon['socket']}")
    stub = rank_pb2_grpc.RankServiceStub(channel)
    wait_for("the daemon's Unix socket", lambda: daemon["socket"].exists())
    # The daemon knows a rank by its process: each stand-in rank gets one to watch.
    processes = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                  stdin=subprocess.PIPE) for _ in range(len(STEP_TIMES_S) + 1)]
    replies = {rank: stub.Register(rank_pb2.RegisterRequest(
        job_id="default", pid=processes[rank].pid, rank=rank, world_size=3,
        hostname="localhost", device="cpu"), timeout=10) for rank in STEP_TIMES_S}
    doomed = processes[-1]
    stub.Register(rank_pb2.RegisterRequest(job_id="default", pid=doomed.pid, rank=2,
                                           world_size=3, device="cpu"), timeout=10)
    doomed.kill()
    with pytest.raises(grpc.RpcError):  # a caller from another job is refused and counted
        stub.Register(rank_pb2.RegisterRequest(job_id="other-job", pid=os.getpid(), rank=0),
                      timeout=10)
    stopping = threading.Event()

    def heartbeat() -> None:
        step = 0
        while not stopping.wait(0.5):  # a rank's heartbeat period
            step += 1
            for rank, reply in replies.items():
                stub.Heartbeat(rank_pb2.HeartbeatRequest(
                    rank_id=reply.rank_id, generation=reply.generation, step=step,
                    step_time_s=STEP_TIMES_S[rank]), timeout=10)

    beater = threading.Thread(target=heartbeat, name="ranks", daemon=True)
    beater.start()
    try:
        yield
    finally:
        stopping.set()
        beater.join(timeout=10)
        channel.close()
        for process in processes:
            process.kill()
            process.wait(timeout=10)


def store_a_shard(daemon: dict, step: int) -> None:
    """Act as a peer daemon putting one shard (stored bytes, peer latency)."""
    async def put() -> None:
        client = ShardClient(daemon["address"], job_id="default")
        try:
            await client.put(f"s{step}-r0-c0-k0", b"\x01" * 65536, step=step, generation=1)
        finally:
            await client.close()
    asyncio.run(put())


def expects_data(q: PanelQuery) -> bool:
    return ((q.dashboard, q.panel) not in NEEDS_TRAINING
            and (q.dashboard, q.panel, q.ref_id) not in NEEDS_TRAINING_QUERIES)


def queries_without_data(daemon: dict, prometheus: str, dashboards: tuple[str, ...]) -> list[str]:
    """Poll each expected panel query until it has data; what is still empty at the deadline."""
    pending = {q: concrete(q.expr, WINDOW) for q in panel_queries(dashboards) if expects_data(q)}
    steps = iter(range(1, 100_000))

    def all_answered() -> bool:
        store_a_shard(daemon, next(steps))  # peer traffic, so its rates are not zero
        for q, expr in list(pending.items()):
            if query(prometheus, expr):
                del pending[q]
        return not pending

    end = time.monotonic() + DEADLINE_S
    while not all_answered() and time.monotonic() < end:
        time.sleep(0.5)  # polling interval of a deadline-bound wait
    return [f"{q.dashboard} / {q.panel} [{q.ref_id}]: {q.expr}" for q in pending]


def test_every_panel_query_returns_data_from_a_scraped_daemon(
        daemon: dict, prometheus: str, ranks: None) -> None:
    missing = queries_without_data(daemon, prometheus, DASHBOARDS)
    assert not missing, "panels without data:\n" + "\n".join(missing)


def test_render_script_draws_the_overview_from_live_data(
        daemon: dict, prometheus: str, ranks: None, tmp_path: Path) -> None:
    assert not queries_without_data(daemon, prometheus, ("overview",))
    out = tmp_path / "overview.png"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_dashboard.py"), "--prometheus",
         prometheus, "--out", str(out), "--minutes", "1"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = int(re.search(r"\((\d+) panels with data\)", result.stdout).group(1))
    overview = {q.panel for q in panel_queries(("overview",))}
    assert drawn == len(overview - {p for d, p in NEEDS_TRAINING if d == "overview"})


def test_step_time_panel_shows_each_rank_with_its_reported_time(
        prometheus: str, ranks: None) -> None:
    (step_time,) = [q for q in panel_queries(("overview",)) if q.panel == "Step time per rank"]
    series = wait_for("step time of both ranks", lambda: (
        found if len(found := query(prometheus, concrete(step_time.expr))) == 2 else None))
    assert sorted(float(s["value"][1]) for s in series) == sorted(STEP_TIMES_S.values())


def test_the_dead_rank_is_counted_as_a_failure_by_kind(prometheus: str, ranks: None) -> None:
    failures = wait_for("a failure in Prometheus", lambda: query(
        prometheus, "sum by (kind) (stalwart_failures_detected_total) > 0"))
    assert {s["metric"]["kind"] for s in failures} == {"process_exit"}
