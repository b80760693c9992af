"""The (dp, pp, tp) grid: rank numbering, groups, and the protocol message, checked against
brute force over small layouts."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.core.layout import AXES, Coord, Layout
from stalwart.daemon.rpc.validate import InvalidRequest, request
from stalwart.v1 import common_pb2

layouts = st.builds(Layout, dp=st.integers(1, 5), pp=st.integers(1, 5), tp=st.integers(1, 5))


def test_ranks_are_numbered_tp_fastest_then_dp_then_pp() -> None:
    layout = Layout(dp=2, pp=3, tp=2)
    assert layout.coords(0) == Coord(0, dp=0, pp=0, tp=0)
    assert layout.coords(1) == Coord(1, dp=0, pp=0, tp=1)
    assert layout.coords(2) == Coord(2, dp=1, pp=0, tp=0)
    assert layout.coords(4) == Coord(4, dp=0, pp=1, tp=0)
    assert layout.coords(11) == Coord(11, dp=1, pp=2, tp=1)
    assert layout.rank_of(dp=1, pp=2, tp=0) == 10


@given(layouts)
def test_coordinates_enumerate_the_grid_pp_outermost(layout: Layout) -> None:
    grid = itertools.product(range(layout.pp), range(layout.dp), range(layout.tp))
    assert [(c.pp, c.dp, c.tp) for c in map(layout.coords, range(layout.world_size))] == list(grid)


@given(layouts)
def test_every_rank_round_trips_through_its_coordinates(layout: Layout) -> None:
    assert layout.world_size == layout.dp * layout.pp * layout.tp
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert c.rank == rank
        assert layout.rank_of(c.dp, c.pp, c.tp) == rank


def test_a_group_holds_the_ranks_that_differ_only_along_its_axis() -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    assert layout.group(5, "tp") == (4, 5)
    assert layout.group(5, "dp") == (5, 7)
    assert layout.group(5, "pp") == (1, 5)


@given(layouts, st.sampled_from(AXES))
def test_the_groups_of_an_axis_partition_the_world(layout: Layout, axis: str) -> None:
    groups = layout.groups(axis)
    size = getattr(layout, axis)
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    assert len(groups) == layout.world_size // size
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    for g in groups:
        assert [getattr(layout.coords(r), axis) for r in g] == list(range(size))
        others = {tuple(getattr(layout.coords(r), a) for a in AXES if a != axis) for r in g}
        assert len(others) == 1
        assert all(layout.group(r, axis) == g for r in g)


@given(layouts)
def test_pipeline_pairs_join_neighbouring_stages_of_each_replica_and_shard(
        layout: Layout) -> None:
    pairs = layout.pp_pairs()
    assert len(pairs) == layout.dp * layout.tp * (layout.pp - 1)
    for a, b in pairs:
        ca, cb = layout.coords(a), layout.coords(b)
        assert (ca.dp, ca.tp, ca.pp + 1) == (cb.dp, cb.tp, cb.pp)


def test_the_layout_round_trips_through_its_protocol_message() -> None:
    layout = Layout(dp=2, pp=3, tp=4, stages=((0, 3), (4, 7), (8, 9)), schedule="gpipe",
                    microbatches=6, grad_accum=2)
    msg = layout.to_proto()
    assert isinstance(msg, common_pb2.ParallelLayout)
    assert (msg.dp, msg.pp, msg.tp, msg.schedule) == (2, 3, 4, "gpipe")
    assert [(s.first_layer, s.last_layer) for s in msg.stages] == [(0, 3), (4, 7), (8, 9)]
    assert Layout.from_proto(msg) == layout


def test_unequal_shares_split_the_steps_micro_batches_consecutively() -> None:
    # 7 micro-batches over 3 replicas: 3 + 2 + 2, in global batch order.
    layout = Layout(dp=3, grad_accum=3, microbatch_total=7)
    assert [layout.replica_microbatches(d) for d in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert layout.total_microbatches == 7
    assert Layout.from_proto(layout.to_proto()) == layout
    even = Layout(dp=2, microbatches=2, grad_accum=3)
    assert [even.replica_microbatches(d) for d in range(2)] == [(0, 6), (6, 6)]


@pytest.mark.parametrize("fields", [
    {"dp": 2, "pp": 2, "grad_accum": 2, "microbatch_total": 3},  # a pipeline
    {"dp": 2, "microbatches": 2, "grad_accum": 1, "microbatch_total": 3},
    {"dp": 4, "grad_accum": 1, "microbatch_total": 3},  # a replica without a share
    {"dp": 2, "grad_accum": 3, "microbatch_total": 3},  # grad_accum not the largest share
])
def test_unequal_shares_a_layout_cannot_run_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match="microbatch_total=3 needs pp=1"):
        Layout(**fields)
    with pytest.raises(InvalidRequest, match="plan.layout.microbatch_total 3 does not fit"):
        request(common_pb2.Plan(layout=common_pb2.ParallelLayout(**fields)))


def test_unset_fields_of_the_message_take_their_defaults() -> None:
    assert Layout.from_proto(common_pb2.ParallelLayout()) == Layout(1, 1, 1)
    assert Layout.from_proto(common_pb2.ParallelLayout(tp=2), world_size=8) == Layout(4, 1, 2)


def test_a_coordinate_round_trips_through_its_protocol_message() -> None:
    coord = Coord(rank=7, dp=1, pp=1, tp=1)
    assert Coord.from_proto(coord.to_proto()) == coord


@pytest.mark.parametrize("rank", [-1, 12, 100])
def test_a_rank_outside_the_world_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=f"rank {rank} is outside .* world of 12 ranks"):
        Layout(dp=2, pp=3, tp=2).coords(rank)


@pytest.mark.parametrize("coords", [(2, 0, 0), (0, 3, 0), (0, 0, 2), (-1, 0, 0)])
def test_coordinates_outside_the_grid_are_refused(coords: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="outside the 2x3x2 grid"):
        Layout(dp=2, pp=3, tp=2).rank_of(*coords)


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("degree", [0, -1])
def test_a_degree_below_one_is_refused(axis: str, degree: int) -> None:
    with pytest.raises(ValueError, match=f"{axis}={degree}: every parallel degree must be >= 1"):
        Layout(**{axis: degree})


def test_an_unknown_axis_is_refused() -> None:
    with pytest.raises(ValueError, match="'ep' is not a parallel axis"):
        Layout(2, 2, 2).groups("ep")
