"""Shrinking onto the survivors: fastest layout, same global batch, fewest layers moved."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.core.decide import Member, PlanDecision, PlanState, decide
from stalwart.core.failures import Failure, FailureKind
from stalwart.core.layout import Layout
from stalwart.core.partition import partition
from stalwart.core.shrink import ElasticConfig, ElasticPlanner, ShrinkMemoryError, plan_shrink

COSTS = (1.0,) + (3.0,) * 8 + (5.0,)  # embedding, 8 blocks, heavy head


def grid(dp: int, pp: int, tp: int, stages, *, per_node: int = 1, microbatches: int | None = None,
         grad_accum: int = 1) -> PlanState:
    """Ranks r0.. in rank order, per_node to a node."""
    lay = Layout(dp, pp, tp, stages=tuple(stages), microbatches=microbatches or pp,
                 grad_accum=grad_accum)
    members = [Member(f"r{r}", f"n{r // per_node}", lay.coords(r)) for r in range(lay.world_size)]
    return PlanState(1, lay, tuple(members))


def held(state: PlanState, rank_id: str) -> set[int]:
    m = next(m for m in state.members if m.rank_id == rank_id)
    a, b = state.layout.stages[m.coord.pp]
    return set(range(a, b + 1))


def test_losing_a_stage_of_four_continues_on_three_with_a_rebalanced_partition():
    before = grid(1, 4, 1, partition(COSTS, 4).stages)
    result = plan_shrink(before, frozenset({"r2"}), ElasticConfig(costs=COSTS))
    lay = result.plan.layout
    assert (lay.dp, lay.pp, lay.tp) == (1, 3, 1)
    assert max(sum(COSTS[a:b + 1]) for a, b in lay.stages) == partition(COSTS, 3).bottleneck
    assert lay.grad_accum * lay.microbatches * lay.dp == 4  # the global batch is unchanged
    assert [m.rank_id for m in result.plan.members] == ["r0", "r1", "r3"]
    for rank_id, layers in result.receive.items():
        assert not set(layers) & held(before, rank_id)  # nobody re-fetches what it holds
    assert result.layers_moved == sum(len(v) for v in result.receive.values())
    assert result.layers_moved <= result.layers_moved_naive
    lost = held(before, "r2")
    assert lost <= {i for v in result.receive.values() for i in v}
    assert all("r2" not in holders for holders in result.sources.values())


def test_losing_a_replica_halves_dp_and_doubles_accumulation_moving_nothing():
    # Each device holds at most 6 of the 10 layers: the model needs two stages.
    config = ElasticConfig(costs=COSTS, mem=(1.0,) * 10, mem_cap=6.0)
    before = grid(2, 2, 1, partition(COSTS, 2).stages, per_node=2)
    result = plan_shrink(before, frozenset({"r1"}), config)
    lay = result.plan.layout
    assert (lay.dp, lay.pp, lay.tp) == (1, 2, 1)
    assert (lay.microbatches, lay.grad_accum) == (2, 2)
    assert lay.stages == before.layout.stages
    assert result.layers_moved == 0 and result.receive == {}
    assert [m.rank_id for m in result.plan.members] == ["r0", "r2"]
    assert [s.rank_id for s in result.plan.spares] == ["r3"]
    assert result.speed_ratio == pytest.approx(0.5)


def test_replicas_whose_micro_batches_do_not_divide_among_the_survivors_take_unequal_shares():
    # Three replicas, a micro-batch each, lose one: two go on (2 + 1 micro-batches a
    # step, two rounds), faster than one replica running all three.
    before = grid(3, 1, 1, [(0, 9)])
    result = plan_shrink(before, frozenset({"r1"}), ElasticConfig(costs=COSTS))
    lay = result.plan.layout
    assert (lay.dp, lay.grad_accum, lay.microbatch_total) == (2, 2, 3)
    assert [lay.replica_microbatches(d)[1] for d in range(2)] == [2, 1]
    assert result.speed_ratio == pytest.approx(0.5)  # two rounds a step where one was
    assert "unequal shares of 3 micro-batches" in result.plan.reason
    # Where they divide, the shares stay equal.
    even = plan_shrink(grid(4, 1, 1, [(0, 9)]), frozenset({"r1", "r2"}),
                       ElasticConfig(costs=COSTS)).plan.layout
    assert (even.dp, even.grad_accum, even.microbatch_total) == (2, 2, 0)


def test_tensor_parallel_groups_stay_inside_one_node():
    # (1,3,2) on three nodes, one TP group each; losing one rank on n0 and one on n1
    # leaves two lone ranks that must not form a TP group across nodes.
    before = grid(1, 3, 2, partition(COSTS, 3).stages, per_node=2)
    result = plan_shrink(before, frozenset({"r0", "r3"}), ElasticConfig(costs=COSTS))
    lay = result.plan.layout
    assert (lay.dp, lay.pp, lay.tp) == (1, 1, 2)
    by_group: dict[tuple[int, int], set[str]] = {}
    for m in result.plan.members:
        by_group.setdefault((m.coord.dp, m.coord.pp), set()).add(m.node)
    assert all(len(nodes) == 1 for nodes in by_group.values())
    assert {m.rank_id for m in result.plan.members} == {"r4", "r5"}
    # The intact group keeps its TP indices, so its own shards stay put.
    assert {m.rank_id: m.coord.tp for m in result.plan.members} == {"r4": 0, "r5": 1}


def test_a_slow_survivor_gets_a_lighter_stage():
    before = grid(1, 4, 1, partition(COSTS, 4).stages)
    config = ElasticConfig(costs=COSTS, speeds={"r3": 0.5})
    result = plan_shrink(before, frozenset({"r1"}), config)
    work = {m.rank_id: sum(COSTS[a:b + 1]) for m in result.plan.members
            for a, b in [result.plan.layout.stages[m.coord.pp]]}
    assert work["r3"] < min(work["r0"], work["r2"])


def test_bytes_moved_counts_each_received_layer():
    before = grid(1, 4, 1, partition(COSTS, 4).stages)
    per_layer = tuple(float(100 * (i + 1)) for i in range(len(COSTS)))
    result = plan_shrink(before, frozenset({"r2"}),
                         ElasticConfig(costs=COSTS, layer_bytes=per_layer))
    assert result.bytes_moved == sum(per_layer[i] for v in result.receive.values() for i in v)
    assert result.bytes_moved <= result.bytes_moved_naive


def test_too_little_memory_fails_naming_the_shortfall_in_bytes():
    before = grid(1, 2, 1, partition(COSTS, 2).stages)
    config = ElasticConfig(costs=COSTS, mem=(1000.0,) * 10, mem_cap=6000.0)
    with pytest.raises(ShrinkMemoryError) as err:
        plan_shrink(before, frozenset({"r1"}), config)
    assert err.value.shortfall_bytes == 4000
    assert "short by 4,000 bytes" in str(err.value)
    assert "6,000 bytes per device" in str(err.value)


def test_the_planner_plugs_into_decide_as_a_shrink():
    before = grid(1, 4, 1, partition(COSTS, 4).stages)
    planner = ElasticPlanner(ElasticConfig(costs=COSTS))
    failure = Failure(FailureKind.PROCESS_EXIT, "r1", "killed", generation=1)
    decision = decide(before, [failure], committed_step=17, shrink_planner=planner)
    assert isinstance(decision, PlanDecision) and decision.kind == "shrink"
    assert decision.plan.generation == 2 and decision.plan.resume_step == 17
    assert decision.plan.layout.pp == 3 and "layers moved" in decision.plan.reason
    assert planner.last is not None and planner.last.plan.layout == decision.plan.layout


# -- fewest layers moved among the fastest plans, against brute force ------------------

def _micro(old: Layout, dp: int, pp: int) -> tuple[int, int] | None:
    total = old.dp * old.grad_accum * old.microbatches
    if total % dp:  # unequal shares, one micro-batch a round, without a pipeline
        return (1, -(-total // dp)) if pp == 1 and total >= dp else None
    per = total // dp
    if old.microbatches >= pp and per % old.microbatches == 0:
        return old.microbatches, per // old.microbatches
    return (per, 1) if per >= pp else None


def _splits(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0, *cuts, n)
        yield [(edges[j], edges[j + 1] - 1) for j in range(p)]


def brute_force(state: PlanState, failed: set[str], costs) -> tuple[float, int]:
    """(fastest step, fewest moved at that speed) over every layout, mapping and split."""
    old = state.layout
    alive = [m for m in state.members if m.rank_id not in failed]
    holds = {m.rank_id: held(state, m.rank_id) for m in alive}
    best = (math.inf, math.inf)
    for pp in range(1, old.pp + 1):
        for dp in range(1, old.dp + 1):
            micro = _micro(old, dp, pp)
            if micro is None or dp * pp > len(alive) or pp > len(costs):
                continue
            m, ga = micro
            for chosen in itertools.permutations(alive, dp * pp):
                for split in _splits(len(costs), pp):
                    step = ga * (m + pp - 1) * max(sum(costs[a:b + 1]) for a, b in split)
                    moved = sum(i not in holds[r.rank_id] for k, r in enumerate(chosen)
                                for i in range(split[k // dp][0], split[k // dp][1] + 1))
                    if step < best[0] * (1 - 1e-9):
                        best = (step, moved)
                    elif step <= best[0] * (1 + 1e-9):
                        best = (best[0], min(best[1], moved))
    return best


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dp=st.integers(1, 2), pp=st.integers(2, 3),
       n=st.integers(3, 6), micro=st.integers(1, 3))
def test_fewest_layers_moved_among_the_fastest_plans_matches_brute_force(data, dp, pp, n, micro):
    costs = tuple(data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1)))
    edges = (0, *cuts, n)
    stages = [(edges[j], edges[j + 1] - 1) for j in range(pp)]
    before = grid(dp, pp, 1, stages, microbatches=max(pp, micro))
    victim = f"r{data.draw(st.integers(0, dp * pp - 1))}"
    result = plan_shrink(before, frozenset({victim}), ElasticConfig(costs=costs))
    step, moved = brute_force(before, {victim}, costs)
    assert result.predicted_step == pytest.approx(step, rel=1e-9)
    assert result.layers_moved == moved


def test_a_config_from_the_analytic_profile_refuses_a_shrink_that_cannot_fit():
    from stalwart.core.costs import GPTShape, gpt_profile

    profile = gpt_profile(GPTShape(vocab=32000, d_model=1024, n_layers=8, n_heads=16,
                                   seq=1024))
    per_layer = ElasticConfig.from_profile(profile)
    need = max(m + 2 * a for m, a in zip(per_layer.mem, per_layer.act, strict=True))
    total = sum(per_layer.mem) + sum(per_layer.act) * 2
    cap = (total + need) / 2  # fits on two stages, not on one
    config = ElasticConfig.from_profile(profile, mem_cap=cap)
    before = grid(1, 2, 1, partition(config.costs, 2, mem=config.mem, act=config.act,
                                     mem_cap=cap).stages)
    with pytest.raises(ShrinkMemoryError, match="short by") as err:
        plan_shrink(before, frozenset({"r0"}), config)
    # One stage of 1F1B holds one micro-batch of activations.
    assert err.value.shortfall_bytes == math.ceil(sum(config.mem) + sum(config.act) - cap)


def test_pools_too_big_to_enumerate_still_get_the_fastest_plan_and_move_less_than_naive():
    costs = tuple(float(1 + i % 3) for i in range(16))
    before = grid(4, 4, 1, partition(costs, 4).stages, per_node=4)
    config = ElasticConfig(costs=costs, max_assignments=50)
    result = plan_shrink(before, frozenset({"r5"}), config)
    lay = result.plan.layout
    exact = partition(costs, lay.pp).bottleneck
    assert result.predicted_step == pytest.approx(
        lay.grad_accum * (lay.microbatches + lay.pp - 1) * exact)
    assert result.layers_moved <= result.layers_moved_naive


def test_lone_ranks_on_different_nodes_form_a_tp_group_across_nodes_only_as_a_last_resort():
    # (2,1,2): each TP pair on its own node; one rank of each pair is lost. No node holds
    # a pair any more: the two lone ranks form one across nodes, at a quarter of the speed.
    before = grid(2, 1, 2, partition(COSTS, 1).stages, per_node=2)
    result = plan_shrink(before, frozenset({"r0", "r3"}), ElasticConfig(costs=COSTS))
    lay = result.plan.layout
    assert (lay.dp, lay.pp, lay.tp, lay.grad_accum) == (1, 1, 2, 2)
    assert {m.node for m in result.plan.members} == {"n0", "n1"}
    assert result.speed_ratio == pytest.approx(0.25 / 2)
    # Switched off, nothing fits the two lone ranks.
    with pytest.raises(ShrinkMemoryError, match="no layout fits the 2 surviving ranks"):
        plan_shrink(before, frozenset({"r0", "r3"}),
                    ElasticConfig(costs=COSTS, tp_across_nodes_speed=0))


def test_a_tp_group_that_lost_a_rank_moves_whole_onto_the_spares_of_another_node():
    # (2,1,2): pairs on n0 and n1; n0 loses one rank and has no spare; n2 has two spares.
    # Keeping dp=2 with a fresh pair on n2 beats halving the replicas.
    before = grid(2, 1, 2, partition(COSTS, 1).stages, per_node=2)
    state = PlanState(1, before.layout, before.members,
                      spares=(Member("s0", "n2"), Member("s1", "n2")))
    result = plan_shrink(state, frozenset({"r0"}), ElasticConfig(costs=COSTS))
    lay = result.plan.layout
    assert (lay.dp, lay.pp, lay.tp) == (2, 1, 2)
    moved = {m.rank_id for m in result.plan.members if m.coord.dp == 0}
    assert moved == {"s0", "s1"} and result.plan.reason.startswith("re-form")
    assert "r1" in {s.rank_id for s in result.plan.spares}  # the lone survivor waits


def test_a_node_lost_from_a_thousand_gpus_shrinks_onto_groups_that_hold_their_stages():
    # dp 8 x pp 16 x tp 8 over 128 nodes, no spares, 80 equal layers: dp stays 8 (it must
    # divide the global batch), so the 127 intact TP groups re-form 14 or 15 stages.
    # Each new stage goes to the groups that already hold most of it: about one layer
    # of the 5-6 per stage moves. A from-scratch split moves more than twice as many.
    lay = Layout(8, 16, 8, microbatches=32)
    members = tuple(Member(f"r{r}", f"n{r // 8}", lay.coords(r)) for r in range(1024))
    before = PlanState(1, lay, members)
    result = plan_shrink(before, frozenset(m.rank_id for m in members if m.node == "n3"),
                         ElasticConfig(costs=(1.0,) * 80))
    after = result.plan.layout
    assert (after.dp, after.tp) == (8, 8) and after.pp in (14, 15)
    groups = after.dp * after.pp
    assert result.layers_moved <= 8 * groups * 1.4  # tp x groups x at most ~1.4 layers each
    assert result.layers_moved * 2 < result.layers_moved_naive
