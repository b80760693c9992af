"""The step loop of one rank of Stalwart's 3D loop: global batch -> this replica's
micro-batches -> pipeline schedule -> data-parallel gradient sum -> (loss-scale check)
-> AdamW -> global loss. A Trainer is built from the model's Layers, the data and a plan
(dims, stage bounds, schedule, micro-batches, accumulation), and can be dropped and
rebuilt with another plan in the same process.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from stalwart.client import host_rng, pipeline
from stalwart.client.digest import tensor_sha256
from stalwart.client.dp import GradReducer, ReduceFn
from stalwart.client.layers import (
    Activation,
    Layers,
    Stage,
    map_tensors,
    probe,
    sample_pair,
    split_rows,
)
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.pipeline import PipelineStats, StepInterrupted, run_schedule
from stalwart.client.user_data import Data
from stalwart.core.layout import Layout

__all__ = ["LossScaler", "TrainConfig", "Trainer", "check_layout", "full_params",
           "resolve_precision", "uniform_bounds"]


PRECISIONS = ("fp32", "bf16", "fp16", "auto")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What stays fixed for a job whatever its layout (the global batch is the Data's)."""

    seed: int = 0
    """Seeds the initial weights."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 5
    """Optimizer steps of linear warm-up."""
    decay_steps: int = 1000
    """Optimizer steps from the start to the end of the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    precision: str = "fp32"
    """fp32 | bf16 (CPU autocast) | fp16 (CUDA autocast with loss scaling) | auto."""
    recompute: str = "none"
    """Activation recomputation for every block: none | selective | full."""
    compress: str = "none"
    """Gradient dtype on the wire for the data-parallel sum: none | fp16 | bf16."""
    bucket_bytes: int = 1 << 20
    """Gradient bucket size for the data-parallel sum (bytes)."""
    grad_clip: float = 0.0
    """Largest global L2 norm of the gradients (over every stage and TP shard); larger
    gradients are scaled down to it before the optimizer step. 0 = no clipping."""

    def __post_init__(self) -> None:
        """Checked where the job is declared: a bad setting found inside every rank would
        fail them all after they registered (and each spare given the role after them)."""
        from stalwart.client.dp import COMPRESSION
        from stalwart.client.recompute import POLICIES

        choices = {"precision": PRECISIONS, "recompute": POLICIES,
                   "compress": tuple(COMPRESSION)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of "
                                 f"{list(allowed)}")
        least = {"lr": 0, "min_lr": 0, "warmup_steps": 0, "decay_steps": 0,
                 "weight_decay": 0, "bucket_bytes": 1, "grad_clip": -math.inf}
        for name, bound in least.items():
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and math.isfinite(value)
                    and value >= bound):
                raise ValueError(f"{name}={value!r}; give a finite number"
                                 + (f" of at least {bound}" if bound > -math.inf else ""))

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based): warm-up, then cosine."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        t = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))


class LossScaler:
    """Dynamic loss scaling for fp16; the skip decision is agreed by every rank of the job."""

    def __init__(self, enabled: bool, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled, self.scale, self.growth_interval = enabled, scale, growth_interval
        self.good_steps = 0

    def unscale_and_check(self, params: list[torch.nn.Parameter], world: Any,
                          device: torch.device | str) -> bool:
        """Divide gradients by the scale; True when every rank's gradients are finite.
        The flag lives on the rank's `device` (the group's), also where a stage has
        nothing to train."""
        if not self.enabled:
            return True
        bad = torch.zeros(1, device=device)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)
                bad += (~torch.isfinite(p.grad)).any().float()
        world.all_reduce(bad)
        ok = bool(bad.item() == 0)
        if ok:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale, self.good_steps = self.scale / 2.0, 0
        return ok

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.enabled, self.scale = bool(state["enabled"]), float(state["scale"])
        self.good_steps = int(state["good_steps"])


