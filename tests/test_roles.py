"""The prepare rule of daemon/security/prepare_rule.py, in one process: a daemon prepares
only its own ranks of the current plan, in its layout, near the last commit, within a
bounded number of steps awaiting commit; a relayed batch is taken seal by seal, each
under its own daemon's tag for its column."""

from __future__ import annotations

import pytest

from stalwart.core.decide import Member, PlanState
from stalwart.core.layout import Coord, Layout
from stalwart.daemon.errors import NotReady
from stalwart.daemon.recovery.step_commits import PendingStep, Prepared
from stalwart.daemon.rpc import validate
from stalwart.daemon.security.auth import Forbidden
from stalwart.daemon.security.prepare_rule import (
    MAX_PENDING_STEPS,
    MAX_STEPS_AHEAD,
    PrepareRule,
    ranks_by_node,
)
from stalwart.daemon.security.roles import node_of
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.commit_tree import RelayKeys
from stalwart.v1 import common_pb2, peer_pb2

PLAN = PlanState(generation=3, layout=Layout(dp=2, pp=1, tp=1), resume_step=10,
                 members=(Member("a/1", "a", Coord(0, 0, 0, 0)),
                          Member("b/7", "b", Coord(1, 1, 0, 0))))


def prepare(node: str = "b", rank: int = 1, step: int = 11, generation: int = 3,
            dp: int = 2) -> peer_pb2.PrepareStepRequest:
    req = peer_pb2.PrepareStepRequest(step=step, generation=generation, node=node,
                                      layout=common_pb2.ParallelLayout(dp=dp, pp=1, tp=1))
    req.seal.node = node
    req.seal.ranks.append(rank)
    return req


def test_a_daemon_prepares_its_own_rank_of_the_plan() -> None:
    PrepareRule(PLAN, latest=10).check("b", prepare())


@pytest.mark.parametrize(("req", "latest", "pending", "says"), [
    (prepare(rank=0), 10, (), "places on a"),
    (prepare(dp=1), 10, (), "captured in layout 1x1x1"),
    (prepare(generation=4), 10, (), "ahead of the plan"),
    (prepare(step=10 + MAX_STEPS_AHEAD + 1), 10, (), f"more than {MAX_STEPS_AHEAD} steps"),
    (prepare(step=500), 10, range(12, 12 + MAX_PENDING_STEPS), "already await their commit"),
])
@pytest.mark.parametrize("kept", [None, ranks_by_node(PLAN)], ids=["derived", "kept"])
def test_a_prepare_outside_the_callers_role_is_forbidden(req, latest, pending, says,
                                                         kept) -> None:
    with pytest.raises(Forbidden, match=says):
        PrepareRule(PLAN, latest, pending, kept).check("b", req)


def test_an_older_generation_is_left_to_the_stale_check_and_no_plan_is_stale() -> None:
    PrepareRule(PLAN, latest=10).check("b", prepare(generation=2, dp=1))
    with pytest.raises(NotReady, match="before this daemon coordinates"):
        PrepareRule(None, latest=None).check("b", prepare())


def test_a_step_already_pending_may_gather_more_ranks_at_the_cap() -> None:
    pending = range(11, 11 + MAX_PENDING_STEPS)
    PrepareRule(PLAN, 10, pending).check("b", prepare(step=11))


def test_the_node_of_a_rank_id_or_of_a_node_name() -> None:
    assert [node_of(x) for x in ("node-1/42", "node-1", "rack/a/9", "x/y")] == [
        "node-1", "node-1", "rack/a", "x/y"]


def sealed(req: peer_pb2.PrepareStepRequest) -> peer_pb2.PrepareStepRequest:
    req.job_id, req.seal.digest = "job", bytes(32)
    return req


def column(keys: RelayKeys, *reqs: peer_pb2.PrepareStepRequest, job: str = "job",
           key_of: str | None = None) -> peer_pb2.SealColumn:
    """The column the daemons on the way make of `reqs` (all of one step), each tagged
    by its own daemon (or by `key_of`'s key)."""
    out = peer_pb2.SealColumn()
    for req in reqs:
        one = commit_tree.column(job, keys.key_for(key_of or req.node), req)
        if out.seals:
            commit_tree.append(out, one)
        else:
            out.CopyFrom(one)
    return out


@pytest.mark.parametrize("kept", [None, ranks_by_node(PLAN)], ids=["derived", "kept"])
def test_a_relayed_column_keeps_the_good_seals_and_leaves_each_bad_one(kept) -> None:
    keys = RelayKeys()
    good = sealed(prepare())
    rank_of_a = column(keys, sealed(prepare(rank=0)))          # a rank of node a
    other_job = column(keys, sealed(prepare()), job="other")     # tagged for another job
    borrowed = column(keys, sealed(prepare(node="a", rank=0)), key_of="b")  # b's key, a's seal
    no_digest = column(keys, prepare())                          # no sha256 in the seal
    batch = peer_pb2.PrepareBatch(job_id="job", columns=[column(keys, good)])
    for bad in (rank_of_a, other_job, borrowed, no_digest):
        commit_tree.append(batch.columns[0], bad)
    taken = PrepareRule(PLAN, 10, (), kept).relayed(batch, keys, "a")
    assert [(p.step, p.nodes, p.sizes, p.firsts) for p in taken] == [(11, ["b"], [1], [1])]
    assert taken[0].seals == [good.seal.SerializeToString(deterministic=True)]


