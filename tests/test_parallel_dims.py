"""ParallelDims: degrees checked against the world, coordinates, groups per generation,
and rebuilds that leave no threads or file descriptors behind. Also the launcher's
failure reporting, which every multi-process test relies on."""

from __future__ import annotations

import os

import pytest
import torch

from stalwart.client.launch import RankFailure
from stalwart.client.parallel_dims import Coords, ParallelDims


def test_product_of_degrees_must_equal_world_size():
    with pytest.raises(ValueError, match="product is 8"):
        ParallelDims(dp=2, pp=2, tp=1, world_size=8)
    with pytest.raises(ValueError, match=">= 1"):
        ParallelDims(dp=0, pp=1, tp=1)
    assert ParallelDims(dp=2, pp=2, tp=2).world_size == 8


def test_coordinates_cover_the_grid_once_with_tp_fastest():
    dims = ParallelDims(dp=2, pp=3, tp=2)
    coords = [dims.coords(r) for r in range(12)]
    assert len(set(coords)) == 12
    assert coords[0] == Coords(dp=0, pp=0, tp=0)
    assert coords[1] == Coords(dp=0, pp=0, tp=1)
    assert coords[2] == Coords(dp=1, pp=0, tp=0)
    assert coords[4] == Coords(dp=0, pp=1, tp=0)
    assert all(dims.rank_of(c) == r for r, c in enumerate(coords))
    with pytest.raises(ValueError, match="outside"):
        dims.coords(12)


def test_group_members_differ_only_along_their_axis():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.members(5, "tp") == (4, 5)
    assert dims.members(5, "dp") == (5, 7)
    assert dims.members(5, "pp") == (1, 5)


def test_groups_are_not_usable_before_build():
    with pytest.raises(RuntimeError, match="not built"):
        _ = ParallelDims(dp=1, pp=1, tp=1).dp_group


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _rebuild_twenty_times(ctx) -> dict:
    dims = ParallelDims(dp=2, pp=1, tp=2)
    dims.build(ctx.store, ctx.rank, 0).world.barrier()
    dims.destroy()
    before = _counts()
    sums = []
    for generation in range(1, 21):
        dims.build(ctx.store, ctx.rank, generation)
        t = torch.tensor([float(ctx.rank + generation)])
        dims.tp_group.all_reduce(t)
        dims.dp_group.all_reduce(t)
        sums.append(t.item())
        dims.destroy()
    return {"before": before, "after": _counts(), "sums": sums}


@pytest.mark.multiprocess
def test_rebuilding_groups_twenty_times_leaks_no_threads_or_fds(run_ranks):
    results = run_ranks(_rebuild_twenty_times, 4, timeout=120)
    for rank, res in enumerate(results):
        assert res["after"] == res["before"], f"rank {rank}: (threads, fds) changed"
        # Every generation's groups really communicated: sum over all 4 ranks.
        assert res["sums"] == [float(6 + 4 * g) for g in range(1, 21)]


def _fail_on_rank_one(ctx) -> None:
    if ctx.rank == 1:
        raise ValueError("rank one was told to fail")
    ctx.store.wait(["key that never appears"])


@pytest.mark.multiprocess
def test_a_failing_rank_is_reported_with_its_traceback(run_ranks):
    with pytest.raises(RankFailure, match="rank one was told to fail"):
        run_ranks(_fail_on_rank_one, 2, timeout=60)
