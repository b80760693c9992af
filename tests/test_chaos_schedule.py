"""The chaos campaign's schedule generator: seeded, feasible, covering every kind."""

from __future__ import annotations

from collections import Counter

import pytest

from stalwart.client.chaos_schedule import (
    KINDS,
    MAX_PROCESSES,
    Fault,
    Schedule,
    Setup,
    feasible,
    generate,
    placement,
)
from stalwart.core.layout import Layout


def test_the_same_seed_generates_the_same_schedules() -> None:
    assert generate(7, 30) == generate(7, 30)
    assert generate(7, 30) != generate(8, 30)


@pytest.mark.parametrize("seed", range(20))
def test_every_generated_schedule_is_feasible_for_its_layout(seed: int) -> None:
    for s in generate(seed, 24):
        run, lay = s.setup, s.setup.layout
        assert feasible(s), s
        assert {lay.dp, lay.pp, lay.tp} <= {1, 2} and 0 <= run.spares <= 2
        assert 2 <= run.nodes <= 4 and run.world + run.spares <= MAX_PROCESSES
        ranks, _ = placement(run)
        for group in lay.groups("tp"):  # a TP group sits on one node
            assert len({ranks[r] for r in group}) == 1, s


def test_every_kind_is_reached_within_one_round() -> None:
    for seed in range(5):
        assert Counter(s.kind for s in generate(seed, len(KINDS))) == Counter(list(KINDS))


def test_a_subset_of_kinds_is_honoured() -> None:
    assert {s.kind for s in generate(3, 10, kinds=["hang", "gpu"])} == {"hang", "gpu"}


def test_a_double_fault_hits_two_ranks_the_second_during_recovery() -> None:
    for s in generate(2, 60, kinds=["double"]):
        first, second = s.faults
        assert first.index != second.index and second.after == "recovery"


def test_a_lone_rank_without_a_spare_is_not_killed() -> None:
    run = Setup(Layout(1, 1, 1), spares=0, nodes=2, ranks_per_node=1)
    assert not feasible(Schedule("kill-rank", run, (Fault("kill-rank", "rank", 0, 3),)))
    spared = Setup(Layout(1, 1, 1), spares=1, nodes=2, ranks_per_node=1)
    assert feasible(Schedule("kill-rank", spared, (Fault("kill-rank", "rank", 0, 3),)))


def test_a_tp_pair_needs_two_survivors() -> None:
    run = Setup(Layout(1, 1, 2), spares=0, nodes=2, ranks_per_node=2)
    assert not feasible(Schedule("kill-rank", run, (Fault("kill-rank", "rank", 1, 3),)))
    run = Setup(Layout(2, 1, 2), spares=0, nodes=2, ranks_per_node=2)
    assert feasible(Schedule("kill-node", run, (Fault("kill-node", "node", 1, 3),)))


def test_a_node_that_only_stores_is_a_target_too() -> None:
    """Its daemon holds shards and records: losing it must cost the job no step."""
    run = Setup(Layout(1, 1, 1), spares=0, nodes=4, ranks_per_node=1)
    assert feasible(Schedule("kill-node", run, (Fault("kill-node", "node", 3, 3),)))
    assert not feasible(Schedule("kill-node", run, (Fault("kill-node", "node", 4, 3),)))
    storage_only = [s for s in generate(0, 60, kinds=["kill-daemon", "kill-node",
                                                      "stop-daemon"])
                    if s.faults[0].index not in set().union(*placement(s.setup))]
    assert storage_only, "some node faults hit a node that runs no rank or spare"


def test_a_disk_that_stays_full_is_one_of_a_node_with_ranks_but_not_the_coordinators(
        ) -> None:
    """Its ranks' roles must move elsewhere. node-0 coordinates, and a coordinator whose
    own disk stays full commits nothing; of 2 nodes, the other has no peer left to keep
    its record copies (limitations the README states)."""
    for s in generate(4, 40, kinds=["disk-stays-full"]):
        (f,) = s.faults
        ranks, _ = placement(s.setup)
        assert f.target == "node" and f.index in set(ranks) and f.index != 0, s
        assert s.setup.nodes >= 3, s
    run = Setup(Layout(2, 1, 1), spares=0, nodes=3, ranks_per_node=1)
    assert feasible(Schedule("disk-stays-full", run, (Fault("disk-stays-full", "node", 1, 3),)))
    assert not feasible(Schedule("disk-stays-full", run,
                                 (Fault("disk-stays-full", "node", 0, 3),)))
    two = Setup(Layout(2, 1, 1), spares=1, nodes=2, ranks_per_node=1)
    assert not feasible(Schedule("disk-stays-full", two,
                                 (Fault("disk-stays-full", "node", 1, 3),)))


def test_an_error_is_raised_inside_a_training_rank() -> None:
    for s in generate(5, 20, kinds=["error"]):
        (f,) = s.faults
        assert f.target == "rank" and 0 <= f.index < s.setup.world, s


def test_the_table_gives_each_kind_its_runs_and_median_time() -> None:
    from stalwart.client.chaos import table

    setup = {"dp": 2, "pp": 1, "tp": 1, "spares": 1, "nodes": 2, "ranks_per_node": 1}
    rows = [{"kind": "hang", "setup": setup, "recovered": True, "equal": True,
             "lost_steps": 0, "fault_to_first_step_s": t} for t in (5.0, 6.0, 9.0)]
    rows.append({**rows[0], "kind": "gpu", "equal": False, "fault_to_first_step_s": None})
    text = table(rows)
    assert "| hang | 3 | 1 | 3 | 3 | 0 | 6.00 (9.00) |" in text
    assert "| gpu | 1 | 1 | 1 | 0 | 0 | - |" in text


def test_a_run_the_harness_itself_fails_is_reported_and_the_campaign_goes_on(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One run's unexpected error (here its daemons cannot start: the disk is full) makes
    # that run fail with the error and a traceback beside its logs; it does not end the
    # campaign's other runs.
    from stalwart.client import chaos_run
    from stalwart.client.local_cluster import LocalCluster

    def full_disk(self: LocalCluster) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalCluster, "start_daemons", full_disk)
    schedule = generate(1, 1)[0]
    out = chaos_run.run_job(schedule, steps=4, timeout_s=10, workdir=tmp_path)
    assert not out.completed
    assert out.error.startswith("the harness failed: OSError: [Errno 28] No space left")
    assert "full_disk" in (tmp_path / "harness-error.txt").read_text()
