"""Failures injected into real clusters (daemons + rank processes): nothing committed is
lost and training continues. Each test runs `stalwart demo` as a user would and reads
its JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    code, summary = demo(tmp_path, *layout, "--spares", "3", "--kill", "rank:0@step:3",
                         "--kill", "rank:1@step:5", "--kill", "rank:2@step:7")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 3)


def test_a_killed_node_is_replaced_from_its_peers_shards(tmp_path: Path) -> None:
    layout = ("--nodes", "3", "--ranks-per-node", "1", "--dp", "2", "--pp", "1")
    # Spares land on node-2 and node-1; node-1 dies with its rank and spare.
    code, summary = demo(tmp_path, *layout, "--spares", "2", "--kill", "node:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)


def test_a_hung_rank_is_fenced_and_replaced(tmp_path: Path) -> None:
    layout = ("--nodes", "2", "--dp", "2", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--hang", "rank:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)


def test_an_nvml_gpu_fault_replaces_the_rank_on_that_gpu(tmp_path: Path) -> None:
    layout = ("--nodes", "2", "--dp", "2", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--gpu-fault", "rank:1@step:4")
    assert code == 0
    assert_recovered(summary, uninterrupted(tmp_path, *layout), 1)


def test_a_second_failure_during_recovery_is_folded_in(tmp_path: Path) -> None:
    layout = ("--nodes", "2", "--dp", "2", "--pp", "1")
    code, summary = demo(tmp_path, *layout, "--spares", "2", "--kill", "rank:0@step:4",
                         "--kill", "rank:1@step:5")
    assert code == 0
    baseline = uninterrupted(tmp_path, *layout)
    assert summary["completed"] and summary["lost_steps"] == 0
    assert summary["param_digest"] == baseline["param_digest"]


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


def test_without_a_spare_the_job_stops_at_the_last_committed_step(tmp_path: Path) -> None:
    code, summary = demo(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "1", "--spares", "0",
                         "--no-shrink", "--kill", "rank:1@step:4")
    assert code == 1 and not summary["completed"]
    assert summary["lost_steps"] == 0
    assert "Training stops at the last committed step" in summary["stopped"]
    assert "spare" in summary["stopped"]
