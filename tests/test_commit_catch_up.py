"""A coordinator that dies while sending phase two leaves its last step committed on some
daemons only. Its successor must take that step from a daemon that has it before it
decides, or the plan would resume below a committed step and lose it; and a daemon that
lacks the step a plan resumes from takes it before it adopts the plan, or its ranks
could not restore.

Two real daemons in one process over TCP; a is the coordinator by name."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
from fixtures_hostile import as_node, code_of, config, until
from snapshot_states import commit_step

from stalwart.daemon.server import Daemon
from stalwart.v1 import common_pb2, peer_pb2, peer_pb2_grpc


async def two_daemons(root: Path, body):
    a = Daemon(dataclasses.replace(config(root / "a"), node="a"))
    await a.start()
    b = Daemon(dataclasses.replace(config(root / "b"), node="b", peers=(a.address,)))
    await b.start()
    try:
        return await body(a, b)
    finally:
        await b.stop(grace_s=0)
        await a.stop(grace_s=0)


def test_a_new_coordinator_takes_the_step_its_predecessor_committed_only_elsewhere(
        tmp_path: Path) -> None:
    async def body(a: Daemon, b: Daemon) -> dict:
        for step in (1, 2):
            commit_step(a.job.snapshots.store, step)
        for step in (1, 2, 3):
            commit_step(b.job.snapshots.store, step)
        await until(lambda: any(p.node == "b" and p.latest_committed == 3
                                for p in a.membership.peers()),
                    "a to hear through gossip that b committed step 3")
        await a.job._catch_up()
        return {"steps": a.job.snapshots.store.committed_steps(),
                "same": a.job.snapshots.store.load_record(3)
                == b.job.snapshots.store.load_record(3)}

    seen = asyncio.run(two_daemons(tmp_path, body))
    assert seen == {"steps": [1, 2, 3], "same": True}


def test_a_plan_brings_the_step_it_resumes_from_to_a_daemon_that_missed_its_commit(
        tmp_path: Path) -> None:
    async def body(a: Daemon, b: Daemon) -> dict:
        for step in (1, 2, 3):
            commit_step(a.job.snapshots.store, step)
        for step in (1, 2):
            commit_step(b.job.snapshots.store, step)
        await until(lambda: any(p.node == "b" for p in a.membership.peers())
                    and b.job.leadership.leader() == "a", "a and b to know each other")
        await a.job.links.install_plan("b", common_pb2.Plan(generation=2, resume_step=3))
        taken = {"steps": b.job.snapshots.store.committed_steps(),
                 "same": a.job.snapshots.store.load_record(3)
                 == b.job.snapshots.store.load_record(3),
                 "generation": b.job.registry.generation}
        # A step the coordinator has not committed either: the plan is adopted all the
        # same (keeping the old generation would be worse), and the error says so.
        await a.job.links.install_plan("b", common_pb2.Plan(generation=3, resume_step=9))
        return {**taken, "then": (b.job.snapshots.store.committed_steps(),
                                  b.job.registry.generation)}

    seen = asyncio.run(two_daemons(tmp_path, body))
    assert seen == {"steps": [1, 2, 3], "same": True, "generation": 2,
                    "then": ([1, 2, 3], 3)}


def test_a_step_record_is_given_only_to_a_live_daemon_of_the_job(tmp_path: Path) -> None:
    async def body(a: Daemon, b: Daemon) -> dict:
        commit_step(a.job.snapshots.store, 1)
        await until(lambda: any(p.node == "b" for p in a.membership.peers()),
                    "a to know b")
        async with grpc.aio.insecure_channel(a.address) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)

            def ask(step: int, node: str):
                return stub.GetStepRecord(peer_pb2.GetStepRecordRequest(job_id="default",
                                                                        step=step),
                                          metadata=as_node(node), timeout=10)
            return {"stranger": await code_of(ask(1, "z")),
                    "absent": await code_of(ask(7, "b")),
                    "member": (await ask(1, "b")).step}

    seen = asyncio.run(two_daemons(tmp_path, body))
    assert seen["stranger"].startswith("PERMISSION_DENIED: daemon z is not a live member")
    assert seen["absent"] == "NOT_FOUND: step 7 is not committed on a"
    assert seen["member"] == 1
