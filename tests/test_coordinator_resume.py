"""The coordinator lifts a stop by itself once what the stop lacked arrives: a spare
that registers, or the layer profile a successor coordinator decided without (it then
shrinks). Ranks that could resume the job only smaller wait for the others of their
wave (a relaunch) to register. In-process coordinator; daemons stand in as a record of
installed plans."""

from __future__ import annotations

import asyncio

import pytest
from coordinator_links import Daemons

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.config import ElasticSettings
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.daemon.rpc.validate import InvalidRequest, request
from stalwart.v1 import common_pb2, peer_pb2

LAYOUT = common_pb2.ParallelLayout(dp=2, pp=1, tp=1, schedule="1f1b", microbatches=1,
                                   grad_accum=1,
                                   stages=[common_pb2.StageBounds(first_layer=0, last_layer=3)])
PROFILE = common_pb2.LayerProfile(costs=[1.0, 2.0, 2.0, 1.0])


def rank(rank_id: str, node: str, r: int, profile: common_pb2.LayerProfile | None = None
         ) -> peer_pb2.RankAnnouncement:
    return peer_pb2.RankAnnouncement(node=node, rank_id=rank_id, rank=r, world_size=2,
                                     layout=LAYOUT, generation=1, profile=profile)


def coordinator(daemons: Daemons, elastic: ElasticSettings | None = None, committed: int = 7
                ) -> Coordinator:
    """The coordinator on node n0, its job's last committed step `committed`."""
    return Coordinator(node="n0", job_id="job", metrics=Metrics(), links=daemons,
                       latest_committed=lambda: committed, elastic=elastic)


def killed(rank_id: str) -> Failure:
    return Failure(FailureKind.PROCESS_EXIT, rank_id, "killed by SIGKILL", generation=1)


def scenario(shrink: bool, first_profile: common_pb2.LayerProfile | None,
             later: peer_pb2.RankAnnouncement) -> list[common_pb2.Plan]:
    async def main() -> list[common_pb2.Plan]:
        daemons = Daemons()
        c = coordinator(daemons, ElasticSettings(shrink=shrink))
        await c.announce(rank("n0/1", "n0", 0, first_profile))
        await c.announce(rank("n1/2", "n1", 1, first_profile))
        await c.on_failures([killed("n1/2")])
        await c.announce(later)
        return daemons.plans

    return asyncio.run(main())


def test_a_spare_that_registers_after_the_stop_resumes_the_job() -> None:
    first, stop, resumed = scenario(False, PROFILE, rank("n1/9", "n1", -1, PROFILE))
    assert first.generation == 1 and not first.stop
    assert stop.stop and stop.resume_step == 7 and list(stop.lost) == ["n1/2"]
    assert not resumed.stop and resumed.generation == stop.generation + 1
    assert resumed.resume_step == 7
    roles = {a.rank_id: a.coord.rank for a in resumed.assignments if not a.spare}
    assert roles == {"n0/1": 0, "n1/9": 1}


def test_a_stop_for_want_of_the_layer_profile_shrinks_once_a_rank_brings_it() -> None:
    # A successor that decided before any rank told it the model's layer costs could not
    # shrink; the re-announced survivor brings them.
    plans = scenario(True, None, rank("n0/1", "n0", 0, PROFILE))
    first, stop, resumed = plans
    assert stop.stop and "1 needed" in stop.stop_message
    assert not resumed.stop and resumed.layout.dp == 1 and resumed.resume_step == 7
    assert [a.rank_id for a in resumed.assignments if not a.spare] == ["n0/1"]


def test_a_successor_coordinator_resumes_a_job_its_predecessor_stopped() -> None:
    _, stop, _ = scenario(False, PROFILE, rank("n1/9", "n1", -1, PROFILE))
    assert {a.rank_id for a in stop.assignments} == {"n0/1", "n1/2"}  # roles kept

    async def main() -> list[common_pb2.Plan]:
        daemons = Daemons()
        successor = coordinator(daemons, ElasticSettings(shrink=False))
        assert successor.take_over(stop)
        # A failure it already knows of (redelivered) changes nothing.
        await successor.on_failures([killed("n1/2")])
        assert daemons.plans == []
        await successor.announce(rank("n0/1", "n0", 0, PROFILE))  # re-announced survivor
        await successor.announce(rank("n1/9", "n1", -1, PROFILE))  # a spare arrives
        return daemons.plans

    [resumed] = asyncio.run(main())
    assert not resumed.stop and resumed.generation == stop.generation + 1
    assert {a.rank_id: a.coord.rank for a in resumed.assignments if not a.spare} == {
        "n0/1": 0, "n1/9": 1}


