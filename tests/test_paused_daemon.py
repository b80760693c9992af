"""A coordinator daemon frozen by SIGSTOP past the heartbeat timeout is declared lost
and the job goes on without it; when it is resumed it learns the current generation
and coordinator before acting: it never coordinates at the old generation, and it ends
its rank that the new plan left out (default rule, no etcd)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from stalwart.client.local_cluster import LocalCluster, wait_until
from stalwart.client.step_log import StepLog

pytestmark = pytest.mark.multiprocess

SPEC = {"model": "tiny",
        "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
                            "seq_len": 16},
        "train": {"global_batch": 4, "seed": 0}, "layout": {"dp": 2, "pp": 1, "tp": 1},
        "steps": 30, "faults": [], "collective_timeout_s": 4.0}


def test_a_resumed_coordinator_defers_to_the_one_that_replaced_it(tmp_path: Path) -> None:
    cluster = LocalCluster(nodes=3, workdir=tmp_path)
    try:
        cluster.start_daemons()
        frozen = cluster.coordinator()
        assert frozen is not None and frozen.name == "node-0"  # the smallest name
        cluster.launch(SPEC, world=2, spares=1, ranks_per_node=1)  # spare on node-2
        follow = StepLog()
        rank0 = next(r for r in cluster.ranks if r.rank == 0)

        def stepped(n: int) -> bool:
            follow.poll([r.log_path for r in cluster.ranks])
            return bool(follow.losses) and max(follow.losses) >= n

        wait_until(lambda: stepped(3), 120, "the job to take 3 steps")
        frozen.proc.send_signal(signal.SIGSTOP)
        successor = cluster.daemons[1]

        def replanned() -> bool:
            st = successor.status()
            return st is not None and st.generation >= 2 and any(
                d.coordinator and d.node == "node-1" for d in st.daemons)

        wait_until(replanned, 60, "node-1 to coordinate generation 2 without node-0")
        frozen.proc.send_signal(signal.SIGCONT)

        def deferred() -> bool:
            st = frozen.status()
            return (st is not None and st.generation == successor.status().generation
                    and any(d.coordinator and d.node == "node-1" for d in st.daemons)
                    and not any(d.coordinator and d.node == "node-0" for d in st.daemons))

        wait_until(deferred, 60, "the resumed daemon to install the current plan and defer")
        wait_until(lambda: rank0.proc.poll() is not None, 60,
                   "the resumed daemon to end its rank the new plan left out")
        wait_until(lambda: stepped(SPEC["steps"]), 180, "training to finish")
        final = successor.status()
        # One re-plan: the pause did not cause a second. (The job's completion, once its
        # last step is committed, installs one more generation of its own.)
        assert final.generation - final.plan.completed == 2, final.plan
        assert not any(d.coordinator and d.node == "node-0" for d in frozen.status().daemons)
    finally:
        for node in cluster.daemons:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
        cluster.close()
