"""A dead rank's capture slots go back to its daemon (real daemon, real rank processes):
they are shared memory counted against the node's slot budget, and the spare that takes
the rank's place needs that room."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stalwart.client.local_cluster import LocalCluster, wait_until

pytestmark = pytest.mark.multiprocess

MICRO = {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}


def slots_of(daemon_pid: int, rank_id: str) -> int:
    """Shared-memory slots the daemon holds open for `rank_id` (its memfds)."""
    count = 0
    for fd in Path(f"/proc/{daemon_pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        count += target.startswith(f"/memfd:stalwart-{rank_id} ")
    return count


def test_a_killed_ranks_slots_are_freed_and_its_spare_gets_its_own(tmp_path: Path) -> None:
    spec = {"model": "tiny", "model_overrides": MICRO,
            "train": {"global_batch": 4, "seed": 0},
            "layout": {"dp": 1, "pp": 1, "tp": 1}, "steps": 400,
            "faults": [{"kind": "kill", "target": "rank", "index": 0, "step": 5}]}
    cluster = LocalCluster(nodes=1, workdir=tmp_path / "cluster")
    cluster.env["STALWART_FAULT_LOG"] = str(tmp_path)
    try:
        cluster.start_daemons()
        daemon = cluster.daemons[0]
        assert daemon.proc is not None
        cluster.launch(spec, 1, spares=1)
        fault = wait_until(lambda: next(tmp_path.glob("fault-*.json"), None), 120,
                           "the rank to kill itself after step 5")
        dead = f"{daemon.name}/{json.loads(fault.read_text())['pid']}"
        spare = next(r for r in cluster.ranks if r.rank < 0)
        alive = f"{daemon.name}/{spare.proc.pid}"
        wait_until(lambda: slots_of(daemon.proc.pid, dead) == 0, 60,
                   f"the daemon to free the slots of {dead}")
        wait_until(lambda: slots_of(daemon.proc.pid, alive) >= 2, 60,
                   f"the spare {alive} to capture into slots of its own")
    finally:
        cluster.close()


def test_a_rank_that_finishes_its_job_leaves_no_slots_behind(tmp_path: Path) -> None:
    """A daemon outlives its jobs: the slots of a rank that left cleanly go back to the
    budget as a dead rank's do, or the next job's ranks would find no room."""
    spec = {"model": "tiny", "model_overrides": MICRO,
            "train": {"global_batch": 4, "seed": 0},
            "layout": {"dp": 1, "pp": 1, "tp": 1}, "steps": 6}
    cluster = LocalCluster(nodes=1, workdir=tmp_path / "cluster")
    try:
        cluster.start_daemons()
        daemon = cluster.daemons[0]
        assert daemon.proc is not None
        cluster.launch(spec, 1)
        [rank] = cluster.ranks
        rank_id = f"{daemon.name}/{rank.proc.pid}"
        wait_until(lambda: slots_of(daemon.proc.pid, rank_id) >= 2, 120,
                   f"{rank_id} to capture into slots of its own")
        assert rank.proc.wait(timeout=120) == 0
        wait_until(lambda: slots_of(daemon.proc.pid, rank_id) == 0, 60,
                   f"the daemon to free the slots of {rank_id}, which left cleanly")
    finally:
        cluster.close()