def test_a_spare_re_announced_before_the_successor_took_over_is_its_spare() -> None:
    # A peer sees the seat move before the successor does and re-announces its spare
    # then; the installed plan, formed before the spare came, does not name it.
    first, _, _ = scenario(False, PROFILE, rank("n1/9", "n1", -1, PROFILE))

    async def main() -> list[common_pb2.Plan]:
        daemons = Daemons()
        successor = coordinator(daemons, ElasticSettings(shrink=False))
        await successor.announce(rank("n1/9", "n1", -1, PROFILE))
        assert daemons.plans == []  # not a first plan: a spare alone forms none
        assert successor.take_over(first)
        await successor.on_failures([killed("n1/2")])
        return daemons.plans

    [replaced] = asyncio.run(main())
    assert not replaced.stop and replaced.generation == first.generation + 1
    assert {a.rank_id: a.coord.rank for a in replaced.assignments if not a.spare} == {
        "n0/1": 0, "n1/9": 1}


def every_rank_lost(settle_s: float, one_by_one: bool, *later: peer_pb2.RankAnnouncement
                    ) -> tuple[list[common_pb2.Plan], float]:
    """Both ranks of a dp=2 job die (together, or one by one: the job shrinks, then
    stops), then `later` register. The plans, and the seconds from the last
    registration until the coordinator's background work was done."""
    async def main() -> tuple[list[common_pb2.Plan], float]:
        daemons = Daemons()
        c = coordinator(daemons, ElasticSettings(shrink=True, resume_settle_s=settle_s))
        await c.announce(rank("n0/1", "n0", 0, PROFILE))
        await c.announce(rank("n1/2", "n1", 1, PROFILE))
        if one_by_one:
            await c.on_failures([killed("n1/2")])
            await c.on_failures([Failure(FailureKind.PROCESS_EXIT, "n0/1", "killed",
                                         generation=2)])
        else:
            await c.on_failures([killed("n0/1"), killed("n1/2")])
        assert daemons.plans[-1].stop
        for a in later:
            await c.announce(a)
        t0 = asyncio.get_running_loop().time()
        await c._spawned.drain()
        return daemons.plans, asyncio.get_running_loop().time() - t0

    return asyncio.run(main())


def test_a_rank_that_could_resume_the_job_only_smaller_waits_for_others_first() -> None:
    plans, waited = every_rank_lost(0.5, False, rank("n0/5", "n0", 0, PROFILE))
    *_, stop, resumed = plans
    assert stop.stop and not resumed.stop and resumed.layout.dp == 1
    assert resumed.resume_step == 7
    assert waited >= 0.5  # none registered meanwhile: it resumed once the window passed


def test_a_relaunch_resumes_at_once_with_each_rank_in_its_launched_role() -> None:
    # The job had shrunk to dp=1 before its last rank died; the stop's layout is dp=1.
    # The job's ranks, started again, register in any order and take the roles their
    # RANK names in the launched layout as soon as all are here.
    plans, _ = every_rank_lost(600.0, True, rank("n1/6", "n1", 1, PROFILE),
                               rank("n0/5", "n0", 0, PROFILE))
    first, shrunk, stop, resumed = plans
    assert shrunk.layout.dp == 1 and stop.stop and stop.layout.dp == 1
    assert not resumed.stop and resumed.layout == first.layout and resumed.resume_step == 7
    assert {a.rank_id: a.coord.rank for a in resumed.assignments if not a.spare} == {
        "n0/5": 0, "n1/6": 1}


def test_spares_that_can_fill_the_launched_size_widen_the_resume_to_it() -> None:
    plans, _ = every_rank_lost(600.0, True, rank("n0/5", "n0", -1, PROFILE),
                               rank("n1/6", "n1", -1, PROFILE))
    *_, stop, resumed = plans
    assert stop.layout.dp == 1
    assert not resumed.stop and resumed.layout.dp == 2 and resumed.resume_step == 7
    assert {a.rank_id for a in resumed.assignments if not a.spare} == {"n0/5", "n1/6"}


