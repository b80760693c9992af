"""A job that stopped for want of a spare resumes by itself, with nothing restarted,
once a spare registers: the survivor waits at the stop, the spare takes the lost role,
and the run ends bitwise as the uninterrupted one. Real daemons and rank processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_recovery_e2e import MICRO, STEPS, uninterrupted

from stalwart.client.local_cluster import LocalCluster, Node, RankProc, wait_until


def status_json(node: Node) -> dict:
    done = subprocess.run([sys.executable, "-m", "stalwart.cli", "status", "--json",
                           "--socket", str(node.socket)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)

pytestmark = pytest.mark.multiprocess


def stopping_job(resume_wait_s: float) -> dict:
    """dp=2 on two nodes, no spare, no shrinking: killing rank 1 once step 4 is committed
    stops it (a kill before any commit would stop it at the start, with nothing stored)."""
    return {"model": "tiny", "model_overrides": json.loads(MICRO),
            "train": {"global_batch": 4, "seed": 0}, "layout": {"dp": 2, "pp": 1, "tp": 1},
            "steps": STEPS, "collective_timeout_s": 4.0, "resume_wait_s": resume_wait_s,
            "faults": [{"kind": "kill", "target": "rank", "index": 1, "step": 4,
                        "committed": True}]}


def start_until_stopped(cluster: LocalCluster, spec: dict) -> tuple[Node, Any]:
    """Start `spec` on `cluster`; its coordinator and the stop plan once it came."""
    cluster.start_daemons()
    cluster.launch(spec, world=2, ranks_per_node=1)
    coordinator = cluster.coordinator()
    assert coordinator is not None
    stop = wait_until(lambda: (st := coordinator.status()) is not None and st.plan.stop
                      and st.plan, 120, "the stop after rank 1 is killed")
    return coordinator, stop


def launched_again(cluster: LocalCluster, spec: dict) -> list[RankProc]:
    """Once every rank of `spec` has ended, its ranks started again without faults, next
    to the same daemons; they have finished when this returns."""
    wait_until(lambda: not cluster.running(), 60, "every rank to end")
    first = list(cluster.ranks)
    cluster.launch({**spec, "faults": []}, world=2, ranks_per_node=1)
    again = [r for r in cluster.ranks if r not in first]
    wait_until(lambda: all((res := r.result()) and res.get("result") for r in again),
               180, "the ranks started again to finish")
    return again


def test_a_stopped_job_resumes_when_a_spare_registers(tmp_path: Path) -> None:
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "stop",
                           daemon_settings={"elastic": {"shrink": False}})
    try:
        coordinator, stop = start_until_stopped(cluster, stopping_job(300.0))
        survivor = next(r for r in cluster.ranks if r.rank == 0)
        assert "by itself" in stop.stop_message and len(stop.lost) == 1
        # The survivor waits at the stop instead of leaving.
        assert survivor.proc.poll() is None and survivor.result() is None
        while_stopped = status_json(coordinator)
        cluster.add_spares(1, node=1)
        resumed = wait_until(lambda: (st := coordinator.status()) is not None
                             and st.generation > stop.generation and not st.plan.stop
                             and st.plan, 120, "the plan that resumes the job")
        wait_until(lambda: len([r for r in cluster.ranks if (res := r.result())
                                and res.get("result")]) == 2, 180, "both roles to finish")
        results = [r.result()["result"] for r in cluster.ranks
                   if r.result() and r.result().get("result")]
        changes = [c.reason for c in coordinator.status().plan_changes]
        at_end = status_json(coordinator)
    finally:
        cluster.close()
    assert resumed.resume_step == stop.resume_step >= 4
    heir = next(a.rank_id for a in resumed.assignments if not a.spare and a.coord.rank == 1)
    assert heir not in stop.lost and heir not in {a.rank_id for a in stop.assignments}
    assert any("resumed after the stop" in c for c in changes), changes
    # `stalwart status` tells the story: stopped with the killed rank dead (no stale
    # step), then the spare that took the lost role listed as rank 1.
    assert while_stopped["plan"]["stop"] and while_stopped["committed_step"] == stop.resume_step
    [lost] = stop.lost
    ranks = {r["rank_id"]: r for r in while_stopped["ranks"]}
    assert ranks[lost]["state"] == "dead" and ranks[lost]["step"] is None
    assert "protection" in while_stopped["storage"]
    final = {r["rank_id"]: r for r in at_end["ranks"]}
    assert at_end["plan"]["completed"] and final[heir]["rank"] == 1
    assert final[heir]["coord"] == {"dp": 1, "pp": 0, "tp": 0}
    baseline = uninterrupted(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "1",
                             "--global-batch", "4")
    assert {r["param_digest"] for r in results} == {baseline["param_digest"]}


def test_a_stopped_job_whose_ranks_left_resumes_when_its_ranks_are_started_again(
        tmp_path: Path) -> None:
    # The ranks do not wait (resume_wait_s 0): all of them leave at the stop. Starting
    # the job's ranks again, next to the same daemons, resumes it from the stop's step.
    spec = stopping_job(0.0)
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "again",
                           daemon_settings={"elastic": {"shrink": False}})
    try:
        _, stop = start_until_stopped(cluster, spec)
        again = launched_again(cluster, spec)
        resumed = [g for r in again for g in r.result()["generations"]]
        digests = {r.result()["result"]["param_digest"] for r in again}
    finally:
        cluster.close()
    assert {g["resume_step"] for g in resumed} == {stop.resume_step}
    baseline = uninterrupted(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "1",
                             "--global-batch", "4")
    assert digests == {baseline["param_digest"]}


def test_a_job_whose_every_rank_was_killed_resumes_at_full_size_when_relaunched(
        tmp_path: Path) -> None:
    # Shrinking is on (the default). The deaths reach the coordinator one by one, so the
    # job may shrink before it stops; the relaunched ranks register one by one too.
    # Resuming on the first of them would train on a smaller layout and widen again as
    # the other came: the job resumes once, in its launched layout, from the stop's
    # step, and ends bitwise as the uninterrupted run.
    spec = {**stopping_job(0.0), "faults": [{"kind": "kill", "target": "all", "index": -1,
                                             "step": 4, "committed": True}]}
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "all")
    try:
        _, stop = start_until_stopped(cluster, spec)
        again = launched_again(cluster, spec)
        generations = [r.result()["generations"] for r in again]
        digests = {r.result()["result"]["param_digest"] for r in again}
    finally:
        cluster.close()
    assert [[(g["resume_step"], g["layout"]["dp"]) for g in gens] for gens in generations] \
        == [[(stop.resume_step, 2)]] * 2, generations
    baseline = uninterrupted(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "1",
                             "--global-batch", "4")
    assert digests == {baseline["param_digest"]}
