"""stalwart.Data's guarantee on real daemons: when a replica dies and the survivor trains
on alone (more accumulation, same global batch), every step still reads exactly its
global batch, and the job reads the same samples as the uninterrupted run."""

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


def samples_by_step(folder: Path) -> dict[int, list[int]]:
    """For each step, the samples of the newest generation that took it, over replicas."""
    newest: dict[int, int] = {}
    reads: dict[tuple[int, int], list[int]] = {}
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            newest[r["step"]] = max(newest.get(r["step"], 0), r["generation"])
            reads.setdefault((r["step"], r["generation"]), []).extend(r["samples"])
    return {step: sorted(reads[(step, gen)]) for step, gen in sorted(newest.items())}


def run(tmp_path: Path, name: str, **kw) -> tuple[dict[int, list[int]], object]:
    folder = tmp_path / name
    folder.mkdir()
    os.environ["SAMPLES_DIR"] = str(folder)
    try:
        result = run_example(tmp_path / f"{name}-cluster", SCRIPT, "--steps", "12", **kw)
    finally:
        del os.environ["SAMPLES_DIR"]
    return samples_by_step(folder), result


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
