"""The partitioner against brute force: optimal bottleneck, memory caps, fewest layers moved."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.core.partition import Partition, in_flight, partition, uniform

SETTINGS = settings(max_examples=1000, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def all_splits(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        b = [0, *cuts, n]
        yield [(b[j], b[j + 1] - 1) for j in range(p)]


def bottleneck(costs, speeds, split) -> float:
    return max(sum(costs[a:e + 1]) / speeds[j] for j, (a, e) in enumerate(split))


def fits(split, static, act, flights, caps) -> bool:
    return all(sum(static[a:e + 1]) + flights[j] * sum(act[a:e + 1]) <= caps[j]
               for j, (a, e) in enumerate(split))


def moved(split, owners) -> int:
    return sum(1 for j, (a, e) in enumerate(split) for i in range(a, e + 1) if owners[i] != j)


# Subnormal costs (below 2.2e-308) defeat the relative rounding slack; no layer costs that.
cost = st.one_of(st.integers(0, 20).map(float),
                 st.floats(0, 50, allow_nan=False, allow_subnormal=False))


@st.composite
def problems(draw, heavy_last: bool = False):
    n = draw(st.integers(1, 9))
    p = draw(st.integers(1, n))
    costs = draw(st.lists(cost, min_size=n, max_size=n))
    if heavy_last:
        costs[-1] = sum(costs) * draw(st.floats(1, 10)) + 1
    speeds = draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=p, max_size=p))
    return costs, p, speeds


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@SETTINGS
@given(problems())
def test_bottleneck_equals_brute_force_optimum(problem):
    costs, p, speeds = problem
    got = partition(costs, p, speeds)
    best = min(bottleneck(costs, speeds, s) for s in all_splits(len(costs), p))
    assert close(got.bottleneck, best)
    assert close(got.bottleneck, bottleneck(costs, speeds, got.stages))


@SETTINGS
@given(problems(heavy_last=True))
def test_heavy_last_layer_gets_its_own_stage_when_optimal(problem):
    costs, p, speeds = problem
    got = partition(costs, p, speeds)
    best = min(bottleneck(costs, speeds, s) for s in all_splits(len(costs), p))
    assert close(got.bottleneck, best)


@SETTINGS
@given(problems(), st.data())
def test_memory_cap_is_respected_and_the_optimum_under_it_is_found(problem, data):
    costs, p, speeds = problem
    n = len(costs)
    static = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    act = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    caps = data.draw(st.lists(st.integers(2, 30), min_size=p, max_size=p))
    schedule = data.draw(st.sampled_from(["1f1b", "gpipe"]))
    flights = in_flight(schedule, p, 4)
    feasible = [s for s in all_splits(n, p) if fits(s, static, act, flights, caps)]
    if not feasible:
        with pytest.raises(ValueError, match="memory cap too small"):
            partition(costs, p, speeds, mem=static, act=act, mem_cap=caps, schedule=schedule,
                      micro_batches=4)
        return
    got = partition(costs, p, speeds, mem=static, act=act, mem_cap=caps, schedule=schedule,
                    micro_batches=4)
    assert fits(got.stages, static, act, flights, caps)
    assert close(got.bottleneck, min(bottleneck(costs, speeds, s) for s in feasible))


@SETTINGS
@given(problems(), st.data())
def test_tie_break_moves_fewest_layers_among_optimal_splits(problem, data):
    # Integer costs keep sums exact, so "equally good" has no rounding to argue about.
    costs, p, speeds = problem
    costs = [float(round(c)) for c in costs]
    n = len(costs)
    previous = data.draw(st.sampled_from(list(all_splits(n, p))))
    owners = [j for j, (a, e) in enumerate(previous) for _ in range(a, e + 1)]
    got = partition(costs, p, speeds, previous=previous)
    best = min(bottleneck(costs, speeds, s) for s in all_splits(n, p))
    fewest = min(moved(s, owners) for s in all_splits(n, p)
                 if close(bottleneck(costs, speeds, s), best))
    assert close(got.bottleneck, best)
    assert got.layers_moved(previous) == fewest == moved(got.stages, owners)


def test_previous_optimal_split_is_kept_unchanged():
    costs = [1.0, 4, 4, 4, 4, 4, 4, 9]
    first = partition(costs, 3)
    again = partition(costs, 3, previous=first)
    assert again.stages == first.stages
    assert again.layers_moved(first) == 0


def test_stages_are_contiguous_inclusive_and_cover_every_layer():
    part = partition([3.0] * 10 + [20.0], 4)
    assert part.stages[0][0] == 0 and part.stages[-1][1] == 10
    for (_, last), (first, _) in itertools.pairwise(part.stages):
        assert first == last + 1
    assert part.stages[-1] == (10, 10)  # the heavy head alone
    assert isinstance(part, Partition)


def test_faster_device_gets_more_layers():
    part = partition([1.0] * 12, 2, speeds=[1.0, 2.0])
    assert part.stages == ((0, 3), (4, 11))
    assert part.bottleneck == 4.0


def test_more_stages_than_layers_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="cannot split 3 layers into 5 stages.*at most 3"):
        partition([1.0, 2.0, 3.0], 5)


def test_memory_shortfall_names_the_layer_and_the_bytes():
    with pytest.raises(ValueError, match=r"layer 1 alone needs 50 bytes.*short by 20 bytes"):
        partition([1.0, 1.0, 1.0], 2, mem=[10, 50, 10], mem_cap=30)


def test_memory_shortfall_names_the_stage_when_no_split_fits():
    with pytest.raises(ValueError, match=r"stage \d .*short by 4 bytes"):
        partition([1.0, 1.0, 1.0], 2, mem=[5, 5, 5], mem_cap=6)


@pytest.mark.parametrize("bad, message", [
    ({"speeds": [1.0]}, "got 1 speeds for 2 stages"),
    ({"speeds": [1.0, 0.0]}, "speed must be a finite number > 0"),
    ({"mem_cap": [1.0, 2.0, 3.0]}, "3 memory caps for 2 stages"),
    ({"previous": [(0, 1), (3, 3)]}, "not contiguous"),
])
def test_bad_arguments_are_explained(bad, message):
    with pytest.raises(ValueError, match=message):
        partition([1.0, 2.0, 3.0, 4.0], 2, **bad)


def test_negative_cost_is_refused():
    with pytest.raises(ValueError, match="layer 1 cost must be a finite number >= 0"):
        partition([1.0, -1.0], 1)


def test_1f1b_keeps_fewer_micro_batches_in_flight_on_later_stages():
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 8) == [8, 8, 8, 8]
    assert in_flight("1f1b", 4, 2) == [2, 2, 2, 1]


def test_uniform_split_puts_the_remainder_first():
    assert uniform(10, 4) == [(0, 2), (3, 5), (6, 7), (8, 9)]
