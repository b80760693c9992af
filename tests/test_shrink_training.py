"""A job that loses a rank and shrinks as the planner says stays on the same trajectory.

Four gloo ranks train (1,4,1), capture their states after step 3 and one "dies"; the
survivors rebuild as the planner's (1,3,1), assemble their new stages' state from the
captured records (client.relayout) and train on. Then the same for (2,2,1) -> (1,2,1)
with doubled accumulation. Both loss curves must follow the one-process run (fp32).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.relayout import Role, fetch_and_assemble
from stalwart.client.state_layout import describe, pack_into
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.client.trainer_state import load_state, state_tensors
from stalwart.core.decide import Member, PlanState
from stalwart.core.layout import Layout
from stalwart.core.partition import partition
from stalwart.core.shrink import ElasticConfig, plan_shrink
from stalwart.v1 import manifest_pb2
from stalwart_examples.gpt import GPTConfig, job

MODEL = GPTConfig(d_model=32, n_layer=4, n_head=4, d_ff=64, seq_len=32)
JOB = job(MODEL, global_batch=8, seed=3, corpus_bytes=1 << 18)
CFG = TrainConfig(seed=3)
BEFORE, AFTER = 3, 2  # steps before the loss, steps after the shrink
COSTS = (1.0,) + (8.0,) * MODEL.n_layer + (4.0,)  # embedding, blocks, head
LAYERS = len(COSTS)


def _before(dp: int, pp: int) -> PlanState:
    layout = Layout(dp, pp, 1, stages=partition(list(COSTS), pp).stages, microbatches=pp)
    members = tuple(Member(f"r{r}", f"n{r}", layout.coords(r)) for r in range(layout.world_size))
    return PlanState(1, layout, members)


def _as_json(state: PlanState) -> dict:
    lay = state.layout
    return {"dp": lay.dp, "pp": lay.pp, "stages": [list(s) for s in lay.stages],
            "microbatches": lay.microbatches, "grad_accum": lay.grad_accum,
            "coords": {m.rank_id: [m.coord.rank, m.coord.dp, m.coord.pp] for m in state.members}}


class _Files:
    """Captured records on disk, served like DaemonClient.restore."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def restore(self, step: int, rank: int, layers: tuple[int, int] | None = None
                ) -> tuple[manifest_pb2.RankState, bytearray]:
        """The whole record whatever `layers` says: relayout takes the layers it needs."""
        record = manifest_pb2.RankState.FromString(
            (self.folder / f"{step}-{rank}.meta").read_bytes())
        return record, bytearray((self.folder / f"{step}-{rank}.bin").read_bytes())


def _capture(trainer: Trainer, folder: Path, rank: int) -> None:
    tensors, extra = state_tensors(trainer)
    metas, total = describe(tensors)
    buf = torch.zeros(total, dtype=torch.uint8)
    pack_into(buf, tensors, metas)
    step = trainer.step_count
    (folder / f"{step}-{rank}.bin").write_bytes(bytes(buf.numpy()))
    record = manifest_pb2.RankState(rank=rank, tensors=metas, total_bytes=total,
                                    extra=json.dumps(extra).encode())
    (folder / f"{step}-{rank}.meta").write_bytes(record.SerializeToString())


def _barrier(store, key: str, count: int, timeout_s: float = 60.0) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {key}: fewer than {count} ranks arrived")
        time.sleep(0.01)


def _phase(ctx, folder: Path, gen: int, before: dict, after: dict) -> list[float]:
    dims = ParallelDims(Layout(before["dp"], before["pp"])).build(ctx.store, ctx.rank, gen)
    t = Trainer(dims, *JOB, CFG, stage_bounds=[tuple(s) for s in before["stages"]],
                microbatches=before["microbatches"])
    losses = [t.step() for _ in range(BEFORE)]
    _capture(t, folder, ctx.rank)
    t.close()
    dims.destroy()
    _barrier(ctx.store, f"captured-{gen}", ctx.world_size)
    mine = after["coords"].get(f"r{ctx.rank}")
    if mine is None:
        return losses  # the rank that failed, or a survivor the new plan keeps spare
    new_rank, dp, pp = mine
    first, last = after["stages"][pp]
    tensors, extra = fetch_and_assemble(_Files(folder), BEFORE, None, Role(first, last, dp=dp))
    dims = ParallelDims(Layout(after["dp"], after["pp"])).build(ctx.store, new_rank, gen + 1)
    t = Trainer(dims, *JOB, CFG, stage_bounds=[tuple(s) for s in after["stages"]],
                microbatches=after["microbatches"], grad_accum=after["grad_accum"])
    load_state(t, tensors, extra)
    losses += [t.step() for _ in range(AFTER)]
    t.close()
    dims.destroy()
    return losses


def _shrinks(ctx, folder: str, cases: list[tuple[dict, dict]]) -> list[list[float]]:
    torch.set_num_threads(1)
    return [_phase(ctx, Path(folder) / str(i), 10 * i, before, after)
            for i, (before, after) in enumerate(cases)]


@pytest.mark.multiprocess
def test_shrunk_jobs_follow_the_uninterrupted_loss_curve(run_ranks, tmp_path):
    pipeline = _before(1, 4)
    to_three = plan_shrink(pipeline, frozenset({"r2"}), ElasticConfig(costs=COSTS)).plan
    assert (to_three.layout.dp, to_three.layout.pp) == (1, 3)
    replicas = _before(2, 2)
    # Each device holds at most 4 of the 6 layers: the model needs two stages.
    tight = ElasticConfig(costs=COSTS, mem=(1.0,) * LAYERS, mem_cap=4.0)
    to_one = plan_shrink(replicas, frozenset({"r1"}), tight).plan
    assert (to_one.layout.dp, to_one.layout.pp, to_one.layout.grad_accum) == (1, 2, 2)
    cases = [(_as_json(pipeline), _as_json(to_three)), (_as_json(replicas), _as_json(to_one))]
    for i in range(len(cases)):
        (tmp_path / str(i)).mkdir()
    results = run_ranks(_shrinks, 4, str(tmp_path), cases, timeout=240)

    dims = ParallelDims().build(dist.HashStore(), 0, 0)
    ref = Trainer(dims, *JOB, CFG)
    reference = [ref.step() for _ in range(BEFORE + AFTER)]
    ref.close()
    dims.destroy()
    for i, (_, after) in enumerate(cases):
        for rank, per_case in enumerate(results):
            losses = per_case[i]
            expect = reference if f"r{rank}" in after["coords"] else reference[:BEFORE]
            assert losses == pytest.approx(expect, rel=1e-5), f"case {i} rank {rank}"
