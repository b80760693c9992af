"""Entry shape 1: the user's own loop, model, optimizer and data, protected.

`run(train, model=..., optimizer=..., ...)` registers the process with its node's
daemon and calls `train(ctx)` once per generation, in the same process: after a
failure the groups are rebuilt, every registered object is restored at the last
committed step, and `train` is entered again with `ctx.steps()` starting there.

The gradients are averaged over the generation's data-parallel group when the step's
`ctx.batches()` ends, after the last micro-batch's backward, where DDP would have
averaged them (overlapped with that backward: client/grad_average.py): code between
it and `optimizer.step()` (clipping by the global norm, GradScaler's inf check) sees
the job's gradients, the same on every replica. The commit point is
`optimizer.step()`: its pre-hook waits for the previous snapshot copy (and averages
the gradients of a loop that reads its data without `ctx.batches`, and wraps a closure
given to the step so that each call's gradients and loss are averaged). The state after
the step (and whatever the loop body did after it, such as the scheduler step) is
captured when `ctx.steps()` moves to the next step.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import grpc
import torch
import torch.distributed as dist

from stalwart.client.daemon_client import DaemonUnavailable
from stalwart.client.digest import param_digest, tensor_sha256
from stalwart.client.generation import Generation
from stalwart.client.grad_average import GradAverage, consecutive_buckets
from stalwart.client.launched import (
    check_collective_timeout,
    check_device,
    launched_agent,
    run_rank,
)
from stalwart.client.user_data import Data
from stalwart.client.user_state import StateError, StateRegistry
from stalwart.core.layout import Layout
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.client.user_loop")

__all__ = ["Context", "Result", "run"]

T = TypeVar("T")


@dataclass
class Result:
    """What `run` returns on the rank that finished training."""

    steps: int = 0
    """Optimizer steps the job took in total."""
    losses: dict[int, float] = field(default_factory=dict)
    """Step (1-based) -> the job-wide mean of the losses passed to `ctx.report_loss`,
    for every step this process took."""
    generations: int = 0
    """Generations this process trained in (1 without a failure)."""
    param_digest: str = ""
    """`stalwart.param_digest` of the registered modules at the end."""


class Context:
    """One generation of the job as the training function sees it."""

    def __init__(self, gen: Generation, program: _UserLoopProgram, start: int) -> None:
        self._gen, self._program = gen, program
        self._step = start
        self._stepped = False
        self._averaged = False  # this step's gradients are averaged over the replicas
        self._finished: int | None = None
        self._looped = False  # ctx.steps() was entered
        self._micro = 0
        self._losses: list[float] = []

    @property
    def generation(self) -> int:
        """Generation number: 1 at the start, one more after each re-plan."""
        return self._gen.plan.generation

    @property
    def resumed_from(self) -> int:
        """Committed step this generation restored (0 at the start of the job)."""
        return self._gen.plan.resume_step

    @property
    def dp_rank(self) -> int:
        """This process's index among the data-parallel replicas of this generation."""
        return self._gen.role.coord.dp

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of this generation."""
        return self._gen.plan.layout.dp

    @property
    def accumulation(self) -> int:
        """Micro-batches per step on this replica (more after a shrink: the global batch
        stays the same; where the step's micro-batches do not divide among the replicas,
        some run one more than others)."""
        return self._layout.replica_microbatches(self.dp_rank)[1]

    @functools.cached_property
    def _layout(self) -> Layout:
        return Layout.from_proto(self._gen.plan.layout)

    @property
    def dp_group(self) -> Any:
        """The torch.distributed process group of this generation's replicas, for the
        loop's own collectives (rebuilt every generation: do not keep it); run them
        through `collective`."""
        return self._gen.dims.dp_group.pg

    def collective(self, fn: Callable[[], T]) -> T:
        """`fn()`, the loop's own collective on `dp_group`, under the job's collective
        deadline: a replica lost or hung in it starts the next generation, as in
        Stalwart's own collectives. Outside it, a failed collective ends this process."""
        self._program.grads.before_collective()
        return self._gen.dims.dp_group.run(fn, "collective of the training function")

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (the 0-based index of the step being taken)."""
        return self._step

    def steps(self, total: int) -> Iterator[int]:
        """Step indices from the resume point up to `total` (exclusive), the job's
        whole length: one loop per generation. Each iteration must call
        `optimizer.step()` once; the state after the iteration is captured."""
        if self._looped:
            # Its last step would have ended the job: the daemons complete a job when
            # the step that ctx.steps() names last commits.
            raise RuntimeError("ctx.steps() was called again: a job is one loop over "
                               "ctx.steps(total) with its total number of steps; choose "
                               "each phase (a warm-up, then the main run) by the step index "
                               "inside that loop")
        self._looped = True
        if total < self._step:
            raise ValueError(f"steps({total}) but the job already took {self._step} steps")
        gen = self._gen
        while self._step < total:
            gen.check_plan()
            t0 = time.perf_counter()
            self._stepped, self._averaged, self._micro, self._losses = False, False, 0, []
            yield self._step
            if not (self._stepped or self._averaged):
                raise RuntimeError(f"step {self._step} ended without optimizer.step(); "
                                   "call it once in every iteration of ctx.steps() (a step "
                                   "may skip it, as GradScaler does on an overflow, only "
                                   "after reading its micro-batches from ctx.batches)")
            self._program.reduce_losses(gen, self)
            self._step += 1
            self._program.capture(gen, self._step, final=self._step == total)
            gen.step_done(self._step, self._program.last_loss, time.perf_counter() - t0)
        self._finished = total

    def batches(self, data: Data) -> Iterator[Any]:
        """This replica's micro-batches of the current step's global batch (collated);
        backpropagate each one's mean loss: once the last one is through, Stalwart
        averages the gradients over micro-batches and replicas."""
        if not isinstance(data, Data):
            raise TypeError(
                f"ctx.batches takes a stalwart.Data, not {type(data).__name__}: wrap the "
                "map-style dataset (stalwart.Data(dataset, global_batch=G)) so the job "
                "deals each step's samples to the replicas; to read your own loader, "
                "iterate it directly and register it as state={'loader': loader}")
        shares = data.shares(self._step, self._layout, self.dp_rank)
        for k, indices in enumerate(shares):
            self._micro += 1
            if k == len(shares) - 1:
                self._program.grads.arm()  # its backward starts the average
            yield data.batch(indices)
        self._program.average_gradients(self._gen, self)

    def report_loss(self, loss: torch.Tensor | float) -> None:
        """Count `loss` (a micro-batch's mean) into the step's job-wide mean loss."""
        self._losses.append(float(loss.detach().item() if torch.is_tensor(loss) else loss))


class _UserLoopProgram:
    """The agent program that runs the user's training function."""

    def __init__(self, train: Callable[[Context], None], registry: StateRegistry,
                 world: int, device: torch.device) -> None:
        self.fn, self.registry, self.world, self.device = train, registry, world, device
        self.optimizers = [opt for _, opt in registry.optimizers()]
        # Every parameter, frozen ones too: a loop may unfreeze one later (fine-tuning
        # a backbone after its head), and its gradient is averaged from then on.
        self.params = list({id(p): p for _, m in registry.modules()
                            for p in m.parameters()}.values())
        # Parameters whose gradients are sparse (nn.Embedding(sparse=True)) on every
        # replica that computes one.
        self.sparse = [m.weight for _, module in registry.modules() for m in module.modules()
                       if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse]
        # The most bytes broadcast (and gradient bytes, as fp32, averaged) in one call.
        self.bucket_bytes = int(float(os.environ.get("STALWART_GRAD_BUCKET_MB", "64")) * 2**20)
        self.grads = GradAverage(self.params, self.sparse, device,
                                 bucket_bytes=self.bucket_bytes,
                                 overlap=os.environ.get("STALWART_GRAD_OVERLAP", "1") != "0")
        # The state the script built, kept as a host copy until a step after it commits:
        # a generation that resumes from step 0 (a failure before the first commit)
        # starts from it again, on survivors that have trained since too.
        self._initial: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        self._past_initial = False
        self.ctx: Context | None = None
        self.capturer: Any = None
        self.last_loss: float | None = None
        self._divisor: int | None = None  # of the last gradient average
        self.finished: Context | None = None

    def start_layout(self) -> common_pb2.ParallelLayout:
        return common_pb2.ParallelLayout(dp=self.world, pp=1, tp=1, microbatches=1,
                                         grad_accum=1, schedule="1f1b",
                                         stages=[common_pb2.StageBounds(first_layer=0,
                                                                        last_layer=0)])

    def profile(self) -> common_pb2.LayerProfile:
        # A trained parameter, and (as for Adam) two moments; a frozen one alone.
        nbytes = sum(p.numel() * p.element_size() * (3.0 if p.requires_grad else 1.0)
                     for p in self.params)
        return common_pb2.LayerProfile(costs=[1.0], state_bytes=[nbytes])

    def warm_up(self) -> None:
        pass

    def restore_request(self, plan: common_pb2.Plan, role: common_pb2.RankAssignment
                        ) -> tuple[int, tuple[int, int] | None]:
        """This replica's own record, as `_restore` asks first."""
        return role.coord.rank, None

    # one generation --------------------------------------------------------------

    def train(self, gen: Generation) -> None:
        t_restore = time.monotonic()
        start = self._restore(gen) if gen.plan.resume_step > 0 else self._start_over(gen)
        rebuild_s = t_restore - gen.record["t_build"]
        gen.report_rebuilt(rebuild_s, time.monotonic() - t_restore)
        for p in self.params:
            p.grad = None  # an abandoned step may have left partial gradients behind
        self.grads.start(gen.dims.dp_group)
        ctx = self.ctx = Context(gen, self, start)
        self.capturer = gen.capturer()
        if start > 0:  # the restored state is whole: its slots can open meanwhile
            self.capturer.open_ahead(self.registry.capture(start)[0])
        hooks = [h for opt in self.optimizers for h in (
            opt.register_step_pre_hook(
                lambda _, args, kwargs: self._before_update(gen, ctx, args, kwargs)),
            opt.register_step_post_hook(lambda *_: self._after_update(ctx)))]
        try:
            self.fn(ctx)
            if ctx._finished is None:
                raise RuntimeError("the training function returned before ctx.steps() ran to "
                                   "its end; loop over ctx.steps(total) to the last step")
            self.capturer.drain()
            gen.wait_committed(ctx._finished)
            self.finished = ctx
        finally:
            for h in hooks:
                h.remove()
            gen.close_capturer(self.capturer)

    def _start_over(self, gen: Generation) -> int:
        """Step 0: the replicas take one replica's modules, and the state is recorded the
        first time; after a failure before any step committed, it is put back."""
        held = self._initial is not None
        if held:
            self.registry.load(*self._initial)
        elif self._past_initial:
            raise RuntimeError("a plan resumes from step 0 after a later step committed")
        self._share_modules(gen, held)
        if not held:
            tensors, extra = self.registry.capture(0)
            self._initial = ({t.name: t.tensor.detach().to("cpu", copy=True) for t in tensors},
                             json.loads(json.dumps(extra)))
        return 0

    def _share_modules(self, gen: Generation, held: bool) -> None:
        """Give every replica the registered modules' parameters and buffers of one
        replica, bit for bit, as DDP's constructor broadcasts rank 0's: a script that
        seeds by rank, or loads weights on rank 0 alone, starts its replicas alike. The
        source is the first replica that `held` the job's starting state (replica 0 at
        the job's start; after a failure before the first commit, a survivor, so that a
        spare takes the lost replica's start). Optimizer state and generators are each
        replica's own, as under DDP."""
        group = gen.dims.dp_group
        if group.size == 1:
            return
        tensors = list({id(t): t for _, m in self.registry.modules()
                        for t in (*m.parameters(), *m.buffers())}.values())
        sizes = [t.numel() * t.element_size() for t in tensors]
        # One MIN gives the source and the smallest and largest shape of the modules:
        # replicas that built different models are told so, not left to a broadcast of
        # mismatched sizes.
        shape = [len(tensors), sum(sizes)]
        agreed = torch.tensor([group.index if held else group.size, *shape,
                               *(-v for v in shape)], device=self.device)
        gen.run_or_abandon(lambda: group.all_reduce(agreed, dist.ReduceOp.MIN),
                           "start-source")
        source, fewest, least, most_neg, largest_neg = agreed.tolist()
        if (fewest, least) != (-most_neg, -largest_neg):
            raise StateError(
                f"the replicas registered different models: {fewest} to {-most_neg} "
                f"parameters and buffers, {least} to {-largest_neg} bytes; every replica "
                "must build the same modules (seeding by rank changes values, not shapes)")
        root = source % group.size
        for bucket in consecutive_buckets(sizes, self.bucket_bytes):
            members = [tensors[b] for b in bucket]
            if group.index == root:
                flat = torch.cat([t.detach().reshape(-1).view(torch.uint8).to(self.device)
                                  for t in members])
            else:
                flat = torch.empty(sum(sizes[b] for b in bucket), dtype=torch.uint8,
                                   device=self.device)
            gen.run_or_abandon(lambda flat=flat: group.broadcast(flat, root), "start-broadcast")
            if group.index != root:
                with torch.no_grad():
                    for t, piece in zip(members, flat.split([sizes[b] for b in bucket]),
                                        strict=True):
                        # A fresh piece is aligned for any dtype.
                        t.copy_(piece.clone().view(t.dtype).view(t.shape))

    def _restore(self, gen: Generation) -> int:
        step, coord = gen.plan.resume_step, gen.role.coord
        # Replicas hold the same model and optimizer state; take this replica's own
        # record (its RNG, its loader state) where the step has one, else replica 0's.
        try:
            _, tensors, extra = gen.restore_rank(step, coord.rank)
        except DaemonUnavailable as exc:
            # Only a step without this replica (after a grow) is read as replica 0's; any
            # other failure is raised, never read around with another replica's RNG and
            # data position.
            if coord.rank == 0 or exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            _, tensors, extra = gen.restore_rank(step, 0)
        restored = self.registry.load(tensors, extra)
        if restored != step:
            raise RuntimeError(f"restored state is of step {restored}, not {step}")
        return step

    def _before_update(self, gen: Generation, ctx: Context, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Before optimizer.step(): the last copy is done, and the gradients are averaged
        unless ctx.batches did it and no backward ran since. Every replica runs the same
        backward passes (as under DDP), so they agree on whether to average. A closure
        given to the step (LBFGS's) is replaced by one that averages what it returns."""
        self.capturer.before_update()
        if not ctx._averaged or self.grads.pending:
            self.average_gradients(gen, ctx)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if not callable(closure):
            return None

        # Fixed for the step's every call: over the micro-batches the step read ahead
        # from ctx.batches (their backward runs in the closure), else over the replicas.
        divisor = ctx._layout.total_microbatches if ctx._micro else ctx.dp_size

        def averaged() -> Any:
            return self._averaged_closure(gen, ctx, closure, divisor)

        if len(args) > 1:
            return (args[0], averaged, *args[2:]), kwargs
        return args, {**kwargs, "closure": averaged}

    def _averaged_closure(self, gen: Generation, ctx: Context, closure: Callable[[], Any],
                          divisor: int) -> Any:
        """Run the step's closure, then average the gradients its backward accumulated and
        the loss it returned, each as the step's gradients are averaged: an optimizer that
        calls it (LBFGS, several times a step, deciding by the loss when to stop) sees the
        job's gradients and loss, the same on every replica, so replicas take the same
        steps and the same number of evaluations."""
        self._divisor = None
        loss = closure()  # a closure that reads ctx.batches averages there
        if self.grads.pending:
            self.average_gradients(gen, ctx, divisor)
        if loss is None:
            return None
        value = (loss.detach() if torch.is_tensor(loss)
                 else torch.tensor(float(loss), dtype=torch.float64))
        # A copy: the all-reduce must not write into the closure's own loss tensor.
        total = value.to(dtype=torch.float64, device=self._loss_device(), copy=True).reshape(1)
        gen.run_or_abandon(lambda: gen.dims.dp_group.all_reduce(total), "closure-loss")
        mean = total / (self._divisor or divisor)
        if torch.is_tensor(loss):
            return mean.reshape(loss.shape).to(dtype=loss.dtype, device=loss.device)
        return float(mean)

    def average_gradients(self, gen: Generation, ctx: Context,
                          divisor: int | None = None) -> None:
        """Average the gradients accumulated since the last average over the replicas
        and the micro-batches of ctx.batches read meanwhile (or over `divisor`)."""
        ctx._averaged = True
        # Over the step's micro-batches on every replica (their shares may differ by
        # one), or over the replicas where the loop read no micro-batches from ctx.batches.
        if divisor is None:
            divisor = ctx._layout.total_microbatches if ctx._micro else ctx.dp_size
        self._divisor = divisor
        if self.grads.pending:
            ctx._micro = 0
        # else the loop read its micro-batches ahead (a list) and runs their backward
        # after: the count stays, for the average at the step to divide by them.
        self.grads.average(gen.run_or_abandon, divisor)

    def _loss_device(self) -> torch.device:
        return self.params[0].device if self.params else self.device

    def reduce_losses(self, gen: Generation, ctx: Context) -> None:
        """The step's job-wide mean of the reported losses, at the step's end (a loop may
        report a loss after its micro-batches)."""
        losses = torch.tensor([sum(ctx._losses), len(ctx._losses)], dtype=torch.float64,
                              device=self._loss_device())  # NCCL reduces CUDA tensors only
        gen.run_or_abandon(lambda: gen.dims.dp_group.all_reduce(losses), "loss-reduce")
        self.last_loss = float(losses[0] / losses[1]) if losses[1] > 0 else None

    def _after_update(self, ctx: Context) -> None:
        ctx._stepped = True

    def capture(self, gen: Generation, step: int, final: bool = False) -> None:
        tensors, extra = self.registry.capture(step)
        coord = gen.role.coord
        extra["layout"] = {"dp": gen.plan.layout.dp, "pp": 1, "tp": 1,
                           "coords": {"dp": coord.dp, "pp": 0, "tp": 0}}
        self.capturer.capture(step, tensors, extra, self.registry.adamw_hints(), final=final)
        if self._initial is not None and step > 1 and gen.committed(1):
            self._initial, self._past_initial = None, True


def run(train: Callable[[Context], None], *, model: torch.nn.Module,
        optimizer: torch.optim.Optimizer, scheduler: Any = None, data: Data | None = None,
        state: Mapping[str, Any] | None = None, device: str | torch.device = "cpu",
        collective_timeout_s: float = 10.0) -> Result | None:
    """Train with `train(ctx)` under Stalwart's protection; see docs/api.md.

    Registers `model`, `optimizer`, `scheduler`, `data` and every object of `state`
    (each with state_dict/load_state_dict) and snapshots them every step. Launched by a
    Stalwart launcher (the environment names the daemon, the rank and the job's store).
    Returns the Result on a rank that finished, None on a spare that never got a role;
    raises JobStopped when the job stopped at its last committed step.
    """
    if not (isinstance(optimizer, torch.optim.Optimizer)
            and hasattr(optimizer, "_optimizer_step_pre_hooks")):
        # Its step() is the commit point: Stalwart hooks it to average the gradients and
        # to finish the previous capture's copy before the parameters change.
        raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a "
                        "torch.optim.Optimizer that called Optimizer.__init__: Stalwart hooks "
                        "the optimizer's step(); make a wrapper such an optimizer (as torch's "
                        "own and most libraries' optimizers are), or pass the optimizer it "
                        "wraps")
    objects: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if scheduler is not None:
        objects["scheduler"] = scheduler
    if data is not None:
        objects["data"] = data
    for key, obj in (state or {}).items():
        if key in objects:
            raise StateError(f"state name {key!r} is taken by run()'s own argument")
        objects[key] = obj
    registry = StateRegistry(objects)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if data is not None and data.global_batch % world:
        # Here, on every rank alike, not as ranks that die after the first plan.
        raise ValueError(f"global batch {data.global_batch} does not split over the job's "
                         f"{world} replicas; choose a global batch that divides by {world}")
    check_device(str(device), "stalwart.run()")
    check_collective_timeout(collective_timeout_s, "stalwart.run()")
    dev = torch.device(device)
    elsewhere = sorted({str(p.device) for _, m in registry.modules() for p in m.parameters()
                        if p.device.type != dev.type})
    if elsewhere:
        # NCCL (device="cuda") reduces CUDA tensors only; gloo would move every gradient
        # through host memory.
        raise ValueError(f"the registered model has parameters on {', '.join(elsewhere)} "
                         f"but run(device={str(dev)!r}); move the model to that device "
                         "before run() (model.to(device)), or name its device")
    program = _UserLoopProgram(train, registry, world, dev)
    agent, daemon = launched_agent(program, device=str(dev),
                                   collective_timeout_s=collective_timeout_s,
                                   who="stalwart.run()")

    def result() -> Result | None:
        done = program.finished
        if done is None:
            return None
        return Result(steps=done._finished or 0, losses=dict(agent.result.losses),
                      generations=len(agent.result.generations),
                      param_digest=modules_digest(registry))
    return run_rank(agent, daemon, result, result_json)


def result_json(result: Result) -> dict[str, Any]:
    return {**asdict(result), "losses": {str(k): v for k, v in result.losses.items()}}


def modules_digest(registry: StateRegistry) -> str:
    hashes = {f"{key}/{name}": tensor_sha256(p) for key, m in registry.modules()
              for name, p in m.named_parameters()}
    return param_digest(hashes)
