"""ParallelDims: a layout checked against the world, groups per generation, and rebuilds
that leave no threads or file descriptors behind. Also the launcher's failure reporting,
which every multi-process test relies on."""

from __future__ import annotations

import os

import pytest
import torch

from stalwart.client.launch import RankFailure
from stalwart.client.parallel_dims import ParallelDims
from stalwart.core.layout import Layout


def test_the_layout_must_cover_the_world_it_is_built_in():
    with pytest.raises(ValueError, match="product is 8"):
        ParallelDims(Layout(dp=2, pp=2, tp=1), world_size=8)
    dims = ParallelDims(Layout(dp=2, pp=2, tp=2), world_size=8)
    assert (dims.layout.dp, dims.layout.pp, dims.layout.tp, dims.layout.world_size) == (2, 2, 2, 8)


def test_without_a_layout_a_single_rank_runs_alone():
    assert ParallelDims().layout == Layout(dp=1, pp=1, tp=1)


def test_groups_are_not_usable_before_build():
    with pytest.raises(RuntimeError, match="not built"):
        _ = ParallelDims().dp_group
    with pytest.raises(RuntimeError, match="not built"):
        _ = ParallelDims().my


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _rebuild_twenty_times(ctx) -> dict:
    dims = ParallelDims(Layout(dp=2, pp=1, tp=2))
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
def test_nccl_communicators_are_aborted_inside_one_group_call():
    """Aborted one by one, NCCL communicators can deadlock on each other's kernels."""
    from stalwart.client.parallel_dims import Group

    calls: list[str] = []

    class NcclLike:
        def __init__(self, name: str) -> None:
            self.name = name

        def _group_start(self) -> None:
            calls.append("start")

        def _group_end(self) -> None:
            calls.append("end")

        def abort(self) -> None:
            calls.append(f"abort {self.name}")

    dims = ParallelDims()
    dims.groups = {name: Group(name, (0,), 0, NcclLike(name)) for name in ("dp", "tp")}
    dims.abort()
    assert calls == ["start", "abort dp", "abort tp", "end"] and not dims.groups


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
