"""Specification of the coordinator's decisions (pure, in-process)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.core.decide import (
    Member,
    NoChange,
    PlanDecision,
    PlanState,
    StopDecision,
    decide,
    resume,
)
from stalwart.core.failures import AFTER_RAISING, Failure, FailureKind
from stalwart.core.layout import Coord, Layout


def grid(dp: int, pp: int, tp: int, ranks_per_node: int, spares: dict[str, int] | None = None,
         generation: int = 1) -> PlanState:
    """A plan whose ranks fill nodes n0, n1, ... in global-rank order (TP innermost)."""
    layout = Layout(dp, pp, tp, stages=tuple((i, i) for i in range(pp)))
    members = [Member(f"r{rank}", f"n{rank // ranks_per_node}", layout.coords(rank))
               for rank in range(layout.world_size)]
    spare_members = [Member(f"s{node}{i}", node)
                     for node, count in (spares or {}).items() for i in range(count)]
    return PlanState(generation, layout, tuple(members), tuple(spare_members))


def killed(rank_id: str, generation: int = 1) -> Failure:
    return Failure(FailureKind.PROCESS_EXIT, rank_id, "killed by SIGKILL", generation=generation)


def coords(plan: PlanState) -> dict[str, Coord]:
    return {m.rank_id: m.coord for m in plan.members}


def test_a_spare_takes_the_failed_ranks_role_and_the_layout_stays():
    state = grid(1, 4, 1, ranks_per_node=2, spares={"n2": 1})
    d = decide(state, [killed("r2")], committed_step=41)
    assert isinstance(d, PlanDecision) and d.kind == "replace"
    assert d.generation == 2 and d.plan.resume_step == 41
    assert d.plan.layout == state.layout
    assert d.replacements == {"r2": "sn20"}
    assert coords(d.plan)["sn20"] == Coord(2, 0, 2, 0)
    assert "r2" not in coords(d.plan) and d.plan.spares == ()
    survivors = {k: v for k, v in coords(state).items() if k != "r2"}
    assert {k: coords(d.plan)[k] for k in survivors} == survivors


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_any_pipeline_stage_can_be_replaced(stage):
    state = grid(1, 4, 1, ranks_per_node=4, spares={"n1": 1})
    d = decide(state, [killed(f"r{stage}")], committed_step=5)
    assert isinstance(d, PlanDecision)
    assert coords(d.plan)["sn10"].pp == stage


def test_a_spare_on_the_failed_ranks_node_is_preferred():
    state = grid(2, 1, 1, ranks_per_node=1, spares={"n0": 1, "n1": 1})
    d = decide(state, [killed("r1")], committed_step=3)
    assert d.replacements == {"r1": "sn10"}


def test_without_spares_the_job_stops_at_the_last_committed_step_with_a_clear_message():
    state = grid(1, 2, 1, ranks_per_node=1)
    d = decide(state, [killed("r1")], committed_step=17)
    assert isinstance(d, StopDecision)
    assert d.generation == 2 and d.last_committed_step == 17
    assert "step 17" in d.message and "r1" in d.message and "spare" in d.message
    assert "SIGKILL" in d.message


def test_a_stop_after_a_rank_raised_names_the_exception_and_that_a_spare_may_raise_it():
    state = grid(1, 2, 1, ranks_per_node=1)
    raised = Failure(FailureKind.PROCESS_EXIT, "r1",
                     f"process 7 exited{AFTER_RAISING}ValueError: bad shape", generation=1)
    d = decide(state, [raised], committed_step=5)
    assert isinstance(d, StopDecision)
    assert "raised 'ValueError: bad shape'" in d.message and "fix the cause" in d.message
    plain = decide(state, [killed("r1")], committed_step=5)
    assert "raised" not in plain.message and ". Training stops" in plain.message


def joined(state: PlanState, *spares: Member) -> PlanState:
    """`state` after spares registered (the coordinator adds them to its stopped plan)."""
    return PlanState(state.generation, state.layout, state.members,
                     (*state.spares, *spares), state.resume_step, state.reason)


def stopped_plan(state: PlanState, stop: StopDecision) -> PlanState:
    return PlanState(stop.generation, state.layout, state.members, state.spares,
                     stop.last_committed_step, "stopped")


def test_a_stopped_job_resumes_when_a_spare_registers():
    state = grid(2, 1, 1, ranks_per_node=1)
    stop = decide(state, [killed("r1")], committed_step=17)
    assert isinstance(stop, StopDecision) and stop.failed == {"r1"}
    assert "by itself" in stop.message and "restart the job" not in stop.message
    waiting = stopped_plan(state, stop)
    d = resume(joined(waiting, Member("s", "n5")), stop, [], committed_step=17)
    assert isinstance(d, PlanDecision) and d.kind == "replace"
    assert d.generation == stop.generation + 1 and d.plan.resume_step == 17
    assert d.replacements == {"r1": "s"} and coords(d.plan)["s"] == coords(state)["r1"]


def test_a_stopped_job_whose_host_returns_resumes_on_that_hosts_new_ranks():
    state = grid(2, 1, 1, ranks_per_node=1, spares={"n1": 1})
    lost = Failure(FailureKind.PEER_LOST, "n1", "no gossip for 6.0 s", generation=1)
    stop = decide(state, [lost], committed_step=9)
    assert isinstance(stop, StopDecision) and stop.failed == {"r1", "sn10"}
    waiting = stopped_plan(state, stop)
    # The old spare on n1 died with it; the host's new rank (same node name) counts.
    d = resume(joined(waiting, Member("n1-new", "n1")), stop, [], committed_step=9)
    assert isinstance(d, PlanDecision) and d.replacements == {"r1": "n1-new"}


def test_failures_while_stopped_add_to_what_a_resume_must_fill():
    state = grid(3, 1, 1, ranks_per_node=1)
    stop = decide(state, [killed("r1")], committed_step=4)
    assert isinstance(stop, StopDecision)
    waiting = joined(stopped_plan(state, stop), Member("s1", "n7"))
    # r2 gave up waiting (or died) before the spare came: one spare is not enough.
    again = resume(waiting, stop, [killed("r2", generation=stop.generation)], committed_step=4)
    assert isinstance(again, StopDecision) and again.failed == {"r1", "r2"}
    assert "1 spare(s) registered, 2 needed" in again.message
    waiting = joined(waiting, Member("s2", "n8"))
    d = resume(waiting, again, [], committed_step=4)
    assert isinstance(d, PlanDecision) and set(d.replacements) == {"r1", "r2"}


def test_the_shrink_planner_hook_is_asked_when_no_spare_is_left():
    state = grid(1, 2, 1, ranks_per_node=1)
    asked = {}

    def shrink(s, failed, step):
        asked.update(failed=failed, step=step)
        return PlanState(99, Layout(1, 1, 1), (Member("r0", "n0", Coord(0, 0, 0, 0)),),
                         reason="1 stage")

    d = decide(state, [killed("r1")], committed_step=8, shrink_planner=shrink)
    assert asked == {"failed": frozenset({"r1"}), "step": 8}
    assert isinstance(d, PlanDecision) and d.kind == "shrink"
    assert d.generation == 2 and d.plan.resume_step == 8 and d.plan.layout.pp == 1


def test_a_shrink_planner_that_finds_nothing_leads_to_a_stop():
    state = grid(1, 2, 1, ranks_per_node=1)
    d = decide(state, [killed("r0")], committed_step=8, shrink_planner=lambda *_: None)
    assert isinstance(d, StopDecision) and "no smaller plan fits" in d.message


def test_a_lost_node_fails_every_rank_and_spare_on_it():
    state = grid(2, 2, 1, ranks_per_node=2, spares={"n1": 1, "n2": 2})
    lost = Failure(FailureKind.PEER_LOST, "n1", "no gossip for 6.0 s", generation=1)
    d = decide(state, [lost], committed_step=30)
    assert isinstance(d, PlanDecision)
    assert set(d.replacements) == {"r2", "r3"}
    assert set(d.replacements.values()) == {"sn20", "sn21"}
    assert all(m.node != "n1" for m in (*d.plan.members, *d.plan.spares))


def full_disk(rank_id: str, generation: int = 1) -> Failure:
    return Failure(FailureKind.STORAGE_FULL, rank_id, "its daemon's disk is full",
                   generation=generation)


def test_a_rank_lost_to_a_full_disk_goes_to_a_spare_on_another_node():
    state = grid(2, 1, 1, ranks_per_node=1, spares={"n0": 1, "n1": 1})
    d = decide(state, [full_disk("r1")], committed_step=3)
    assert d.replacements == {"r1": "sn00"}
    # The spare on the full node stays a spare, for a later plan.
    assert [s.rank_id for s in d.plan.spares] == ["sn10"]


def test_a_full_disk_with_spares_only_on_its_node_shrinks_or_stops():
    state = grid(2, 1, 1, ranks_per_node=1, spares={"n1": 1})
    d = decide(state, [full_disk("r1")], committed_step=3)
    assert isinstance(d, StopDecision)
    assert "1 spare(s) registered, 1 needed (1 of them on a node whose disk is full: n1)" \
        in d.message


def test_a_full_tensor_parallel_node_moves_its_group_to_another_node():
    state = grid(2, 1, 2, ranks_per_node=2, spares={"n1": 2, "n2": 2})
    d = decide(state, [full_disk("r2"), full_disk("r3")], committed_step=1)
    assert set(d.replacements.values()) == {"sn20", "sn21"}


def test_tensor_parallel_replacements_stay_inside_one_node():
    # dp=2, tp=2: TP group (dp 1) lives on n1; spares on n1 and n2.
    state = grid(2, 1, 2, ranks_per_node=2, spares={"n1": 1, "n2": 2})
    d = decide(state, [killed("r3")], committed_step=1)
    assert d.replacements == {"r3": "sn10"}
    whole = decide(state, [Failure(FailureKind.PEER_LOST, "n1", "gone", generation=1)], 1)
    assert set(whole.replacements.values()) == {"sn20", "sn21"}


def test_a_tensor_parallel_group_without_spares_beside_its_survivors_moves_whole():
    # dp=2, tp=2: r3 of the group on n1 dies; the two spares are on n2. The group moves
    # there whole (r2 becomes a spare): same layout and stage bounds, so the spares
    # restore their roles' own snapshots, not a re-partition of the model.
    state = grid(2, 2, 2, ranks_per_node=2, spares={"n4": 2})
    d = decide(state, [killed("r3")], committed_step=5)
    assert isinstance(d, PlanDecision) and d.kind == "replace"
    assert d.replacements == {"r2": "sn40", "r3": "sn41"}
    assert d.plan.layout == state.layout
    assert coords(d.plan)["sn40"] == coords(state)["r2"]
    assert coords(d.plan)["sn41"] == coords(state)["r3"]
    assert [s.rank_id for s in d.plan.spares] == ["r2"] and "r2 became a spare" in d.plan.reason
    # One spare beside the survivor is preferred to moving the group.
    near = grid(2, 2, 2, ranks_per_node=2, spares={"n1": 1, "n4": 2})
    assert decide(near, [killed("r3")], 5).replacements == {"r3": "sn10"}


def test_groups_filled_beside_their_survivors_come_before_a_group_that_moves_whole():
    # Groups (r0 r1) on n0, (r4 r5) and (r6 r7) on n1. The spares beside r4 and r6 take
    # r5's and r7's roles; r1's group, with no spare on n0, moves whole to n4 (n3's one
    # spare cannot hold it), although n1 was the largest pool when it was looked at.
    state = grid(2, 2, 2, ranks_per_node=4, spares={"n1": 2, "n3": 1, "n4": 2})
    d = decide(state, [killed("r1"), killed("r5"), killed("r7")], committed_step=5)
    assert isinstance(d, PlanDecision) and d.kind == "replace"
    assert d.replacements == {"r5": "sn10", "r7": "sn11", "r0": "sn40", "r1": "sn41"}
    assert sorted(s.rank_id for s in d.plan.spares) == ["r0", "sn30"]


def test_tensor_parallel_group_without_a_spare_on_its_node_stops():
    state = grid(1, 1, 2, ranks_per_node=2, spares={"n1": 1})
    d = decide(state, [killed("r1")], committed_step=4)
    assert isinstance(d, StopDecision) and "tensor-parallel" in d.message


def test_second_failure_during_recovery_folds_into_one_decision_with_a_new_generation():
    state = grid(1, 4, 1, ranks_per_node=2, spares={"n2": 2})
    first = decide(state, [killed("r0")], committed_step=10)
    assert isinstance(first, PlanDecision) and first.generation == 2
    # The spare that was taking over dies before the new generation trained a step.
    second = decide(first.plan, [killed("sn20", generation=2)], committed_step=10,
                    in_flight=first)
    assert isinstance(second, PlanDecision) and second.generation == 3
    assert second.previous == state
    assert second.replacements == {"r0": "sn21"}
    assert [f.subject for f in second.causes] == ["r0", "sn20"]
    assert coords(second.plan)["sn21"] == Coord(0, 0, 0, 0)


def test_a_survivor_failing_during_recovery_is_replaced_too():
    state = grid(1, 4, 1, ranks_per_node=2, spares={"n2": 2})
    first = decide(state, [killed("r0")], committed_step=10)
    second = decide(first.plan, [killed("r3", generation=2)], 10, in_flight=first)
    assert second.replacements == {"r0": "sn20", "r3": "sn21"} and second.generation == 3


def test_second_failure_during_recovery_without_spares_stops_with_a_newer_generation():
    state = grid(1, 2, 1, ranks_per_node=1, spares={"n2": 1})
    first = decide(state, [killed("r0")], committed_step=6)
    second = decide(first.plan, [killed("r1", generation=2)], 6, in_flight=first)
    assert isinstance(second, StopDecision) and second.generation == 3
    assert second.last_committed_step == 6 and len(second.causes) == 2


def test_observations_from_an_older_generation_are_ignored_but_facts_count():
    state = grid(1, 2, 1, ranks_per_node=1, spares={"n2": 1}, generation=5)
    hang = Failure(FailureKind.COLLECTIVE_HANG, "r0", "all_reduce > 2 s", generation=4)
    d = decide(state, [hang], committed_step=9)
    assert isinstance(d, NoChange) and d.ignored == (hang,)
    exit_ = killed("r0", generation=4)
    assert isinstance(decide(state, [exit_], committed_step=9), PlanDecision)


def test_stragglers_are_only_failures_when_asked():
    state = grid(1, 2, 1, ranks_per_node=1, spares={"n2": 1})
    slow = Failure(FailureKind.STRAGGLER, "r1", "3.1x slower", generation=1)
    assert isinstance(decide(state, [slow], 2), NoChange)
    assert isinstance(decide(state, [slow], 2, stragglers_fail=True), PlanDecision)


def test_a_lost_spare_only_shrinks_the_spare_pool():
    state = grid(1, 2, 1, ranks_per_node=1, spares={"n2": 2})
    d = decide(state, [killed("sn20")], 2)
    assert isinstance(d, NoChange) and d.plan.generation == 1
    assert [s.rank_id for s in d.plan.spares] == ["sn21"]


def test_failures_about_unknown_ranks_change_nothing():
    state = grid(1, 2, 1, ranks_per_node=1)
    d = decide(state, [killed("ghost")], 2)
    assert isinstance(d, NoChange) and d.plan == state and len(d.ignored) == 1


def test_plans_round_trip_through_protobuf():
    state = grid(2, 2, 2, ranks_per_node=4, spares={"n2": 2}, generation=7)
    assert PlanState.from_proto(state.to_proto()) == state


def test_invalid_plans_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs 2"):
        PlanState(1, Layout(1, 2, 1), (Member("a", "n", Coord(0, 0, 0, 0)),))
    with pytest.raises(ValueError, match="one rank per cell"):
        PlanState(1, Layout(1, 2, 1), (Member("a", "n", Coord(0, 0, 0, 0)),
                                       Member("b", "n", Coord(1, 0, 0, 0))))
    with pytest.raises(ValueError, match="tp fastest, then dp, pp slowest"):
        PlanState(1, Layout(2, 2, 1), tuple(Member(f"r{r}", "n", Coord(r, r // 2, r % 2, 0))
                                            for r in range(4)))


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 3), pp=st.integers(1, 3), n_spares=st.integers(0, 4),
    data=st.data(),
)
def test_replacement_matches_brute_force_counting(dp, pp, n_spares, data):
    """With tp=1, a replace happens exactly when spares >= failed roles, and then every role
    is filled once, survivors keep their roles and the used spares leave the pool."""
    state = grid(dp, pp, 1, ranks_per_node=1, spares={"sp": n_spares})
    ids = [m.rank_id for m in (*state.members, *state.spares)]
    dead = data.draw(st.sets(st.sampled_from(ids), min_size=1))
    d = decide(state, [killed(r) for r in sorted(dead)], committed_step=1)
    dead_roles = [m for m in state.members if m.rank_id in dead]
    live_spares = [s for s in state.spares if s.rank_id not in dead]
    if not dead_roles:
        assert isinstance(d, NoChange) and len(d.plan.spares) == len(live_spares)
    elif len(live_spares) >= len(dead_roles):
        assert isinstance(d, PlanDecision) and d.generation == 2
        assert sorted(coords(d.plan).values(), key=lambda c: c.rank) == sorted(
            coords(state).values(), key=lambda c: c.rank)
        assert not dead & {m.rank_id for m in (*d.plan.members, *d.plan.spares)}
        assert len(d.plan.spares) == len(live_spares) - len(dead_roles)
    else:
        assert isinstance(d, StopDecision) and d.last_committed_step == 1


def hang(rank_id: str, generation: int = 1) -> Failure:
    return Failure(FailureKind.COLLECTIVE_HANG, rank_id, "all_reduce > 2.0 s",
                   generation=generation)


def test_a_hang_blames_the_member_that_did_not_report_waiting():
    state = grid(2, 2, 1, ranks_per_node=2, spares={"n2": 1})
    d = decide(state, [hang("r0"), hang("r1"), hang("r3")], committed_step=12)
    assert isinstance(d, PlanDecision) and d.replacements == {"r2": "sn20"}


def test_hangs_explained_by_a_dead_rank_blame_only_that_rank():
    state = grid(2, 2, 1, ranks_per_node=2, spares={"n2": 1})
    d = decide(state, [hang("r0"), killed("r2")], committed_step=12)
    assert d.replacements == {"r2": "sn20"}


def test_when_every_member_waits_only_the_groups_are_rebuilt():
    state = grid(1, 2, 1, ranks_per_node=1)
    d = decide(state, [hang("r0"), hang("r1")], committed_step=12)
    assert isinstance(d, PlanDecision) and d.kind == "rebuild"
    assert d.generation == 2 and d.plan.members == state.members and d.replacements == {}
