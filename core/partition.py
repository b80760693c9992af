"""Optimal contiguous pipeline partition: layers into stages, minimising the slowest stage.

Stages run on devices in a fixed order with per-device speed factors and per-stage
memory caps; among the optimal splits the one that moves the fewest layers away
from a previous split wins, so re-planning after a failure moves little state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.core.partition_search import Memory, Problem

__all__ = ["Partition", "Splitter", "in_flight", "partition", "uniform"]



@dataclass(frozen=True)
class Partition:
    """Stage bounds as inclusive (first, last) layer pairs, 0-based, one per stage."""

    stages: tuple[tuple[int, int], ...]
    stage_costs: tuple[float, ...]
    """Sum of the layer costs of each stage (same unit as the costs)."""
    stage_times: tuple[float, ...]
    """Each stage's cost divided by its device's speed factor."""
    bottleneck: float
    """The slowest stage time: max(stage_times)."""
    stage_memory: tuple[float, ...] | None = None
    """Bytes each stage needs (static + activations in flight), when memory was given."""

    @property
    def num_layers(self) -> int:
        return self.stages[-1][1] + 1

    def owners(self) -> list[int]:
        """Stage index owning each layer."""
        out: list[int] = []
        for j, (first, last) in enumerate(self.stages):
            out += [j] * (last - first + 1)
        return out

    def layers_moved(self, previous: Partition | Sequence[Sequence[int]]) -> int:
        """Layers whose stage (hence device, in the fixed device order) differs from `previous`."""
        before = _owners_of(previous)
        after = self.owners()
        if len(before) != len(after):
            raise ValueError(f"previous partition covers {len(before)} layers, this one "
                             f"{len(after)}: compare partitions of the same model")
        return sum(a != b for a, b in zip(after, before, strict=True))

    def to_json(self) -> dict:
        out: dict = {"stages": [list(s) for s in self.stages],
                     "bottleneck": self.bottleneck,
                     "stage_costs": list(self.stage_costs),
                     "stage_times": list(self.stage_times)}
        if self.stage_memory is not None:
            out["stage_memory_bytes"] = list(self.stage_memory)
        return out


def in_flight(schedule: str, stages: int, micro_batches: int | None = None) -> list[int]:
    """Micro-batches whose activations each stage holds at its peak.

    1F1B: stage j (0-based) of p holds min(p - j, m); GPipe holds all m. Without
    `micro_batches`, m = p (the smallest count that fills a 1F1B pipeline).
    """
    m = stages if micro_batches is None else micro_batches
    if m < 1:
        raise ValueError(f"micro_batches must be at least 1, got {m}")
    if schedule == "1f1b":
        return [min(stages - j, m) for j in range(stages)]
    if schedule == "gpipe":
        return [m] * stages
    raise ValueError(f"unknown schedule {schedule!r}: use '1f1b' or 'gpipe'")


def uniform(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Equal layer counts per stage (the first stages take the remainder)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    out, first = [], 0
    for j in range(stages):
        size = base + (1 if j < extra else 0)
        out.append((first, first + size - 1))
        first += size
    return out


def partition(costs: Sequence[float], stages: int, speeds: Sequence[float] | None = None,
              mem: Sequence[float] | None = None, mem_cap: float | Sequence[float] | None = None,
              previous: Partition | Sequence[Sequence[int]] | None = None, *,
              act: Sequence[float] | None = None, schedule: str = "1f1b",
              micro_batches: int | None = None,
              keep: Sequence[int] | None = None,
              move_costs: Sequence[Sequence[float]] | None = None) -> Partition:
    """Split layers 0..n-1 into `stages` contiguous non-empty stages, minimising the
    largest cost(stage) / speed(stage).

    costs: per-layer cost (seconds or FLOPs, any non-negative unit).
    speeds: per-stage device speed factor, in the fixed device order (default all 1).
    mem: per-layer static bytes (parameters + gradients + optimizer state).
    act: per-layer activation bytes per micro-batch; stage j holds in_flight(...)[j] of them.
    mem_cap: bytes per stage (one number for all, or one per stage).
    previous: an earlier split of the same layers; among optimal splits the one whose
        layers change stage the least is returned.
    keep: instead of `previous`, the stage index each layer may keep without moving
        (-1 where none can), for re-planning onto a different device list.
    move_costs: instead of both, move_costs[j][i] = what placing layer i on stage j costs
        (e.g. how many of the stage's devices lack it, over all DP replicas).
    """
    n = len(costs)
    p = stages
    if p < 1:
        raise ValueError(f"stages must be at least 1, got {p}")
    if n < p:
        raise ValueError(f"cannot split {n} layers into {p} stages: every stage needs at "
                         f"least one layer; use at most {n} stages")
    for i, c in enumerate(costs):
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"layer {i} cost must be a finite number >= 0, got {c}")
    speeds = [1.0] * p if speeds is None else [float(s) for s in speeds]
    if len(speeds) != p:
        raise ValueError(f"got {len(speeds)} speeds for {p} stages: give one per stage")
    for j, s in enumerate(speeds):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"stage {j} speed must be a finite number > 0, got {s}")
    if sum(x is not None for x in (previous, keep, move_costs)) > 1:
        raise ValueError("give at most one of previous, keep and move_costs")
    if previous is not None:
        keep = _owners_of(previous)
    if keep is not None:
        if len(keep) != n:
            raise ValueError(f"previous partition covers {len(keep)} layers but there are {n}")
        move_costs = [[0.0 if k == j else 1.0 for k in keep] for j in range(p)]
    if move_costs is None:
        move_costs = [[0.0] * n] * p
    if len(move_costs) != p or any(len(row) != n for row in move_costs):
        raise ValueError(f"move_costs must be {p} rows (stages) of {n} numbers (layers)")

    return Splitter(costs, p, mem=mem, act=act, mem_cap=mem_cap, schedule=schedule,
                    micro_batches=micro_batches).split(speeds, move_costs)


class Splitter:
    """`partition` of one model into one stage count, for many speeds and move costs:
    the bottleneck search runs once per distinct speeds, and only the fewest-moves
    tie-break once per call (a re-plan's search scores hundreds of assignments that
    differ in which groups hold a stage, rarely in how fast each stage is).

    Inputs are taken as `partition` checked them."""

    def __init__(self, costs: Sequence[float], stages: int, *,
                 mem: Sequence[float] | None = None,
                 mem_cap: float | Sequence[float] | None = None,
                 act: Sequence[float] | None = None, schedule: str = "1f1b",
                 micro_batches: int | None = None) -> None:
        self.costs = costs
        self.memory = _memory_model(len(costs), stages, mem, act, mem_cap, schedule,
                                    micro_batches)
        self._solved: dict[tuple[float, ...], tuple[Problem, float]] = {}

    def split(self, speeds: Sequence[float],
              move_costs: Sequence[Sequence[float]]) -> Partition:
        """The fastest split at `speeds` that moves the least by `move_costs`
        (ValueError: no split fits the memory caps)."""
        key = tuple(speeds)
        if key not in self._solved:
            problem = Problem(self.costs, list(key), self.memory)
            if not problem.feasible(math.inf):
                raise ValueError(problem.memory_shortfall_message())
            self._solved[key] = problem, problem.min_bottleneck()
        problem, best = self._solved[key]
        return _describe(problem, problem.min_moves(best, move_costs))


def _owners_of(part: Partition | Sequence[Sequence[int]]) -> list[int]:
    pairs = part.stages if isinstance(part, Partition) else part
    out: list[int] = []
    expect = 0
    for j, (first, last) in enumerate(pairs):
        if first != expect or last < first:
            raise ValueError(f"stage {j} bounds ({first}, {last}) are not contiguous from "
                             f"layer {expect}: stages must be inclusive, ordered, non-empty")
        out += [j] * (last - first + 1)
        expect = last + 1
    return out


def _memory_model(n: int, p: int, mem: Sequence[float] | None, act: Sequence[float] | None,
                  mem_cap: float | Sequence[float] | None, schedule: str,
                  micro_batches: int | None) -> Memory | None:
    if mem_cap is None:
        if mem is not None or act is not None:
            raise ValueError("per-layer memory was given without mem_cap: give the bytes "
                             "available per stage")
        return None
    caps = [float(mem_cap)] * p if isinstance(mem_cap, int | float) else list(mem_cap)
    if len(caps) != p:
        raise ValueError(f"got {len(caps)} memory caps for {p} stages: give one or one per stage")
    static = [0.0] * n if mem is None else [float(x) for x in mem]
    acts = [0.0] * n if act is None else [float(x) for x in act]
    if len(static) != n or len(acts) != n:
        raise ValueError(f"memory lists must have one entry per layer ({n})")
    return Memory(static, acts, in_flight(schedule, p, micro_batches), caps)


def _describe(problem: Problem, bounds: list[tuple[int, int]]) -> Partition:
    costs = [problem.prefix[b + 1] - problem.prefix[a] for a, b in bounds]
    times = [c / s for c, s in zip(costs, problem.speeds, strict=True)]
    memory = None
    if problem.memory is not None:
        memory = tuple(problem.mem_prefix[j][b + 1] - problem.mem_prefix[j][a]
                       for j, (a, b) in enumerate(bounds))
    return Partition(tuple(bounds), tuple(costs), tuple(times), max(times), memory)
