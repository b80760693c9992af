"""`stalwart.run_layers`: the launched entry point of entry shape 2, Stalwart's 3D loop
over the user's Layers, protected across failures like `stalwart.run`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from stalwart.client.launched import (
    check_collective_timeout,
    check_device,
    launched_agent,
    run_rank,
)
from stalwart.client.layers import Layers
from stalwart.client.pipeline import SCHEDULES
from stalwart.client.trainer import TrainConfig, check_layout
from stalwart.client.trainer_program import TrainerProgram
from stalwart.client.user_data import Data
from stalwart.client.user_loop import Result, result_json
from stalwart.core.layout import Layout
from stalwart.v1 import common_pb2

__all__ = ["run_layers"]


def run_layers(layers: Layers, data: Data, *, steps: int, pp: int = 1, tp: int = 1,
               schedule: str = "1f1b", microbatches: int | None = None, grad_accum: int = 1,
               stage_bounds: Sequence[tuple[int, int]] | None = None, device: str = "cpu",
               collective_timeout_s: float = 10.0, **train: Any) -> Result | None:
    """Train `layers` on `data` for `steps` optimizer steps with Stalwart's DP x PP x TP
    loop (AdamW, warm-up then cosine learning rate); see docs/api.md.

    The launcher's WORLD_SIZE ranks start as dp = WORLD_SIZE / (pp * tp) replicas of a
    `pp`-stage pipeline (`schedule` "1f1b" or "gpipe", `microbatches` per round, default
    pp) with `tp`-way tensor parallelism. `train` sets TrainConfig fields (seed, lr,
    min_lr, warmup_steps, decay_steps, weight_decay, precision, recompute, compress,
    grad_clip). Returns the Result on every rank that trained to the end, None on a
    spare that never got a role; raises JobStopped when the job stopped.
    """
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(train) - fields)
    if unknown:
        raise TypeError(f"run_layers() got unknown settings {unknown}; TrainConfig has "
                        f"{sorted(fields)}")
    cfg = TrainConfig(**train)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}; give the job's length in optimizer steps (at "
                         "least 1)")
    check_device(device, "stalwart.run_layers()")
    check_collective_timeout(collective_timeout_s, "stalwart.run_layers()")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; choose one of {SCHEDULES}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if pp < 1 or tp < 1 or world % (pp * tp):
        raise ValueError(f"pp={pp} x tp={tp} does not divide the job's {world} ranks; choose "
                         "degrees whose product divides WORLD_SIZE")
    # A layout the data or the model cannot take fails here, on every rank alike, before
    # anything registers: not as ranks that die after the first plan, which the job would
    # read as failures and re-plan around.
    dp, microbatches = world // (pp * tp), microbatches or pp
    check_layout(len(layers), Layout(dp, pp, tp), global_batch=data.global_batch,
                 microbatches=microbatches, grad_accum=grad_accum, bounds=stage_bounds)
    layout = common_pb2.ParallelLayout(
        dp=dp, pp=pp, tp=tp, schedule=schedule, microbatches=microbatches, grad_accum=grad_accum,
        stages=[common_pb2.StageBounds(first_layer=a, last_layer=b)
                for a, b in stage_bounds or ()])
    program = TrainerProgram(layers, data, cfg, layout, steps, device)
    agent, daemon = launched_agent(program, device=device,
                                   collective_timeout_s=collective_timeout_s,
                                   who="stalwart.run_layers()")

    def result() -> Result | None:
        if not program.digest:
            return None
        return Result(steps=steps, losses=dict(agent.result.losses),
                      generations=len(agent.result.generations), param_digest=program.digest)
    return run_rank(agent, daemon, result, result_json)
