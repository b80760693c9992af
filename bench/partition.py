"""Balanced vs uniform pipeline partition on measured layer costs, and partitioner speed.

For each GPT preset (as shipped, and with a 8192-token vocabulary that makes the LM head
weigh what it does in real GPTs) the layers are timed on this machine, split uniformly
and optimally, and both splits are trained in a real pipeline (gloo processes, 1F1B)
in the same run; the step times give the speed-up, and each stage's compute seconds in
that run give the speed-up a machine with a free core per stage would see.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any

from stalwart.core.partition import partition, uniform

WIDE_VOCAB = 8192


def run(quick: bool) -> dict:
    import torch

    from stalwart.client.launch import run_local
    from stalwart.client.layers import probe
    from stalwart_examples.gpt import config, job

    torch.set_num_threads(1)  # each pipeline rank gets one thread too
    presets = ["tiny"] if quick else ["tiny", "small"]
    # One stage per core: more ranks than cores would measure the CPU, not the pipeline.
    pp = max(2, min(4, os.cpu_count() or 2))
    micro_batches = 4 if quick else 8
    cases = []
    for name in presets:
        for vocab in (config(name).vocab, WIDE_VOCAB):
            cfg = config(name, vocab=vocab)
            layers, data = job(cfg, global_batch=micro_batches, corpus_bytes=1 << 20)
            inputs, targets = data.batch(data.indices(0)[:1])
            probes, _ = probe(layers, inputs, targets, repeats=7 if quick else 15)
            costs = [p.fwd_s + p.bwd_s for p in probes]
            even = uniform(len(costs), pp)
            best = partition(costs, pp)
            cases.append({
                "preset": name, "vocab": vocab, "pp": pp, "micro_batches": micro_batches,
                "layer_s": [round(c, 6) for c in costs],
                "uniform": [list(s) for s in even], "balanced": [list(s) for s in best.stages],
                "imbalance_uniform": _imbalance(costs, even),
                "imbalance_balanced": _imbalance(costs, best.stages),
                "simulated_step_uniform_s": _simulated(costs, even, micro_batches),
                "simulated_step_balanced_s": _simulated(costs, best.stages, micro_batches),
                "model": {k: getattr(cfg, k) for k in ("d_model", "n_layer", "n_head", "d_ff",
                                                         "seq_len", "vocab")},
            })
    steps, warmup = (12, 2) if quick else (20, 2)
    load_before = os.getloadavg()[0]
    ranks = run_local(_pipeline_rank, pp, cases, steps, warmup, timeout=600)
    load_after = os.getloadavg()[0]
    for k, case in enumerate(cases):
        times = ranks[0][k]
        case["step_time_uniform_s"] = times["uniform"]
        case["step_time_balanced_s"] = times["balanced"]
        case["speedup"] = round(times["uniform"] / times["balanced"], 3)
        for name in ("uniform", "balanced"):
            # Compute seconds per step of each stage in the real run (waits excluded).
            busy = [r[k][f"busy_{name}"] for r in ranks]
            case[f"stage_busy_{name}_s"] = busy
        case["busy_bound_speedup"] = round(max(case["stage_busy_uniform_s"])
                                           / max(case["stage_busy_balanced_s"]), 3)
    headline = max(cases, key=lambda c: c["imbalance_uniform"])
    return {
        **_partition_speed(quick),
        "imbalance_uniform": headline["imbalance_uniform"],
        "imbalance_balanced": headline["imbalance_balanced"],
        "step_time_uniform_s": headline["step_time_uniform_s"],
        "step_time_balanced_s": headline["step_time_balanced_s"],
        "speedup": headline["speedup"],
        # Cases whose two splits are the same: their "speed-up" is the noise of this run.
        "noise_control_speedups": [c["speedup"] for c in cases if c["uniform"] == c["balanced"]],
        "busy_bound_speedup": headline["busy_bound_speedup"],
        "headline_case": f"{headline['preset']} vocab={headline['vocab']} pp={pp}",
        "step_time_source": "measured",
        "layer_cost_source": "measured: fastest fwd+bwd per layer + AdamW update / m, 1 thread",
        # A pipeline only beats its slowest stage when every stage has a free core; the
        # load average shows how much else was running on this machine meanwhile.
        "loadavg_1min_before_after": [round(load_before, 2), round(load_after, 2)],
        "cpus": os.cpu_count(),
        "cases": cases,
    }


def _imbalance(costs: list[float], stages: Any) -> float:
    """Slowest stage's cost over the mean stage cost (1.0 = perfectly balanced)."""
    loads = [sum(costs[a:b + 1]) for a, b in stages]
    return round(max(loads) / (sum(loads) / len(loads)), 4)


