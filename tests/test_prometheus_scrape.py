"""A real Prometheus scrapes the daemons of a real training run with a fault.

Two daemons (parity on peers and on SeaweedFS S3) serve /metrics; a dp=2 x pp=2
tiny GPT trains with a spare while rank 1 is SIGKILLed after step 4, and a caller
of the wrong job is refused. Then every dashboard panel's query, asked over the
run as Grafana would, must return data; NO_DATA_WITHOUT names the few panels
that only a fault this run does not inject can fill.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from dashboard_queries import DASHBOARDS, ROOT, PanelQuery, concrete, panel_queries
from fixtures_s3 import ACCESS_KEY, BUCKET, REGION, SECRET_KEY

from stalwart.client.local_cluster import LocalCluster
from stalwart.client.ports import free_port
from stalwart.v1 import rank_pb2, rank_pb2_grpc

# The module's run trains five processes beside two daemons and Prometheus: it runs
# with the multiprocess tests, one at a time, never beside another test.
pytestmark = pytest.mark.multiprocess

sys.path.insert(0, str(ROOT / "scripts"))
from demo_dashboard import (  # noqa: E402
    SMALLEST,
    roles_done,
    start_prometheus,
    stop,
    tiny_spec,
    wait,
)
from prometheus_api import range_query  # noqa: E402

# Every phase of the run (the killed rank's life, the spare's role, generation 2) lasts
# many scrapes: a leaving rank's series are dropped, and recovery can take well under a
# second. At about 0.05 s a step, 30 steps are 1.5 s, six 0.25 s scrapes at the least.
STEPS, KILL_STEP, WORLD = 120, 30, 4
SCRAPE_S = 0.25
RUN_DEADLINE_S = 240.0
QUERY_DEADLINE_S = 20.0
WINDOW = "5s"  # rate windows: twenty scrapes
# (dashboard, panel title) -> the fault its data needs, which this run does not inject.
NO_DATA_WITHOUT = {
    ("storage", "S3 errors by operation and code"): "a failing S3 request",
    ("storage", "Peer transfer errors"): "a failing shard transfer (a lost daemon)",
}


@dataclass(frozen=True)
class Run:
    cluster: LocalCluster
    prometheus: str
    start: float  # Unix seconds
    end: float


def refuse_a_caller_of_another_job(socket: Path) -> None:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = rank_pb2_grpc.RankServiceStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.Register(rank_pb2.RegisterRequest(job_id="other-job", pid=os.getpid(), rank=0),
                          timeout=10)


@pytest.fixture(scope="module")
def run(s3_server, tmp_path_factory) -> Iterator[Run]:
    """The training run, finished, with Prometheus still serving what it scraped."""
    s3 = {"endpoint": s3_server.endpoint, "bucket": BUCKET, "prefix": f"scrape-{os.getpid()}",
          "region": REGION}
    cluster = LocalCluster(nodes=2, metrics=True,
                           daemon_settings={"s3": s3, "erasure": {"parity_to": "both"}},
                           env={"AWS_ACCESS_KEY_ID": ACCESS_KEY,
                                "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    prometheus = None
    try:
        cluster.start_daemons()
        port = free_port()
        prometheus = start_prometheus([f"127.0.0.1:{n.metrics_port}" for n in cluster.daemons],
                                      tmp_path_factory.mktemp("prometheus"), port, SCRAPE_S)
        start = time.time()
        spec = tiny_spec(STEPS, kill_rank=1, kill_step=KILL_STEP, overrides=SMALLEST)
        cluster.launch(spec, WORLD, spares=1)
        refuse_a_caller_of_another_job(cluster.daemons[0].socket)
        wait(f"training to finish (logs in {cluster.workdir})",
             lambda: roles_done(cluster, STEPS, WORLD), RUN_DEADLINE_S)
        yield Run(cluster, f"http://127.0.0.1:{port}", start, time.time())
    finally:
        if prometheus is not None:
            stop(prometheus)
        cluster.close()


def poll(run: Run, expr: str) -> list[dict]:
    """Ask over the run until an answer comes (the last scrape may still be due)."""
    try:
        return wait(f"data for {expr}", lambda: range_query(run.prometheus, expr, run.start,
                                                            time.time(), SCRAPE_S),
                    QUERY_DEADLINE_S)
    except TimeoutError:
        return []


def expects_data(q: PanelQuery) -> bool:
    return (q.dashboard, q.panel) not in NO_DATA_WITHOUT


def queries_without_data(run: Run, dashboards: tuple[str, ...]) -> list[str]:
    return [f"{q.dashboard} / {q.panel} [{q.ref_id}]: {q.expr}"
            for q in panel_queries(dashboards)
            if expects_data(q) and not poll(run, concrete(q.expr, WINDOW))]


def test_every_panel_query_returns_data_from_a_training_run_with_a_fault(run: Run) -> None:
    missing = queries_without_data(run, DASHBOARDS)
    assert not missing, "panels without data:\n" + "\n".join(missing)


def test_render_script_draws_every_overview_panel_from_the_run(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "overview.png"
    minutes = (time.time() - run.start) / 60
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_dashboard.py"), "--prometheus",
         run.prometheus, "--out", str(out), "--minutes", f"{minutes:.3f}"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    overview = {q.panel for q in panel_queries(("overview",))}
    assert f"({len(overview)} panels with data)" in result.stdout


def test_step_time_panel_shows_every_rank_that_trained(run: Run) -> None:
    (step_time,) = [q for q in panel_queries(("overview",)) if q.panel == "Step time per rank"]
    series = poll(run, concrete(step_time.expr))
    # Four ranks of the first generation, then the spare in place of the killed rank:
    # Prometheus scraped before the launch, so even the killed rank's short life shows.
    launched = {f"{r.node.name}/{r.proc.pid}" for r in run.cluster.ranks}
    assert len(launched) == WORLD + 1
    shown = {s["metric"]["rank"] for s in series}
    assert shown == launched, f"launched {sorted(launched)}, the panel shows {sorted(shown)}"
    # A spare reports 0 until it gets a role; the killed rank may die between two scrapes.
    finished = {f"{r.node.name}/{r.proc.pid}" for r in run.cluster.ranks if r.proc.poll() == 0}
    timed = {s["metric"]["rank"] for s in series
             if any(float(v) > 0 for _, v in s["values"])}
    assert len(finished) == WORLD and finished <= timed


def test_the_killed_rank_is_counted_as_a_process_exit(run: Run) -> None:
    failures = poll(run, "sum by (kind) (stalwart_failures_detected_total) > 0")
    assert "process_exit" in {s["metric"]["kind"] for s in failures}


def test_the_recovery_shows_a_new_generation_and_its_phases(run: Run) -> None:
    generation = poll(run, "max(stalwart_generation)")
    seen = {float(v) for _, v in generation[0]["values"]}
    # 1, then 2 after the replacement; 3 is the completion once the last step commits.
    assert 2.0 in seen and seen <= {1.0, 2.0, 3.0}
    # A restore reads state only when a step committed before the kill (load-dependent).
    phases = poll(run, "sum by (phase) (stalwart_recovery_phase_seconds_count) > 0")
    assert "plan" in {s["metric"]["phase"] for s in phases}
    # The counter child exists at 0 before the re-plan, so its increase is seen.
    assert poll(run, f'sum(increase(stalwart_plan_changes_total{{kind="replace"}}[{WINDOW}])) > 0')


def test_committed_steps_are_protected_against_a_node_loss(run: Run) -> None:
    margin = poll(run, "min(stalwart_protection_margin_nodes)")
    assert float(margin[0]["values"][-1][1]) >= 1
    shards = poll(run, 'sum by (state) (stalwart_shards{state="healthy"}) > 0')
    assert shards, "no healthy shards were counted"
