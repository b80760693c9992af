"""A rank waiting for its final step to commit follows a newer plan instead of timing
out: a peer lost before that step committed makes the job resume earlier, and every
rank, finished or not, must redo the steps after the resume point."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.client.generation import Generation, PlanChanged
from stalwart.v1 import common_pb2, rank_pb2


class NeverCommits:
    """A daemon whose final step never commits; after `plan_after` waits a new plan
    (generation 2) reaches the rank."""

    def __init__(self, agent: Any, plan_after: int) -> None:
        self.agent, self.plan_after, self.waits = agent, plan_after, []

    def call(self, _what: str, _rpc: str, request: Any, timeout: float) -> Any:
        self.waits.append(request.timeout_s)
        if len(self.waits) == self.plan_after:
            self.agent._newest = 2
        return rank_pb2.WaitCommittedReply(committed=False, message="not yet")


def generation(plan_after: int) -> tuple[Generation, NeverCommits]:
    agent = SimpleNamespace(_newest=1)
    agent.superseded = lambda generation: agent._newest > generation
    agent.daemon = daemon = NeverCommits(agent, plan_after)
    gen = Generation(common_pb2.Plan(generation=1), common_pb2.RankAssignment(), None,
                     agent, {})  # type: ignore[arg-type]
    return gen, daemon


def test_a_newer_plan_ends_the_wait_for_the_final_commit() -> None:
    gen, daemon = generation(plan_after=3)
    with pytest.raises(PlanChanged):
        gen.wait_committed(12, timeout_s=60.0)
    assert len(daemon.waits) == 3 and max(daemon.waits) <= 0.5


def test_without_a_newer_plan_the_wait_times_out_naming_the_step() -> None:
    gen, daemon = generation(plan_after=0)
    with pytest.raises(RuntimeError, match="final step 12 was not committed within 0.2 s"):
        gen.wait_committed(12, timeout_s=0.2)