def _simulated(costs: list[float], stages: Any, micro_batches: int) -> float:
    """1F1B step time if only compute counted: (m + p - 1) x slowest stage."""
    return round((micro_batches + len(stages) - 1) * max(sum(costs[a:b + 1])
                                                         for a, b in stages), 6)


def _partition_speed(quick: bool) -> dict:
    """Seconds to split 512 layers into 64 stages (median of repeats), with and without
    heterogeneous speeds, memory caps and a previous split."""
    rng = random.Random(0)
    costs = [rng.uniform(0.8, 1.2) for _ in range(512)]
    costs[0], costs[-1] = 0.1, 6.0  # embedding light, LM head heavy
    speeds = [rng.choice([0.5, 1.0, 1.0, 2.0]) for _ in range(64)]
    mem = [1e9] * 512
    repeats = 3 if quick else 7

    def timed(**kw: Any) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            partition(costs, 64, **kw)
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times), 5)

    previous = partition(costs, 64).stages
    return {"partition_512x64_s": timed(),
            "partition_512x64_speeds_s": timed(speeds=speeds),
            "partition_512x64_speeds_mem_previous_s": timed(
                speeds=speeds, mem=mem, mem_cap=12e9, previous=previous)}


def _pipeline_rank(ctx: Any, cases: list[dict], steps: int, warmup: int) -> list[dict]:
    """One pipeline rank: train each case with its uniform and its balanced split."""
    import torch

    from stalwart.client.parallel_dims import ParallelDims
    from stalwart.client.pipeline import PipelineStats
    from stalwart.client.trainer import TrainConfig, Trainer
    from stalwart.core.layout import Layout
    from stalwart_examples.gpt import GPTConfig, job

    torch.set_num_threads(1)
    generation, out = 0, []
    for case in cases:
        # Both splits live side by side and take turns, so load from other processes on
        # the machine falls on both alike.
        runs = {}
        for name in ("uniform", "balanced"):
            dims = ParallelDims(Layout(pp=case["pp"])).build(ctx.store, ctx.rank, generation)
            generation += 1
            layers, data = job(GPTConfig(**case["model"]), global_batch=case["micro_batches"],
                               corpus_bytes=1 << 20)
            runs[name] = (dims, Trainer(dims, layers, data, TrainConfig(),
                                        stage_bounds=[tuple(b) for b in case[name]],
                                        schedule="1f1b", microbatches=case["micro_batches"]),
                          [])
        for i in range(warmup + steps):
            # Alternate which split goes first, so neither always follows the other.
            order = list(runs.values()) if i % 2 == 0 else list(runs.values())[::-1]
            for dims, trainer, step_s in order:
                if i == warmup:
                    trainer.stats = PipelineStats()
                dims.pp_group.barrier()  # start together: time the step, not the lag
                t0 = time.perf_counter()
                trainer.step()
                if i >= warmup:
                    step_s.append(time.perf_counter() - t0)
        for dims, trainer, _ in runs.values():
            trainer.close()
            dims.destroy()
        result = {name: round(statistics.median(s), 5) for name, (_, _, s) in runs.items()}
        for name, (_, trainer, _) in runs.items():
            result[f"busy_{name}"] = round(trainer.stats.busy_s / steps, 5)
        out.append(result)
    return out
