"""Failures injected into real clusters (daemons + rank processes): nothing committed is
lost and training continues. Each test runs `stalwart demo` as a user would and reads
its JSON summary."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.client.local_cluster import LocalCluster, wait_until
from stalwart.v1 import common_pb2

pytestmark = pytest.mark.multiprocess

MICRO = json.dumps({"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16})
STEPS = 10


def demo(tmp_path: Path, *args: str, steps: int = STEPS) -> tuple[int, dict]:
    out = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
    cmd = [sys.executable, "-m", "stalwart.cli", "demo", "--model-overrides", MICRO,
           "--steps", str(steps), "--collective-timeout", "4", "--timeout", "240",
           "--json", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"no summary; demo said:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(out.read_text())


_baselines: dict[tuple[str, ...], dict] = {}


def uninterrupted(tmp_path: Path, *layout: str) -> dict:
    """The same job without faults (and without spares), run once per layout."""
    if layout not in _baselines:
        code, summary = demo(tmp_path, *layout, "--spares", "0", "--no-faults")
        assert code == 0 and summary["completed"], summary
        _baselines[layout] = summary
    return _baselines[layout]


def assert_recovered(summary: dict, baseline: dict, recoveries: int) -> None:
    assert summary["completed"], summary
    assert summary["lost_steps"] == 0
    assert len(summary["recoveries"]) == recoveries, summary["recoveries"]
    # With spares the layout never changes: the run is bitwise the uninterrupted one.
    assert summary["losses"] == baseline["losses"]
    assert summary["param_digest"] == baseline["param_digest"]


def test_a_killed_rank_in_each_pipeline_stage_is_replaced(tmp_path: Path) -> None:
    layout = ("--nodes", "3", "--ranks-per-node", "1", "--dp", "1", "--pp", "3",
              "--global-batch", "6")
    work = tmp_path / "stages"
    code, summary = demo(tmp_path, *layout, "--spares", "3", "--kill", "rank:0@step:3",
                         "--kill", "rank:1@step:5", "--kill", "rank:2@step:7",
                         "--workdir", str(work))
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 3)
    waits = land_waits(work)
    for r in summary["recoveries"]:
        # Every role fetched its state while it built its groups.
        assert r["resume_step"] == 0 or r["restored_ahead"] == r["roles"] > 0, r
        # The killed rank's daemon had taken in its capture of step N - 1 (the copy of
        # step N runs during step N + 1) or of step N.
        assert r["captured_step"] is not None and 1 <= r["captured_step"] <= r["fault_step"], r
        if r["resume_step"] >= r["captured_step"]:
            continue  # that step was not trained again
        # Redone only after the coordinator gave it the training it saves: on a loaded
        # machine its storing can take longer than the steps themselves.
        wait = waits.get(r["captured_step"])
        assert wait is not None, (r, waits)
        assert not wait["committed"] and wait["waited_s"] >= wait["worth_s"], (r, wait)


def land_waits(workdir: Path) -> dict[int, dict]:
    """Each coordinator's wait for a failed rank's captured step to commit before it
    re-planned, by step, from the daemons' logs."""
    waits = {}
    for log in workdir.glob("node-*/daemon.log"):
        for line in log.read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("msg", "").endswith("before re-planning"):
                waits[record["step"]] = {
                    "committed": record["msg"].startswith("captured step committed"),
                    "waited_s": record["waited_s"], "worth_s": record["worth_s"]}
    return waits


def test_a_tp_group_that_lost_a_rank_is_replaced_by_spares_on_one_node(tmp_path: Path) -> None:
    # The demo starts --tp spares to a node: the two spares (both on node-2) take the
    # place of the TP group on node-0 together, its survivor becoming a spare. A spare
    # beside the survivor would keep the group on one node too; one on another node
    # would stretch the group across nodes. The layout and its stage bounds hold: the
    # spares restore their roles' own snapshots, not a re-partitioned model.
    layout = ("--nodes", "3", "--ranks-per-node", "2", "--dp", "1", "--pp", "2", "--tp", "2")
    code, summary = demo(tmp_path, *layout, "--spares", "2", "--kill", "rank:1@step:4")
    assert code == 0
    assert summary["layout"] == {"dp": 1, "pp": 2, "tp": 2}
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)
    reason = summary["recoveries"][0]["reason"]
    assert reason.startswith("replace") and "became a spare" in reason, reason


