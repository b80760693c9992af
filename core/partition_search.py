"""The search behind `core.partition.partition`: prefix sums, the feasibility test, the
bisection on the bottleneck and the fewest-moves tie-break (a sliding-window DP).

Pure arithmetic over per-layer costs, speeds and memory; `partition.py` validates
the inputs and turns the bounds found here into a `Partition`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Relative width at which the bisection on the bottleneck stops; the answer is
# then an achieved stage time, optimal up to this rounding.
_REL_TOL = 1e-12
_MAX_PROBES = 200
_SLACK = 1 + 1e-12


@dataclass
class Memory:
    """Per-layer bytes, per-stage micro-batches in flight and caps."""

    static: list[float]
    act: list[float]
    flights: list[int]
    caps: list[float]


class Problem:
    """Prefix sums and the feasibility test shared by the search and the tie-break."""

    def __init__(self, costs: Sequence[float], speeds: list[float], memory: Memory | None):
        self.n, self.p = len(costs), len(speeds)
        self.costs = [float(c) for c in costs]
        self.speeds = speeds
        self.memory = memory
        self.prefix = [0.0]
        for c in self.costs:
            self.prefix.append(self.prefix[-1] + c)
        # Layers by decreasing cost (as the prefix sums see it): the ones too heavy for a
        # stage at a bound are a prefix of this order, found by bisection.
        single = [self.prefix[i + 1] - self.prefix[i] for i in range(self.n)]
        self.by_cost = sorted(range(self.n), key=lambda i: -single[i])
        self.sorted_neg = [-single[i] for i in self.by_cost]
        self.mem_prefix: list[list[float]] = []
        self.by_need: list[tuple[list[int], list[float]]] = []
        if memory is not None:
            cache: dict[int, tuple[list[float], tuple[list[int], list[float]]]] = {}
            for f in memory.flights:
                if f not in cache:
                    acc = [0.0]
                    for s, a in zip(memory.static, memory.act, strict=True):
                        acc.append(acc[-1] + s + f * a)
                    need = [acc[i + 1] - acc[i] for i in range(self.n)]
                    order = sorted(range(self.n), key=lambda i, need=need: -need[i])
                    cache[f] = (acc, (order, [-need[i] for i in order]))
                self.mem_prefix.append(cache[f][0])
                self.by_need.append(cache[f][1])

    # -- stage limits at a bottleneck bound --------------------------------------------

    def cost_fits(self, a: int, e: int, j: int, bound: float) -> bool:
        # The slack absorbs rounding in bound * speed (c / s * s can land below c).
        return self.prefix[e + 1] - self.prefix[a] <= bound * self.speeds[j] * _SLACK

    def mem_fits(self, a: int, e: int, j: int, extra: float = 0.0) -> bool:
        if self.memory is None:
            return True
        pre = self.mem_prefix[j]
        return pre[e + 1] - pre[a] <= self.memory.caps[j] + extra

    def reach(self, a: int, j: int, bound: float, extra: float = 0.0) -> int:
        """Last layer e such that layers a..e fit stage j (a - 1 when none does)."""
        limit = self.n - 1
        if bound != math.inf:
            room = bound * self.speeds[j] * _SLACK
            e = bisect.bisect_right(self.prefix, self.prefix[a] + room) - 2
            e = max(min(e, limit), a - 1)
            # The bisection works on P[a] + B*s; fits() works on P[e+1] - P[a]: reconcile.
            while e >= a and not self.cost_fits(a, e, j, bound):
                e -= 1
            while e < limit and self.cost_fits(a, e + 1, j, bound):
                e += 1
            limit = e
        if self.memory is not None:
            pre, cap = self.mem_prefix[j], self.memory.caps[j] + extra
            e = bisect.bisect_right(pre, pre[a] + cap) - 2
            e = max(min(e, limit), a - 1)
            while e >= a and not self.mem_fits(a, e, j, extra):
                e -= 1
            while e < limit and self.mem_fits(a, e + 1, j, extra):
                e += 1
            limit = e
        return limit

    def bad(self, j: int, bound: float, extra: float = 0.0) -> set[int]:
        """Layers that do not fit stage j even alone."""
        out: set[int] = set()
        if bound != math.inf:
            k = bisect.bisect_left(self.sorted_neg, -bound * self.speeds[j] * _SLACK)
            out.update(self.by_cost[:k])
        if self.memory is not None:
            order, neg = self.by_need[j]
            out.update(order[:bisect.bisect_left(neg, -(self.memory.caps[j] + extra))])
        return out

    # -- feasibility: the exact set of reachable stage ends, as sorted intervals ---------

    def feasible(self, bound: float, extra: float = 0.0) -> bool:
        """Whether some split has every stage time <= bound and memory <= cap + extra."""
        ends = [(-1, -1)]
        for j in range(self.p):
            bad = sorted(self.bad(j, bound, extra))
            bad_set = set(bad)
            spans: list[tuple[int, int]] = []
            for h1, h2 in ends:
                lo, hi = h1 + 1, min(h2 + 1, self.n - 1)
                while lo <= hi and lo in bad_set:
                    lo += 1
                while hi >= lo and hi in bad_set:
                    hi -= 1
                if lo > hi:
                    continue
                # Starts lo..hi are contiguous and R(a) only grows with a, so the ends they
                # reach are [lo, R(hi)] less the layers too big for this stage alone (which
                # all lie in [lo, hi]: past hi the segment from hi fits).
                first = lo
                for b in bad[bisect.bisect_left(bad, lo):bisect.bisect_right(bad, hi)]:
                    spans.append((first, b - 1))
                    first = b + 1
                spans.append((first, self.reach(hi, j, bound, extra)))
            ends = merge(spans)
            if not ends:
                return False
        return ends[-1][1] == self.n - 1

    def min_bottleneck(self) -> float:
        """The smallest feasible bottleneck, found by bisection to a relative 1e-12."""
        total = self.prefix[-1]
        if total == 0.0:
            return 0.0
        lo = total / sum(self.speeds) * (1 - 1e-9)
        if self.feasible(lo):
            return lo
        hi = total / min(self.speeds)
        for _ in range(_MAX_PROBES):
            if hi - lo <= _REL_TOL * hi:
                break
            mid = (lo + hi) / 2
            if self.feasible(mid):
                hi = mid
            else:
                lo = mid
        return hi

    # -- tie-break: fewest layers moved among splits within the bound --------------------

    def min_moves(self, bound: float,
                  move_costs: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
        """Exact DP over (stage, last layer) with a sliding-window minimum over starts."""
        n, p = self.n, self.p
        inf = math.inf
        prev = [inf] * n  # prev[e]: fewest moves for layers 0..e in the stages so far
        choice: list[list[int]] = []
        for j in range(p):
            moved = [0.0] * (n + 1)  # prefix sums of this stage's move costs
            for i, c in enumerate(move_costs[j]):
                moved[i + 1] = moved[i] + c
            cur = [inf] * n
            starts = [-1] * n
            window: deque[tuple[int, float]] = deque()
            nxt = j  # next start to enter the window
            first_start = 0
            for e in range(j, n - (p - 1 - j)):
                # Starts a with a..e fitting stage j; the smallest one only grows with e.
                while first_start <= e and not (self.cost_fits(first_start, e, j, bound)
                                                and self.mem_fits(first_start, e, j)):
                    first_start += 1
                while nxt <= e:
                    base = 0.0 if nxt == 0 else prev[nxt - 1]
                    if base < inf and (j > 0 or nxt == 0):
                        val = base - moved[nxt]
                        while window and window[-1][1] > val:
                            window.pop()
                        window.append((nxt, val))
                    nxt += 1
                while window and window[0][0] < first_start:
                    window.popleft()
                if window:
                    a, val = window[0]
                    cur[e] = val + moved[e + 1]
                    starts[e] = a
            choice.append(starts)
            prev = cur
        if prev[n - 1] == inf:
            raise AssertionError("no split within the optimal bottleneck; this is a bug")
        bounds = []
        e = n - 1
        for j in range(p - 1, -1, -1):
            a = choice[j][e]
            bounds.append((a, e))
            e = a - 1
        return bounds[::-1]

    # -- reporting ---------------------------------------------------------------------

    def memory_shortfall_message(self) -> str:
        """Why no split fits the memory caps, in bytes, naming the layer or stage."""
        assert self.memory is not None
        n, p = self.n, self.p
        alone = [self.bad(j, math.inf) for j in range(p)]
        for i in range(n):
            # Layer i can only sit on stages that leave one layer for every other stage.
            allowed = range(max(0, i - (n - p)), min(p - 1, i) + 1)
            if all(i in alone[j] for j in allowed):
                j = min(allowed, key=lambda s: self._need(i, i, s) - self.memory.caps[s])
                need, cap = self._need(i, i, j), self.memory.caps[j]
                return (f"memory cap too small: layer {i} alone needs {need:,.0f} bytes on "
                        f"stage {j} (cap {cap:,.0f}), short by {need - cap:,.0f} bytes; raise "
                        f"the cap, recompute activations, or shard the layer with TP")
        lo, hi = 0.0, float(sum(self._need(0, n - 1, j) for j in range(p)))
        while hi - lo > max(1.0, 1e-9 * hi):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.feasible(math.inf, mid) else (mid, hi)
        bounds = self.min_moves_mem(hi)
        j, (a, b) = max(enumerate(bounds),
                        key=lambda t: self._need(t[1][0], t[1][1], t[0]) - self.memory.caps[t[0]])
        need, cap = self._need(a, b, j), self.memory.caps[j]
        return (f"memory cap too small: the best split of {n} layers into {p} stages still "
                f"needs {need:,.0f} bytes on stage {j} (layers {a}-{b}, cap {cap:,.0f}), short "
                f"by {need - cap:,.0f} bytes; raise the cap, add stages, or recompute "
                f"activations")

    def _need(self, a: int, b: int, j: int) -> float:
        pre = self.mem_prefix[j]
        return pre[b + 1] - pre[a]

    def min_moves_mem(self, extra: float) -> list[tuple[int, int]]:
        saved = self.memory.caps
        self.memory.caps = [c + extra for c in saved]
        try:
            return self.min_moves(math.inf, [[0.0] * self.n] * self.p)
        finally:
            self.memory.caps = saved


def merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    spans = sorted(s for s in spans if s[0] <= s[1])
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
