"""Hierarchical all-reduce against the flat one, in real gloo processes.

One spawn of 8 ranks checks three layouts at once: 2 nodes x 4 (all ranks), 2 nodes x 2
(ranks 0-3) and an uneven 3 + 1 split (ranks 4-7), so 2 cores start torch only 8 times.
"""

from __future__ import annotations

import datetime

import pytest

LAYOUTS = {
    "2x4": (tuple(range(8)), (0, 0, 0, 0, 1, 1, 1, 1)),
    "2x2": ((0, 1, 2, 3), (0, 0, 1, 1)),
    "3+1": ((4, 5, 6, 7), (0, 0, 0, 1)),
}
SIZES = (1, 7, 1001, 4096)  # elements; 7 and 1001 do not split evenly over 2 or 4 ranks


def _tensor(rank: int, size: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(size, generator=gen, dtype=torch.float32) * 10


def _compare_layouts(ctx) -> dict:
    """Rank body: for each layout this rank belongs to, hier vs flat vs exact float64 sum."""
    import torch
    import torch.distributed as dist

    from stalwart.bench.hier_allreduce import (
        LinkBytes,
        build_hier_groups,
        counting_flat_allreduce,
        hierarchical_allreduce,
        make_reduce_fn,
        time_collective,
    )

    timeout = datetime.timedelta(seconds=60)
    out: dict = {}
    for name, (ranks, nodes) in LAYOUTS.items():
        if ctx.rank not in ranks:
            continue
        index = ranks.index(ctx.rank)
        hier_bytes, flat_bytes = LinkBytes(), LinkBytes()
        groups = build_hier_groups(nodes, store=ctx.store, rank=ctx.rank, ranks=ranks,
                                   tag=f"test/{name}", counter=hier_bytes)
        flat_pg = dist.ProcessGroupGloo(dist.PrefixStore(f"test/{name}/flat/", ctx.store),
                                        index, len(ranks), timeout)
        worst_gap, worst_err = 0.0, 0.0
        for seed, size in enumerate(SIZES):
            hier = torch.zeros(size, 2)[:, 0]  # a strided view: not contiguous
            hier.copy_(_tensor(ctx.rank, size, seed))
            flat = _tensor(ctx.rank, size, seed)
            exact = sum(_tensor(r, size, seed).double() for r in ranks)
            hierarchical_allreduce(hier, groups)
            counting_flat_allreduce(flat, flat_pg, nodes, index, flat_bytes)
            worst_gap = max(worst_gap, (hier - flat).abs().max().item())
            worst_err = max(worst_err, (hier.double() - exact).abs().max().item())
        groups.counter = None  # count only the compared calls above
        via_adapter = _tensor(ctx.rank, 33, 99)
        make_reduce_fn(groups)(via_adapter, flat_pg)
        exact = sum(_tensor(r, 33, 99).double() for r in ranks)
        seconds = time_collective(lambda g=groups: hierarchical_allreduce(torch.ones(256), g),
                                  lambda pg=flat_pg: pg.barrier().wait(), repeats=3)
        out[name] = {"gap": worst_gap, "err": worst_err, "seconds": seconds,
                     "adapter_err": (via_adapter.double() - exact).abs().max().item(),
                     "hier_inter": hier_bytes.total("inter"),
                     "flat_inter": flat_bytes.total("inter"),
                     "hier_intra": hier_bytes.total("intra")}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """One spawn shared by every test here (the `run_ranks` fixture is per test)."""
    from stalwart.client.launch import run_local

    return run_local(_compare_layouts, 8, timeout=120.0)


def _members(results: list[dict], name: str) -> list[dict]:
    return [r[name] for r in results if name in r]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hierarchical_and_flat_allreduce_agree_on_random_fp32_tensors(
        results: list[dict], name: str) -> None:
    members = _members(results, name)
    assert len(members) == len(LAYOUTS[name][0])
    for m in members:
        # |values| ~ 10..40 summed over <= 8 ranks: differences only from summation order
        assert m["gap"] <= 1e-4
        assert m["err"] <= 1e-4
        assert m["adapter_err"] <= 1e-4


@pytest.mark.multiprocess
def test_hierarchical_allreduce_sends_4_7ths_of_the_flat_bytes_across_nodes_on_2x4(
        results: list[dict]) -> None:
    members = _members(results, "2x4")
    hier = sum(m["hier_inter"] for m in members)
    flat = sum(m["flat_inter"] for m in members)
    # flat ring in rank order: 2 crossing edges x 2*7/8 S = 3.5 S; hier: 2 (k-1) S = 2 S,
    # on chunks padded to a multiple of 4 elements
    padded, exact = sum(-(-n // 4) * 4 for n in SIZES), sum(SIZES)
    assert hier / flat == pytest.approx((2 * padded) / (3.5 * exact))
    assert all(m["hier_intra"] > 0 for m in members)
    assert all(m["seconds"] > 0 for m in members)


@pytest.mark.multiprocess
def test_uneven_nodes_reduce_through_one_leader_per_node(results: list[dict]) -> None:
    members = _members(results, "3+1")
    leaders = [m for m in members if m["hier_inter"] > 0]
    assert len(leaders) == 2


def test_link_bytes_are_exported_as_the_daemon_counter_and_reset() -> None:
    from stalwart.bench.hier_allreduce import LinkBytes
    from stalwart.daemon.metrics import Metrics

    counts, metrics = LinkBytes(), Metrics()
    counts.add("inter", "hier_allreduce", 100.0)
    counts.add("intra", "hier_reduce_scatter", 30.0)
    counts.add("intra", "hier_all_gather", 30.0)
    assert counts.total("intra") == 60.0
    assert counts.as_dict()["hier_allreduce"] == {"intra": 0.0, "inter": 100.0}
    counts.export(metrics.link_bytes)
    assert metrics.registry.get_sample_value(
        "stalwart_link_bytes_total", {"link": "inter", "collective": "hier_allreduce"}) == 100.0
    assert counts.total("inter") == 0.0