def test_a_killed_node_is_replaced_from_its_peers_shards(tmp_path: Path) -> None:
    layout = ("--nodes", "3", "--ranks-per-node", "1", "--dp", "2", "--pp", "1")
    # Spares land on node-2 and node-1; node-1 dies with its rank and spare.
    code, summary = demo(tmp_path, *layout, "--spares", "2", "--kill", "node:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)


def test_a_relay_of_the_commit_tree_killed_with_its_node_is_routed_around(
        tmp_path: Path) -> None:
    """With commit_fanout 1 the daemons form a chain under the coordinator (node-0):
    node-3's prepares go up through node-2 and node-1, node-0's commits down the same way.
    node-2 dies with its rank once step 4 is committed (so the chain has carried
    commits both ways): its neighbours route around it, the spare on
    node-4 takes its role, the chain re-forms without it, and the run is bitwise the one
    whose daemons all talk to the coordinator directly."""
    layout = ("--nodes", "5", "--ranks-per-node", "1", "--dp", "4", "--pp", "1")
    work = tmp_path / "chain"
    code, summary = demo(tmp_path, *layout, "--commit-fanout", "1", "--spares", "1",
                         "--kill", "node:2@commit:4", "--workdir", str(work))
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)

    def told(node: str, msg: str, key: str) -> list:
        lines = (work / node / "daemon.log").read_text().splitlines()
        events = [json.loads(x) for x in lines if x.startswith("{")]
        return [e[key] for e in sorted((e for e in events if e.get("msg") == msg),
                                       key=lambda e: e["generation"])]

    assert told("node-3", "prepares go up the commit tree", "parent") == ["node-2", "node-1"]
    assert told("node-1", "commits go on down the commit tree", "children") == [
        ["node-2"], ["node-3"]]
    assert told("node-4", "prepares go up the commit tree", "parent") == ["node-3"]


def test_a_hung_rank_is_fenced_and_replaced(tmp_path: Path) -> None:
    layout = ("--nodes", "2", "--dp", "2", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--hang", "rank:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)
    # The hang was seen as one (its peer's collective timed out), and the hung process,
    # alive and heartbeating, was ended by its daemon when the new plan left it out.
    assert "collective_hang" in {d["kind"] for d in summary["detected"]}
    assert summary["exits"]["rank1"] == -9


def test_a_rank_whose_training_raises_is_replaced_without_waiting_for_a_timeout(
        tmp_path: Path) -> None:
    """Rank 1's training raises (a bug in its code) after step 4. It does not tell its
    daemon it leaves cleanly, so its exit is seen as the failure it is and the spare
    takes its role at once. Had it said it left, rank 0 would have waited in its
    all-reduce until the collective timeout and been reported as hung."""
    layout = ("--nodes", "2", "--dp", "2", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--error", "rank:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)
    rank1 = f"node-{summary['rank_nodes']['rank1']}/{summary['pids']['rank1']}"
    detected = [(d["subject"], d["kind"]) for d in summary["detected"]]
    assert (rank1, "process_exit") in detected, detected
    # It told its daemon what it raised before exiting: the exit's report names it.
    assert any(d["subject"] == rank1 and "after raising InjectedError" in d["evidence"]
               for d in summary["detected"]), summary["detected"]
    assert "collective_hang" not in {kind for _, kind in detected}, detected
    assert summary["exits"]["rank1"] not in (0, None, -9), summary["exits"]


def test_an_nvml_gpu_fault_replaces_the_rank_on_that_gpu(tmp_path: Path) -> None:
    layout = ("--nodes", "2", "--dp", "2", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--gpu-fault", "rank:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)
    # The daemon's GPU monitor saw the Xid on rank 1's device (not only the collective
    # timeout that a stalled rank also causes).
    rank1 = f"node-{summary['rank_nodes']['rank1']}/{summary['pids']['rank1']}"
    assert {"subject": rank1, "kind": "gpu_fault"} in [
        {k: d[k] for k in ("subject", "kind")} for d in summary["detected"]]


def test_a_second_failure_during_recovery_is_folded_in(tmp_path: Path) -> None:
    """Rank 0 dies; while generation 2 is still restoring, the spare that took its role
    is SIGKILLed too: one decision folds both in (generation 1 -> 3, the second spare
    takes the role) and the run ends bitwise as the uninterrupted one."""
    spec = {"model": "tiny", "model_overrides": json.loads(MICRO),
            "train": {"global_batch": 4, "seed": 0}, "layout": {"dp": 2, "pp": 1, "tp": 1},
            "steps": STEPS, "collective_timeout_s": 4.0,
            "faults": [{"kind": "kill", "target": "rank", "index": 0, "step": 4}]}
    # Rank 1 stays frozen through both decisions; a heartbeat timeout longer than any
    # loaded machine's recovery keeps it a survivor (its peers' deaths are seen as
    # process exits, which need no heartbeat).
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "fold",
                           daemon_settings={"heartbeat_timeout_s": 60.0})
    cluster.env["STALWART_FAULT_LOG"] = str(tmp_path)  # rank 0 says when it kills itself
    try:
        cluster.start_daemons()
        cluster.launch(spec, world=2, spares=2, ranks_per_node=1)
        coordinator = cluster.coordinator()
        survivor = next(r for r in cluster.ranks if r.rank == 1)
        # Generation 2 cannot train its first step while rank 1 is frozen, so the heir
        # dies while the recovery is still in flight. It
        # is frozen the moment rank 0 dies: a recovery takes a tenth of a second here.
        wait_until(lambda: next(tmp_path.glob("fault-*.json"), None), 120,
                   "rank 0 to kill itself", every_s=0.002)
        survivor.proc.send_signal(signal.SIGSTOP)

        def second_generation() -> common_pb2.Plan | None:
            st = coordinator.status()
            return st.plan if st is not None and st.generation == 2 else None

        try:
            plan = wait_until(second_generation, 60, "the plan that replaces rank 0")
            heir = next(a.rank_id for a in plan.assignments
                        if not a.spare and a.coord.rank == 0)
            victim = next(r for r in cluster.ranks if heir.endswith(f"/{r.proc.pid}"))
            victim.proc.send_signal(signal.SIGKILL)
            wait_until(lambda: (st := coordinator.status()) is not None and st.generation >= 3,
                       60, "the decision that folds the heir's death in")
        finally:
            survivor.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: len([r for r in cluster.ranks if (res := r.result())
                                and res.get("result")]) == 2, 180, "both roles to finish")
        changes = [c.reason for c in coordinator.status().plan_changes]
        digests = {r.result()["result"]["param_digest"] for r in cluster.ranks
                   if r.result() and r.result().get("result")}
    finally:
        cluster.close()
    assert any("generation 1 -> 3" in c for c in changes), changes  # folded: one decision
    baseline = uninterrupted(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "1",
                             "--global-batch", "4")
    assert digests == {baseline["param_digest"]}


