"""Pipeline bubble and activation memory of 1F1B vs GPipe, measured on the real executor,
and the memory/compute trade of each activation-recompute policy on the tiny GPT.

Each stage is two small linear layers plus a fixed sleep per forward (t) and backward (2t):
sleeping costs no CPU, so p stage processes on 2 cores still see the timing the schedule
alone causes. Bubble = 1 - (stage's compute seconds) / (round's wall seconds between
barriers), averaged over stages; memory = bytes saved for backward alive at once.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["run"]


def _sleep_stage(d: int, forward_s: float):
    import torch
    from torch import nn

    class Sleep(torch.autograd.Function):
        """Identity whose forward takes `forward_s` and backward twice that."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            time.sleep(forward_s)
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(2 * forward_s)
            return grad

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Sleep.apply(self.b(torch.nn.functional.gelu(self.a(x))))

    return Stage()


def _bench_worker(ctx: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One stage of a p-stage pipeline; runs every (schedule, m) config and reports its own."""
    import torch

    from stalwart.client.parallel_dims import ParallelDims
    from stalwart.client.pipeline import PipelineStats, run_schedule, schedule
    from stalwart.core.layout import Layout

    torch.manual_seed(ctx.rank)
    dims = ParallelDims(Layout(pp=ctx.world_size)).build(ctx.store, ctx.rank, 0)
    pp = dims.pp_group
    d, seq, mb = spec["d"], spec["seq"], spec["micro_size"]
    stage = _sleep_stage(d, spec["forward_s"])
    shape = (mb, seq, d)
    out = []
    for kind in ("gpipe", "1f1b"):
        for m in spec["microbatches"]:
            actions = schedule(kind, pp.size, pp.index, m)
            inputs = [torch.randn(shape) for _ in range(m)]
            stats, wall = None, 0.0
            for rnd in range(spec["rounds"] + 1):  # round 0 warms up and is not counted
                if rnd == 1:
                    stats = PipelineStats()
                # Barriers bracket the round so every stage's wall time is the pipeline's.
                pp.barrier()
                started = time.perf_counter()
                run_schedule(stage, actions, pp, inputs=inputs, in_shape=shape, out_shape=shape,
                             loss_fn=lambda y, i: (y.float().pow(2).mean(), 0.0), stats=stats)
                pp.barrier()
                if stats is not None:
                    wall += time.perf_counter() - started
            out.append({"schedule": kind, "p": pp.size, "m": m, "stage": pp.index,
                        "busy_s": stats.busy_s, "wall_s": wall,
                        "peak_activation_bytes": stats.peak_activation_bytes})
            stage.zero_grad(set_to_none=True)
    dims.destroy()
    return out


def _recompute_trade(rounds: int) -> dict[str, dict[str, float]]:
    """Peak saved-activation bytes and compute seconds of the tiny GPT under each
    recompute policy, in one process (one stage holding every layer)."""
    import torch
    import torch.distributed as dist

    from stalwart.client import recompute
    from stalwart.client.layers import Stage
    from stalwart.client.parallel_dims import ParallelDims
    from stalwart.client.pipeline import PipelineStats, run_schedule, schedule
    from stalwart_examples.gpt import config, job

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg, mb, m = config("tiny"), 4, 2
    layers, data = job(cfg, global_batch=mb * m, corpus_bytes=1 << 20)
    dims = ParallelDims().build(dist.HashStore(), 0, 0)
    ids, targets = data.batch(data.indices(0))

    def loss_fn(out: torch.Tensor, i: int) -> tuple[torch.Tensor, float]:
        return layers.loss(out, targets.split(mb)[i]), 0.0

    out = {}
    for policy in recompute.POLICIES:
        stage = Stage(layers, 0, len(layers) - 1, recompute=policy)
        stats = None
        for rnd in range(rounds + 1):  # round 0 warms up (first use of checkpointing is slow)
            if rnd == 1:
                stats = PipelineStats()
            run_schedule(stage, schedule("1f1b", 1, 0, m), dims.pp_group,
                         inputs=list(ids.split(mb)), loss_fn=loss_fn, stats=stats)
        out[policy] = {"peak_activation_bytes": stats.peak_activation_bytes,
                       "compute_s_per_round": round(stats.busy_s / rounds, 4)}
    dims.destroy()
    torch.set_num_threads(threads)
    base = out["none"]
    for fig in out.values():
        fig["memory_vs_none"] = round(fig["peak_activation_bytes"]
                                      / base["peak_activation_bytes"], 3)
        fig["time_vs_none"] = round(fig["compute_s_per_round"] / base["compute_s_per_round"], 3)
    return out


def run(quick: bool) -> dict:
    from stalwart.client.launch import run_local

    spec = {"d": 64, "seq": 32, "micro_size": 2, "forward_s": 0.004 if quick else 0.02,
            "rounds": 2 if quick else 3}
    configs: dict[str, dict[str, Any]] = {}
    for p, ms in ((2, [2, 4, 8]), (4, [4, 8, 16])):
        per_rank = run_local(_bench_worker, p, {**spec, "microbatches": ms}, timeout=600)
        rows = [row for rank_rows in per_rank for row in rank_rows]
        for kind in ("gpipe", "1f1b"):
            for m in ms:
                mine = sorted((r for r in rows if r["schedule"] == kind and r["m"] == m),
                              key=lambda r: r["stage"])
                bubbles = [1.0 - r["busy_s"] / r["wall_s"] for r in mine]
                configs[f"{kind},p={p},m={m}"] = {
                    "schedule": kind, "p": p, "m": m,
                    "bubble_measured": round(sum(bubbles) / len(bubbles), 4),
                    "bubble_formula": round((p - 1) / (m + p - 1), 4),
                    "bubble_per_stage": [round(b, 4) for b in bubbles],
                    "peak_activation_bytes": max(r["peak_activation_bytes"] for r in mine),
                    "peak_activation_bytes_per_stage": [r["peak_activation_bytes"] for r in mine],
                    "round_s": round(mine[0]["wall_s"] / spec["rounds"], 4),
                }
    ratios = {f"p={c['p']},m={c['m']}":
              round(c["peak_activation_bytes"]
                    / configs[f"1f1b,p={c['p']},m={c['m']}"]["peak_activation_bytes"], 3)
              for c in configs.values() if c["schedule"] == "gpipe"}
    return {
        "configs": configs,
        "peak_activation_gpipe_over_1f1b": ratios,
        "recompute": _recompute_trade(2 if quick else 5),
        "setup": {**spec, "note": "stage = Linear-GELU-Linear + sleep(t) forward, sleep(2t) "
                  "backward; bubble = 1 - compute_s / round wall_s, mean over stages; "
                  "memory = bytes saved for backward (parameters excluded), max over stages"},
    }
