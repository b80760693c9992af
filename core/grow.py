"""Admit ranks that registered during training: at a step boundary, widen the plan onto
the running members plus the spares when the predicted speed-up is worth the pause.

The search is the shrink planner's (`stalwart.core.shrink.plan_layout`) with the
degrees allowed only to grow, so layers move as little as they do on a shrink.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from stalwart.core.decide import Member, PlanState
from stalwart.core.shrink import ElasticConfig, ShrinkResult, plan_layout

__all__ = ["GrowPolicy", "plan_grow"]


def plan_grow(state: PlanState, config: ElasticConfig, threshold: float, *,
              joined: Iterable[Member] = ()) -> ShrinkResult | None:
    """A wider plan on the members, the spares of `state` and the `joined` ranks, or None
    when its predicted gain in steps/s is below `threshold` (a fraction: 0.1 = 10 %).

    Members keep their roles where the layout allows; ranks the new plan leaves out stay
    spares. The result's generation and resume_step are the caller's to set.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be a fraction >= 0, got {threshold}")
    known = {m.rank_id for m in (*state.members, *state.spares)}
    extra = tuple(Member(m.rank_id, m.node) for m in joined if m.rank_id not in known)
    pool = dataclasses.replace(state, spares=(*state.spares, *extra))
    if not pool.spares:
        return None
    lay = state.layout
    everyone = len(pool.members) + len(pool.spares)
    result = plan_layout(pool, frozenset(), config, dp_range=(lay.dp, everyone),
                         pp_range=(lay.pp, len(config.costs)))
    if result.plan.layout.world_size <= lay.world_size:
        return None
    if result.speed_ratio - 1.0 < threshold:
        return None
    reason = f"{result.plan.reason}; predicted {result.speed_ratio:.2f}x steps/s"
    return dataclasses.replace(result, plan=dataclasses.replace(result.plan, reason=reason))


class GrowPolicy:
    """Called by the coordinator at a step boundary once spares are registered; the last
    widening's full result (layers to receive, predicted speed) stays in `last`."""

    def __init__(self, config: ElasticConfig, threshold: float) -> None:
        self.config, self.threshold = config, threshold
        self.last: ShrinkResult | None = None

    def __call__(self, state: PlanState, committed_step: int) -> PlanState | None:
        result = plan_grow(state, self.config, self.threshold)
        if result is None:
            return None
        self.last = result
        return dataclasses.replace(result.plan, generation=state.generation + 1,
                                   resume_step=committed_step)