def test_the_coordinator_killed_during_recovery_is_succeeded(tmp_path: Path) -> None:
    layout = ("--nodes", "3", "--ranks-per-node", "1", "--dp", "2", "--pp", "1")
    # rank 1 (node-1) dies, and at the same step node-0 — the coordinator — with rank 0.
    code, summary = demo(tmp_path, *layout, "--spares", "2", "--kill", "rank:1@step:4",
                         "--kill", "node:0@step:4")
    assert code == 0, summary
    baseline = uninterrupted(tmp_path, *layout)
    assert summary["completed"] and summary["lost_steps"] == 0
    assert summary["param_digest"] == baseline["param_digest"]


def test_an_etcd_elected_coordinator_killed_mid_run_is_succeeded(tmp_path: Path,
                                                                 etcd: str) -> None:
    layout = ("--nodes", "3", "--ranks-per-node", "1", "--dp", "2", "--pp", "1")
    # Whichever daemon won the etcd seat dies with what runs on it: a training rank (the
    # survivor who takes the seat re-plans with a spare) or only a spare (node-2; no
    # re-plan, but the shards and prepares it should have taken go elsewhere). Either
    # way the run ends as if nothing broke.
    code, summary = demo(tmp_path, *layout, "--spares", "2", "--etcd", etcd,
                         "--kill", "coordinator@step:4")
    assert code == 0, summary
    first, *later = summary["coordinators"]
    assert later and later[-1] != first, summary["coordinators"]
    hosted_a_rank = first != "node-2"  # ranks 0 and 1 live on node-0 and node-1
    assert [r["kind"] for r in summary["recoveries"]] == (
        [f"kill node:{first.removeprefix('node-')}"] if hosted_a_rank else [])
    baseline = uninterrupted(tmp_path, *layout)
    assert summary["completed"] and summary["lost_steps"] == 0
    assert summary["param_digest"] == baseline["param_digest"]


def test_a_successor_coordinator_shrinks_when_the_lost_node_took_more_ranks_than_spares(
        tmp_path: Path, etcd: str) -> None:
    # The demo's default 2 nodes x 2 ranks (dp=2 pp=2) and one spare: the seat holder's
    # node takes two ranks, one spare cannot fill both roles. The successor decides with
    # the layer profile its own ranks registered (it need not wait for re-announcements)
    # and shrinks onto the survivors.
    code, summary = demo(tmp_path, "--etcd", etcd, "--kill", "coordinator@step:4",
                         steps=12)
    assert code == 0, summary
    assert summary["completed"] and summary["lost_steps"] == 0 and not summary["stopped"]
    (recovery,) = summary["recoveries"]
    assert recovery["reason"].startswith("shrink dp=2 pp=2 tp=1 ->"), recovery


def test_without_a_spare_the_job_stops_at_the_last_committed_step(tmp_path: Path) -> None:
    code, summary = demo(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "1", "--spares", "0",
                         "--no-shrink", "--kill", "rank:1@step:4")
    assert code == 1 and not summary["completed"]
    assert summary["lost_steps"] == 0
    assert "Training stops at the last committed step" in summary["stopped"]
    assert "spare" in summary["stopped"]


def test_a_hang_of_a_jobs_only_rank_is_detected_as_a_stall_and_replaced(tmp_path: Path) -> None:
    # No peer's collective can time out on it: its daemon sees it heartbeat without steps.
    layout = ("--nodes", "2", "--ranks-per-node", "1", "--dp", "1", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--hang", "rank:0@step:3")
    assert code == 0, summary
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)
    assert "stalled" in {d["kind"] for d in summary["detected"]}
    assert summary["exits"]["rank0"] == -9  # ended by its daemon
