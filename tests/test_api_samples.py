"""stalwart.Data's guarantee on real daemons: when a replica dies and the survivors train
on (more accumulation, same global batch; unequal shares where the step's micro-batches
do not divide among them), every step still reads exactly its global batch, and the job
reads the same samples as the uninterrupted run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from example_runs import run_example
from programs.count_samples import Indexed

import stalwart

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/programs/count_samples.py"


def reads(folder: Path) -> list[dict]:
    return [json.loads(line) for path in folder.glob("*.jsonl")
            for line in path.read_text().splitlines()]


def samples_by_step(folder: Path) -> dict[int, list[int]]:
    """For each step, the samples of the newest generation that took it, over replicas."""
    newest: dict[int, int] = {}
    samples: dict[tuple[int, int], list[int]] = {}
    for r in reads(folder):
        newest[r["step"]] = max(newest.get(r["step"], 0), r["generation"])
        samples.setdefault((r["step"], r["generation"]), []).extend(r["samples"])
    return {step: sorted(samples[(step, gen)]) for step, gen in sorted(newest.items())}


def run(tmp_path: Path, name: str, **kw) -> tuple[dict[int, list[int]], object]:
    folder = tmp_path / name
    folder.mkdir()
    os.environ["SAMPLES_DIR"] = str(folder)
    try:
        result = run_example(tmp_path / f"{name}-cluster", SCRIPT, "--steps", "12", **kw)
    finally:
        del os.environ["SAMPLES_DIR"]
    return samples_by_step(folder), result


def test_three_replicas_that_lose_one_go_on_as_two_with_unequal_shares(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 12 samples a step in 3 micro-batches of 4: the two survivors read 2 and 1 of them
    # (not one survivor all 3, the other idle), and every step still reads its batch.
    monkeypatch.setenv("GLOBAL_BATCH", "12")
    shrunk, result = run(tmp_path, "uneven", nodes=3, world=3, kill_rank=2,
                         kill_after_step=4)
    last = result.plans[-1].layout
    assert (last.dp, last.grad_accum, last.microbatch_total) == (2, 2, 3), result.plans
    data = stalwart.Data(Indexed(), global_batch=12, seed=1)
    assert sorted(shrunk) == list(range(12))
    for step in range(12):
        assert shrunk[step] == sorted(data.indices(step)), step
    final = max(r["generation"] for r in reads(tmp_path / "uneven"))
    shares = {r["dp_rank"]: len(r["samples"]) for r in reads(tmp_path / "uneven")
              if r["generation"] == final}
    assert shares == {0: 8, 1: 4}


def test_a_shrink_skips_and_repeats_no_sample(tmp_path: Path) -> None:
    base, _ = run(tmp_path, "base")
    shrunk, result = run(tmp_path, "shrunk", kill_rank=1, kill_after_step=4)
    assert result.plans[-1].layout.dp == 1 and result.plans[-1].layout.grad_accum == 2
    assert sorted(base) == sorted(shrunk) == list(range(12))
    data = stalwart.Data(Indexed(), global_batch=8, seed=1)
    for step in range(12):
        assert shrunk[step] == sorted(data.indices(step)), step  # the step's whole batch
    assert shrunk == base
    # Steps 0-5 read global positions 0-47, all of the first epoch of 50: no repeats.
    first_epoch = [s for step in range(6) for s in shrunk[step]]
    assert len(set(first_epoch)) == 48
