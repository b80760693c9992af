"""A rank that dies after its daemon took in its capture of a step does not make the job
redo that step: the coordinator lets the step commit (the survivors' prepares of it are
on their way) before it picks the resume step, waiting no longer than training the
steps it saves took. In-process coordinator; the daemons are a record of installed plans
and commits, and the prepares are the ones daemons send. While it waits, every daemon
stores that step next: the captures of earlier steps still waiting are dropped (a real
Intake)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from coordinator_links import Daemons

from stalwart.core.failures import Failure, FailureKind
from stalwart.core.step_record import seal
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import LAND_WAIT_MAX_S, Coordinator
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.snapshot import intake as intake_module
from stalwart.daemon.snapshot.intake import MAX_BACKLOG, Intake
from stalwart.daemon.snapshot.slots import FdServer, SlotPool
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, rank_pb2

LAYOUT = common_pb2.ParallelLayout(dp=2, pp=1, tp=1, schedule="1f1b", microbatches=1,
                                   grad_accum=1)
STEP_S = 0.2  # the job's pace: one step (and one commit) every STEP_S
JOB_STEPS = 4  # committed before the failure


def prepare(node: str, rank: int, step: int, generation: int = 1
            ) -> peer_pb2.PrepareStepRequest:
    return peer_pb2.PrepareStepRequest(
        job_id="job", step=step, generation=generation, node=node, layout=LAYOUT,
        seal=seal(node, [manifest_pb2.RankState(rank=rank, node=node)]))


def killed(rank_id: str, captured: int) -> Failure:
    return Failure(FailureKind.PROCESS_EXIT, rank_id, "killed by SIGKILL", generation=1,
                   reporter="n0", captured_step=captured)


class WithAFrozenDaemon(Daemons):
    """Daemons whose `frozen` one (stopped, not yet declared lost) takes calls and
    answers none."""

    def __init__(self, live: list[str]) -> None:
        super().__init__()
        self.live, self.frozen = live, ""

    async def hurry_step(self, node: str, request: peer_pb2.HurryStepRequest) -> bool:
        if node == self.frozen:
            await asyncio.Event().wait()
        return await super().hurry_step(node, request)

    async def commit_step(self, node: str, request) -> None:
        if node == self.frozen:
            await asyncio.Event().wait()
        await super().commit_step(node, request)


async def running_job(step_s: float = STEP_S, daemons: Daemons | None = None
                      ) -> tuple[Coordinator, Daemons]:
    """Ranks n0/1 (rank 0) and n1/2 (rank 1), a spare on n1, steps 1..JOB_STEPS committed
    one every `step_s` (the training between commits)."""
    daemons = daemons or Daemons()
    c = Coordinator(node="n0", job_id="job", metrics=Metrics(), links=daemons,
                    latest_committed=lambda: max(daemons.committed, default=None))
    for rank_id, node, rank in (("n0/1", "n0", 0), ("n1/2", "n1", 1), ("n1/3", "n1", 2)):
        await c.announce(peer_pb2.RankAnnouncement(node=node, rank_id=rank_id, rank=rank,
                                                   world_size=2, layout=LAYOUT, generation=1))
    assert len(daemons.plans) == 1
    for step in range(1, JOB_STEPS + 1):
        await asyncio.sleep(step_s)  # a step of training
        await c.prepared(prepare("n0", 0, step), prepare("n1", 1, step))
    assert daemons.committed == list(range(1, JOB_STEPS + 1))
    return c, daemons


async def waiting(c: Coordinator) -> None:
    """Until the coordinator waits for a commit (it does so without any real wait)."""
    for _ in range(100):
        if c.commits._landed._waiters:  # noqa: SLF001 - the test's only window on it
            return
        await asyncio.sleep(0)
    raise AssertionError("the coordinator re-planned without waiting for the captured step")


def test_a_step_the_dead_rank_captured_commits_before_the_plan_resumes_from_it() -> None:
    async def main() -> tuple[list[int], common_pb2.Plan]:
        c, daemons = await running_job()
        step = JOB_STEPS + 1
        # n1 made its rank's capture of step 5 durable; n0 took rank 0's capture of it in
        # before the rank died and is still storing it.
        await c.prepared(prepare("n1", 1, step))
        replan = asyncio.create_task(c.on_failures([killed("n0/1", captured=step)]))
        await waiting(c)
        assert len(daemons.plans) == 1  # nothing decided while the step may still land
        await c.prepared(prepare("n0", 0, step))  # n0's store finished
        await asyncio.wait_for(replan, 10.0)
        # Every daemon was told to store step 5 next.
        assert sorted(daemons.hurried) == [("n0", step), ("n1", step)]
        return daemons.committed, daemons.plans[-1]

    committed, plan = asyncio.run(main())
    assert committed[-1] == JOB_STEPS + 1
    assert plan.generation == 2 and plan.resume_step == JOB_STEPS + 1  # nothing redone


def test_a_step_the_hurry_made_moot_is_skipped_as_such_not_as_lost_prepares(caplog) -> None:
    # The hurry names step 6: every daemon drops its captures of step 5 still waiting,
    # so step 5 never completes (n0's prepare of it never comes) and step 6 commits over
    # it. That is the hurry at work, not prepares lost with a coordinator.
    async def main() -> tuple[list[int], common_pb2.Plan]:
        c, daemons = await running_job()
        await c.prepared(prepare("n1", 1, JOB_STEPS + 1))
        replan = asyncio.create_task(c.on_failures([killed("n0/1", captured=JOB_STEPS + 2)]))
        await waiting(c)
        await c.prepared(prepare("n0", 0, JOB_STEPS + 2), prepare("n1", 1, JOB_STEPS + 2))
        await asyncio.wait_for(replan, 10.0)
        return daemons.committed, daemons.plans[-1]

    with caplog.at_level(logging.INFO, logger="stalwart.daemon.recovery.step_commits"):
        committed, plan = asyncio.run(main())
    assert committed[-1] == JOB_STEPS + 2 and JOB_STEPS + 1 not in committed
    assert plan.resume_step == JOB_STEPS + 2
    assert [(r.levelname, r.getMessage()) for r in caplog.records
            if "skipped" in r.getMessage()] == [
        ("INFO", "step skipped: a hurry before a re-plan made it moot")]


def test_a_captured_step_that_does_not_land_in_the_jobs_pace_is_given_up() -> None:
    # n1's prepare of step 5 never comes (its store failed): the plan waits about one
    # step's training, then resumes from the last committed step.
    async def main() -> common_pb2.Plan:
        c, daemons = await running_job()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(c.on_failures([killed("n0/1", captured=JOB_STEPS + 1)]), 10.0)
        assert loop.time() - t0 >= STEP_S / 2  # it did wait for the step
        return daemons.plans[-1]

    plan = asyncio.run(main())
    assert plan.generation == 2 and plan.resume_step == JOB_STEPS


def test_no_wait_when_the_failure_says_nothing_of_captures_or_a_node_is_lost() -> None:
    # A lost node took its ranks' captures with it; a failure without a captured step
    # (another detector's), or one reported in an older generation, gives nothing to
    # wait for: the plan is decided at once.
    async def main(failure: Failure) -> int:
        c, daemons = await running_job()
        await c.prepared(prepare("n1", 1, JOB_STEPS + 1))
        replan = asyncio.create_task(c.on_failures([failure]))
        for _ in range(100):  # let it run to its end without any real wait
            if replan.done():
                break
            await asyncio.sleep(0)
        assert replan.done(), "the coordinator waited with nothing to wait for"
        return daemons.plans[-1].resume_step

    assert asyncio.run(main(killed("n0/1", captured=0))) == JOB_STEPS
    older = Failure(FailureKind.PROCESS_EXIT, "n0/1", "killed by SIGKILL", generation=0,
                    reporter="n0", captured_step=JOB_STEPS + 1)
    assert asyncio.run(main(older)) == JOB_STEPS
    lost = Failure(FailureKind.PEER_LOST, "n0", "no heartbeat for 3 s", generation=1,
                   reporter="n1", captured_step=JOB_STEPS + 1)
    assert asyncio.run(main(lost)) == JOB_STEPS


def test_the_captured_step_travels_with_the_failure_report() -> None:
    f = killed("n0/1", captured=17)
    assert Failure.from_proto(f.to_proto()).captured_step == 17


class OneRank:
    """A real Intake with one rank, r0, whose captures `durable` stores."""

    def __init__(self, tmp_path: Path, durable: Callable[..., Awaitable[None]]) -> None:
        self.pool = SlotPool(budget_bytes=1 << 20)
        self.registry = Registry(node="n0", heartbeat_interval_s=1.0,
                                 heartbeat_timeout_s=60.0, metrics=Metrics())
        self.intake = Intake(self.pool, FdServer(self.pool, tmp_path / "fd.sock"),
                             self.registry, Metrics(), "n0", durable)
        self.slot = self.pool.open("r0", 64)[0]

    async def capture(self, step: int, generation: int = 1) -> None:
        await self.intake.capture(rank_pb2.CaptureRequest(
            rank_id="r0", slot_id=self.slot.slot_id, step=step, generation=generation,
            tensors=[common_pb2.TensorMeta(name="x", nbytes=8, offset=0)]))


def test_a_hurried_step_is_stored_without_waiting_for_the_earlier_ones(tmp_path: Path
                                                                        ) -> None:
    # A rank's captures of steps 1-3 wait in its daemon's intake, step 1 being stored;
    # the coordinator waits for step 3. Step 2 is dropped, and step 3 is stored while
    # step 1 is still being stored (its work learns it is moot and stops at its next
    # stage); the rank's backlog is free again. Step 4 still waits for step 3, and a
    # capture of another plan is not touched.
    async def main() -> tuple[list[tuple[int, int]], list[bool], int]:
        stored: list[tuple[int, int]] = []
        moot_when_done: list[bool] = []
        storing, step_one, step_three = asyncio.Event(), asyncio.Event(), asyncio.Event()
        three_begun = asyncio.Event()

        async def durable(request: rank_pb2.CaptureRequest, owned: bytes, release) -> None:
            storing.set()
            if request.step == 1:
                await step_one.wait()  # step 1 takes its time
                moot_when_done.append(r0.intake.moot(request))
            if request.step == 3:
                three_begun.set()
                await step_three.wait()
            stored.append((request.generation, request.step))

        r0 = OneRank(tmp_path, durable)
        intake, capture = r0.intake, r0.capture
        for step in (1, 2, 3):
            await capture(step)
        await storing.wait()
        intake.hurry(1, 3)
        try:  # step 2 dropped at once makes room for step 4; step 1 is still stored
            await asyncio.wait_for(capture(4), 30)
            await asyncio.wait_for(three_begun.wait(), 30)
        except TimeoutError:
            raise AssertionError("steps 2 and 3 waited for step 1, which a hurry made "
                                 "moot") from None
        step_three.set()
        four = intake._tail["r0"].task  # noqa: SLF001 - the rank's last capture's work
        await four
        step_one.set()
        await capture(2, generation=2)  # a new plan redoes step 2: stored
        await intake._tail["r0"].task  # noqa: SLF001
        backlog = intake._backlog["r0"]  # noqa: SLF001
        r0.pool.close()
        return stored, moot_when_done, backlog

    stored, moot_when_done, backlog = asyncio.run(main())
    assert stored == [(1, 3), (1, 4), (1, 1), (2, 2)]
    assert moot_when_done == [True]
    assert backlog == 0


def test_a_new_plan_drops_the_old_plans_captures_waiting_behind_one_still_stored(
        tmp_path: Path) -> None:
    # The rank's capture of step 1 is being stored, its shards' peer frozen; steps 2 and
    # 3 wait behind it and the backlog is full. A new plan makes them moot: they are
    # dropped at once, so the rank's first capture of the new plan is taken in and
    # stored while step 1 is still being stored (not once its peer wakes).
    async def main() -> tuple[list[tuple[int, int]], int]:
        stored: list[tuple[int, int]] = []
        frozen = asyncio.Event()

        async def durable(request: rank_pb2.CaptureRequest, owned: bytes, release) -> None:
            if request.step == 1:
                await frozen.wait()
            stored.append((request.generation, request.step))

        r0 = OneRank(tmp_path, durable)
        intake, capture = r0.intake, r0.capture
        r0.registry.install_plan(common_pb2.Plan(generation=1))
        for step in range(1, MAX_BACKLOG + 1):
            await capture(step)
        r0.registry.install_plan(common_pb2.Plan(generation=2))
        try:
            await asyncio.wait_for(capture(2, generation=2), 30)
            await asyncio.wait_for(intake._tail["r0"].task, 30)  # noqa: SLF001
        except TimeoutError:
            raise AssertionError("the old plan's moot captures held the backlog until "
                                 "the capture ahead of them was stored") from None
        backlog = intake._backlog["r0"]  # noqa: SLF001 - step 1's room, still held
        frozen.set()
        await intake.stop()
        r0.pool.close()
        return stored, backlog

    stored, backlog = asyncio.run(main())
    assert stored[0] == (2, 2)
    assert backlog == 1


class Hurried:
    """A real Intake at plan 1 with two ranks: r0's capture of step 2 is being stored
    (until `two` is set), r1 has stored step 2 and took in step 3, and a hurry named
    step 2 (the coordinator waits for it to commit)."""

    async def start(self, tmp_path: Path) -> Hurried:
        self.pool = SlotPool(budget_bytes=1 << 20)
        self.registry = Registry(node="n0", heartbeat_interval_s=1.0,
                                 heartbeat_timeout_s=60.0, metrics=Metrics())
        self.registry.install_plan(common_pb2.Plan(generation=1))
        self.stored: list[tuple[str, int]] = []
        self.two = asyncio.Event()

        async def durable(request: rank_pb2.CaptureRequest, owned: bytes, release) -> None:
            if (request.rank_id, request.step) == ("r0", 2):
                await self.two.wait()
            self.stored.append((request.rank_id, request.step))

        self.intake = Intake(self.pool, FdServer(self.pool, tmp_path / "fd.sock"),
                             self.registry, Metrics(), "n0", durable)
        slots = {r: self.pool.open(r, 64)[0] for r in ("r0", "r1")}

        async def capture(rank: str, step: int) -> None:
            await self.intake.capture(rank_pb2.CaptureRequest(
                rank_id=rank, slot_id=slots[rank].slot_id, step=step, generation=1,
                tensors=[common_pb2.TensorMeta(name="x", nbytes=8, offset=0)]))

        await capture("r0", 2)
        self.intake.hurry(1, 2)
        await capture("r1", 2)
        await capture("r1", 3)
        for _ in range(50):  # let the work run until it waits (no real wait)
            await asyncio.sleep(0)
        return self

    async def done(self) -> list[tuple[str, int]]:
        self.two.set()
        for rank in ("r0", "r1"):
            await asyncio.wait_for(self.intake._tail[rank].task, 30)  # noqa: SLF001
        self.pool.close()
        return self.stored


def test_a_later_step_waits_for_the_replan_while_the_hurried_step_is_stored(
        tmp_path: Path) -> None:
    # A survivor's capture of a step after the hurried one is redone by the coordinator's
    # re-plan; stored meanwhile, it would take the cores the hurried step needs. It waits
    # for the new plan, which redoes it: it is then dropped, not stored.
    async def main() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        h = await Hurried().start(tmp_path)
        while_storing = list(h.stored)
        h.registry.install_plan(common_pb2.Plan(generation=2))
        return while_storing, await h.done()

    while_storing, stored = asyncio.run(main())
    assert while_storing == [("r1", 2)]
    assert sorted(stored) == [("r0", 2), ("r1", 2)]


def test_without_a_replan_the_later_step_is_stored_after_the_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No new plan follows the hurry (the coordinator died meanwhile, or the failure
    # changed nothing): the later step is stored once the hold is over.
    monkeypatch.setattr(intake_module, "HURRY_HOLD_S", 0.2)

    async def main() -> list[tuple[str, int]]:
        h = await Hurried().start(tmp_path)
        await asyncio.wait_for(h.intake._tail["r1"].task, 30)  # noqa: SLF001
        return await h.done()

    stored = asyncio.run(main())
    assert stored[:2] == [("r1", 2), ("r1", 3)]  # before the hurried step of r0 ended


class Backlogged:
    """A real Intake whose rank's encoding is MAX_BACKLOG captures behind (the stored
    steps wait for `room`), and whose next capture, of step MAX_BACKLOG + 1, waits in the
    daemon for room, its call still open (`call`)."""

    async def start(self, tmp_path: Path) -> Backlogged:
        self.pool = SlotPool(budget_bytes=1 << 20)
        registry = Registry(node="n0", heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0,
                            metrics=Metrics())
        self.record = registry.register(pid=1, rank=0, world_size=1, local_rank=0,
                                        hostname="h", spare=False, device="cpu",
                                        watch_pid=False)
        self.stored: list[int] = []
        self.room = asyncio.Event()

        async def durable(request: rank_pb2.CaptureRequest, owned: bytes, release) -> None:
            await self.room.wait()
            self.stored.append(request.step)

        self.intake = Intake(self.pool, FdServer(self.pool, tmp_path / "fd.sock"), registry,
                             Metrics(), "n0", durable)
        slot = self.pool.open(self.record.rank_id, 64)[0]

        def capture(step: int) -> rank_pb2.CaptureRequest:
            return rank_pb2.CaptureRequest(
                rank_id=self.record.rank_id, slot_id=slot.slot_id, step=step, generation=1,
                tensors=[common_pb2.TensorMeta(name="x", nbytes=8, offset=0)])

        for step in range(1, MAX_BACKLOG + 1):
            await self.intake.capture(capture(step))
        self.call = asyncio.create_task(self.intake.capture(capture(MAX_BACKLOG + 1)))
        for _ in range(20):  # let the call run until it waits (no real wait)
            await asyncio.sleep(0)
        assert not self.call.done(), "the capture did not wait for room"
        assert self.record.captured == (1, MAX_BACKLOG)  # not taken in yet
        return self

    async def stored_all(self) -> list[int]:
        await self.intake._tail[self.record.rank_id].task  # noqa: SLF001 - its last work
        return self.stored


def test_a_capture_waiting_for_room_is_taken_in_after_its_rank_is_gone(
        tmp_path: Path) -> None:
    # Encoding is MAX_BACKLOG captures behind, so the rank's next capture waits in the
    # daemon for room. Its slot already holds the step, and it is taken in although the
    # rank dies meanwhile (its call cancelled), and counted as captured once it is.
    async def main() -> tuple[list[int], int]:
        b = await Backlogged().start(tmp_path)
        b.call.cancel()  # the rank died: gRPC cancels its call
        b.room.set()
        await b.intake._taking.drain()  # noqa: SLF001 - the captures being taken in
        stored = await b.stored_all()
        b.pool.close()
        return stored, b.record.captured

    stored, captured = asyncio.run(main())
    assert captured == (1, MAX_BACKLOG + 1)
    assert stored == list(range(1, MAX_BACKLOG + 2))


def test_a_dead_ranks_slots_are_freed_once_its_last_capture_is_out(tmp_path: Path) -> None:
    # A rank killed while its capture waits for room: the capture is still taken in from
    # its slot, and only then are its slots freed (they count against the node's budget,
    # which a spare taking its place needs).
    async def main() -> tuple[list[int], bool, int]:
        b = await Backlogged().start(tmp_path)
        b.call.cancel()  # the rank died
        forget = asyncio.create_task(b.intake.forget_rank(b.record.rank_id))
        for _ in range(20):
            await asyncio.sleep(0)
        held_while_waiting = not forget.done() and b.pool.used_bytes > 0
        b.room.set()
        await forget
        return await b.stored_all(), held_while_waiting, b.pool.used_bytes

    stored, held_while_waiting, used = asyncio.run(main())
    assert held_while_waiting
    assert stored == list(range(1, MAX_BACKLOG + 2))
    assert used == 0


def test_a_step_every_daemon_holds_is_waited_for_past_the_jobs_pace() -> None:
    # Every daemon answers the hurry that its ranks' captures of step 5 are taken in:
    # nothing but storing stands between the step and its commit, so the coordinator
    # waits for it although storing it outlasts the step's training (1.5 steps' worth),
    # but not past twice that: then training the step again costs less. A slower pace
    # than the other tests': the step lands mid-way between the two bounds, 0.3 s from
    # each, which a loaded machine's stalls do not cross.
    pace = 3 * STEP_S

    async def main(stored_after_s: float | None) -> tuple[common_pb2.Plan, float]:
        c, daemons = await running_job(pace)
        daemons.holding = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        replan = asyncio.create_task(c.on_failures([killed("n0/1", captured=JOB_STEPS + 1)]))
        await waiting(c)
        if stored_after_s is not None:
            await asyncio.sleep(stored_after_s)  # storing the step is slow
            await c.prepared(prepare("n0", 0, JOB_STEPS + 1),
                             prepare("n1", 1, JOB_STEPS + 1))
        await asyncio.wait_for(replan, 10.0)
        return daemons.plans[-1], loop.time() - t0

    plan, waited = asyncio.run(main(1.5 * pace))
    assert waited >= 1.5 * pace
    assert plan.generation == 2 and plan.resume_step == JOB_STEPS + 1
    plan, waited = asyncio.run(main(None))  # never stored
    assert 2 * pace <= waited < LAND_WAIT_MAX_S / 2  # not the longest wait
    assert plan.resume_step == JOB_STEPS


def test_a_frozen_daemon_without_a_role_holds_up_neither_the_hurry_nor_the_commit(
        ) -> None:
    # n2 stores shards only and is frozen (SIGSTOP), not yet declared lost: it takes the
    # hurry and the commit and answers neither. Only the daemons of the plan's nodes are
    # asked whether they hold the step, so the coordinator still waits for it past the
    # job's pace (it lands at 1.8 s, between the pace's 1 s + 0.5 s for answers and twice
    # the pace); and the step counts as landed once it is committed here, not once n2
    # answers.
    async def main() -> tuple[common_pb2.Plan, bool]:
        daemons = WithAFrozenDaemon(["n0", "n1", "n2"])
        c, _ = await running_job(daemons=daemons)
        c.commits.seconds_per_step = lambda: 1.0  # the job's pace
        daemons.holding, daemons.frozen = True, "n2"
        replan = asyncio.create_task(c.on_failures([killed("n0/1", captured=JOB_STEPS + 1)]))
        await waiting(c)
        await asyncio.sleep(1.8)  # storing the step is slow
        # Its commit's phase two to n2 never ends (until n2 is declared lost).
        committing = asyncio.create_task(c.prepared(prepare("n0", 0, JOB_STEPS + 1),
                                                    prepare("n1", 1, JOB_STEPS + 1)))
        await asyncio.wait_for(replan, 10.0)
        committing.cancel()
        return daemons.plans[-1], JOB_STEPS + 1 in daemons.committed

    plan, committed_here = asyncio.run(main())
    assert committed_here
    assert plan.generation == 2 and plan.resume_step == JOB_STEPS + 1


def test_a_step_counts_as_landed_once_committed_here_not_once_every_daemon_has_it() -> None:
    # The captured step's commit reaches n0 (the coordinator) at once, and never frozen
    # n2: the re-plan waiting for it goes on at once (within 3 s, where the wait for it
    # would last 5 s), and resumes from it.
    async def main() -> common_pb2.Plan:
        daemons = WithAFrozenDaemon(["n0", "n1", "n2"])
        c, _ = await running_job(daemons=daemons)
        c.commits.seconds_per_step = lambda: 30.0  # a slow job: worth the longest wait
        daemons.frozen = "n2"
        replan = asyncio.create_task(c.on_failures([killed("n0/1", captured=JOB_STEPS + 1)]))
        await waiting(c)
        committing = asyncio.create_task(c.prepared(prepare("n0", 0, JOB_STEPS + 1),
                                                    prepare("n1", 1, JOB_STEPS + 1)))
        try:
            await asyncio.wait_for(replan, 3.0)
        except TimeoutError:
            raise AssertionError("the re-plan waited for the frozen daemon's "
                                 "acknowledgement of the step") from None
        committing.cancel()
        return daemons.plans[-1]

    plan = asyncio.run(main())
    assert plan.generation == 2 and plan.resume_step == JOB_STEPS + 1


def test_a_daemons_prepare_is_taken_without_waiting_for_the_commits_phase_two() -> None:
    # The way a daemon's prepare reaches the coordinator (its own, or by PrepareStep):
    # taken at once, the commit it completes run behind it, so the capture path that
    # sent it goes on while phase two waits for frozen n2.
    async def main() -> tuple[bool, list[int], bool]:
        daemons = WithAFrozenDaemon(["n0", "n1", "n2"])
        c, _ = await running_job(daemons=daemons)
        daemons.frozen = "n2"
        c.prepared_soon(prepare("n0", 0, JOB_STEPS + 1), prepare("n1", 1, JOB_STEPS + 1))
        landed = await c.commits.landed(JOB_STEPS + 1, 10.0)
        c.prepared_soon(prepare("n0", 0, JOB_STEPS + 2))  # taken behind it
        pending = JOB_STEPS + 2 in c.commits.steps
        return landed, daemons.committed, pending

    landed, committed, pending = asyncio.run(main())
    assert landed and committed[-1] == JOB_STEPS + 1
    assert pending


def test_the_longer_wait_needs_every_node_of_the_plan_and_ends_at_the_next_failure() -> None:
    # Past the job's pace the coordinator waits for the captured step only while the
    # daemon of every node the plan gives a role holds it: not when n1 has left the
    # live daemons (its loss not handled yet), and no longer once another failure is
    # queued. Either way it re-plans from the last committed step well before the
    # longest wait (5 s).
    async def main(case: str) -> int:
        c, daemons = await running_job()
        daemons.holding = True
        if case == "a node left":
            daemons.live = ["n0"]
        replan = asyncio.create_task(c.on_failures([killed("n0/1", captured=JOB_STEPS + 1)]))
        await waiting(c)
        if case == "news":
            c.failure_queued()
        await asyncio.wait_for(replan, 3.0)
        return daemons.plans[-1].resume_step

    assert asyncio.run(main("a node left")) == JOB_STEPS
    assert asyncio.run(main("news")) == JOB_STEPS


class Holders:
    """A real Intake on n0 at plan 1: ranks a and b hold roles on n0 (c on n1, and a
    spare on n0), and each has taken in its capture of step 2."""

    async def start(self, tmp_path: Path) -> Holders:
        self.pool = SlotPool(budget_bytes=1 << 20)
        self.registry = Registry(node="n0", heartbeat_interval_s=1.0,
                                 heartbeat_timeout_s=60.0, metrics=Metrics())

        def register(pid: int, spare: bool = False) -> str:
            return self.registry.register(pid=pid, rank=-1 if spare else pid, world_size=3,
                                          local_rank=0, hostname="h", spare=spare,
                                          device="cpu", watch_pid=False).rank_id
        self.a, self.b, spare = register(0), register(1), register(9, spare=True)
        self.registry.install_plan(common_pb2.Plan(generation=1, assignments=[
            common_pb2.RankAssignment(rank_id=self.a, node="n0"),
            common_pb2.RankAssignment(rank_id=self.b, node="n0"),
            common_pb2.RankAssignment(rank_id="n1/2", node="n1"),
            common_pb2.RankAssignment(rank_id=spare, node="n0", spare=True)]))

        async def durable(request: rank_pb2.CaptureRequest, owned: bytes, release) -> None:
            pass

        self.intake = Intake(self.pool, FdServer(self.pool, tmp_path / "fd.sock"),
                             self.registry, Metrics(), "n0", durable)
        self.slots = {r: self.pool.open(r, 64)[0] for r in (self.a, self.b)}
        for rank in (self.a, self.b):
            await self.capture(rank, 2)
        return self

    async def capture(self, rank: str, step: int, generation: int = 1) -> None:
        await self.intake.capture(rank_pb2.CaptureRequest(
            rank_id=rank, slot_id=self.slots[rank].slot_id, step=step,
            generation=generation, tensors=[common_pb2.TensorMeta(name="x", nbytes=8)]))


def test_a_daemon_holds_a_step_once_each_of_its_ranks_captures_of_it_is_taken_in(
        tmp_path: Path) -> None:
    # Hurried to step 3: a's capture of it is in, b's comes while the daemon waits, and
    # the answer comes as soon as it is (long before the wait allowed ends).
    async def main() -> tuple[bool, bool, bool]:
        h = await Holders().start(tmp_path)
        await h.capture(h.a, 3)
        answer = asyncio.create_task(h.intake.hurry_step(1, 3, wait_s=60.0))
        for _ in range(20):
            await asyncio.sleep(0)
        early = answer.done()
        await h.capture(h.b, 3)
        held = await asyncio.wait_for(answer, 30.0)
        # A step the daemon already holds (a later one counts) is answered at once.
        at_once = await asyncio.wait_for(h.intake.hurry_step(1, 2, wait_s=60.0), 30.0)
        h.pool.close()
        return early, held, at_once

    early, held, at_once = asyncio.run(main())
    assert not early, "the daemon answered before b's capture was taken in"
    assert held and at_once


def test_a_daemon_does_not_hold_a_step_a_rank_of_it_never_captured(tmp_path: Path) -> None:
    # b's capture of step 3 never comes (its wait ends), b leaves without it while the
    # daemon waits (answered once b is forgotten here) or had left (answered at once),
    # or b's newest capture is of a later step in an older plan.
    async def main() -> tuple[bool, bool, bool, bool]:
        h = await Holders().start(tmp_path)
        await h.capture(h.a, 3)
        timed_out = await asyncio.wait_for(h.intake.hurry_step(1, 3, wait_s=0.05), 30.0)
        answer = asyncio.create_task(h.intake.hurry_step(1, 3, wait_s=60.0))
        for _ in range(20):
            await asyncio.sleep(0)
        h.registry.heartbeat(h.b, 1, 2, 0.1, leaving=True)
        await h.intake.forget_rank(h.b)
        leaving = await asyncio.wait_for(answer, 30.0)
        left = await asyncio.wait_for(h.intake.hurry_step(1, 3, wait_s=60.0), 30.0)
        h.registry.install_plan(common_pb2.Plan(generation=2, assignments=[
            common_pb2.RankAssignment(rank_id=h.a, node="n0")]))
        older = await asyncio.wait_for(h.intake.hurry_step(2, 3, wait_s=0.05), 30.0)
        h.pool.close()
        return timed_out, leaving, left, older

    assert asyncio.run(main()) == (False, False, False, False)


def test_a_failure_reports_no_capture_of_a_step_its_plan_trains_again() -> None:
    # A rank whose newest capture (step 7) was taken in under plan 1 dies under plan 2,
    # which resumed from step 4 before the rank captured anything: the report names
    # step 4, which it holds and is committed, so the coordinator does not wait for a
    # step 7 the new plan has not reached.
    now = [0.0]

    def dies_silent(plan_generation: int) -> int:
        registry = Registry(node="n0", heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0,
                            metrics=Metrics(), clock=lambda: now[0])
        record = registry.register(pid=1, rank=0, world_size=1, local_rank=0, hostname="h",
                                   spare=False, device="cpu", watch_pid=False)
        registry.install_plan(common_pb2.Plan(generation=1))
        record.captured = (1, 7)  # what the intake records as it takes a capture in
        if plan_generation > 1:
            registry.install_plan(common_pb2.Plan(generation=plan_generation, resume_step=4))
        now[0] += 10.0
        [failure] = registry.check()
        return failure.captured_step

    assert dies_silent(1) == 7
    assert dies_silent(2) == 4


def test_a_step_that_completes_while_the_plan_is_decided_commits_only_if_the_plan_stays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Step 5's last prepare arrives while the coordinator decides from step 4 (late on a
    # loaded machine, after the wait for it gave up): committing it then would leave a
    # plan resuming below a committed step. It commits after all when the decision
    # keeps the plan (a spare was lost).
    from stalwart.daemon.recovery import coordinator as coordinator_module

    real = coordinator_module.decide
    deciding, decide_on = threading.Event(), threading.Event()

    def slow_decide(*args, **kwargs):
        deciding.set()
        decide_on.wait(10.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(coordinator_module, "decide", slow_decide)

    async def main(rank_id: str) -> tuple[list[int], common_pb2.Plan]:
        deciding.clear(), decide_on.clear()
        c, daemons = await running_job()
        await c.prepared(prepare("n1", 1, JOB_STEPS + 1))
        replan = asyncio.create_task(c.on_failures([killed(rank_id, captured=0)]))
        assert await asyncio.to_thread(deciding.wait, 10.0)
        # Step 5 is complete now (its delivery may then wait for the decision to end).
        delivered = asyncio.create_task(c.prepared(prepare("n0", 0, JOB_STEPS + 1)))
        for _ in range(100):
            if (step := c.commits.steps.get(JOB_STEPS + 1)) and step.complete:
                break
            await asyncio.sleep(0)
        held = list(daemons.committed)
        decide_on.set()
        await asyncio.wait_for(asyncio.gather(replan, delivered), 10.0)
        assert held == list(range(1, JOB_STEPS + 1))  # not while the plan was decided
        if daemons.plans[-1].generation == 1:  # the held step commits in the background
            assert await c.commits.landed(JOB_STEPS + 1, 10.0)
        return daemons.committed, daemons.plans[-1]

    committed, plan = asyncio.run(main("n0/1"))  # a role lost: a new plan from step 4
    assert plan.generation == 2 and plan.resume_step == committed[-1] == JOB_STEPS
    committed, plan = asyncio.run(main("n1/3"))  # the spare lost: the plan stays
    assert plan.generation == 1 and committed[-1] == JOB_STEPS + 1


def test_a_step_whose_commit_is_under_way_when_a_failure_comes_is_resumed_from() -> None:
    # Step 5's commit is being written on the coordinator's own store when a rank dies
    # (a failure saying nothing of captures: nothing to wait for). The plan is decided
    # once that write is done, from step 5, and the commit ends cleanly.
    class SlowStore(Daemons):
        async def commit_step(self, node: str, request) -> None:
            if node == "n0":
                await asyncio.sleep(0.05)  # the store's write, on an executor
            await super().commit_step(node, request)

    async def main() -> tuple[list[int], common_pb2.Plan]:
        c, daemons = await running_job()
        daemons.__class__ = SlowStore
        delivered = asyncio.create_task(c.prepared(prepare("n0", 0, JOB_STEPS + 1),
                                                   prepare("n1", 1, JOB_STEPS + 1)))
        for _ in range(100):
            if c.commits._local is not None:  # noqa: SLF001 - the window the test needs
                break
            await asyncio.sleep(0)
        assert c.commits._local is not None and daemons.committed[-1] == JOB_STEPS  # noqa: SLF001
        await asyncio.wait_for(c.on_failures([killed("n0/1", captured=0)]), 10.0)
        await asyncio.wait_for(delivered, 10.0)
        return daemons.committed, daemons.plans[-1]

    committed, plan = asyncio.run(main())
    assert plan.generation == 2 and plan.resume_step == committed[-1] == JOB_STEPS + 1


def test_a_step_prepared_under_two_plans_commits_only_from_the_newer_ones_prepares(
        ) -> None:
    # n0 prepared step 5 under plan 1; a newer plan (here, one that widened the job)
    # resumes from step 4 and trains step 5 again. n1's prepare of it under plan 2 does
    # not complete it with n0's old one: n0's prepare under plan 2 must come too.
    async def main() -> tuple[list[int], list[int]]:
        c, daemons = await running_job()
        await c.prepared(prepare("n0", 0, JOB_STEPS + 1))
        assert c.plan is not None
        c.plan = dataclasses.replace(c.plan, generation=2, resume_step=JOB_STEPS)
        await c.prepared(prepare("n1", 1, JOB_STEPS + 1, generation=2))
        held = list(daemons.committed)
        await c.prepared(prepare("n0", 0, JOB_STEPS + 1, generation=2))
        return held, daemons.committed

    held, committed = asyncio.run(main())
    assert held[-1] == JOB_STEPS and committed[-1] == JOB_STEPS + 1
