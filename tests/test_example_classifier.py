"""The classifier example (entry shape 1: the user's own loop, model, SGD with momentum
and StepLR) on real daemons: a SIGKILLed rank is replaced by a spare bitwise, and
without a spare data parallelism shrinks keeping the global batch."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from example_runs import REPO, run_example

import stalwart

pytestmark = pytest.mark.multiprocess

SCRIPT = "examples/classifier/train.py"
ARGS = ("--steps", "24", "--global-batch", "16")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    run = run_example(tmp_path_factory.mktemp("base"), SCRIPT, *ARGS)
    assert len(run.finished()) == 2, run.logs[-4000:]
    return run


def test_the_uninterrupted_run_trains_every_step_on_both_replicas(uninterrupted) -> None:
    assert sorted(uninterrupted.losses) == list(range(1, 25))
    assert all(r["steps"] == 24 and r["generations"] == 1 for r in uninterrupted.finished())
    assert uninterrupted.losses[24] < uninterrupted.losses[1]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_is_replaced_by_a_spare_bitwise(tmp_path: Path, uninterrupted,
                                                      victim: int) -> None:
    # Rank 0 served the store generation 1 started from: generation 2 starts from one
    # its plan's ranks serve, so no process outside the plan is needed.
    run = run_example(tmp_path, SCRIPT, *ARGS, spares=1, kill_rank=victim, kill_after_step=6)
    assert len(run.finished()) == 2, run.logs[-4000:]
    resumed = run.plans[-1].resume_step
    assert run.committed_at_kill is not None and resumed >= run.committed_at_kill  # 0 lost
    assert run.plans[-1].layout.dp == 2  # the spare took the dead rank's place
    # Each role of the new plan fetched the state it resumed from while building its groups.
    resumed_in = [g for r in run.results for g in r.get("generations", [])
                  if g["resume_step"] > 0]
    assert resumed_in and all(g["restored_ahead"] for g in resumed_in), resumed_in
    assert run.digest() == uninterrupted.digest()
    assert run.losses == uninterrupted.losses
    # The whole model, BatchNorm's running statistics included: the step resumed from
    # held them as they were after its own forward, not the next one's.
    mine, theirs = (_exported(r, tmp_path / name) for r, name in
                    ((run, "run.pt"), (uninterrupted, "uninterrupted.pt")))
    model = sorted(k for k in theirs if k.startswith("model/"))
    assert any("running_mean" in k for k in model)
    assert [k for k in model if not torch.equal(mine[k], theirs[k])] == []


def test_without_a_spare_the_survivor_trains_on_with_accumulation(tmp_path: Path,
                                                                  uninterrupted) -> None:
    run = run_example(tmp_path, SCRIPT, *ARGS, kill_rank=1, kill_after_step=6)
    assert len(run.finished()) == 1, run.logs[-4000:]
    plan = run.plans[-1]
    assert (plan.layout.dp, plan.layout.grad_accum) == (1, 2)  # the global batch is kept
    assert plan.resume_step >= run.committed_at_kill
    for step in range(plan.resume_step + 1, 25):
        assert run.losses[step] == pytest.approx(uninterrupted.losses[step], rel=1e-4)


def test_the_plain_script_trains_without_stalwart() -> None:
    out = subprocess.run([sys.executable, str(REPO / "examples/classifier/plain.py"),
                          "--steps", "11"], capture_output=True, text=True, timeout=120,
                         check=True)
    first, last = (float(line.split()[-1]) for line in out.stdout.splitlines()[:2])
    assert out.stdout.startswith("step 0 loss") and last < first


def test_adopting_stalwart_adds_the_lines_docs_api_says() -> None:
    plain = [line.strip() for line in (REPO / "examples/classifier/plain.py").read_text()
             .splitlines()]
    mine = [line.strip() for line in (REPO / "examples/classifier/train.py").read_text()
            .splitlines()]
    added = sum(1 for line in difflib.ndiff(plain, mine) if line.startswith("+ "))
    claim = re.search(r"adds \*\*(\d+) lines\*\*", (REPO / "docs/api.md").read_text())
    assert claim and int(claim[1]) == added <= 15


def _exported(run, path: Path) -> dict:
    """The job's last committed step as `stalwart export` writes it, offline, from the
    job's data dirs (chunks are kept as erasure shards across them)."""
    from stalwart.cli import main

    dirs = sorted(run.workdir.glob("node-*"))
    assert len(dirs) == 2
    assert main(["export", *(a for d in dirs for a in ("--data-dir", str(d))),
                 str(path)]) == 0
    return torch.load(path, weights_only=True)


def test_an_export_of_the_jobs_store_holds_the_trained_model(tmp_path: Path,
                                                            uninterrupted) -> None:
    from stalwart.client.digest import tensor_sha256

    state = _exported(uninterrupted, tmp_path / "classifier.pt")
    params = {k: tensor_sha256(v) for k, v in state.items() if k.startswith("model/")
              and "running_" not in k and "num_batches" not in k}
    assert stalwart.param_digest(params) == uninterrupted.digest()
    assert "optimizer/model/head.1.weight/momentum_buffer" in state


def test_an_unused_spare_leaves_cleanly_once_the_job_has_trained_its_last_step(
        tmp_path: Path) -> None:
    from stalwart.client.local_cluster import LocalCluster, wait_until

    cluster = LocalCluster(nodes=2, workdir=tmp_path / "cluster")
    try:
        cluster.start_daemons()
        cluster.launch(None, 2, spares=1, argv=[str(REPO / SCRIPT), *ARGS])
        wait_until(lambda: all(r.proc.poll() is not None for r in cluster.ranks), 180,
                   "every rank and the spare to exit on their own")
        codes = {("spare" if r.rank < 0 else f"rank{r.rank}"): r.proc.returncode
                 for r in cluster.ranks}
        status = cluster.daemons[0].status()
    finally:
        cluster.close()
    assert codes == {"rank0": 0, "rank1": 0, "spare": 0}
    assert status.plan.completed and status.plan.resume_step == 24
