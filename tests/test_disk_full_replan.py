"""A node whose disk stays full does not hold back the job's protection for good.

Its daemon cannot store its ranks' captures, so no step commits. Once the refusals have
lasted `[snapshot] disk_full_replan_s`, the daemon reports its ranks STORAGE_FULL: the
coordinator gives their roles to spares on other nodes (never to a spare on the full
node), and steps commit again.

Real daemons and rank processes; node-1's data_dir is a tmpfs, filled before the job
starts and never freed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from stalwart.client.chaos_faults import fill, mount_tmpfs, unmount
from stalwart.client.local_cluster import LocalCluster, wait_until

pytestmark = pytest.mark.multiprocess

STEPS = 30
SPEC = {"model": "tiny",
        "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
                            "seq_len": 16},
        "train": {"global_batch": 4, "seed": 0}, "layout": {"dp": 2, "pp": 1, "tp": 1},
        "steps": STEPS, "collective_timeout_s": 10.0, "faults": []}


def _events(node_dir: Path) -> list[dict]:
    lines = (node_dir / "daemon.log").read_text().splitlines()
    return [json.loads(x) for x in lines if x.startswith("{")]


def test_the_ranks_of_a_node_whose_disk_stays_full_move_to_a_spare_elsewhere(
        tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    work = tmp_path / "c"
    full = work / "node-1"
    if (why := mount_tmpfs(full)) is not None:
        pytest.skip(f"this container cannot mount a tmpfs: {why}")
    # Spares go on the last nodes first: one on node-2 and one on node-1 (the full one).
    cluster = LocalCluster(nodes=3, workdir=work,
                           daemon_settings={"snapshot": {"disk_full_replan_s": 2.0}})
    try:
        cluster.start_daemons()
        fill(full)
        cluster.launch(SPEC, world=2, spares=2, ranks_per_node=1)
        coordinator = cluster.coordinator()

        def finished() -> bool:
            results = [r.result() for r in cluster.ranks]
            return sum(1 for r in results if r and r.get("result")) == 2

        wait_until(finished, 240, "both roles to finish the job")
        status = coordinator.status()
        changes = [c.reason for c in status.plan_changes]
        committed = status.latest_committed_step
        coordinator_dir = work / coordinator.name
        events = _events(coordinator_dir)
    finally:
        cluster.close()
        unmount(full)
    detected = [e for e in events if e.get("msg") == "failure detected"]
    storage_full = [e for e in detected if e["kind"] == "storage_full"]
    assert storage_full and all(e["subject"].startswith("node-1/") for e in storage_full), \
        detected
    # The role of node-1's rank went to the spare on node-2, not to the one on node-1.
    assert any(re.search(r"node-1/\d+ -> node-2/\d+", c) for c in changes), changes
    assert not any(re.search(r"-> node-1/", c) for c in changes), changes
    assert committed == STEPS  # the job's last step is protected after all
    # The re-plan did not wait for a captured step to land: none of node-1's can.
    assert not [e for e in events if e.get("msg", "").endswith("before re-planning")]
