"""Stalwart's 3D loop seeds the RNG that dropout draws from, per role, from the job's
seed: a rerun of a job draws the same masks (so it ends with the same parameters), and
a spare that takes a killed rank's place goes on drawing where that rank would have. On
real daemons and rank processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_runs import run_example

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/programs/normed_layers.py"
ARGS = ("--steps", "10", "--dropout", "0.3")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    run = run_example(tmp_path_factory.mktemp("base"), SCRIPT, *ARGS)
    assert len(run.finished()) == 2, run.logs[-4000:]
    return run


def test_a_rerun_with_dropout_ends_with_the_same_parameters(tmp_path: Path,
                                                            uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS)
    assert len(run.finished()) == 2, run.logs[-4000:]
    assert run.digest() == uninterrupted.digest()
    assert run.losses == uninterrupted.losses


def test_a_spare_draws_the_dropout_masks_of_the_rank_it_replaces(tmp_path: Path,
                                                                 uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS, spares=1, kill_rank=1, kill_after_step=4)
    assert len(run.finished()) == 2, run.logs[-4000:]
    assert run.plans[-1].layout.pp == 2  # the spare took the place
    assert run.digest() == uninterrupted.digest()
    assert run.losses == uninterrupted.losses
