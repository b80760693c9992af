"""Without a spare the job shrinks onto the survivors (same global batch, same
trajectory) and widens again when a rank joins; real daemons and rank processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_recovery_e2e import MICRO, demo

from stalwart.client.local_cluster import LocalCluster, wait_until

pytestmark = pytest.mark.multiprocess

FOUR_BLOCKS = json.dumps({**json.loads(MICRO), "n_layer": 4})
TOLERANCE = 1e-4  # relative: fp32, the same sums in another pipeline/DP arrangement


def assert_same_trajectory(losses: list[float], baseline: list[float]) -> None:
    assert len(losses) == len(baseline)
    for step, (a, b) in enumerate(zip(losses, baseline, strict=True), start=1):
        assert abs(a - b) <= TOLERANCE * abs(b), (step, a, b)


def shrink_reason(tmp_path: Path, *layout: str, kill: str) -> str:
    """The reason of the one re-plan after `kill` in a 10-step demo of `layout` without
    spares, whose losses stay those of the run without the kill."""
    code, base = demo(tmp_path, *layout, "--spares", "0", "--no-faults", steps=10)
    assert code == 0
    code, summary = demo(tmp_path, *layout, "--spares", "0", "--kill", kill, steps=10)
    assert code == 0 and summary["completed"] and summary["lost_steps"] == 0
    (recovery,) = summary["recoveries"]
    assert_same_trajectory(summary["losses"], base["losses"])
    return recovery["reason"]


def test_losing_a_stage_of_four_continues_on_three_rebalanced(tmp_path: Path) -> None:
    layout = ("--model-overrides", FOUR_BLOCKS, "--nodes", "2", "--dp", "1", "--pp", "4")
    code, base = demo(tmp_path, *layout, "--spares", "0", "--no-faults", steps=12)
    assert code == 0
    code, summary = demo(tmp_path, *layout, "--spares", "0", "--kill", "rank:2@step:5",
                         steps=12)
    assert code == 0 and summary["completed"] and summary["lost_steps"] == 0
    (recovery,) = summary["recoveries"]
    assert recovery["reason"].startswith("shrink dp=1 pp=4 tp=1 -> dp=1 pp=3 tp=1")
    assert_same_trajectory(summary["losses"], base["losses"])


def test_losing_a_replica_doubles_accumulation(tmp_path: Path) -> None:
    # Two stages of this model fit in 450 kB per device, one does not: the planner must
    # keep the pipeline and give up the replica (without a cap, pure DP would be faster).
    reason = shrink_reason(tmp_path, "--nodes", "2", "--dp", "2", "--pp", "2",
                           "--mem-cap", "450000", kill="rank:1@step:4")
    assert "-> dp=1 pp=2 tp=1" in reason and "grad_accum 1 -> 2" in reason


def test_three_replicas_that_lose_one_go_on_as_two_with_unequal_shares(
        tmp_path: Path) -> None:
    # Three micro-batches a step do not divide between two replicas: they run two and
    # one, rather than one replica running all three.
    reason = shrink_reason(tmp_path, "--nodes", "3", "--ranks-per-node", "1", "--dp", "3",
                           "--pp", "1", "--global-batch", "12", kill="rank:2@step:4")
    assert "-> dp=2 pp=1 tp=1" in reason
    assert "grad_accum 1 -> 2 (unequal shares of 3 micro-batches)" in reason


def test_a_shrink_without_memory_for_the_model_stops_naming_the_shortfall(
        tmp_path: Path) -> None:
    code, summary = demo(tmp_path, "--nodes", "2", "--dp", "1", "--pp", "2", "--spares", "0",
                         "--mem-cap", "200000", "--kill", "rank:1@step:3", steps=8)
    assert code == 1 and not summary["completed"] and summary["lost_steps"] == 0
    assert "bytes" in summary["stopped"] and "short" in summary["stopped"]
    assert "last committed step" in summary["stopped"]


def test_a_rank_that_joins_later_is_admitted_and_the_plan_widened() -> None:
    # Six blocks: four stages beat three in the planner's model, so the joiner pays off.
    spec = {"model": "tiny", "model_overrides": {**json.loads(MICRO), "n_layer": 6},
            "train": {"global_batch": 8, "seed": 0},
            "layout": {"dp": 1, "pp": 4, "tp": 1, "microbatches": 4}, "steps": 400,
            "faults": [{"kind": "kill", "target": "rank", "index": 2, "step": 3}],
            "collective_timeout_s": 4.0, "flops_costs": True}
    cluster = LocalCluster(nodes=2, daemon_settings={"elastic": {"grow_threshold": 0.0}})
    try:
        cluster.start_daemons()
        cluster.launch(spec, world=4)
        coord = cluster.daemons[0]

        def generation() -> int:
            st = coord.status()
            return st.generation if st is not None else 0

        wait_until(lambda: generation() >= 2, 120, "the shrink after the kill")
        cluster.add_spares(1, node=1)
        wait_until(lambda: generation() >= 3, 120, "the joining rank to be admitted")
        plan = coord.status().plan
        assert plan.reason.startswith("widen dp=1 pp=3 tp=1 -> dp=1 pp=4"), plan.reason
        assert plan.layout.dp * plan.layout.pp == 4  # every rank has a role again
        wait_until(lambda: (coord.status().latest_committed_step or 0) > plan.resume_step + 2,
                   120, "training to go on in the widened plan")
    finally:
        cluster.close()


def test_a_lost_node_with_a_whole_tp_group_and_the_coordinator_shrinks(tmp_path: Path) -> None:
    # node-0 holds the coordinator and the (dp 0) TP pair; one spare, on node-2, cannot
    # take a pair's place: the successor coordinator (which learns the layer profile
    # from the re-announced ranks) keeps the surviving pair and doubles the accumulation.
    layout = ("--nodes", "3", "--ranks-per-node", "2", "--dp", "2", "--pp", "1", "--tp", "2")
    code, base = demo(tmp_path, *layout, "--spares", "0", "--no-faults", steps=10)
    assert code == 0
    code, summary = demo(tmp_path, *layout, "--spares", "1", "--kill", "node:0@step:4",
                         steps=10)
    assert code == 0 and summary["completed"] and summary["lost_steps"] == 0, summary
    (recovery,) = summary["recoveries"]
    assert "dp=2 pp=1 tp=2 -> dp=1 pp=1 tp=2" in recovery["reason"], recovery
    assert "grad_accum 1 -> 2" in recovery["reason"]
    assert_same_trajectory(summary["losses"], base["losses"])
