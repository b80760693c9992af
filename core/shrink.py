"""Shrink a plan onto the surviving ranks: fewer DP replicas, fewer pipeline stages with
a re-balanced partition, or both, chosen by predicted step time; among equally fast
layouts the one that moves the fewest layers. TP degree and the global batch stay fixed.

The same search widens a plan when ranks join (see `stalwart.core.grow`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stalwart.core.costs import CostProfile
from stalwart.core.decide import Member, PlanState, ShrinkRefused
from stalwart.core.layout import Coord, Layout
from stalwart.core.partition import partition, uniform
from stalwart.core.stage_search import (
    TIE,
    Candidate,
    Scorer,
    align,
    assignments,
    greedy_assignments,
    improve,
    lacks,
    pick,
)

# Greedy starts of the local search per (dp, pp): a large pool has hundreds of them,
# nearly all one spare group apart.
MAX_STARTS = 8

__all__ = ["ElasticConfig", "ElasticPlanner", "ShrinkMemoryError", "ShrinkResult",
           "plan_layout", "plan_shrink", "predicted_step"]



class ShrinkMemoryError(ShrinkRefused):
    """No layout of the survivors fits the model in the per-device memory cap."""

    def __init__(self, message: str, shortfall_bytes: float) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """What the elastic planner knows about the model and the devices."""

    costs: tuple[float, ...]
    """Per-layer cost of one micro-batch (seconds or FLOPs)."""
    mem: tuple[float, ...] | None = None
    """Per-layer static bytes on one rank (its TP shard of parameters, grads, optimizer)."""
    act: tuple[float, ...] | None = None
    """Per-layer activation bytes of one micro-batch on one rank."""
    mem_cap: float | None = None
    """Bytes of memory per device; None: memory is not checked."""
    layer_bytes: tuple[float, ...] | None = None
    """Per-layer bytes a rank receives when it gains the layer (for bytes_moved)."""
    speeds: Mapping[str, float] = field(default_factory=dict)
    """rank_id -> speed factor (default 1); a stage runs at its slowest rank."""
    keep_microbatches: bool = True
    """Keep the micro-batches per pipeline round and raise gradient accumulation (when
    still >= the stage count); otherwise use the fastest count."""
    tp_across_nodes_speed: float = 0.25
    """Speed factor of a TP group whose ranks sit on different nodes (its all-reduces
    cross the network every layer): such groups are formed from ranks left over on their
    nodes and used only when that is predicted faster than leaving them idle. 0: never."""
    max_assignments: int = 300
    """Rank-to-stage assignments tried per (dp, pp): all of them when there are no more,
    else a local search from greedy ones within this many (each costs one partition)."""

    @classmethod
    def from_profile(cls, profile: CostProfile, *, tp: int = 1, mem_cap: float | None = None,
                     recompute: str = "none", bytes_per_param: float = 16.0,
                     state_bytes_per_param: float = 12.0,
                     speeds: Mapping[str, float] | None = None) -> ElasticConfig:
        """A config from a layer profile (analytic `gpt_profile` or measured), torch-free
        so the coordinator can build it. Block layers are split over `tp` ranks; the
        embedding and head are counted whole (replicated). bytes_per_param: memory per
        parameter (weights, grads, optimizer); state_bytes_per_param: what a rank receives
        (fp32 weights and two AdamW moments = 12)."""
        split = [tp if x.kind == "block" else 1 for x in profile.layers]
        return cls(
            costs=tuple(c / k for c, k in zip(profile.costs(recompute=recompute), split,
                                              strict=True)),
            mem=tuple(x.params * bytes_per_param / k for x, k in zip(profile.layers, split,
                                                                      strict=True)),
            act=tuple(a / k for a, k in zip(profile.act_bytes(recompute), split, strict=True)),
            mem_cap=mem_cap,
            layer_bytes=tuple(x.params * state_bytes_per_param / k
                              for x, k in zip(profile.layers, split, strict=True)),
            speeds=dict(speeds or {}))


@dataclass(frozen=True)
class ShrinkResult:
    """The chosen plan and what it costs to reach it."""

    plan: PlanState
    predicted_step: float
    """ga x (microbatches + pp - 1) x bottleneck, in the unit of the costs."""
    predicted_before: float
    """The same prediction for the plan before the change (all its ranks alive)."""
    layers_moved: int
    """(rank, layer) pairs whose TP shard the rank must receive."""
    layers_moved_naive: int
    """The same count for a from-scratch partition with ranks placed in rank order."""
    receive: dict[str, tuple[int, ...]]
    """rank_id -> layers it must receive (its TP shard of each)."""
    sources: dict[int, tuple[str, ...]]
    """layer -> surviving rank_ids that hold a shard of it."""
    bytes_moved: float
    bytes_moved_naive: float
    considered: tuple[dict, ...] = ()

    @property
    def speed_ratio(self) -> float:
        """Predicted steps/s after over before (< 1 for a shrink)."""
        return self.predicted_before / self.predicted_step if self.predicted_step else 1.0

    def predicted_steps_per_s(self, measured_before: float) -> float:
        """Steps/s predicted for the new plan, calibrated by the measured old steps/s."""
        return measured_before * self.speed_ratio


@dataclass(frozen=True)
class _Group:
    """One TP group of the pool: ranks by tp index, and the layers all of them hold."""

    members: tuple[Member, ...]
    held: tuple[int, int] | None
    speed: float
    old_dp: int

    @property
    def kind(self) -> tuple:
        return (self.held, self.speed)


def predicted_step(costs: Sequence[float], layout: Layout, speeds: Sequence[float]) -> float:
    """Step time of `layout` (stage speeds given) in the unit of the costs."""
    stages = layout.stages or tuple(uniform(len(costs), layout.pp))
    worst = max(sum(costs[a:b + 1]) / s for (a, b), s in zip(stages, speeds, strict=True))
    return layout.grad_accum * (layout.microbatches + layout.pp - 1) * worst


def _groups(state: PlanState, pool: list[Member], speeds: Mapping[str, float],
            n_layers: int, across_nodes: float = 0.0) -> list[_Group]:
    """Intact TP groups keep their holdings; other pool ranks form fresh groups per node,
    and what is left on the nodes forms groups across nodes at `across_nodes` speed."""
    lay, alive = state.layout, {m.rank_id for m in pool}
    stages = lay.stages or tuple(uniform(n_layers, lay.pp))
    out, used = [], set()
    cells: dict[tuple[int, int], list[Member]] = {}
    for m in state.members:
        if m.coord is not None:
            cells.setdefault((m.coord.dp, m.coord.pp), []).append(m)
    for (d, p), ms in sorted(cells.items()):
        ms.sort(key=lambda m: m.coord.tp)
        if all(m.rank_id in alive for m in ms) and len({m.node for m in ms}) == 1:
            out.append(_Group(tuple(ms), stages[p], min(speeds.get(m.rank_id, 1.0) for m in ms), d))
            used.update(m.rank_id for m in ms)
    rest = sorted((m for m in pool if m.rank_id not in used),
                  key=lambda m: (m.node, m.coord is None, m.rank_id))
    leftover: list[Member] = []
    for _, on_node in itertools.groupby(rest, key=lambda m: m.node):
        ms = list(on_node)
        whole = len(ms) - len(ms) % lay.tp
        for i in range(0, whole, lay.tp):
            chunk = tuple(ms[i:i + lay.tp])
            out.append(_Group(chunk, None, min(speeds.get(m.rank_id, 1.0) for m in chunk), -1))
        leftover += ms[whole:]
    if lay.tp > 1 and across_nodes > 0:
        for i in range(0, len(leftover) - lay.tp + 1, lay.tp):
            chunk = tuple(leftover[i:i + lay.tp])
            speed = min(speeds.get(m.rank_id, 1.0) for m in chunk) * across_nodes
            out.append(_Group(chunk, None, speed, -1))
    return out


def _microbatches(old: Layout, dp: int, pp: int, keep: bool) -> tuple[int, int] | None:
    """(microbatches, grad_accum) that keep the step's micro-batches with m >= pp, or
    None. Where they do not divide among dp replicas and there is no pipeline, the
    replicas take unequal shares, one micro-batch a round (`Layout.replica_microbatches`):
    3 replicas that lose one go on as 2 (2 + 1 micro-batches), not as 1 running all 3."""
    total = old.total_microbatches
    if total % dp:
        return (1, -(-total // dp)) if pp == 1 and total >= dp else None
    per_replica = total // dp
    if keep and old.microbatches >= pp and per_replica % old.microbatches == 0:
        return old.microbatches, per_replica // old.microbatches
    if per_replica < pp:
        return None
    return per_replica, 1


def plan_layout(state: PlanState, failed: frozenset[str], config: ElasticConfig, *,
                dp_range: tuple[int, int], pp_range: tuple[int, int]) -> ShrinkResult:
    """The fastest layout of the surviving members and spares of `state` with dp and pp in
    the given inclusive ranges, moving the fewest layers among equally fast ones.

    Raises ShrinkMemoryError when no layout fits the memory cap.
    """
    costs, old, tp = list(config.costs), state.layout, state.layout.tp
    pool = [m for m in (*state.members, *state.spares) if m.rank_id not in failed]
    groups = _groups(state, pool, config.speeds, len(costs), config.tp_across_nodes_speed)
    kinds = Counter(g.kind for g in groups)
    best: Candidate | None = None
    considered, shortfalls = [], []
    fastest = max((g.speed for g in groups), default=1.0)
    layouts = []
    for pp in range(pp_range[0], min(pp_range[1], len(costs), len(groups)) + 1):
        for dp in range(dp_range[0], min(dp_range[1], len(groups) // pp) + 1):
            micro = _microbatches(old, dp, pp, config.keep_microbatches)
            if micro is not None:
                # No split beats an even share on the fastest device, nor the largest layer.
                floor = max(sum(costs) / pp, max(costs)) / fastest
                layouts.append((micro[1] * (micro[0] + pp - 1) * floor, dp, pp, micro))
    for floor, dp, pp, micro in sorted(layouts):
        if best is not None and floor > best.key[0] * (1 + TIE):
            break  # this and every later layout is slower than the best found
        m, ga = micro
        exact = math.comb(len(kinds) + dp - 1, dp) ** pp <= config.max_assignments
        local: Candidate | None = None
        score = Scorer(costs, tp, config, micro, pp)
        try:
            if exact:
                for assignment in assignments(kinds, dp, pp):
                    local = pick(local, score(assignment))
            else:
                budget = [config.max_assignments]  # evaluations left for this (dp, pp)
                starts = itertools.islice(greedy_assignments(kinds, dp, pp), MAX_STARTS)
                seen = set()
                for assignment in starts:
                    if budget[0] <= 0 and local is not None:
                        break  # starts count too
                    budget[0] -= 1
                    # Each stage to the groups that hold most of it; starts that align
                    # to the same assignment are searched once.
                    start = align(score(assignment), kinds, score, budget)
                    if start.assignment not in seen:
                        seen.add(start.assignment)
                        local = pick(local, improve(start, kinds, score, budget))
        except ValueError as exc:  # memory does not depend on which ranks hold a stage
            shortfalls.append((dp, pp, m, str(exc)))
        if local is not None:
            considered.append({"dp": dp, "pp": pp, "microbatches": m, "grad_accum": ga,
                               "predicted_step": local.key[0], "layers_moved": local.key[1]})
            best = pick(best, local)
    if best is None:
        raise _memory_error(state, pool, config, shortfalls)
    return _result(state, failed, pool, groups, best, config, tuple(considered))


def _memory_error(state: PlanState, pool: list[Member], config: ElasticConfig,
                  shortfalls: list[tuple]) -> ShrinkMemoryError:
    if not shortfalls or config.mem_cap is None:
        return ShrinkMemoryError(
            f"no layout fits the {len(pool)} surviving ranks with tp={state.layout.tp} and a "
            "global batch that divides among them; register a spare rank", 0.0)
    best_short, best_text = math.inf, ""
    for dp, pp, m, text in shortfalls:
        # Whole bytes: the smallest extra cap that fits lies in (lo, hi].
        lo, hi = 0, math.ceil(sum(config.mem or ()) + sum(config.act or ()) * m)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                partition(list(config.costs), pp, mem=config.mem, act=config.act,
                          mem_cap=config.mem_cap + mid, micro_batches=m)
                hi = mid
            except ValueError:
                lo = mid
        if hi < best_short:
            # Keep partition's account of the stage; the advice follows once, below.
            best_short, best_text = hi, f"dp={dp} pp={pp}: {text.split('; raise')[0]}"
    return ShrinkMemoryError(
        f"cannot shrink onto the {len(pool)} surviving ranks: the model does not fit in "
        f"{config.mem_cap:,.0f} bytes per device; the closest layout is short by "
        f"{best_short:,} bytes ({best_text}). Register a spare rank, raise the memory cap, or "
        "recompute activations.", best_short)


def _result(state: PlanState, failed: frozenset[str], pool: list[Member], groups: list[_Group],
            best: Candidate, config: ElasticConfig, considered: tuple[dict, ...]) -> ShrinkResult:
    old, tp = state.layout, state.layout.tp
    m, ga = best.micro
    free: dict[tuple, deque[_Group]] = {}
    for g in sorted(groups, key=lambda g: g.old_dp):
        free.setdefault(g.kind, deque()).append(g)
    total = old.total_microbatches
    layout = Layout(dp=best.dp, pp=best.pp, tp=tp, stages=best.stages, schedule=old.schedule,
                    microbatches=m, grad_accum=ga,
                    microbatch_total=total if total % best.dp else 0)
    members, receive = [], {}
    for s, combo in enumerate(best.assignment):
        chosen = [free[k].popleft() for k in combo]
        # A group keeps its DP index where it can (its RNG stream and data share).
        slots: dict[int, _Group] = {}
        for g in chosen:
            if 0 <= g.old_dp < best.dp and g.old_dp not in slots:
                slots[g.old_dp] = g
        rest = [g for g in chosen if g not in slots.values()]
        for d in range(best.dp):
            if d not in slots:
                slots[d] = rest.pop(0)
        a, b = best.stages[s]
        for d, g in sorted(slots.items()):
            for t, mem in enumerate(g.members):
                coord = Coord(layout.rank_of(d, s, t), d, s, t)
                members.append(Member(mem.rank_id, mem.node, coord))
                need = tuple(i for i in range(a, b + 1) if lacks(g.held, i))
                if need:
                    receive[mem.rank_id] = need
    used = {m.rank_id for m in members}
    members.sort(key=lambda x: x.coord.rank)
    spares = tuple(Member(x.rank_id, x.node) for x in pool if x.rank_id not in used)
    verb = ("shrink" if len(members) < old.world_size else
            "widen" if len(members) > old.world_size else "re-form")  # e.g. a TP group moved
    reason = (f"{verb} dp={old.dp} pp={old.pp}"
              f" tp={tp} -> dp={best.dp} pp={best.pp} tp={tp}, stages {list(best.stages)}, "
              f"grad_accum {old.grad_accum} -> {ga}"
              f"{f' (unequal shares of {total} micro-batches)' if layout.microbatch_total else ''}"
              f", {best.key[1]} layers moved; the fastest "
              f"of {len(considered)} layout(s) that fit")
    cell_nodes: dict[tuple[int, int], set[str]] = {}
    for x in members:
        cell_nodes.setdefault((x.coord.dp, x.coord.pp), set()).add(x.node)
    if any(len(nodes) > 1 for nodes in cell_nodes.values()):
        reason += "; a tensor-parallel group spans nodes (nothing faster fits)"
    plan = PlanState(generation=state.generation, layout=layout, members=tuple(members),
                     spares=spares, resume_step=state.resume_step, reason=reason)
    # The baseline: a from-scratch split, TP groups placed in their old rank order.
    naive_slots = sorted(groups, key=lambda g: min(x.coord.rank if x.coord else 10**9
                                                   for x in g.members))[:best.dp * best.pp]
    naive_bounds = partition(list(config.costs), best.pp, mem=config.mem, act=config.act,
                             mem_cap=config.mem_cap, micro_batches=m).stages
    naive_need = [i for n, g in enumerate(naive_slots)
                  for i in range(naive_bounds[n // best.dp][0], naive_bounds[n // best.dp][1] + 1)
                  for _ in range(tp) if lacks(g.held, i)]
    per_layer = config.layer_bytes or (0.0,) * len(config.costs)
    holders: list[list[str]] = [[] for _ in config.costs]
    for g in groups:
        if g.held is not None:
            for i in range(max(g.held[0], 0), min(g.held[1], len(holders) - 1) + 1):
                holders[i] += [x.rank_id for x in g.members]
    sources = {i: tuple(h) for i, h in enumerate(holders)}
    before_speeds = [min((config.speeds.get(x.rank_id, 1.0) for x in state.members
                          if x.coord and x.coord.pp == s), default=1.0) for s in range(old.pp)]
    return ShrinkResult(
        plan=plan, predicted_step=best.key[0],
        predicted_before=predicted_step(config.costs, old, before_speeds),
        layers_moved=best.key[1], layers_moved_naive=len(naive_need), receive=receive,
        sources=sources, bytes_moved=float(sum(per_layer[i] for v in receive.values() for i in v)),
        bytes_moved_naive=float(sum(per_layer[i] for i in naive_need)),
        considered=considered)


def plan_shrink(state: PlanState, failed: frozenset[str], config: ElasticConfig) -> ShrinkResult:
    """The best plan on the survivors of `failed` (spares included) with at most the
    current DP replicas and pipeline stages: what the job ran on already fitted."""
    lost = failed & {m.rank_id for m in state.members}
    if not lost:
        raise ValueError(f"none of {sorted(failed)} holds a role; nothing to shrink")
    lay = state.layout
    return plan_layout(state, failed, config, dp_range=(1, lay.dp), pp_range=(1, lay.pp))


class ElasticPlanner:
    """`core.decide.ShrinkPlanner` adapter; the last full result stays in `last`."""

    def __init__(self, config: ElasticConfig) -> None:
        self.config = config
        self.last: ShrinkResult | None = None

    def __call__(self, state: PlanState, failed: frozenset[str],
                 committed_step: int) -> PlanState | None:
        result = plan_shrink(state, failed, self.config)
        self.last = result
        return dataclasses.replace(result.plan, resume_step=committed_step)