def test_a_relayed_seal_with_bases_is_taken_with_its_oldest_and_a_base_not_before_its_step_is_not(
        ) -> None:
    keys = RelayKeys()
    plan = PlanState(generation=3, layout=Layout(dp=3, pp=1, tp=1), resume_step=10,
                     members=tuple(Member(f"{n}/1", n, Coord(r, r, 0, 0))
                                   for r, n in enumerate("abc")))
    reqs = []
    for rank, (node, bases) in enumerate([("a", [7, 4]), ("b", []), ("c", [4, 11])]):
        req = sealed(prepare(node=node, rank=rank, dp=3))
        req.seal.bases.extend(bases)
        reqs.append(req)
    taken = PrepareRule(plan, 10).relayed(
        peer_pb2.PrepareBatch(job_id="job", columns=[column(keys, *reqs)]), keys, "a")
    # c's base 11 is not before step 11: its deltas could not apply
    assert [(p.nodes, p.firsts, p.oldest) for p in taken] == [(["a", "b"], [0, 1], [4, 11])]


def test_a_seal_moved_to_another_step_or_altered_on_the_way_is_refused() -> None:
    keys = RelayKeys()
    first = column(keys, sealed(prepare(step=11)))
    moved = peer_pb2.SealColumn()
    moved.CopyFrom(first)
    moved.step = 12                                   # its tag binds it to step 11
    altered = peer_pb2.SealColumn()
    altered.CopyFrom(first)
    altered.seals[0] = altered.seals[0][:-1] + b"\x01"  # another digest, same tag
    rule = PrepareRule(PLAN, 10)
    assert rule.relayed(peer_pb2.PrepareBatch(job_id="job", columns=[first]), keys, "a")
    for bad in (moved, altered):
        assert rule.relayed(peer_pb2.PrepareBatch(job_id="job", columns=[bad]), keys, "a") == []


def test_a_column_outside_the_rule_is_left_whole_and_a_subset_of_a_nodes_ranks_is_taken(
        ) -> None:
    keys = RelayKeys()
    plan = PlanState(generation=3, layout=Layout(dp=3, pp=1, tp=1), resume_step=10,
                     members=(Member("a/1", "a", Coord(0, 0, 0, 0)),
                              Member("b/7", "b", Coord(1, 1, 0, 0)),
                              Member("b/8", "b", Coord(2, 2, 0, 0))))
    three = common_pb2.ParallelLayout(dp=3, pp=1, tp=1)
    part = sealed(prepare(rank=2))        # one of b's two ranks: parsed, not matched
    part.layout.CopyFrom(three)
    rule = PrepareRule(plan, 10)
    taken = rule.relayed(peer_pb2.PrepareBatch(job_id="job", columns=[column(keys, part)]),
                         keys, "a")
    assert [(p.nodes, p.sizes) for p in taken] == [(["b"], [1])]
    ahead = sealed(prepare(step=10 + MAX_STEPS_AHEAD + 1))
    ahead.layout.CopyFrom(three)
    older = sealed(prepare(generation=2))
    assert rule.relayed(peer_pb2.PrepareBatch(job_id="job", columns=[
        column(keys, ahead), column(keys, older), column(keys, sealed(prepare()))]),
        keys, "a") == []  # too far ahead; an older generation; the plan's layout is 3


def test_a_seal_that_repeats_a_rank_or_an_empty_column_is_refused() -> None:
    keys = RelayKeys()
    repeated = sealed(prepare())
    repeated.seal.ranks.extend([1, 1, 1])  # b's one rank four times: a world of 4?
    with pytest.raises(validate.InvalidRequest, match="each rank once"):
        validate.request(repeated)
    batch = peer_pb2.PrepareBatch(job_id="job", columns=[column(keys, repeated)])
    assert PrepareRule(PLAN, 10).relayed(batch, keys, "a") == []
    with pytest.raises(validate.InvalidRequest, match="holds no seal"):
        validate.request(peer_pb2.PrepareBatch(job_id="job", columns=[
            peer_pb2.SealColumn(step=11, generation=3)]))


def test_a_daemons_prepare_sent_again_replaces_its_first_and_is_counted_once() -> None:
    # A node's seal of a subset of its ranks, then of all of them (a prepare sent again):
    # the step counts the node's ranks once, so it is not complete on one node's word.
    pending = PendingStep(common_pb2.ParallelLayout(dp=3, pp=1, tp=1), 3, 3)
    for ranks in ([1, 2], [2], [1, 2]):
        req = sealed(prepare())
        req.layout.dp = 3
        req.seal.ClearField("ranks")
        req.seal.ranks.extend(ranks)
        pending.add(Prepared.of(req))
        assert pending.covered == len(ranks) and not pending.complete


def test_a_seal_repeated_in_a_column_on_the_way_is_counted_once() -> None:
    # A daemon on the way copies b's seal, tag and all: the column checks, but b's rank
    # counts once, so the step of two ranks is not complete on b's word alone.
    keys = RelayKeys()
    b = sealed(prepare())
    taken = PrepareRule(PLAN, 10).relayed(
        peer_pb2.PrepareBatch(job_id="job", columns=[column(keys, b, b)]), keys, "x")
    assert [p.nodes for p in taken] == [["b", "b"]]
    pending = PendingStep(b.layout, 3, 2)
    pending.add(taken[0])
    assert pending.covered == 1 and not pending.complete
