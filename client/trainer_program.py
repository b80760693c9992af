"""Stalwart's 3D loop as an agent program: each generation builds a Trainer for its
plan, restores the committed step (relaid out when the layout changed), trains and
captures every step until the job's last step is committed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from stalwart.client import host_rng
from stalwart.client.daemon_client import DaemonUnavailable
from stalwart.client.digest import param_digest
from stalwart.client.generation import Generation, PlanChanged
from stalwart.client.layers import Activation, BlockProbe, Layers, probe, sample_pair
from stalwart.client.relayout import Role, captured_layout, fetch_and_assemble
from stalwart.client.trainer import TrainConfig, Trainer, uniform_bounds
from stalwart.client.trainer_state import adamw_hints, load_state, state_tensors
from stalwart.client.user_data import Data
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.client.trainer_program")


@dataclass
class TrainerProgram:
    """The 3D loop over `layers` for `steps` optimizer steps, starting in `layout`."""

    layers: Layers
    data: Data
    train_cfg: TrainConfig
    layout: common_pb2.ParallelLayout
    steps: int
    device: str = "cpu"
    digest: str = ""
    """The job's parameter digest once training ended (every stage and TP shard)."""
    _probes: list[BlockProbe] | None = None
    _activations: tuple[Activation, ...] = ()
    _initial_rng: dict[str, Any] | None = None
    """Python's and numpy's generators as the first generation found them: one that
    resumes from step 0 starts from them again (the Trainer reseeds torch's)."""

    def start_layout(self) -> common_pb2.ParallelLayout:
        return self.layout

    def _probe(self) -> list[BlockProbe]:
        if self._probes is None:
            lay = self.layout
            per_round = max(1, lay.dp) * max(1, lay.microbatches) * max(1, lay.grad_accum)
            micro = max(1, self.data.global_batch // per_round)
            inputs, targets = sample_pair(self.data.batch(self.data.indices(0)[:micro]))
            self._probes, self._activations = probe(self.layers, inputs, targets,
                                                  seed=self.train_cfg.seed)
        return self._probes

    def profile(self) -> common_pb2.LayerProfile:
        return layer_profile(self._probe(), max(1, self.layout.tp), self.layers.costs)

    def warm_up(self) -> None:
        self._probe()

    def restore_request(self, plan: common_pb2.Plan, role: common_pb2.RankAssignment
                        ) -> tuple[int, tuple[int, int] | None]:
        """Its own rank's record of the role's layers, as `_restore` asks first."""
        lay = plan.layout
        bounds = [(s.first_layer, s.last_layer) for s in lay.stages] or \
            uniform_bounds(len(self.layers), max(1, lay.pp))
        return role.coord.rank, bounds[role.coord.pp]

    def train(self, gen: Generation) -> None:
        lay = gen.plan.layout
        trainer = capturer = None
        try:
            self._probe()
            trainer = Trainer(gen.dims, self.layers, self.data, self.train_cfg,
                              stage_bounds=[(s.first_layer, s.last_layer) for s in lay.stages]
                              or None, schedule=lay.schedule or "1f1b",
                              microbatches=lay.microbatches or 1,
                              grad_accum=lay.grad_accum or 1, device=self.device,
                              activations=self._activations)
            trainer.interrupted = gen.newer_plan_waiting  # an abandoned step stops computing
            rebuild_s = time.monotonic() - gen.record["t_build"]
            t_restore = time.monotonic()
            if gen.plan.resume_step > 0:
                _restore(gen, trainer, gen.plan.resume_step)
            elif self._initial_rng is None:
                self._initial_rng = host_rng.states()
            else:
                host_rng.load(self._initial_rng)
            gen.report_rebuilt(rebuild_s, time.monotonic() - t_restore)
            capturer = gen.capturer()
            if gen.plan.resume_step > 0:  # the restored state is whole: its slots can open
                capturer.open_ahead(state_tensors(trainer)[0])

            def wait_for_copy(*_: Any) -> None:
                capturer.before_update()  # the optimizer is about to overwrite what is copied

            hook = trainer.optimizer.register_step_pre_hook(wait_for_copy)
            while trainer.step_count < self.steps:
                gen.check_plan()
                t0 = time.perf_counter()
                loss = gen.run_or_abandon(trainer.step, "step")
                step = trainer.step_count
                tensors, extra = state_tensors(trainer)
                capturer.capture(step, tensors, extra, adamw_hints(trainer),
                                 final=step == self.steps)
                gen.step_done(step, loss, time.perf_counter() - t0)
            capturer.drain()
            hook.remove()
            gen.wait_committed(self.steps)
            gen.result.param_hashes = trainer.param_hashes()
            self.digest = _job_digest(gen, gen.result.param_hashes)
            gen.result.stalls_s = capturer.stats.stalls_s
        finally:
            gen.close_capturer(capturer)
            if not gen.abandoned and trainer is not None:
                trainer.close()


def _job_digest(gen: Generation, hashes: dict[str, str]) -> str:
    """Every stage's parameter hashes through the job's store; the same on every rank."""
    me, prefix = gen.role.coord, f"stalwart/digest/g{gen.plan.generation}"
    if me.dp == 0 and me.tp == 0:
        gen.store.set(f"{prefix}/stage{me.pp}", json.dumps(hashes))
    merged: dict[str, str] = {}
    for stage in range(gen.plan.layout.pp):
        merged.update(json.loads(gen.store.get(f"{prefix}/stage{stage}")))
    return param_digest(merged)


def _restore(gen: Generation, trainer: Trainer, step: int) -> None:
    """Load this role's state at committed `step` from the daemon.

    Same layout: the state the same rank captured. Another layout (after a shrink or
    a grow): the layers and TP shards of the new role, assembled from the old ranks
    that hold them.
    """
    coord = gen.role.coord
    first = coord.rank
    # The role's layers only: under the same layout they are all the old rank holds.
    layers = trainer.bounds[coord.pp]
    try:
        metas, tensors, extra = gen.restore_rank(step, first, layers)
    except DaemonUnavailable as exc:
        # A grown plan has more ranks than the step had: the step has no such rank. Any
        # other failure is raised, never read around with another rank's RNG and data.
        if first == 0 or exc.code != grpc.StatusCode.NOT_FOUND:
            raise
        first = 0
        metas, tensors, extra = gen.restore_rank(step, first, layers)
    old = extra.get("layout", {})
    same = (first == coord.rank and
            (old.get("dp"), old.get("pp"), old.get("tp")) == (
                trainer.dims.layout.dp, trainer.dims.layout.pp, trainer.dims.layout.tp)
            and [tuple(b) for b in old.get("stage_bounds", [])] == list(trainer.bounds))
    if not same:
        lo, hi = trainer.bounds[coord.pp]
        role = Role(lo, hi, tp=coord.tp, tp_size=trainer.dims.layout.tp, dp=coord.dp)
        t0 = time.monotonic()
        fetched = {first: sum(m.nbytes for m in metas)}
        tensors, extra = fetch_and_assemble(gen.daemon, step, captured_layout(extra),
                                            role, local={first: (metas, tensors, extra)},
                                            fetched=fetched)
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        log.warning("relayout restore: layers %d-%d from old ranks %s of the step-%d "
                    "%sx%sx%s layout: fetched %d bytes for %d needed in %.2f s", lo, hi,
                    sorted(fetched), step, old.get("dp"), old.get("pp"), old.get("tp"),
                    sum(fetched.values()), needed, time.monotonic() - t0)
    load_state(trainer, tensors, extra)
    if trainer.step_count != step:
        raise RuntimeError(f"restored state is of step {trainer.step_count}, not {step}")


def layer_profile(probes: list[BlockProbe], tp: int,
                  costs: Sequence[float] | None = None) -> common_pb2.LayerProfile:
    """Per-block cost (the given `costs`, else measured forward + backward seconds of a
    micro-batch), memory and state bytes on one rank, for the elastic planner; blocks
    with planned linears count 1/tp of each."""
    split = [tp if p.sharded else 1 for p in probes]
    measured = [p.fwd_s + p.bwd_s for p in probes]
    return common_pb2.LayerProfile(
        costs=[c / k for c, k in zip(costs or measured, split, strict=True)],
        mem_bytes=[p.mem_bytes / k for p, k in zip(probes, split, strict=True)],
        act_bytes=[p.out_bytes / k for p, k in zip(probes, split, strict=True)],
        state_bytes=[p.state_bytes / k for p, k in zip(probes, split, strict=True)])


__all__ = ["PlanChanged", "TrainerProgram", "layer_profile"]
