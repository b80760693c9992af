"""Re-planning after failures and joins: the new layout, its partition, and who receives what."""

from __future__ import annotations

import pytest

from stalwart.core.partition import partition
from stalwart.core.replan import Layout, replan

COSTS = [1.0] + [3.0] * 8 + [5.0]  # embedding, 8 blocks, heavy head


def pipeline(devices: list[str], dp: int = 1, tp: int = 1) -> Layout:
    pp = len(devices) // (dp * tp)
    return Layout(dp, pp, tp, partition(COSTS, pp).stages, tuple(devices))


def test_losing_a_stage_rebalances_onto_the_survivors_and_moves_few_layers():
    before = pipeline(["a", "b", "c", "d"])
    plan = replan(before, COSTS, failed=["c"], pp_options=[3])
    assert (plan.layout.dp, plan.layout.pp, plan.layout.tp) == (1, 3, 1)
    assert plan.layout.devices == ("a", "b", "d")
    assert plan.partition.bottleneck == partition(COSTS, 3).bottleneck
    # Whatever a survivor already holds it keeps; only the dead stage's layers and the
    # shifts needed for balance travel.
    for rank, layers in plan.receive.items():
        device = plan.layout.devices[rank]
        first, last = before.stages[before.devices.index(device)]
        assert not set(layers) & set(range(first, last + 1))
    assert plan.layers_moved == sum(len(v) for v in plan.receive.values())
    naive = partition(COSTS, 3)
    naive_moved = sum(1 for i, s in enumerate(naive.owners())
                      if plan.layout.devices[s] != _owner(before, i))
    assert plan.layers_moved <= naive_moved


def _owner(layout: Layout, layer: int) -> str:
    for rank, device in enumerate(layout.devices):
        first, last = layout.stages[layout.coords(rank)[1]]
        if first <= layer <= last:
            return device
    raise AssertionError(layer)


def test_losing_a_replica_member_drops_the_broken_replica_and_moves_nothing():
    before = pipeline(["a0", "a1", "b0", "b1"], dp=2)
    # Ranks run tp fastest, then dp, pp slowest: replica 0 is a0 -> b0, replica 1 a1 -> b1.
    plan = replan(before, COSTS, failed=["b1"], pp_options=[2])
    assert (plan.layout.dp, plan.layout.pp) == (1, 2)
    assert plan.layers_moved == 0 and plan.receive == {}
    assert plan.layout.stages == before.stages
    assert plan.layout.devices == ("a0", "b0")


def test_every_layer_has_a_surviving_source_unless_all_holders_died():
    before = pipeline(["a", "b", "c", "d"])
    plan = replan(before, COSTS, failed=["c"], pp_options=[3])
    lost = set(range(*_span(before.stages[2])))
    for layer, holders in plan.sources.items():
        assert "c" not in holders
        assert bool(holders) != (layer in lost)


def _span(bounds: tuple[int, int]) -> tuple[int, int]:
    return bounds[0], bounds[1] + 1


def test_an_added_device_widens_the_pipeline_when_it_is_faster():
    before = pipeline(["a", "b", "c"])
    plan = replan(before, COSTS, added=["d"], microbatches=8, pp_options=[3, 4])
    assert plan.layout.pp == 4 and "d" in plan.layout.devices
    assert plan.partition.bottleneck < partition(COSTS, 3).bottleneck
    new_rank = plan.layout.devices.index("d")
    first, last = plan.layout.stages[plan.layout.coords(new_rank)[1]]
    assert plan.receive[new_rank] == list(range(first, last + 1))


def test_slow_survivor_gets_fewer_layers():
    before = pipeline(["a", "b", "c", "d"])
    plan = replan(before, COSTS, failed=["d"], speeds={"b": 0.5}, pp_options=[3])
    sizes = [last - first + 1 for first, last in plan.layout.stages]
    assert sizes[1] == min(sizes)


def test_tensor_parallel_degree_and_shard_index_are_kept():
    before = Layout(1, 2, 2, partition(COSTS, 2).stages, ("a", "b", "c", "d"))
    plan = replan(before, COSTS, added=["e", "f"], pp_options=[3])
    assert plan.layout.tp == 2
    # "a" held TP shard 0 of stage 0 and keeps shard 0 of its layers where it still can.
    rank = plan.layout.devices.index("a")
    assert plan.layout.coords(rank)[2] == 0


def test_too_few_survivors_for_one_tp_group_is_refused():
    before = Layout(1, 1, 4, ((0, 9),), ("a", "b", "c", "d"))
    with pytest.raises(ValueError, match="one tensor-parallel group needs 4"):
        replan(before, COSTS, failed=["a", "b"])


def test_unknown_failed_device_is_refused():
    with pytest.raises(ValueError, match=r"failed devices \['z'\] are not in the plan"):
        replan(pipeline(["a", "b"]), COSTS, failed=["z"])


def test_survivors_without_memory_for_the_model_fail_naming_the_shortfall():
    before = pipeline(["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="no layout of the 2 surviving devices.*short by"):
        replan(before, COSTS, failed=["c", "d"], mem=[10.0] * 10, mem_cap=40.0)
