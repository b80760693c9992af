"""Which announced plans make a rank leave the generation it is in (`ElasticAgent.
superseded`): any newer plan, except the job's completion. The completion comes once
every rank committed its last step, while the ranks may still compute the job's digest
through their groups; abandoning that work would leave every rank without its result.
Pure logic with a stand-in for the daemon's plan stream."""

from __future__ import annotations

from types import SimpleNamespace

from stalwart.client.agent import AgentConfig, ElasticAgent
from stalwart.v1 import common_pb2


class PlanStream:
    """Announces `plans`, then ends as a closed channel does."""

    generation = 0

    def __init__(self, *plans: common_pb2.Plan) -> None:
        self.plans = plans

    def watch_plan(self, known_generation: int):
        for plan in self.plans:
            yield SimpleNamespace(plan=plan)
        raise ConnectionError("the stream ended")


def _after(*plans: common_pb2.Plan) -> ElasticAgent:
    agent = ElasticAgent(None, AgentConfig(), PlanStream(*plans))
    agent._watch()  # returns once the stream ends
    return agent


def test_the_jobs_completion_does_not_abandon_the_last_generation() -> None:
    agent = _after(common_pb2.Plan(generation=1),
                   common_pb2.Plan(generation=2, stop=True, completed=True, resume_step=8))
    assert not agent.superseded(1)
    assert agent.daemon.generation == 2  # heartbeats still speak for the newest plan


def test_a_newer_plan_or_a_stop_supersedes_the_generation() -> None:
    assert _after(common_pb2.Plan(generation=1), common_pb2.Plan(generation=2)).superseded(1)
    stop = common_pb2.Plan(generation=2, stop=True, stop_message="no spare")
    assert _after(common_pb2.Plan(generation=1), stop).superseded(1)
