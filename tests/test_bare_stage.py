"""A pipeline stage whose blocks hold no tensors (an activation, a dropout) is a rank
with nothing to optimize: it trains, its spare takes its place bitwise, and a shrink
that folds it into a neighbour restores the neighbour's layers around it. On real
daemons and rank processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_runs import run_example

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/programs/bare_stage.py"
ARGS = ("--steps", "8")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    run = run_example(tmp_path_factory.mktemp("base"), SCRIPT, *ARGS, nodes=3, world=3)
    assert len(run.finished()) == 3, run.logs[-4000:]
    return run


def test_the_bare_stages_rank_is_replaced_by_a_spare_bitwise(tmp_path: Path,
                                                             uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS, nodes=3, world=3, spares=1, kill_rank=1,
                      kill_after_step=3)
    assert len(run.finished()) == 3, run.logs[-4000:]
    assert run.plans[-1].layout.pp == 3
    assert run.digest() == uninterrupted.digest()
    assert run.losses == uninterrupted.losses


def test_a_shrink_folds_the_bare_stage_into_a_neighbour(tmp_path: Path, uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS, nodes=3, world=3, kill_rank=2,
                      kill_after_step=3)
    assert len(run.finished()) == 2, run.logs[-4000:]
    assert run.plans[-1].layout.pp == 2
    assert sorted(run.losses) == sorted(uninterrupted.losses)
    for step, loss in uninterrupted.losses.items():
        assert run.losses[step] == pytest.approx(loss, rel=1e-4), step
