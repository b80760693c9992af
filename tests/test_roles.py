"""The prepare rule of daemon/security/prepare_rule.py, in one process: a daemon prepares
only its own ranks of the current plan, in its layout, near the last commit, within a
bounded number of steps awaiting commit; a relayed batch is taken prepare by prepare."""

from __future__ import annotations

import pytest

from stalwart.core.decide import Member, PlanState
from stalwart.core.layout import Coord, Layout
from stalwart.daemon.errors import NotReady
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


def test_a_relayed_batch_keeps_the_good_prepares_and_leaves_each_bad_one() -> None:
    keys = RelayKeys()

    def tagged(req: peer_pb2.PrepareStepRequest, node: str | None = None
               ) -> peer_pb2.TaggedPrepare:
        data = req.SerializeToString()
        return peer_pb2.TaggedPrepare(prepare=data, step=req.step,
                                      tag=commit_tree.tag(keys.key_for(node or req.node), data))

    def sealed(req: peer_pb2.PrepareStepRequest, job: str = "job") -> peer_pb2.PrepareStepRequest:
        req.job_id, req.seal.digest = job, bytes(32)
        return req

    good = sealed(prepare())
    batch = peer_pb2.PrepareBatch(job_id="job", prepares=[
        tagged(good),
        tagged(sealed(prepare(node="a", rank=0)), node="b"),  # tagged with another's key
        tagged(sealed(prepare(), job="other")),               # of another job
        tagged(sealed(prepare(rank=0))),                       # a rank of node a
        tagged(prepare()),                                     # no seal digest
    ])
    taken = PrepareRule(PLAN, 10, (), ranks_by_node(PLAN)).relayed(batch, keys, "a")
    assert [t.SerializeToString() for t in taken] == [good.SerializeToString()]
