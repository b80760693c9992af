"""A daemon whose disk is full still adopts a plan that resumes from a step it missed.

Before it adopts a plan, a daemon commits the plan's resume step where it lacks it
(`JobGate._take_resume_step`). Its disk refusing that record (ENOSPC) must not refuse
the plan: the plan's ranks on this node, a spare given a role here among them, would
never learn their roles, and every other rank would wait for them until its group
build timed out. Pure logic with stand-ins for the leadership, the registry and the
store; `stalwart chaos --kinds full-disk` runs it against a filled tmpfs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from stalwart.daemon.security.roles import JobGate
from stalwart.v1 import common_pb2


def _gate(take_commit) -> tuple[JobGate, list[common_pb2.Plan]]:
    adopted: list[common_pb2.Plan] = []

    async def confirm(caller: str) -> bool:
        return caller == "node-0"

    def adopt(plan: common_pb2.Plan) -> common_pb2.Ack:
        adopted.append(plan)
        return common_pb2.Ack(accepted=True)

    gate = JobGate.__new__(JobGate)
    gate.leadership = SimpleNamespace(confirm=confirm, leader=lambda: "node-0")
    gate.registry = SimpleNamespace(generation=1)
    gate.store = SimpleNamespace(job_id="job", committed_steps=lambda: [1, 2, 3, 4, 5])
    gate.take_commit = take_commit
    gate.adopt_plan = adopt
    return gate, adopted


def test_a_resume_step_this_full_disk_refuses_still_lets_the_plan_in():
    asked: list[int] = []

    async def take_commit(node: str, job_id: str, step: int) -> None:
        asked.append(step)
        raise OSError(28, "No space left on device")

    gate, adopted = _gate(take_commit)
    plan = common_pb2.Plan(generation=2, resume_step=7)
    ack = asyncio.run(gate.install_from("node-0", plan))
    assert asked == [7]
    assert ack.accepted and adopted == [plan]


def test_a_resume_step_held_here_is_not_asked_for():
    async def take_commit(node: str, job_id: str, step: int) -> None:
        raise AssertionError("a held step is not fetched")

    gate, adopted = _gate(take_commit)
    plan = common_pb2.Plan(generation=2, resume_step=5)
    assert asyncio.run(gate.install_from("node-0", plan)).accepted
    assert adopted == [plan]
