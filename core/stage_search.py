"""The search inside a shrink or grow: which surviving TP groups serve which stage.

Groups of the same kind (the layers they hold, their speed) are interchangeable, so
the search runs over multisets of kinds per stage: every assignment when few enough,
else greedy starts, the first aligned with its split (each stage to the groups that
hold most of it), improved by local swaps. Each assignment is scored by the exact
partition (`core/partition.py`) that moves the fewest layers among the fastest.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.core.partition import Splitter

if TYPE_CHECKING:
    from stalwart.core.shrink import ElasticConfig

# Predicted step times within this fraction count as equal; fewer moved layers then win.
TIE = 1e-9
# Swaps scored in a row without a gain before the local search stops trying those that
# move no less under the current split.
PATIENCE = 24


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
    seen = set()
    for skip in range(len(flat) - dp * pp + 1):
        chosen = flat[:dp * pp - skip] + flat[len(flat) - skip:] if skip else flat[:dp * pp]
        chosen.sort(key=lambda k: (k[0] is None, k[0] or (0, 0)))
        start = tuple(tuple(chosen[s * dp:(s + 1) * dp]) for s in range(pp))
        if start not in seen:  # interchangeable groups make many skips the same start
            seen.add(start)
            yield start


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


class Scorer:
    """Scores assignments of one (dp, pp, micro-batches) layout: time, layers moved and
    stage changes, with the partition that moves the fewest layers among the fastest.

    A stage's move costs depend only on its multiset of kinds and the partition's
    bottleneck only on the stage speeds, so both are computed once and reused: a
    search over a large pool scores hundreds of assignments that share them."""

    def __init__(self, costs: list[float], tp: int, config: ElasticConfig,
                 micro: tuple[int, int], pp: int) -> None:
        self.costs, self.tp, self.micro = costs, tp, micro
        self.splitter = Splitter(costs, pp, mem=config.mem, act=config.act,
                                 mem_cap=config.mem_cap, micro_batches=micro[0])
        self._rows: dict[tuple, list[float]] = {}
        self.scored = 0

    def _row(self, combo: tuple) -> list[float]:
        """What each layer costs to place on a stage of these kinds: tp x the groups
        that lack it (a difference array over the held ranges)."""
        row = self._rows.get(combo)
        if row is None:
            n = len(self.costs)
            have = [0] * (n + 1)
            for held, _ in combo:
                if held is not None:
                    a, b = max(held[0], 0), min(held[1], n - 1)
                    if a <= b:
                        have[a] += 1
                        have[b + 1] -= 1
            row, inside = [], 0
            for i in range(n):
                inside += have[i]
                row.append(float(self.tp * (len(combo) - inside)))
            self._rows[combo] = row
        return row

    def placed(self, kind: tuple, bounds: tuple[int, int]) -> float:
        """What one group of `kind` moves on a stage of layers `bounds`."""
        held = kind[0]
        a, b = bounds
        if held is None:
            return float(self.tp * (b - a + 1))
        inside = max(0, min(b, held[1]) - max(a, held[0]) + 1)
        return float(self.tp * (b - a + 1 - inside))

    def gain(self, change: dict[int, tuple], stages: tuple[tuple[int, int], ...]) -> float:
        """What `change` (stage -> (old kind, new kind)) moves more under `stages`."""
        return sum(self.placed(new, stages[s]) - self.placed(old, stages[s])
                   for s, (old, new) in change.items())

    def __call__(self, assignment: tuple[tuple, ...]) -> Candidate:
        """ValueError: no partition fits the memory caps."""
        self.scored += 1
        m, ga = self.micro
        pp, dp = len(assignment), len(assignment[0])
        speeds = [min(k[1] for k in combo) for combo in assignment]
        move = [self._row(combo) for combo in assignment]
        part = self.splitter.split(speeds, move)
        moved = int(sum(move[j][i] for i, j in enumerate(part.owners())))
        changed = sum(k[0] != part.stages[s] for s, combo in enumerate(assignment)
                      for k in combo)
        return Candidate((ga * (m + pp - 1) * part.bottleneck, moved, changed), dp, pp,
                         self.micro, assignment, part.stages)


def pick(best: Candidate | None, other: Candidate | None) -> Candidate | None:
    if other is None:
        return best
    return other if better(*other.key, best) else best


def improve(best: Candidate, kinds: Counter, score: Scorer, budget: list[int]) -> Candidate:
    """Local search from a greedy assignment: swap kinds between neighbouring stages or
    with unused ranks while that helps and budget[0] evaluations are left (pools too big
    to enumerate)."""
    improved = True
    while improved and budget[0] > 0:
        improved = False
        cur = best.assignment
        used = Counter(k for combo in cur for k in combo)
        unused = [k for k in kinds if kinds[k] > used[k]]
        changes = []
        for s in range(len(cur)):
            for k1 in set(cur[s]):
                swaps = [(s + 1, k2) for k2 in set(cur[s + 1]) if k2 != k1] \
                    if s + 1 < len(cur) else []
                changes += [{s: (k1, k2), t: (k2, k1)} for t, k2 in swaps]
                changes += [{s: (k1, k2)} for k2 in unused if k2 != k1]
        # Most promising first: what the swap moves under the current split (a swap that
        # already moves less there can only move less once split again).
        gains = [(score.gain(change, best.stages), i) for i, change in enumerate(changes)]
        misses = 0
        for gain, i in sorted(gains):
            change = changes[i]
            if budget[0] <= 0 or (misses >= PATIENCE and gain >= 0):
                break  # what is left moves no less under this split: rarely a gain
            budget[0] -= 1
            other = score(swap(cur, change))
            if better(*other.key, best):
                best, improved = other, True
                break
            misses += 1
    return best


def align(start: Candidate, kinds: Counter, score: Scorer, budget: list[int]) -> Candidate:
    """Alternate the two halves of the problem from `start`: give each stage of the
    current split the groups that already hold most of it, split again for that
    assignment, while that helps (a few rounds; each costs one score). Local swaps
    alone crawl on a large pool, one group per round."""
    best = start
    while budget[0] > 0:
        assignment = holders_first(kinds, best.stages, best.dp)
        if assignment == best.assignment:
            break
        budget[0] -= 1
        other = score(assignment)
        if not better(*other.key, best):
            break
        best = other
    return best


def holders_first(kinds: Counter, stages: tuple[tuple[int, int], ...], dp: int
                  ) -> tuple[tuple, ...]:
    """dp group kinds per stage, cheapest (kind, stage) pairs first: fewest of the
    stage's layers missing, then the fastest."""
    def missing(held: tuple[int, int] | None, a: int, b: int) -> int:
        if held is None:
            return b - a + 1
        return b - a + 1 - max(0, min(b, held[1]) - max(a, held[0]) + 1)

    left, slots = Counter(kinds), [dp] * len(stages)
    combos: list[list] = [[] for _ in stages]
    for _, _, _, s, k in sorted((missing(k[0], a, b), -k[1], repr(k), s, k)
                                for k in kinds for s, (a, b) in enumerate(stages)):
        take = min(left[k], slots[s])
        if take:
            combos[s] += [k] * take
            left[k] -= take
            slots[s] -= take
    return tuple(tuple(sorted(c, key=repr)) for c in combos)


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
