"""The coordinator's decisions as pure functions: failures in, next plan out.

Given the newest plan and typed failures, `decide` puts registered spares into
the failed ranks' roles (layout unchanged) or stops cleanly at the last
committed step; shrinking plugs in through `shrink_planner`. Generations fence
everything (`core/generation.py` refuses messages from an older one).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stalwart.core.failures import Failure, FailureKind
from stalwart.core.layout import Coord, Layout
from stalwart.v1 import common_pb2

__all__ = [
    "Member", "PlanState", "PlanDecision", "StopDecision", "NoChange", "Decision",
    "ShrinkPlanner", "ShrinkRefused", "decide", "resume",
]


@dataclass(frozen=True)
class Member:
    """A registered rank: a role holder when `coord` is set, a spare when it is None."""

    rank_id: str
    node: str
    coord: Coord | None = None

    @property
    def where(self) -> str:
        if self.coord is None:
            return f"spare {self.rank_id} on {self.node}"
        c = self.coord
        return f"rank {self.rank_id} (dp {c.dp}, stage {c.pp}, tp {c.tp}) on {self.node}"


@dataclass(frozen=True)
class PlanState:
    """Membership and layout of one generation (the pure twin of `stalwart.v1.Plan`)."""

    generation: int
    layout: Layout
    members: tuple[Member, ...]
    spares: tuple[Member, ...] = ()
    resume_step: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        lay = self.layout
        if len(self.members) != lay.world_size:
            raise ValueError(
                f"plan of generation {self.generation} has {len(self.members)} ranks but its "
                f"layout dp={lay.dp} pp={lay.pp} tp={lay.tp} needs {lay.world_size}"
            )
        ids = [m.rank_id for m in (*self.members, *self.spares)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"plan of generation {self.generation} names a rank twice: {ids}")
        cells = {(m.coord.dp, m.coord.pp, m.coord.tp) for m in self.members if m.coord}
        if len(cells) != lay.world_size or any(
            not (0 <= d < lay.dp and 0 <= p < lay.pp and 0 <= t < lay.tp) for d, p, t in cells
        ):
            raise ValueError(
                f"plan of generation {self.generation} does not fill the "
                f"{lay.dp}x{lay.pp}x{lay.tp} grid with one rank per cell"
            )
        # Process groups are built from the rank alone, so its coordinates must agree.
        for m in self.members:
            if m.coord is not None and lay.coords(m.coord.rank) != m.coord:
                raise ValueError(
                    f"plan of generation {self.generation} gives {m.where} global rank "
                    f"{m.coord.rank}, which the layout places at {lay.coords(m.coord.rank)}; "
                    "number ranks tp fastest, then dp, pp slowest (Layout.coords)"
                )
        if any(s.coord is not None for s in self.spares):
            raise ValueError("a spare holds a role; spares must have coord=None")

    def to_proto(self) -> common_pb2.Plan:
        assignments = [
            common_pb2.RankAssignment(rank_id=m.rank_id, node=m.node, coord=m.coord.to_proto())
            for m in self.members if m.coord is not None
        ] + [common_pb2.RankAssignment(rank_id=s.rank_id, node=s.node, spare=True)
             for s in self.spares]
        return common_pb2.Plan(
            generation=self.generation, layout=self.layout.to_proto(), assignments=assignments,
            reason=self.reason, resume_step=self.resume_step,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.Plan) -> PlanState:
        members, spares = [], []
        for a in msg.assignments:
            if a.spare:
                spares.append(Member(a.rank_id, a.node))
            else:
                members.append(Member(a.rank_id, a.node, Coord.from_proto(a.coord)))
        return cls(
            generation=msg.generation,
            layout=Layout.from_proto(msg.layout),
            members=tuple(members), spares=tuple(spares),
            resume_step=msg.resume_step, reason=msg.reason,
        )


@dataclass(frozen=True)
class PlanDecision:
    """A new generation: `kind` is "replace" (spares in, layout unchanged), "shrink", or
    "rebuild" (same members, fresh groups); the coordinator adds "grow" (a resume
    widened onto the ranks that joined) and "relaunch" (every rank lost, and the job's
    ranks started again in their launched roles).

    `replacements` maps each rank that gave up its role to the spare that took it. A lost
    one that still runs (hung) is fenced by its daemon, which ends every rank the new plan
    left out; a survivor whose tensor-parallel group moved whole stays, as a spare.
    """

    kind: str
    previous: PlanState
    plan: PlanState
    replacements: Mapping[str, str]
    causes: tuple[Failure, ...]

    @property
    def generation(self) -> int:
        return self.plan.generation

    def summary(self) -> str:
        moves = ", ".join(f"{old} -> {new}" for old, new in sorted(self.replacements.items()))
        return (f"generation {self.previous.generation} -> {self.generation} ({self.kind}"
                f"{': ' + moves if moves else ''}), resuming from step {self.plan.resume_step}")


@dataclass(frozen=True)
class StopDecision:
    """No viable plan: fence the old generation and stop at the last committed step."""

    generation: int
    last_committed_step: int
    message: str
    causes: tuple[Failure, ...]
    failed: frozenset[str] = frozenset()
    """rank_ids lost (members and spares): `resume` fills the members' roles with spares
    that register later."""


@dataclass(frozen=True)
class NoChange:
    """Nothing to re-plan; `plan` may drop lost spares but keeps the generation."""

    plan: PlanState
    reason: str
    ignored: tuple[Failure, ...] = field(default=())


Decision = PlanDecision | StopDecision | NoChange


class ShrinkRefused(ValueError):
    """A shrink planner's account of why no smaller plan fits (memory, batch); the stop
    message carries it."""


class ShrinkPlanner(Protocol):
    """Hook for the elastic work: a plan on the survivors, or None when none fits.

    The returned plan's generation and resume_step are overwritten by `decide`.
    """

    def __call__(
        self, state: PlanState, failed: frozenset[str], committed_step: int
    ) -> PlanState | None: ...


def _is_relevant(f: Failure, generation: int, stragglers_fail: bool) -> bool:
    if f.kind is FailureKind.STRAGGLER and not stragglers_fail:
        return False
    # Facts (dead process, lost GPU or node) stay true; observations made inside an
    # older generation (late heartbeat, hung collective) were about groups that are gone.
    stale = 0 < f.generation < generation and not f.kind.is_fact
    return not stale


def _failed_ids(state: PlanState, failures: Iterable[Failure]) -> tuple[set[str], list[Failure]]:
    """rank_ids (members and spares) that failed, and the failures naming nobody.

    A COLLECTIVE_HANG names the rank that waited, not the one that hung: when no other
    failure explains the wait, the culprits are the members that reported no hang.
    """
    everyone = (*state.members, *state.spares)
    member_ids = {m.rank_id for m in state.members}
    failed: set[str] = set()
    unknown: list[Failure] = []
    waiting: set[str] = set()
    for f in failures:
        if f.kind is FailureKind.COLLECTIVE_HANG:
            if f.subject in member_ids:
                waiting.add(f.subject)
            else:
                unknown.append(f)
            continue
        hit = {m.rank_id for m in everyone
               if (m.node == f.subject if f.names_node else m.rank_id == f.subject)}
        failed |= hit
        if not hit:
            unknown.append(f)
    if waiting and not failed & member_ids:
        failed |= member_ids - waiting
    return failed, unknown


def _pick_spares(
    state: PlanState, failed: list[Member], pool: list[Member], tp_within_node: bool
) -> dict[str, Member] | None:
    """Spare for each member that changes place, or None when some role cannot be filled.

    A tensor-parallel group stays on one node: its lost members are replaced by spares
    beside its survivors, or, with too few spares there, the whole group moves to a node
    whose spares can hold all of it (its survivors are then replaced too, and become
    spares). The layout and its stage bounds hold either way."""
    chosen: dict[str, Member] = {}
    free = sorted(pool, key=lambda s: (s.node, s.rank_id))
    groups: dict[tuple[int, int], list[Member]] = {}
    for m in sorted(failed, key=lambda m: m.coord.rank if m.coord else -1):
        assert m.coord is not None
        groups.setdefault((m.coord.dp, m.coord.pp), []).append(m)
    if state.layout.tp == 1 or not tp_within_node:
        for _, lost in sorted(groups.items()):
            for m in lost:
                if not free:
                    return None
                # A spare on the same node keeps the role's locality (local daemon's copy).
                spare = min(free, key=lambda s: (s.node != m.node, s.node, s.rank_id))
                free.remove(spare)
                chosen[m.rank_id] = spare
        return chosen

    spares_on = Counter(s.node for s in free)

    def take(members: list[Member], node: str) -> None:
        for m in members:
            spare = next(s for s in free if s.node == node)
            free.remove(spare)
            spares_on[node] -= 1
            chosen[m.rank_id] = spare

    failed_ids = {m.rank_id for m in failed}
    cells = {key: sorted((m for m in state.members
                          if m.coord and (m.coord.dp, m.coord.pp) == key),
                         key=lambda m: m.coord.rank) for key in groups}
    # First the groups whose lost members fit beside their survivors; only then do the
    # others, which move whole, take what spares are left.
    whole = []
    for key, lost in sorted(groups.items()):
        alive = sorted({m.node for m in cells[key] if m.rank_id not in failed_ids})
        node = next((n for n in alive if spares_on[n] >= len(lost)), None)
        if node is None:
            whole.append((key, lost))
        else:
            take(lost, node)
    for key, lost in whole:
        fits = [n for n, count in spares_on.items() if count >= len(cells[key])]
        if not fits:
            return None
        # The spares of the node it was on first (their daemon holds its captures), then
        # the smallest pool that holds it: larger ones stay for other groups.
        take(cells[key], min(fits, key=lambda n: (n != lost[0].node, spares_on[n], n)))
    return chosen


def _stop_message(failed: list[Member], causes: Sequence[Failure], step: int, why: str) -> str:
    lost = "; ".join(m.where for m in failed)
    seen = "; ".join(f.describe() for f in causes)
    why = why.rstrip(" .") + "."
    raised = sorted({f.raised for f in causes if f.raised})
    if raised:
        others = f" (and {len(raised) - 1} other exceptions)" if len(raised) > 1 else ""
        why += (f" The training of {sum(bool(f.raised) for f in causes)} lost rank(s) raised "
                f"{raised[0]!r}{others}: a spare given such a role runs the same code and "
                "may raise it again; read the rank's log and fix the cause before adding "
                "spares.")
    return (
        f"Lost {lost}. {why} Training stops at the last committed step {step}; nothing "
        f"committed is lost. It resumes from step {step} by itself, with nothing "
        f"restarted, once enough spare ranks register with the job's daemons (start them "
        f"with `stalwart run --spares N` on any host, or bring the lost host back). "
        f"(Detected: {seen})"
    )


def decide(
    state: PlanState,
    failures: Sequence[Failure],
    committed_step: int,
    *,
    in_flight: PlanDecision | None = None,
    stragglers_fail: bool = False,
    tp_within_node: bool = True,
    shrink_planner: ShrinkPlanner | None = None,
) -> Decision:
    """Decide the next plan after `failures`, starting from the newest plan `state`.

    `committed_step` is the newest committed step (the resume point). When a
    recovery is still in flight (`in_flight`, whose plan is `state`), the new
    failures fold into it: one decision with all causes and a new generation.
    """
    if in_flight is not None and in_flight.plan.generation != state.generation:
        raise ValueError(
            f"in-flight recovery targets generation {in_flight.plan.generation} but the newest "
            f"plan is generation {state.generation}; pass the in-flight plan as the state"
        )
    relevant = [f for f in failures if _is_relevant(f, state.generation, stragglers_fail)]
    ignored = tuple(f for f in failures if f not in relevant)
    failed_ids, unknown = _failed_ids(state, relevant)
    ignored += tuple(unknown)
    causes = tuple(f for f in relevant if f not in unknown)
    failed = [m for m in state.members if m.rank_id in failed_ids]
    all_causes = (in_flight.causes if in_flight else ()) + causes
    previous = in_flight.previous if in_flight else state
    if not failed:
        pool = [s for s in state.spares if s.rank_id not in failed_ids]
        kept = dataclasses.replace(state, spares=tuple(pool))
        if any(f.kind is FailureKind.COLLECTIVE_HANG for f in causes):
            # Every member waits on another: nobody to blame, so only the groups are new.
            plan = dataclasses.replace(kept, generation=state.generation + 1,
                                       resume_step=committed_step,
                                       reason="rebuild groups: every rank waited in a collective")
            return PlanDecision("rebuild", previous, plan, {}, all_causes)
        why = "lost spares only" if len(pool) < len(state.spares) else "no role holder failed"
        return NoChange(kept, why, ignored)
    replanned = _replan(state, frozenset(failed_ids), causes, all_causes, previous,
                        committed_step, shrink_planner, tp_within_node)
    if (isinstance(replanned, PlanDecision) and replanned.kind == "replace"
            and in_flight is not None):
        # A spare that died before finishing its takeover hands the original role on.
        replacements = dict(replanned.replacements)
        composed = {old: replacements.pop(new, new) for old, new in in_flight.replacements.items()}
        replanned = dataclasses.replace(replanned, replacements={**composed, **replacements})
    return replanned


def resume(
    state: PlanState,
    stopped: StopDecision,
    failures: Sequence[Failure],
    committed_step: int,
    *,
    stragglers_fail: bool = False,
    tp_within_node: bool = True,
    shrink_planner: ShrinkPlanner | None = None,
) -> PlanDecision | StopDecision:
    """The job stopped (`stopped`) with `state` its newest membership: the plan that
    resumes it now that spares have registered, or the stop again (with `failures`
    that came since folded in) while there are still too few.

    The lost members are those `stopped` named plus whatever `failures` name now; a
    spare counts unless it failed since it registered, so the ranks of a host that
    came back fill roles even though the host's name is among the old causes.
    """
    relevant = [f for f in failures if _is_relevant(f, state.generation, stragglers_fail)]
    newly, unknown = _failed_ids(state, relevant)
    causes = stopped.causes + tuple(f for f in relevant if f not in unknown)
    failed_ids = frozenset(stopped.failed | newly)
    return _replan(state, failed_ids, causes, causes, state, committed_step,
                   shrink_planner, tp_within_node)


def _replan(
    state: PlanState,
    failed_ids: frozenset[str],
    causes: tuple[Failure, ...],
    all_causes: tuple[Failure, ...],
    previous: PlanState,
    committed_step: int,
    shrink_planner: ShrinkPlanner | None,
    tp_within_node: bool,
) -> PlanDecision | StopDecision:
    """Fill the roles of the `failed_ids` members with spares, else shrink, else stop.
    A spare on a node whose disk refused its ranks' captures (STORAGE_FULL) takes no
    role: its captures would be refused too. It stays a spare for later plans."""
    pool = [s for s in state.spares if s.rank_id not in failed_ids]
    failed = [m for m in state.members if m.rank_id in failed_ids]
    generation = state.generation + 1
    full = {f.subject for f in all_causes if f.kind is FailureKind.STORAGE_FULL}
    full_nodes = {m.node for m in state.members if m.rank_id in full}
    usable = [s for s in pool if s.node not in full_nodes]
    chosen = _pick_spares(state, failed, usable, tp_within_node)
    if chosen is None:
        if shrink_planner is not None:
            try:
                planned = shrink_planner(state, frozenset(failed_ids), committed_step)
            except ShrinkRefused as exc:
                return StopDecision(generation, committed_step,
                                    _stop_message(failed, causes, committed_step, str(exc)),
                                    all_causes, failed_ids)
            if planned is not None:
                plan = dataclasses.replace(
                    planned, generation=generation, resume_step=committed_step,
                    reason=planned.reason or "shrink onto the survivors")
                return PlanDecision("shrink", previous, plan, {}, all_causes)
        unusable = len(pool) - len(usable)
        why = (f"{len(pool)} spare(s) registered, {len(failed)} needed"
               + (f" ({unusable} of them on a node whose disk is full: "
                  f"{', '.join(sorted(full_nodes))})" if unusable else "")
               + (" (a tensor-parallel group takes its spares from one node: beside its "
                  f"survivors, or {state.layout.tp} for the whole group)"
                  if state.layout.tp > 1 else "")
               + (", and no smaller plan fits the survivors." if shrink_planner else "."))
        return StopDecision(generation, committed_step,
                            _stop_message(failed, causes, committed_step, why), all_causes,
                            failed_ids)

    members = tuple(
        Member(chosen[m.rank_id].rank_id, chosen[m.rank_id].node, m.coord)
        if m.rank_id in chosen else m
        for m in state.members
    )
    used = {s.rank_id for s in chosen.values()}
    # Survivors whose tensor-parallel group moved to another node wait as spares.
    moved = [Member(m.rank_id, m.node) for m in state.members
             if m.rank_id in chosen and m.rank_id not in failed_ids]
    reason = "replace " + ", ".join(
        f"{old} with spare {new.rank_id}" for old, new in chosen.items())
    if moved:
        reason += "".join(f"; {m.rank_id} became a spare" for m in moved) + (
            ": its tensor-parallel group moved whole to a node with spares for all of it")
    plan = PlanState(
        generation=generation, layout=state.layout, members=members,
        spares=(*(s for s in pool if s.rank_id not in used), *moved),
        resume_step=committed_step, reason=reason,
    )
    replacements = {old: new.rank_id for old, new in chosen.items()}
    return PlanDecision("replace", previous, plan, replacements, all_causes)