def finished(rank_id: str, node: str, step: int) -> peer_pb2.RankAnnouncement:
    return peer_pb2.RankAnnouncement(node=node, rank_id=rank_id, rank=-1, finished_at=step)


def test_a_rank_that_leaves_at_a_committed_last_step_ends_the_job() -> None:
    # Launched again after the job's last step (7) committed, the ranks restore it, train
    # nothing and leave: no commit ends the job, their leaving does. Every rank trains to
    # the same length, so the first one's does (another may have failed in its restore).
    async def main(committed: int, who: str = "n0/1") -> list[common_pb2.Plan]:
        daemons = Daemons()
        c = coordinator(daemons, committed=committed)
        await c.announce(rank("n0/1", "n0", 0, PROFILE))
        await c.announce(rank("n1/2", "n1", 1, PROFILE))
        await c.announce(finished(who, who.split("/")[0], 7))
        return daemons.plans

    first, done = asyncio.run(main(committed=7))
    assert not first.stop and first.resume_step == 7
    assert done.stop and done.completed and done.resume_step == 7
    assert done.generation == first.generation + 1
    # A rank that left at its last step before it committed leaves it to that commit;
    # one the plan does not name (of an earlier run) ends nothing.
    assert len(asyncio.run(main(committed=6))) == 1
    assert len(asyncio.run(main(committed=7, who="n1/5"))) == 1


def test_a_completed_job_started_again_resumes_once_every_launch_rank_registered() -> None:
    # Daemons that kept the completed job; a successor coordinator took it over.
    async def main() -> tuple[list[common_pb2.Plan], list[common_pb2.Plan]]:
        daemons = Daemons()
        c = coordinator(daemons)
        await c.announce(rank("n0/1", "n0", 0, PROFILE))
        await c.announce(rank("n1/2", "n1", 1, PROFILE))
        await c.announce(finished("n0/1", "n0", 7))
        done = daemons.plans[-1]
        successor, later = coordinator(Daemons()), []
        assert successor.take_over(done)
        await successor.announce(rank("n1/2", "n1", 1, PROFILE))  # announced again
        await successor.announce(rank("n0/8", "n0", 0, PROFILE))
        later.append(len(successor.links.plans))  # one launch rank is not back yet
        await successor.announce(rank("n1/9", "n1", 1, PROFILE))
        await successor.announce(finished("n1/9", "n1", 7))
        return daemons.plans, [*successor.links.plans, later]

    (_, done), (again, ended, [waiting]) = asyncio.run(main())
    assert waiting == 0
    assert not again.stop and again.generation == done.generation + 1
    assert again.resume_step == 7
    assert {a.rank_id: a.coord.rank for a in again.assignments if not a.spare} == {
        "n0/8": 0, "n1/9": 1}
    assert ended.completed and ended.generation == again.generation + 1


def test_a_successor_resumes_a_stopped_job_with_a_spare_announced_before_it_took_over() -> None:
    # The spare registered while the seat moved: the successor heard of it before it
    # knew it coordinates, and its daemon's announcements again bring nothing new.
    _, stop, _ = scenario(False, PROFILE, rank("n1/9", "n1", -1, PROFILE))
    spare = rank("n1/9", "n1", -1, PROFILE)
    spare.generation = stop.generation  # registered under the stop

    async def main() -> list[common_pb2.Plan]:
        daemons = Daemons()
        successor = coordinator(daemons, ElasticSettings(shrink=False))
        await successor.announce(spare)
        assert successor.take_over(stop)
        await successor._spawned.drain()
        await successor.announce(spare)  # announced again
        return daemons.plans

    [resumed] = asyncio.run(main())
    assert not resumed.stop and resumed.generation == stop.generation + 1
    assert {a.rank_id: a.coord.rank for a in resumed.assignments if not a.spare} == {
        "n0/1": 0, "n1/9": 1}


@pytest.mark.parametrize(("rank_id", "valid"), [
    ("n0/7", True), ("n0/7.2", True), ("n0/7.", False), ("n0/x", False), ("n1/7", False)])
def test_a_rank_id_names_its_node_and_its_pid_or_that_pids_nth_process(rank_id, valid):
    announcement = peer_pb2.RankAnnouncement(node="n0", rank_id=rank_id, rank=-1)
    if valid:
        request(announcement)
    else:
        with pytest.raises(InvalidRequest, match="must be '<node>/<pid>'"):
            request(announcement)
