"""A daemon that holds no rank, only shards and record copies, is frozen (SIGSTOP) while
the job trains: once membership suspects it, the other daemons stop waiting on the puts
and record copies they had sent it, and once it is declared lost on the commits, and
carry on without it. The job
finishes under its first plan, no rank replaced and nothing redone, with the
failure-free result. Before, those calls each waited out their deadline; the ranks'
captures queued behind them until one rank missed a collective and was thrown out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.client.chaos_run import judge, run_job
from stalwart.client.chaos_schedule import Fault, Schedule, Setup
from stalwart.core.layout import Layout

pytestmark = pytest.mark.multiprocess

LAYOUT = Layout(dp=2, pp=1, tp=1, stages=(), schedule="1f1b", microbatches=1, grad_accum=1)
SETUP = Setup(layout=LAYOUT, spares=0, nodes=3, ranks_per_node=1)  # node-2: storage only
STEPS = 16


def test_a_frozen_daemon_holding_no_rank_stalls_nothing_past_its_loss(tmp_path: Path) -> None:
    baseline = run_job(Schedule("baseline", SETUP), steps=STEPS, timeout_s=120,
                       workdir=tmp_path / "baseline")
    assert baseline.completed, baseline.error
    frozen = Schedule("stop-daemon", SETUP, (Fault("stop-daemon", "node", 2, 4),))
    out = run_job(frozen, steps=STEPS, timeout_s=120, workdir=tmp_path / "frozen")
    story = f"{out.error} plans={out.plans} (logs in {out.workdir})"
    assert out.completed, story
    assert [p["generation"] for p in out.plans] == [1], story  # no re-plan, no rank lost
    assert out.lost_steps == 0, story
    assert judge(out, baseline, LAYOUT), story  # bitwise the failure-free run
    # The shards in flight to the frozen daemon went elsewhere once it was suspected (a
    # heartbeat overdue), not after their puts' deadline.
    rerouted = [e for log in Path(out.workdir).glob("node-*/daemon.log")
                for e in map(json.loads, (line for line in log.read_text().splitlines()
                                          if line.startswith("{")))
                if e["msg"].startswith("shard rerouted") and e.get("peer") == "node-2"]
    assert rerouted and all("went quiet" in e["error"] for e in rerouted), story
