"""`stalwart bench elastic --quick` on a real local cluster: a (1,4,1) job loses a stage's
rank without a spare, and the bench reports the shrink it measured."""

from __future__ import annotations

import pytest

from stalwart.bench import elastic

pytestmark = pytest.mark.multiprocess


def test_quick_bench_measures_a_real_shrink_onto_three_stages() -> None:
    out = elastic.run(quick=True)
    cluster = out["cluster"]
    assert "error" not in cluster, cluster
    assert cluster["plan_before"]["pp"] == 4 and cluster["plan_after"]["pp"] == 3
    assert cluster["planner_matches_coordinator"]  # the bench recomputed the same plan
    assert 0 < out["layers_moved"] <= out["layers_moved_naive"]
    assert 0 < out["bytes_moved"] <= out["bytes_moved_naive"]
    assert out["replan_s"] > 0 and out["pause_s"] > 0 and out["throughput_ratio"] > 0
    assert cluster["steps_timed"]["before"] >= 3 and cluster["steps_timed"]["after"] >= 3
    assert len(out["planner_cases"]) == 5
