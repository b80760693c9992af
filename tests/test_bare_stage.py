"""Ranks with nothing to optimize: a first stage whose block is frozen (no backward at
all) and a stage whose blocks hold no tensors (an activation, a dropout). The job trains,
a spare takes the bare stage's place bitwise, and a shrink folds stages together around
them. On real daemons and rank processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from example_runs import run_example

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/programs/bare_stage.py"
ARGS = ("--steps", "6")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    run = run_example(tmp_path_factory.mktemp("base"), SCRIPT, *ARGS, nodes=4, world=4)
    assert len(run.finished()) == 4, run.logs[-4000:]
    return run


def test_the_bare_stages_rank_is_replaced_by_a_spare_bitwise(tmp_path: Path,
                                                             uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS, nodes=4, world=4, spares=1, kill_rank=2,
                      kill_after_step=3)
    assert len(run.finished()) == 4, run.logs[-4000:]
    assert run.plans[-1].layout.pp == 4
    assert run.digest() == uninterrupted.digest()
    assert run.losses == uninterrupted.losses


def test_a_shrink_folds_the_bare_stage_into_a_neighbour(tmp_path: Path, uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS, nodes=4, world=4, kill_rank=3,
                      kill_after_step=3)
    # Two or three stages, as the profile makes either faster; a survivor left over waits
    # as a spare.
    layout = run.plans[-1].layout
    assert layout.pp in (2, 3) and layout.dp == 1, layout
    assert len(run.finished()) == layout.pp, run.logs[-4000:]
    run.digest()  # every stage reports the job's one digest
    # Nothing committed is lost: the steps up to the resume point are the uninterrupted
    # run's. After it the dropout block may draw from another stage's RNG stream (it
    # moved), so the later losses are only those of a job that trains on.
    resumed = run.plans[-1].resume_step
    assert resumed >= run.committed_at_kill
    assert sorted(run.losses) == sorted(uninterrupted.losses)
    assert all(run.losses[s] == uninterrupted.losses[s] for s in range(1, resumed + 1))
    assert all(math.isfinite(run.losses[s]) for s in run.losses)
