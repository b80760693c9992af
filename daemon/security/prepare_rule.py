"""The prepare rule: a daemon prepares only its own ranks of the coordinator's plan, in
the plan's layout, near the last commit, without taking the steps awaiting commit past a
bound.

The coordinator checks it for every prepare of every step (2,048 of them a step at
2,048 nodes), so what depends only on the plan is derived once per plan
(`ranks_by_node`), what depends only on the moment once per batch (a `PrepareRule`),
and a prepare then costs O(its own ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from stalwart.core.decide import PlanState
from stalwart.daemon.errors import NotReady
from stalwart.daemon.rpc import validate
from stalwart.daemon.rpc.errors import TYPED
from stalwart.daemon.security.auth import Forbidden
from stalwart.daemon.snapshot.commit_tree import BadTag, RelayKeys
from stalwart.v1 import peer_pb2

log = logging.getLogger("stalwart.daemon.security.prepare_rule")

MAX_STEPS_AHEAD = 10_000   # a prepare may be at most this many steps past the last commit
MAX_PENDING_STEPS = 256    # steps prepared but not yet committed, at most


def ranks_by_node(plan: PlanState) -> dict[str, frozenset[int]]:
    """Node -> the global ranks the plan puts on it."""
    placed: dict[str, set[int]] = {}
    for m in plan.members:
        if m.coord is not None:
            placed.setdefault(m.node, set()).add(m.coord.rank)
    return {node: frozenset(ranks) for node, ranks in placed.items()}


@dataclass(frozen=True)
class PrepareRule:
    """The rule at one moment: the coordinator's plan (None before it has one), the last
    committed step, and the steps awaiting commit. `ranks_of` is `ranks_by_node(plan)`
    when the caller keeps it across batches."""
    plan: PlanState | None
    latest: int | None
    pending: Collection[int] = ()
    ranks_of: Mapping[str, AbstractSet[int]] | None = None

    def check(self, caller: str, req: peer_pb2.PrepareStepRequest) -> None:
        """Raise unless `caller` may prepare what `req` names: NotReady before a plan,
        Forbidden outside the caller's role. An older generation passes: the
        coordinator answers it with StaleGeneration."""
        plan = self.plan
        if plan is None:
            raise NotReady(f"step {req.step} prepared before this daemon coordinates a plan")
        generation, step = req.generation, req.step
        if generation > plan.generation:
            raise Forbidden(f"prepare of generation {generation} is ahead of the plan "
                            f"(generation {plan.generation})")
        if generation < plan.generation:
            return
        floor = max(self.latest or 0, plan.resume_step)
        if step > floor + MAX_STEPS_AHEAD:
            raise Forbidden(f"step {step} is more than {MAX_STEPS_AHEAD} steps past the last "
                            f"committed step {floor}")
        if len(self.pending) >= MAX_PENDING_STEPS and step not in self.pending:
            raise Forbidden(f"{len(self.pending)} steps already await their commit; step "
                            f"{step} is refused until older ones commit or are skipped")
        lay, want = req.layout, plan.layout
        if lay.tp != want.tp or lay.pp != want.pp or lay.dp != want.dp:
            raise Forbidden(f"step {step} was captured in layout {lay.dp}x{lay.pp}x{lay.tp}, "
                            f"the plan's is {want.dp}x{want.pp}x{want.tp}")
        ranks_of = ranks_by_node(plan) if self.ranks_of is None else self.ranks_of
        ranks = req.seal.ranks
        if not ranks_of.get(caller, frozenset()).issuperset(ranks):
            self._misplaced(caller, ranks)

    def _misplaced(self, caller: str, ranks: Collection[int]) -> None:
        assert self.plan is not None
        where = {m.coord.rank: m.node for m in self.plan.members if m.coord is not None}
        rank = next(r for r in ranks if where.get(r) != caller)
        raise Forbidden(f"daemon {caller} prepared rank {rank}, which the plan of "
                        f"generation {self.plan.generation} places on "
                        f"{where.get(rank, 'no node')}; a daemon prepares its own ranks")

    def relayed(self, batch: peer_pb2.PrepareBatch, keys: RelayKeys, via: str
                ) -> list[peer_pb2.PrepareStepRequest]:
        """The prepares of a batch that came up the commit tree through `via` which may be
        taken: each carries its own daemon's tag, is well formed, of the batch's job, and
        within that daemon's role. One bad prepare is logged and left, not the batch."""
        taken = []
        for tagged in batch.prepares:
            try:
                req = keys.open(tagged)
                validate.request(req)
                if req.job_id != batch.job_id:
                    raise Forbidden(f"a prepare of job {req.job_id!r} in a batch of job "
                                    f"{batch.job_id!r}")
                self.check(req.node, req)
            except (BadTag, validate.InvalidRequest, Forbidden, *TYPED) as exc:
                log.warning("relayed prepare refused",
                            extra={"via": via, "step": tagged.step, "error": str(exc)})
                continue
            taken.append(req)
        return taken
