"""What a rank redoes after a failure starts from, and draws, what the uninterrupted run
did. Python's and numpy's global generators are part of every step's state, so a data
set that augments with `random` or `np.random` makes a spare's run bitwise the
uninterrupted one; a failure before the first step commits puts every rank, survivors
that trained meanwhile included, back to the state the script built. The replicas start
from one replica's weights, as under DDP, however each process built its own."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from example_runs import run_example

from stalwart.client import host_rng
from stalwart.client.user_state import StateRegistry


def draws() -> list[float]:
    # gauss() and normal() cache a second value: the state must carry it.
    return [random.random(), random.gauss(0, 1), float(np.random.normal()),
            float(np.random.rand()), random.getrandbits(64)]


@pytest.mark.parametrize("cached_gauss", [False, True])
def test_a_restored_state_draws_what_the_captured_one_drew(cached_gauss: bool) -> None:
    random.seed(3)
    np.random.seed(3)
    if cached_gauss:
        random.gauss(0, 1)
        np.random.normal()
    saved = {k: t.clone() for k, t in host_rng.states().items()}
    assert set(saved) == {"python", "numpy"}
    assert all(t.dtype == torch.int64 for t in saved.values())
    want = draws()
    random.seed(99)
    np.random.seed(99)
    host_rng.load(saved)
    assert draws() == want


def test_a_state_without_a_generator_leaves_it_as_it_is() -> None:
    np.random.seed(5)
    want = float(np.random.rand())
    np.random.seed(5)
    host_rng.load({"python": host_rng.states()["python"]})
    assert float(np.random.rand()) == want


def test_the_registry_captures_and_restores_them_with_torchs() -> None:
    model = torch.nn.Linear(2, 2)
    registry = StateRegistry({"model": model})
    random.seed(1)
    np.random.seed(1)
    tensors, extra = registry.capture(0)
    names = {t.name for t in tensors}
    assert {"rng/cpu", "rng/python", "rng/numpy"} <= names
    want = draws()
    random.seed(2)
    np.random.seed(2)
    registry.load({t.name: t.tensor.clone() for t in tensors}, json.loads(json.dumps(extra)))
    assert draws() == want


def trained(tmp_path: Path, name: str, **kw) -> tuple[str, object]:
    outs, run = trained_outs(tmp_path, name, **kw)
    return outs[0]["param_digest"], run


def trained_outs(tmp_path: Path, name: str, **kw) -> tuple[list[dict], object]:
    """What each of the two ranks that finished wrote, and the run; they must agree on
    the parameters."""
    folder = tmp_path / name
    folder.mkdir()
    os.environ["PARAMS_DIR"] = str(folder)
    try:
        # A short folder name: the daemons' Unix sockets live under it.
        run = run_example(tmp_path / "c", "tests/programs/augmented.py",
                          "--steps", "12", **kw)
    finally:
        del os.environ["PARAMS_DIR"]
    outs = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    assert len(outs) == 2 and len({o["param_digest"] for o in outs}) == 1, run.logs[-4000:]
    return outs, run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    return trained(tmp_path_factory.mktemp("base"), "base")[0]


@pytest.mark.multiprocess
def test_a_spare_draws_the_augmentation_the_lost_rank_would_have(tmp_path: Path,
                                                               uninterrupted: str) -> None:
    digest, _ = trained(tmp_path, "killed", spares=1, kill_rank=1, kill_after_step=5)
    assert digest == uninterrupted


@pytest.mark.multiprocess
def test_a_failure_before_the_first_commit_starts_the_survivor_over(
        tmp_path: Path, uninterrupted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_FIRST_STEP", "1")
    digest, run = trained(tmp_path, "failed", spares=1)
    # Replica 0 had taken its first optimizer step too when the job resumed from step 0.
    assert [p.resume_step for p in run.plans] == [0, 0], run.plans
    assert digest == uninterrupted


@pytest.mark.multiprocess
def test_replicas_start_from_one_replicas_weights(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank seeds by its rank, so each builds other weights; trained() asserts
    # that every rank ends with the same parameters.
    monkeypatch.setenv("SEED_BY_RANK", "1")
    trained(tmp_path, "by-rank")


@pytest.mark.multiprocess
def test_a_spare_joining_at_step_0_takes_a_survivors_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spare built weights of its own; the survivor had trained one step past the
    # start it goes back to. Both must take the survivor's start.
    monkeypatch.setenv("SEED_BY_RANK", "1")
    monkeypatch.setenv("FAIL_FIRST_STEP", "1")
    _, run = trained(tmp_path, "by-rank-failed", spares=1)
    assert [p.resume_step for p in run.plans] == [0, 0], run.plans


@pytest.mark.multiprocess
def test_a_second_run_in_the_same_process_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered again, the rank would find its job completed and return without training.
    monkeypatch.setenv("RUN_TWICE", "1")
    outs, _ = trained_outs(tmp_path, "twice")
    assert all("already trained under stalwart.run()" in o["again"] for o in outs), outs


@pytest.mark.multiprocess
def test_replicas_that_built_different_models_are_told_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WIDTH_BY_RANK", "1")
    monkeypatch.setenv("PARAMS_DIR", str(tmp_path))
    run = run_example(tmp_path / "c", "tests/programs/augmented.py", "--steps", "4")
    assert "StateError: the replicas registered different models" in run.logs, run.logs
    assert all(code not in (0, None) for code in run.exit_codes), run.exit_codes
