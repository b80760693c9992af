"""Admitting ranks that join during training: widen only when the predicted gain is worth it."""

from __future__ import annotations

import pytest
from test_shrink import COSTS, grid

from stalwart.core.decide import Member
from stalwart.core.grow import GrowPolicy, plan_grow
from stalwart.core.partition import partition
from stalwart.core.shrink import ElasticConfig, plan_shrink

CONFIG = ElasticConfig(costs=COSTS)


def test_a_joining_rank_widens_a_shrunk_pipeline_back_to_four_stages():
    shrunk = plan_shrink(grid(1, 4, 1, partition(COSTS, 4).stages), frozenset({"r2"}),
                         CONFIG).plan
    grown = plan_grow(shrunk, CONFIG, 0.01, joined=[Member("new", "n9")])
    assert grown is not None
    lay = grown.plan.layout
    assert (lay.dp, lay.pp, lay.tp) == (1, 4, 1)
    assert max(sum(COSTS[a:b + 1]) for a, b in lay.stages) == partition(COSTS, 4).bottleneck
    assert grown.speed_ratio > 1.01
    assert "new" in {m.rank_id for m in grown.plan.members}
    assert set(grown.receive["new"]) == set(range(*_span(lay, grown.plan, "new")))
    assert grown.layers_moved == sum(len(v) for v in grown.receive.values())
    assert grown.layers_moved <= grown.layers_moved_naive


def _span(lay, plan, rank_id):
    m = next(m for m in plan.members if m.rank_id == rank_id)
    a, b = lay.stages[m.coord.pp]
    return a, b + 1


def test_a_gain_below_the_threshold_keeps_the_plan():
    shrunk = plan_shrink(grid(1, 4, 1, partition(COSTS, 4).stages), frozenset({"r2"}),
                         CONFIG).plan
    assert plan_grow(shrunk, CONFIG, 0.5, joined=[Member("new", "n9")]) is None


def test_returning_replica_restores_data_parallelism_and_moves_only_its_own_layers():
    config = ElasticConfig(costs=COSTS, mem=(1.0,) * 10, mem_cap=6.0)
    before = grid(2, 2, 1, partition(COSTS, 2).stages, per_node=2)
    shrunk = plan_shrink(before, frozenset({"r1"}), config).plan
    assert shrunk.layout.grad_accum == 2
    grown = plan_grow(shrunk, config, 0.2, joined=[Member("back", "n0")])
    assert grown is not None
    lay = grown.plan.layout
    assert (lay.dp, lay.pp, lay.grad_accum, lay.microbatches) == (2, 2, 1, 2)
    assert grown.speed_ratio == pytest.approx(2.0)
    kept = {m.rank_id: (m.coord.dp, m.coord.pp) for m in grown.plan.members}
    assert kept["r0"] == (0, 0) and kept["r2"] == (0, 1)  # members keep their roles
    assert set(grown.receive) <= {"back", "r3"}  # only the newcomers receive layers


def test_nothing_to_admit_means_no_change():
    plan = grid(1, 2, 1, partition(COSTS, 2).stages)
    assert plan_grow(plan, CONFIG, 0.0) is None


def test_policy_sets_the_next_generation_and_resume_step():
    shrunk = plan_shrink(grid(1, 4, 1, partition(COSTS, 4).stages), frozenset({"r2"}),
                         CONFIG).plan
    with_spare = shrunk.__class__(shrunk.generation, shrunk.layout, shrunk.members,
                                  (Member("new", "n9"),))
    policy = GrowPolicy(CONFIG, threshold=0.01)
    plan = policy(with_spare, committed_step=40)
    assert plan is not None and plan.generation == shrunk.generation + 1
    assert plan.resume_step == 40 and plan.spares == ()
    assert policy.last is not None and "widen" in plan.reason
