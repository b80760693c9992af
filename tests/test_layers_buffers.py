"""Stalwart's 3D loop snapshots its blocks' persistent buffers (BatchNorm's running
statistics) with their parameters, on real daemons: after a kill, a spare's restore and a
survivor's re-partitioned one hold them as the uninterrupted run had them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from example_runs import run_example

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/programs/normed_layers.py"
ARGS = ("--steps", "12")


def _exported(run, path: Path) -> dict[str, torch.Tensor]:
    """The job's last committed step as `stalwart export` writes it, model tensors only."""
    from stalwart.cli import main

    dirs = sorted(run.workdir.glob("node-*"))
    assert main(["export", *(a for d in dirs for a in ("--data-dir", str(d))),
                 str(path)]) == 0
    return {k: v for k, v in torch.load(path, weights_only=True).items()
            if k.startswith("model/")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("base")
    run = run_example(folder, SCRIPT, *ARGS)
    assert len(run.finished()) == 2, run.logs[-4000:]
    return run, _exported(run, folder / "base.pt")


def test_a_spare_restores_the_buffers_bitwise(tmp_path: Path, uninterrupted) -> None:
    base, theirs = uninterrupted
    run = run_example(tmp_path, SCRIPT, *ARGS, spares=1, kill_rank=1, kill_after_step=5)
    assert len(run.finished()) == 2, run.logs[-4000:]
    assert run.digest() == base.digest()
    mine = _exported(run, tmp_path / "run.pt")
    buffers = [k for k in theirs if "running_" in k or "num_batches" in k]
    assert len(buffers) == 9  # three blocks' running mean, variance and count
    assert [k for k in theirs if not torch.equal(mine[k], theirs[k])] == []


def test_a_survivor_repartitioned_onto_every_block_restores_their_buffers(
        tmp_path: Path, uninterrupted) -> None:
    # No spare: pp=2 shrinks to one stage, which takes the other stage's blocks (and
    # their buffers) from the step its rank captured.
    base, theirs = uninterrupted
    run = run_example(tmp_path, SCRIPT, *ARGS, kill_rank=1, kill_after_step=5)
    assert len(run.finished()) == 1, run.logs[-4000:]
    assert run.plans[-1].layout.pp == 1
    for step in range(run.plans[-1].resume_step + 1, 13):
        assert run.losses[step] == pytest.approx(base.losses[step], rel=1e-4)
    mine = _exported(run, tmp_path / "run.pt")
    assert int(mine["model/layers.2.norm.num_batches_tracked"]) == 12 * 2  # 2 micro-batches
    for k, t in theirs.items():
        torch.testing.assert_close(mine[k], t, rtol=1e-4, atol=1e-6, msg=k)
