"""Every DP x PP x TP layout trains exactly like one process: same first five fp32 losses.

All layouts run in one spawn of 8 ranks (process start dominates on 2 cores); each layout
is a new generation of process groups, so the run also exercises in-process rebuilds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.core.layout import Layout
from stalwart_examples.gpt import GPTConfig, job

JOB = job(GPTConfig(d_model=32, n_layer=2, n_head=4, d_ff=64, seq_len=32), global_batch=8,
          seed=3, corpus_bytes=1 << 18)
CFG = TrainConfig(seed=3)
STEPS = 5
CLIPPED = TrainConfig(**{**CFG.__dict__, "grad_clip": 0.05})  # well below the norms seen
# (dp, pp, tp, schedule, microbatches, grad_accum)
LAYOUTS = [
    (1, 1, 1, "1f1b", 1, 1), (2, 1, 1, "1f1b", 1, 2), (1, 2, 1, "1f1b", 4, 1),
    (1, 1, 2, "gpipe", 1, 1), (2, 2, 1, "gpipe", 2, 1), (1, 2, 2, "gpipe", 2, 2),
    (2, 1, 2, "1f1b", 2, 1), (2, 2, 2, "1f1b", 2, 2),
]


def _train(store, rank: int, generation: int, layout: tuple, cfg: TrainConfig = CFG,
           reduce_fn=None, report: dict | None = None) -> list[float]:
    dp, pp, tp, schedule, m, accum = layout
    dims = ParallelDims(Layout(dp=dp, pp=pp, tp=tp)).build(store, rank, generation)
    trainer = Trainer(dims, *JOB, cfg, schedule=schedule, microbatches=m, grad_accum=accum,
                      reduce_fn=reduce_fn)
    try:
        losses = [trainer.step() for _ in range(STEPS)]
        if report is not None:
            report["overlapped"] = trainer.reducer.overlapped
            report["buckets"] = len(trainer.reducer.buckets)
        return losses
    finally:
        trainer.close()
        dims.destroy()


def _all_layouts(ctx) -> dict:
    out: dict = {}
    for generation, layout in enumerate(LAYOUTS):
        if ctx.rank < layout[0] * layout[1] * layout[2]:
            out[str(layout)] = _train(ctx.store, ctx.rank, generation, layout)
    if ctx.rank < 2:
        out["relayout"] = _relayout(ctx.store, ctx.rank, len(LAYOUTS) + 1)
        calls = []

        def counting_sum(tensor, group):
            calls.append(tensor.numel())
            dist.all_reduce(tensor, group=group)

        bf16 = TrainConfig(**{**CFG.__dict__, "compress": "bf16", "bucket_bytes": 4096})
        out["reducer"] = {}
        out["bf16-wire"] = _train(ctx.store, ctx.rank, len(LAYOUTS) + 3, LAYOUTS[1], bf16,
                                  reduce_fn=counting_sum, report=out["reducer"])
        out["calls_per_step"] = len(calls) / STEPS
    # Clipping the global gradient norm: one norm over every stage and TP shard.
    out["clipped"] = _clipped(ctx.store, ctx.rank, len(LAYOUTS) + 4, LAYOUTS[-1])
    return out


def _clipped(store, rank: int, generation: int, layout: tuple) -> dict[str, list[float]]:
    """Losses and the global gradient norm of each step, clipping at CLIPPED.grad_clip."""
    dp, pp, tp, schedule, m, accum = layout
    dims = ParallelDims(Layout(dp=dp, pp=pp, tp=tp)).build(store, rank, generation)
    trainer = Trainer(dims, *JOB, CLIPPED, schedule=schedule, microbatches=m, grad_accum=accum)
    try:
        out: dict[str, list[float]] = {"losses": [], "norms": []}
        for _ in range(STEPS):
            out["losses"].append(trainer.step())
            out["norms"].append(trainer.last_grad_norm)
        return out
    finally:
        trainer.close()
        dims.destroy()


def _relayout(store, rank: int, generation: int) -> list[float]:
    """Train 3 steps as (1,1,2), then rebuild in-process as (1,2,1) from the gathered full
    state and train 2 more: the 5 losses must follow the one-process run."""
    dims = ParallelDims(Layout(dp=1, pp=1, tp=2)).build(store, rank, generation)
    a = Trainer(dims, *JOB, CFG)
    losses = [a.step() for _ in range(3)]
    params, moments = a.full_params(), a.full_optimizer_state()
    step, data = a.step_count, a.data.state_dict()
    a.close()
    dims.destroy()
    dims = ParallelDims(Layout(dp=1, pp=2, tp=1)).build(store, rank, generation + 1)
    b = Trainer(dims, *JOB, CFG, microbatches=2)
    b.load_full_state(params, moments, step=step, data=data)
    losses += [b.step() for _ in range(2)]
    b.close()
    dims.destroy()
    return losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _train(dist.HashStore(), 0, 0, LAYOUTS[0])


@pytest.mark.multiprocess
def test_every_layout_matches_single_process_losses(run_ranks, reference):
    results = run_ranks(_all_layouts, 8, timeout=240)
    # The (2,2,2) run's norm, summed over stages and TP shards with replicated parameters
    # counted once, is the one-process norm; clipping was active at every step.
    one = _clipped(dist.HashStore(), 0, 0, LAYOUTS[0])
    for rank in range(8):
        assert results[rank]["clipped"]["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert results[0]["clipped"]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert min(one["norms"]) > 2 * CLIPPED.grad_clip
    for layout in LAYOUTS:
        key = str(layout)
        losses = results[0][key]
        assert losses == pytest.approx(reference, rel=1e-5), f"layout {key}"
        members = layout[0] * layout[1] * layout[2]
        for rank in range(1, members):
            assert results[rank][key] == losses, f"rank {rank} reports another loss in {key}"
    assert results[0]["relayout"] == pytest.approx(reference, rel=1e-5)
    # Gradients sent as bf16 through a custom reduce_fn: several buckets, same trajectory.
    reducer = results[0]["reducer"]
    assert reducer["buckets"] > 1 and results[0]["calls_per_step"] == reducer["buckets"]
    # All but the bucket holding the first layer's parameters start before backward ends.
    assert reducer["overlapped"] >= reducer["buckets"] - 1
    assert results[0]["bf16-wire"] == pytest.approx(reference, rel=1e-2)
    assert reference[-1] < reference[0]


@pytest.mark.multiprocess
def test_train_cli_digest_matches_one_process_bitwise(tmp_path):
    """Two stages with one micro-batch do the single process's arithmetic exactly, so the
    digest gathered across stages must equal the one computed in one process."""
    from stalwart import cli
    from stalwart.client.digest import param_digest

    out = tmp_path / "train.json"
    argv = ["train", "--pp", "2", "--microbatches", "1", "--steps", "2", "--model", "tiny",
            "--global-batch", "4", "--seed", "7", "--json", str(out)]
    assert cli.main(argv) == 0
    report = __import__("json").loads(out.read_text())
    cfg = TrainConfig(seed=7, lr=3e-3, min_lr=3e-4, decay_steps=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launcher's ranks: bitwise results depend on it
    try:
        dims = ParallelDims().build(dist.HashStore(), 0, 0)
        trainer = Trainer(dims, *job("tiny", global_batch=4, seed=7), cfg)
        losses = [trainer.step() for _ in range(2)]
        digest = param_digest(trainer.param_hashes())
        trainer.close()
        dims.destroy()
    finally:
        torch.set_num_threads(threads)
    assert report["losses"] == losses
    assert report["param_digest"] == digest
