"""Specs for shard placement, protection margins and repair plans (pure, in-process)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.core.placement import (
    S3,
    ChunkPlacement,
    Node,
    PlacementError,
    chunk_margin,
    decodable,
    place_chunk,
    recoverable_steps,
    repair_plan,
    step_margin,
)


def cluster(n: int, racks: int = 1) -> list[Node]:
    return [Node(f"n{i}", {"rack": f"r{i % racks}"}) for i in range(n)]


codes = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (3, 3)])


@settings(max_examples=80, deadline=None)
@given(km=codes, extra=st.integers(0, 6), racks=st.integers(1, 5), chunk=st.text(max_size=20))
def test_shards_go_to_distinct_nodes_and_spread_over_racks(km, extra, racks, chunk):
    k, m = km
    nodes = cluster(k + m + extra, racks)
    p = place_chunk(chunk, k, m, nodes)
    holders = [hs[0] for hs in p.holders]
    assert len(set(holders)) == k + m
    rack_of = {n.name: n.labels["rack"] for n in nodes}
    used = {rack_of[h] for h in holders}
    assert len(used) == min(k + m, racks)
    assert place_chunk(chunk, k, m, list(reversed(nodes))) == p


def test_load_spreads_over_nodes_by_chunk_id():
    nodes = cluster(8)
    counts = {n.name: 0 for n in nodes}
    for c in range(400):
        for hs in place_chunk(f"step7/rank0/{c}", 2, 1, nodes).holders:
            counts[hs[0]] += 1
    assert min(counts.values()) > 0.5 * (400 * 3 / 8)


def test_zones_are_spread_before_racks():
    nodes = [Node(f"n{i}", {"zone": f"z{i // 4}", "rack": f"r{i // 2}"}) for i in range(8)]
    p = place_chunk("c", 1, 1, nodes)
    zones = {next(n.labels["zone"] for n in nodes if n.name == hs[0]) for hs in p.holders}
    assert len(zones) == 2


def test_too_few_nodes_is_a_clear_error():
    with pytest.raises(PlacementError, match="need 6 distinct nodes, only 4"):
        place_chunk("c", 4, 2, cluster(4))


def test_parity_to_s3_needs_only_k_nodes_and_survives_any_node_loss_up_to_m():
    p = place_chunk("c", 2, 2, cluster(2), parity_to="s3")
    assert p.holders[2:] == ((S3,), (S3,))
    assert chunk_margin(p) == 2
    assert decodable(p, {"n0", "n1"})


def test_parity_to_both_keeps_a_copy_on_a_node_and_in_s3():
    p = place_chunk("c", 2, 1, cluster(3), parity_to="both")
    assert len(p.holders[2]) == 2 and S3 in p.holders[2]


@settings(max_examples=60, deadline=None)
@given(km=codes, extra=st.integers(0, 3), data=st.data())
def test_margin_matches_brute_force(km, extra, data):
    k, m = km
    nodes = cluster(k + m + extra)
    p = place_chunk("chunk", k, m, nodes)
    lost = set(data.draw(st.sets(st.sampled_from([n.name for n in nodes]), max_size=m + 1)))
    margin = chunk_margin(p, lost)
    live = [n.name for n in nodes if n.name not in lost]
    if not decodable(p, lost):
        assert margin == -1
        return
    # The margin is the largest r such that every r further losses leave it decodable.
    worst = next((r - 1 for r in range(1, len(live) + 1)
                  if any(not decodable(p, lost | set(c))
                         for c in itertools.combinations(live, r))), len(live))
    assert margin == worst
    assert margin == m - len(lost & {hs[0] for hs in p.holders})


def test_step_margin_is_its_weakest_chunk_and_recoverable_steps_are_newest_first():
    weak = ChunkPlacement("a", 2, 1, (("n0",), ("n1",), ("n2",)))
    strong = ChunkPlacement("b", 2, 2, (("n0",), ("n1",), ("n2",), ("n3",)))
    assert step_margin([weak, strong]) == 1
    steps = {10: [weak], 11: [strong]}
    assert recoverable_steps(steps, {"n0", "n1"}) == [11]
    assert recoverable_steps(steps, {"n3"}) == [11, 10]
    assert step_margin([weak], {"n0", "n1"}) == -1


def test_repair_recreates_lost_shards_on_free_nodes_and_restores_the_margin():
    nodes = cluster(6)
    placements = [place_chunk(f"c{i}", 2, 2, nodes) for i in range(20)]
    lost = {"n3"}
    plan = repair_plan(placements, lost, nodes)
    assert not plan.unrecoverable and not plan.unplaceable
    lost_shards = {(p.chunk_id, i) for p in placements
                   for i, hs in enumerate(p.holders) if hs[0] in lost}
    assert {(t.chunk_id, t.index) for t in plan.tasks} == lost_shards
    by_id = {p.chunk_id: p for p in placements}
    for t in plan.tasks:
        p = by_id[t.chunk_id]
        assert t.target not in lost and t.target not in {hs[0] for hs in p.holders}
        assert len(t.sources) == 2 and all(node not in lost for _, node in t.sources)
        holders = list(p.holders)
        holders[t.index] = (t.target,)
        assert chunk_margin(ChunkPlacement(p.chunk_id, 2, 2, tuple(holders)), lost) == 2


def test_repair_reports_unrecoverable_and_unplaceable_chunks():
    p = ChunkPlacement("c", 2, 1, (("n0",), ("n1",), ("n2",)))
    plan = repair_plan([p], {"n0", "n1"}, cluster(4))
    assert plan.unrecoverable == ["c"] and not plan.tasks
    plan = repair_plan([p], {"n0"}, cluster(3))
    assert plan.unplaceable == [("c", 0)]


def test_a_large_cluster_places_each_chunk_among_a_window_and_still_spreads_the_load():
    # 2,048 daemons in 64 racks: a chunk chooses among the WINDOW nodes after its hash on
    # the ring, so its cost does not grow with the cluster; every node still gets shards.
    nodes = cluster(2048, racks=64)
    counts = dict.fromkeys((n.name for n in nodes), 0)
    for c in range(3000):
        p = place_chunk(f"9/{c % 8}/c{c}", 4, 2, nodes)
        holders = [hs[0] for hs in p.holders]
        assert len(set(holders)) == 6
        assert len({int(h[1:]) % 64 for h in holders}) == 6  # six racks
        for h in holders:
            counts[h] += 1
    mean = 3000 * 6 / 2048
    assert max(counts.values()) < 3 * mean
    assert sum(c > 0 for c in counts.values()) > 0.95 * 2048
    assert place_chunk("x", 4, 2, list(reversed(nodes))) == place_chunk("x", 4, 2, nodes)


def test_losing_one_node_of_a_large_cluster_moves_few_placements():
    nodes = cluster(2048, racks=64)
    fewer = [n for n in nodes if n.name != "n1000"]
    chunks = [f"3/0/c{c}" for c in range(1000)]
    moved = sum(place_chunk(c, 4, 2, nodes) != place_chunk(c, 4, 2, fewer) for c in chunks)
    held = sum(any(hs[0] == "n1000" for hs in place_chunk(c, 4, 2, nodes).holders)
               for c in chunks)
    assert moved >= held  # every chunk it held must move
    assert moved <= 30    # and few others (consistent hashing of the windows)