class Trainer:
    """One rank's share of a DP x PP x TP training job for one plan."""

    def __init__(self, dims: ParallelDims, layers: Layers, data: Data, cfg: TrainConfig, *,
                 stage_bounds: list[tuple[int, int]] | None = None, schedule: str = "1f1b",
                 microbatches: int = 1, grad_accum: int = 1, reduce_fn: ReduceFn | None = None,
                 device: str | torch.device = "cpu",
                 activations: Sequence[Activation] | None = None) -> None:
        lay = dims.layout
        # The step's micro-batches over all replicas, and this replica's consecutive
        # share of them (unequal shares, one micro-batch a round, after some shrinks).
        total = lay.microbatch_total or lay.dp * grad_accum * microbatches
        self.total = total
        self.first, self.rounds = (lay.replica_microbatches(dims.my.dp) if lay.microbatch_total
                                   else (dims.my.dp * grad_accum * microbatches, grad_accum))
        bounds = check_layout(len(layers), lay, global_batch=data.global_batch,
                              microbatches=microbatches, grad_accum=grad_accum,
                              bounds=stage_bounds)
        self.dims, self.cfg, self.bounds = dims, cfg, [tuple(b) for b in bounds]
        self.layers, self.data = layers, data
        self.schedule_kind, self.m, self.grad_accum = schedule, microbatches, grad_accum
        self.micro_size = data.global_batch // total
        self.device = torch.device(device)
        if activations is None:
            inputs, targets = sample_pair(data.batch(data.indices(0)[:1]))
            activations = probe(layers, inputs, targets, seed=cfg.seed, repeats=1)[1]
        me = dims.my
        first, last = self.bounds[me.pp]
        # The activation this stage receives (the previous block's output) and sends
        # on (its last block's): blocks may change its shape and dtype.
        none = Activation((), torch.float32)
        self.inbound = activations[first - 1] if first > 0 else none
        self.outbound = activations[last] if last < len(layers) - 1 else none
        self.stage = Stage(layers, first, last, seed=cfg.seed, tp=dims.tp_group,
                           recompute=cfg.recompute).to(self.device)
        # What trains: a parameter its block froze (requires_grad False) is neither summed,
        # clipped nor updated, only captured and restored with the rest.
        self.param_names = [n for n, p in self.stage.named_parameters() if p.requires_grad]
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        # The blocks' persistent buffers (BatchNorm's running statistics, ...), which the
        # stage's state holds beside its parameters: snapshotted and restored with them.
        kept = set(self.stage.state_dict(keep_vars=True))  # persistent ones only
        self.buffer_names = [n for n, _ in self.stage.named_buffers() if n in kept]
        self.reducer = GradReducer(self.params, dims.dp_group, bucket_bytes=cfg.bucket_bytes,
                                   compress=cfg.compress, reduce_fn=reduce_fn)
        # One group, even empty: a stage of parameter-free blocks (an activation, a
        # reshape) has nothing to update, and AdamW refuses a bare empty list.
        self.optimizer = torch.optim.AdamW([{"params": self.params}], lr=cfg.lr_at(0),
                                           betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.precision = precision = resolve_precision(cfg.precision, self.device)[0]
        self.scaler = LossScaler(enabled=precision == "fp16")
        self.actions = pipeline.schedule(schedule, dims.layout.pp, me.pp, microbatches)
        self.step_count = 0
        # Step 0's RNG, which dropout draws from, is a function of the job's seed and the
        # role, as the weights are: a rerun draws the same masks, each replica and stage
        # its own, the TP ranks of a stage the same (the activations they all hold stay
        # equal). A restore replaces it with the RNG of the step it restores.
        torch.manual_seed(role_seed(cfg.seed, me.dp, me.pp))
        # True once the step being taken is no longer wanted (a newer plan abandoned it):
        # the step then ends at its next forward or backward (StepInterrupted) instead
        # of computing on beside the next generation's build.
        self.interrupted: Callable[[], bool] | None = None
        self.last_grad_norm: float | None = None  # before clipping, when grad_clip > 0
        self.stats: PipelineStats | None = None

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.precision == "fp16":
            return torch.autocast(self.device.type, dtype=torch.float16)
        return nullcontext()

    def _loss(self, targets: list[torch.Tensor], scale: float, out: torch.Tensor,
              i: int) -> tuple[torch.Tensor, float]:
        loss = self.layers.loss(out, targets[i])
        # Each micro-batch's mean is scaled so that the DP sum of gradients is the global mean.
        scaled = loss * scale
        backprop = scaled * self.scaler.scale if self.scaler.enabled else scaled
        return backprop, scaled.item()

    def step(self) -> float:
        """One optimizer step; returns the global mean loss (the same value on every rank)."""
        data = self.data
        size = self.m * self.micro_size  # samples a round
        start = self.first * self.micro_size
        mine = data.indices(self.step_count)[start:start + self.rounds * size]
        ids, targets = (map_tensors(lambda t: t.to(self.device), v)
                        for v in sample_pair(data.batch(mine)))
        for p in self.params:
            p.grad = None
        scale = 1.0 / self.total
        local_loss = 0.0
        for a in range(self.rounds):
            rows = slice(a * size, (a + 1) * size)
            mb_ids = split_rows(map_tensors(lambda t, r=rows: t[r], ids), self.micro_size)
            mb_targets = split_rows(map_tensors(lambda t, r=rows: t[r], targets),
                                    self.micro_size)
            losses = run_schedule(
                self.stage, self.actions, self.dims.pp_group, inputs=mb_ids,
                loss_fn=partial(self._loss, mb_targets, scale),
                in_shape=(self.micro_size, *self.inbound.shape), in_dtype=self.inbound.dtype,
                out_shape=(self.micro_size, *self.outbound.shape),
                device=self.device, autocast=self._autocast, stats=self.stats,
                before_last_backward=self.reducer.arm if a == self.rounds - 1 else None,
                interrupted=self.interrupted)
            local_loss += sum(losses)
        self.reducer.finish()
        if self.interrupted is not None and self.interrupted():
            raise StepInterrupted("left before the optimizer step")
        cfg = self.cfg
        if self.scaler.unscale_and_check(self.params, self.dims.world, self.device):
            if cfg.grad_clip > 0:
                self.last_grad_norm = self._clip_gradients(cfg.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr_at(self.step_count)
            self.optimizer.step()
        self.step_count += 1
        return self._global_loss(local_loss)

    def _clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient by max_norm / global norm when that is below 1; returns the
        global L2 norm before clipping, the same on every rank.

        Gradients are already summed over DP, so replicas agree; TP shards are summed over
        the TP group, parameters replicated across TP (layer norms, embedding, head) count
        once; stages are summed over the pipeline.
        """
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.stage.named_parameters():
            if p.grad is not None:
                sq = p.grad.detach().double().pow(2).sum()
                if self.stage.shard_dim(name) is None:
                    replicated += sq
                else:
                    sharded += sq
        self.dims.tp_group.all_reduce(sharded)
        total = (sharded + replicated).reshape(1)
        self.dims.pp_group.all_reduce(total)
        norm = float(total.sqrt().item())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _global_loss(self, local: float) -> float:
        """Sum the last stage's scaled losses over DP, then hand the value to every stage."""
        loss = torch.tensor([local], dtype=torch.float64, device=self.device)
        if self.dims.my.pp == self.dims.layout.pp - 1:
            self.dims.dp_group.all_reduce(loss)
        self.dims.pp_group.broadcast(loss, self.dims.layout.pp - 1)
        return float(loss.item())

    def full_params(self) -> dict[str, torch.Tensor]:
        """This stage's parameters at full size by canonical name (collective over TP)."""
        return full_params(self.stage, self.dims.tp_group)

    def param_hashes(self) -> dict[str, str]:
        """sha256 of each full parameter of this stage (collective over TP)."""
        return {name: tensor_sha256(t) for name, t in self.full_params().items()}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW moments at full size by canonical name (TP shards gathered; collective
        over TP), so they can be re-sliced for another layout."""
        out = {}
        for name, p in self.stage.named_parameters():
            state = self.optimizer.state.get(p, {})
            out[name] = {}
            for key, t in state.items():
                dim = self.stage.shard_dim(name)
                if t.dim() and dim is not None and self.dims.layout.tp > 1:
                    t = torch.cat(self.dims.tp_group.all_gather(t), dim=dim)
                out[name][key] = t.detach().clone()
        return out

    def load_full_state(self, params: dict[str, torch.Tensor],
                        optimizer: dict[str, dict[str, torch.Tensor]] | None = None, *,
                        step: int | None = None, data: dict[str, Any] | None = None) -> None:
        """Load full-size parameters (and AdamW moments, step count, data position) by
        canonical name, keeping this rank's TP slice: the layout that made them is irrelevant.
        """
        if step is not None:
            self.step_count = step
        if data is not None:
            self.data.load_state_dict(data)
        with torch.no_grad():
            for name, p in self.stage.named_parameters():
                if name not in params:
                    raise KeyError(f"{name} is missing from the full state; this stage holds "
                                   f"blocks {self.stage.first}..{self.stage.last}")
                p.copy_(self._my_slice(name, params[name]))
                if optimizer is not None and p.requires_grad:
                    self.optimizer.state[p] = {
                        k: (self._my_slice(name, t) if t.dim() else t.clone()).to(p.device)
                        for k, t in optimizer[name].items()}

    def _my_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        dim = self.stage.shard_dim(name)
        if dim is None or self.dims.layout.tp == 1:
            return full
        return full.chunk(self.dims.layout.tp, dim)[self.dims.my.tp]

    def layout(self) -> dict[str, Any]:
        me, lay = self.dims.my, self.dims.layout
        return {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp,
                "coords": {"dp": me.dp, "pp": me.pp, "tp": me.tp},
                "stage_bounds": [list(b) for b in self.bounds], "schedule": self.schedule_kind,
                "microbatches": self.m, "grad_accum": self.grad_accum,
                "shard_dims": {n: self.stage.shard_dim(n) for n, _ in
                               self.stage.named_parameters()}}

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to continue exactly: tensors are this rank's shards,
        keyed by canonical parameter name. Tensors are live references (no copy is made):
        copy them before the next step() changes them."""
        names = self.param_names  # the optimizer's order
        opt = self.optimizer.state_dict()
        return {
            "step": self.step_count,
            "model": dict(self.stage.state_dict()),
            "optimizer": {"state": {names[i]: s for i, s in opt["state"].items()},
                          "param_groups": opt["param_groups"]},
            "scaler": self.scaler.state_dict(),
            "data": self.data.state_dict(),
            "rng": {"cpu": torch.get_rng_state(), **host_rng.states(),
                    **({"cuda": torch.cuda.get_rng_state(self.device)}
                       if self.device.type == "cuda" else {})},
            "layout": self.layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by a Trainer with the same layout."""
        names = self.param_names
        self.stage.load_state_dict(state["model"])
        self.optimizer.load_state_dict({
            "state": {names.index(n): s for n, s in state["optimizer"]["state"].items()},
            "param_groups": state["optimizer"]["param_groups"]})
        self.scaler.load_state_dict(state["scaler"])
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        host_rng.load(state["rng"])
        self.step_count = int(state["step"])

    def close(self, wait: bool = True) -> None:
        """Release hooks and threads; the caller destroys the process groups. Pass
        wait=False after a failure (see GradReducer.close)."""
        self.reducer.close(wait=wait)


def full_params(stage: Stage, tp: Any) -> dict[str, torch.Tensor]:
    """A stage's parameters at full size by canonical name (TP shards gathered).

    Collective over the stage's TP group: every TP rank of the stage must call it.
    """
    out = {}
    for name, p in stage.named_parameters():
        dim = stage.shard_dim(name)
        t = p.detach()
        if dim is not None and tp is not None and tp.size > 1:
            t = torch.cat(tp.all_gather(t), dim=dim)
        out[name] = t.clone()
    return out


def role_seed(seed: int, dp: int, pp: int) -> int:
    """The RNG seed of replica `dp`'s stage `pp` at step 0 of a job seeded `seed`."""
    return int.from_bytes(hashlib.sha256(f"stalwart-rng/{seed}/{dp}/{pp}".encode())
                          .digest()[:8], "little") >> 1


def check_layout(num_layers: int, layout: Layout, *, global_batch: int, microbatches: int = 1,
                 grad_accum: int = 1, bounds: Sequence[Sequence[int]] | None = None
                 ) -> list[tuple[int, int]]:
    """The stage bounds of `layout` over `num_layers` blocks, or ValueError saying in one
    line what does not fit and a value that would (the launcher asks before any rank
    starts; every rank asks again)."""
    if microbatches < 1 or grad_accum < 1:
        raise ValueError(f"microbatches={microbatches}, grad_accum={grad_accum}: each must be "
                         "at least 1")
    if layout.pp > num_layers:
        raise ValueError(f"pp={layout.pp}: the model has {num_layers} blocks, so at most "
                         f"pp={num_layers} stages")
    if global_batch % (layout.microbatch_total or layout.dp * grad_accum * microbatches):
        dps = [d for d in range(layout.dp, 0, -1)
               if global_batch % (d * grad_accum * microbatches) == 0]
        ms = [m for m in range(microbatches, 0, -1)
              if global_batch % (layout.dp * grad_accum * m) == 0]
        options = [f"{k}={v[0]}" for k, v in (("dp", dps), ("microbatches", ms)) if v]
        hint = f" ({' or '.join(options)} would)" if options else ""
        raise ValueError(f"global batch {global_batch} does not split into dp={layout.dp} x "
                         f"grad_accum={grad_accum} x microbatches={microbatches}; choose "
                         f"degrees whose product divides it{hint}")
    chosen = [tuple(b) for b in bounds] if bounds else uniform_bounds(num_layers, layout.pp)
    if len(chosen) != layout.pp:
        raise ValueError(f"{len(chosen)} stage bounds for pp={layout.pp}; give one per stage, "
                         f"e.g. {_bounds_text(uniform_bounds(num_layers, layout.pp))}")
    flat = [i for first, last in chosen for i in range(first, last + 1)]
    if (any(len(b) != 2 for b in chosen) or flat != list(range(num_layers))
            or any(f > la for f, la in chosen)):
        raise ValueError(f"stage bounds {_bounds_text(chosen)} must cover blocks 0.."
                         f"{num_layers - 1} in order, each stage a non-empty contiguous range, "
                         f"e.g. {_bounds_text(uniform_bounds(num_layers, layout.pp))}")
    return [(int(a), int(b)) for a, b in chosen]


def _bounds_text(bounds: Sequence[Sequence[int]]) -> str:
    return ",".join("-".join(str(x) for x in b) for b in bounds)


def resolve_precision(precision: str, device: str | torch.device) -> tuple[str, str]:
    """(the precision a rank trains in, a warning or "") for the asked `precision`."""
    kind = torch.device(device).type
    if precision == "auto":
        if kind == "cuda":
            # Native bf16 only (Ampere and later): emulated bf16 is slower than fp16.
            chosen = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) \
                else "fp16"
        else:
            chosen = "bf16"
        return chosen, f"precision auto: {chosen} on {kind}"
    if precision == "fp16" and kind == "cpu":
        return precision, ("precision fp16 on CPU: emulated, several times slower than fp32 "
                           "or bf16; fp16 pays off on GPUs")
    return precision, ""


def uniform_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous inclusive (first, last) block ranges of near-equal length."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} blocks into {stages} non-empty stages")
    base, extra = divmod(num_layers, stages)
    bounds, first = [], 0
    for s in range(stages):
        last = first + base + (1 if s < extra else 0) - 1
        bounds.append((first, last))
        first = last + 1
    return bounds
