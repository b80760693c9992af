"""The prepare rule of daemon/security/roles.py, in one process: a daemon prepares only its own
ranks of the current plan, in its layout, near the last commit, within a bounded number
of steps awaiting commit."""

from __future__ import annotations

import pytest

from stalwart.core.decide import Member, PlanState
from stalwart.core.layout import Coord, Layout
from stalwart.daemon.errors import NotReady
from stalwart.daemon.security.auth import Forbidden
from stalwart.daemon.security.roles import (
    MAX_PENDING_STEPS,
    MAX_STEPS_AHEAD,
    check_prepare,
    node_of,
)
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
    check_prepare(PLAN, "b", prepare(), latest=10)


@pytest.mark.parametrize(("req", "latest", "pending", "says"), [
    (prepare(rank=0), 10, (), "places on a"),
    (prepare(dp=1), 10, (), "captured in layout 1x1x1"),
    (prepare(generation=4), 10, (), "ahead of the plan"),
    (prepare(step=10 + MAX_STEPS_AHEAD + 1), 10, (), f"more than {MAX_STEPS_AHEAD} steps"),
    (prepare(step=500), 10, range(12, 12 + MAX_PENDING_STEPS), "already await their commit"),
])
def test_a_prepare_outside_the_callers_role_is_forbidden(req, latest, pending, says) -> None:
    with pytest.raises(Forbidden, match=says):
        check_prepare(PLAN, "b", req, latest=latest, pending=pending)


def test_an_older_generation_is_left_to_the_stale_check_and_no_plan_is_stale() -> None:
    check_prepare(PLAN, "b", prepare(generation=2, dp=1), latest=10)
    with pytest.raises(NotReady, match="before this daemon coordinates"):
        check_prepare(None, "b", prepare(), latest=None)


def test_a_step_already_pending_may_gather_more_ranks_at_the_cap() -> None:
    pending = range(11, 11 + MAX_PENDING_STEPS)
    check_prepare(PLAN, "b", prepare(step=11), latest=10, pending=pending)


def test_the_node_of_a_rank_id_or_of_a_node_name() -> None:
    assert [node_of(x) for x in ("node-1/42", "node-1", "rack/a/9", "x/y")] == [
        "node-1", "node-1", "rack/a", "x/y"]
