"""The search inside a shrink or grow: which surviving TP groups serve which stage.

Groups of the same kind (the layers they hold, their speed) are interchangeable, so
the search runs over multisets of kinds per stage: every assignment when few enough,
else greedy starts improved by local swaps. Each assignment is scored by the exact
partition (`core/partition.py`) that moves the fewest layers among the fastest.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.core.partition import partition

if TYPE_CHECKING:
    from stalwart.core.shrink import ElasticConfig

# Predicted step times within this fraction count as equal; fewer moved layers then win.
TIE = 1e-9


def assignments(kinds: Counter, dp: int, pp: int) -> Iterator[tuple[tuple, ...]]:
    """Every way to give each stage a multiset of dp group kinds (stage order matters)."""
    order = sorted(kinds, key=repr)

    def rec(stage: int, left: Counter) -> Iterator[list[tuple]]:
        if stage == pp:
            yield []
            return
        for combo in itertools.combinations_with_replacement(order, dp):
            need = Counter(combo)
            if all(left[k] >= c for k, c in need.items()):
                for tail in rec(stage + 1, left - need):
                    yield [combo, *tail]
    for a in rec(0, Counter(kinds)):
        yield tuple(a)


def greedy_assignments(kinds: Counter, dp: int, pp: int) -> Iterator[tuple[tuple, ...]]:
    """A few monotone assignments (kinds in layer order) for pools too big to enumerate."""
    flat = [k for k in sorted(kinds, key=lambda k: (k[0] is None, k[0] or (0, 0), -k[1]))
            for _ in range(kinds[k])]
    for skip in range(len(flat) - dp * pp + 1):
        chosen = flat[:dp * pp - skip] + flat[len(flat) - skip:] if skip else flat[:dp * pp]
        chosen.sort(key=lambda k: (k[0] is None, k[0] or (0, 0)))
        yield tuple(tuple(chosen[s * dp:(s + 1) * dp]) for s in range(pp))


def lacks(held: tuple[int, int] | None, layer: int) -> bool:
    return held is None or not held[0] <= layer <= held[1]


@dataclass
class Candidate:
    key: tuple[float, int, int]
    dp: int
    pp: int
    micro: tuple[int, int]
    assignment: tuple[tuple, ...]
    stages: tuple[tuple[int, int], ...]


def better(step: float, moved: int, changed: int, best: Candidate | None) -> bool:
    if best is None:
        return True
    b_step, b_moved, b_changed = best.key
    if step < b_step * (1 - TIE):
        return True
    return step <= b_step * (1 + TIE) and (moved, changed) < (b_moved, b_changed)


def evaluate(assignment: tuple[tuple, ...], costs: list[float], tp: int,
              config: ElasticConfig, micro: tuple[int, int]) -> Candidate:
    """Time, layers moved and stage changes of one rank-kind-to-stage assignment, with
    the partition that moves the fewest layers among the fastest (ValueError: no fit)."""
    m, ga = micro
    pp, dp = len(assignment), len(assignment[0])
    speeds = [min(k[1] for k in combo) for combo in assignment]
    move = [[float(tp * sum(lacks(k[0], i) for k in combo)) for i in range(len(costs))]
            for combo in assignment]
    part = partition(costs, pp, speeds, mem=config.mem, act=config.act, mem_cap=config.mem_cap,
                     micro_batches=m, move_costs=move)
    moved = int(sum(move[j][i] for i, j in enumerate(part.owners())))
    changed = sum(k[0] != part.stages[s] for s, combo in enumerate(assignment) for k in combo)
    return Candidate((ga * (m + pp - 1) * part.bottleneck, moved, changed), dp, pp, micro,
                 assignment, part.stages)


def pick(best: Candidate | None, other: Candidate | None) -> Candidate | None:
    if other is None:
        return best
    return other if better(*other.key, best) else best


def improve(best: Candidate, kinds: Counter, costs: list[float], tp: int, config: ElasticConfig,
             micro: tuple[int, int], budget: list[int]) -> Candidate:
    """Local search from a greedy assignment: swap kinds between neighbouring stages or
    with unused ranks while that helps and budget[0] evaluations are left (pools too big
    to enumerate)."""
    improved = True
    while improved and budget[0] > 0:
        improved = False
        cur = best.assignment
        used = Counter(k for combo in cur for k in combo)
        unused = [k for k in kinds if kinds[k] > used[k]]
        tries = []
        for s in range(len(cur)):
            for k1 in set(cur[s]):
                swaps = [(s + 1, k2) for k2 in set(cur[s + 1]) if k2 != k1] \
                    if s + 1 < len(cur) else []
                for t, k2 in swaps:
                    tries.append(swap(cur, {s: (k1, k2), t: (k2, k1)}))
                tries += [swap(cur, {s: (k1, k2)}) for k2 in unused if k2 != k1]
        for cand in tries:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            other = evaluate(cand, costs, tp, config, micro)
            if better(*other.key, best):
                best, improved = other, True
                break
    return best


def swap(assignment: tuple[tuple, ...], change: dict[int, tuple]) -> tuple[tuple, ...]:
    """`assignment` with one kind replaced per stage: change[stage] = (old kind, new kind)."""
    out = []
    for s, combo in enumerate(assignment):
        if s in change:
            old, new = change[s]
            combo = list(combo)
            combo[combo.index(old)] = new
            combo = tuple(sorted(combo, key=repr))
        out.append(combo)
    return tuple(out)
