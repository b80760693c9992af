"""The elastic agent: one rank's life across generations.

register -> wait for a role -> build groups -> (restore) -> train and capture
every step -> on a failure or a new plan: drop the groups, take the new role,
restore the last committed step, continue. Survivors never restart their
process; a spare waits, registered, until a plan gives it a role.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from stalwart.client.capture import Capturer
from stalwart.client.daemon_client import DaemonClient, DaemonUnavailable
from stalwart.client.data import load_corpus
from stalwart.client.link_bytes import LinkBytes
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.relayout import OldLayout, Role, fetch_and_assemble
from stalwart.client.state_layout import unpack
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.client.trainer_state import adamw_hints, load_state, state_tensors
from stalwart.core.costs import GPTShape, gpt_profile
from stalwart.core.shrink import ElasticConfig
from stalwart.v1 import common_pb2, rank_pb2

log = logging.getLogger("stalwart.client.agent")


class JobStopped(RuntimeError):
    """The coordinator found no viable plan; training stops at the last committed step."""


class _PlanChanged(Exception):
    pass


@dataclass(kw_only=True)
class AgentConfig:
    train: TrainConfig
    """Model, batch, optimizer: fixed for the job whatever its layout."""
    layout: common_pb2.ParallelLayout
    """The layout this job starts with (the coordinator's first plan)."""
    steps: int
    """Optimizer steps to train in total."""
    spare: bool = False
    """Register without a role and wait for one."""
    collective_timeout_s: float = 10.0
    """Deadline of every collective; a longer wait counts as a hang (seconds)."""
    plan_timeout_s: float = 120.0
    """Longest wait for a new plan after a failure (seconds)."""
    device: str = "cpu"
    backend: str = "gloo"


@dataclass
class AgentResult:
    rank_id: str = ""
    losses: dict[int, float] = field(default_factory=dict)  # step -> global loss
    generations: list[dict[str, Any]] = field(default_factory=list)
    param_hashes: dict[str, str] = field(default_factory=dict)
    coord: dict[str, int] = field(default_factory=dict)
    stalls_s: list[float] = field(default_factory=list)
    stopped: str = ""


class GrpcCaptureTransport:
    """The capturer's view of the daemon: OpenSlot and Capture over the Unix socket."""

    def __init__(self, daemon: DaemonClient, coord: common_pb2.RankCoord,
                 layout: common_pb2.ParallelLayout, generation: int) -> None:
        self.daemon, self.coord, self.layout, self.generation = daemon, coord, layout, generation

    def open_slots(self, nbytes: int) -> list[tuple[str, str]]:
        reply = self.daemon.call("open_slot", "OpenSlot", rank_pb2.OpenSlotRequest(
            rank_id=self.daemon.rank_id, nbytes=nbytes))
        return [(sid, reply.fd_socket) for sid in (reply.slot_ids or [reply.slot_id])]

    def send_capture(self, step: int, slot_id: str, metas: list[common_pb2.TensorMeta],
                     extra: bytes, hints: Sequence[Any] = (), stall_s: float = 0.0) -> None:
        self.daemon.call("capture", "Capture", rank_pb2.CaptureRequest(
            rank_id=self.daemon.rank_id, generation=self.generation, step=step,
            slot_id=slot_id, tensors=metas, extra=extra, coord=self.coord, layout=self.layout,
            adamw=hints, stall_s=stall_s), timeout=120)


class ElasticAgent:
    """Runs one rank of the job until `steps` are trained or the job stops."""

    def __init__(self, cfg: AgentConfig, daemon: DaemonClient, store: Any,
                 on_step: Callable[[int, float], None] | None = None) -> None:
        self.cfg, self.daemon, self.store = cfg, daemon, store
        self.on_step = on_step
        self.result = AgentResult()
        self.links = LinkBytes()  # what each step sent, by link; heartbeats carry it
        self._plans: queue.Queue[common_pb2.Plan] = queue.Queue()
        self._corpus: bytes | None = None  # loaded once, reused by every generation
        self._newest = 0

    # plans ----------------------------------------------------------------------

    def _watch(self) -> None:
        """Background: every plan the daemon announces goes into the queue."""
        while True:
            try:
                for event in self.daemon.watch_plan(known_generation=self._newest):
                    self._newest = max(self._newest, event.plan.generation)
                    # Heartbeats speak for the newest generation at once; collectives and
                    # captures keep the one they run in until the rank rebuilds.
                    self.daemon.generation = max(self.daemon.generation, self._newest)
                    self._plans.put(event.plan)
            except Exception as exc:  # the channel closes when the rank ends
                log.debug("plan watch ended: %s", exc)
                return

    def _next_plan(self, after: int) -> common_pb2.Plan:
        deadline = time.monotonic() + self.cfg.plan_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no plan newer than generation {after} within "
                                   f"{self.cfg.plan_timeout_s:g} s; is the coordinator up?")
            try:
                plan = self._plans.get(timeout=left)
            except queue.Empty:
                continue
            if plan.generation > after:
                return plan

    def _role(self, plan: common_pb2.Plan) -> common_pb2.RankAssignment | None:
        return next((a for a in plan.assignments
                     if a.rank_id == self.daemon.rank_id and not a.spare), None)

    def _newer_plan_waiting(self, generation: int) -> bool:
        return self._newest > generation

    # the loop -------------------------------------------------------------------

    def run(self) -> AgentResult:
        reply = self.daemon.register(spare=self.cfg.spare, device=self.cfg.device,
                                     layout=self.cfg.layout, profile=layer_profile(self.cfg))
        self.result.rank_id = reply.rank_id
        self.daemon.start_heartbeats()
        threading.Thread(target=self._watch, name="stalwart-plan-watch", daemon=True).start()
        # Work every generation needs, done before any failure: a spare then takes over
        # in a fraction of a second. The first optimizer pulls in torch._dynamo (~1.5 s).
        import torch._dynamo  # noqa: F401

        self._corpus = load_corpus(self.cfg.train.corpus_bytes)
        plan = self._next_plan(after=0)
        while True:
            if plan.stop:
                self.result.stopped = plan.stop_message
                raise JobStopped(plan.stop_message)
            role = self._role(plan)
            if role is None:  # a spare, or a rank the plan left out
                plan = self._next_plan(after=plan.generation)
                continue
            try:
                self._train(plan, role)
                return self.result
            except _PlanChanged:
                pass
            except Exception as exc:
                if not _is_group_failure(exc):
                    raise  # a bug, not a failure of the job: end loudly (a spare takes over)
                self._report_collective_error(plan, exc)
            plan = self._next_plan(after=plan.generation)

    def _report_collective_error(self, plan: common_pb2.Plan, exc: BaseException) -> None:
        text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        log.warning("generation %d broke: %s", plan.generation, text)
        if self._newer_plan_waiting(plan.generation):
            return  # the coordinator already moved on; this was a consequence
        if "timed out" in text.lower() or "timeout" in text.lower():
            try:
                self.daemon.report_failure(common_pb2.FailureEvent.COLLECTIVE_HANG,
                                           self.daemon.rank_id, text,
                                           generation=plan.generation)
            except Exception as report_error:
                log.warning("could not report the hang: %s", report_error)

    def _train(self, plan: common_pb2.Plan, role: common_pb2.RankAssignment) -> None:
        lay, cfg = plan.layout, self.cfg
        received_unix = time.time()
        t_rebuild = time.monotonic()
        self.daemon.generation = plan.generation
        node_of = {a.coord.rank: a.node for a in plan.assignments if not a.spare}
        dims = ParallelDims(dp=lay.dp, pp=lay.pp, tp=lay.tp).build(
            self.store, role.coord.rank, plan.generation, backend=cfg.backend,
            timeout_s=cfg.collective_timeout_s, node_of=node_of, links=self.links)
        trainer = capturer = None
        abandoned = False
        try:
            if self._corpus is None:
                self._corpus = load_corpus(cfg.train.corpus_bytes)
            trainer = Trainer(dims, cfg.train, corpus=self._corpus,
                              stage_bounds=[(s.first_layer, s.last_layer) for s in lay.stages]
                              or None, schedule=lay.schedule or "1f1b",
                              microbatches=lay.microbatches or 1,
                              grad_accum=lay.grad_accum or 1, device=cfg.device)
            rebuild_s = time.monotonic() - t_rebuild
            t_restore = time.monotonic()
            if plan.resume_step > 0:
                self._restore(trainer, plan.resume_step, role.coord)
            restore_s = time.monotonic() - t_restore
            if plan.generation > 1:
                self.daemon.report_phases({"rebuild": rebuild_s, "restore": restore_s})
            self.result.coord = {"rank": role.coord.rank, "dp": role.coord.dp,
                                 "pp": role.coord.pp, "tp": role.coord.tp}
            record = {"generation": plan.generation, "resume_step": plan.resume_step,
                      "rebuild_s": round(rebuild_s, 4), "restore_s": round(restore_s, 4),
                      "first_step_s": None, "reason": plan.reason,
                      "plan_received_unix": received_unix, "first_step_unix": None}
            self.result.generations.append(record)
            capturer = Capturer(GrpcCaptureTransport(self.daemon, role.coord, lay,
                                                     plan.generation), token=self.daemon.token)
            def wait_for_copy(*_: Any) -> None:
                capturer.before_update()  # the optimizer is about to overwrite what is copied

            hook = trainer.optimizer.register_step_pre_hook(wait_for_copy)
            t_gen = time.monotonic()
            while trainer.step_count < cfg.steps:
                if self._newer_plan_waiting(plan.generation):
                    raise _PlanChanged()
                t0 = time.perf_counter()
                try:
                    loss = self._step_or_abandon(trainer, plan.generation)
                except _PlanChanged:
                    abandoned = True
                    raise
                step = trainer.step_count
                if record["first_step_s"] is None:
                    record["first_step_s"] = round(time.monotonic() - t_gen, 4)
                    record["first_step_unix"] = time.time()
                self.result.losses[step] = loss
                tensors, extra = state_tensors(trainer)
                capturer.capture(step, tensors, extra, adamw_hints(trainer))
                self.daemon.report_step(step, time.perf_counter() - t0)
                self.daemon.add_link_bytes(self.links.drain())
                if self.on_step is not None:
                    self.on_step(step, loss)
            capturer.drain()
            hook.remove()
            self._wait_committed(cfg.steps)
            self.result.param_hashes = trainer.param_hashes()
            self.result.stalls_s = capturer.stats.stalls_s
        finally:
            if abandoned:
                # A step of this generation is stuck in a collective with a dead or hung
                # peer; gloo cannot abort it and destroying its groups would block until
                # their timeout. Leave them to that timeout; the next generation uses new
                # groups under a new store prefix.
                log.warning("abandoning generation %d with a step still in flight",
                            plan.generation)
            else:
                if capturer is not None:
                    try:
                        capturer.close()
                    except Exception as exc:  # the old generation's captures may be refused
                        log.debug("capturer closed with: %s", exc)
                if trainer is not None:
                    trainer.close()
                dims.destroy()

    def _wait_committed(self, step: int, timeout_s: float = 120.0) -> None:
        """The last step is durable before this rank reports success."""
        reply = self.daemon.call("wait_committed", "WaitCommitted", rank_pb2.WaitCommittedRequest(
            step=step, timeout_s=timeout_s), timeout=timeout_s + 5)
        if not reply.committed:
            raise RuntimeError(f"final step {step} was not committed: {reply.message}")

    def _step_or_abandon(self, trainer: Trainer, generation: int) -> float:
        """One training step on a helper thread; gives up on it when a newer plan arrives."""
        done: Future[float] = Future()

        def body() -> None:
            try:
                done.set_result(trainer.step())
            except BaseException as exc:  # noqa: B036 - handed to the waiting thread
                done.set_exception(exc)

        threading.Thread(target=body, name=f"stalwart-step-g{generation}", daemon=True).start()
        while True:
            try:
                return done.result(timeout=0.05)
            except FutureTimeout:
                if self._newer_plan_waiting(generation):
                    raise _PlanChanged() from None

    def _restore(self, trainer: Trainer, step: int, coord: common_pb2.RankCoord) -> None:
        """Load this role's state at committed `step` from the daemon.

        Same layout: the state the same rank captured. Another layout (after a shrink or
        a grow): the layers and TP shards of the new role, assembled from the old ranks
        that hold them.
        """
        first = coord.rank
        try:
            record, data = self.daemon.restore(step, first)
        except DaemonUnavailable:
            if first == 0:
                raise
            first = 0  # a grown plan has more ranks than the step had
            record, data = self.daemon.restore(step, first)
        metas = list(record.tensors)
        tensors = unpack(data, metas)
        extra = json.loads(record.extra.decode())
        old = extra.get("layout", {})
        same = (first == coord.rank and
                (old.get("dp"), old.get("pp"), old.get("tp")) == (
                    trainer.dims.dp, trainer.dims.pp, trainer.dims.tp)
                and [tuple(b) for b in old.get("stage_bounds", [])] == list(trainer.bounds))
        if not same:
            lo, hi = trainer.bounds[coord.pp]
            role = Role(lo, hi, tp=coord.tp, tp_size=trainer.dims.tp, dp=coord.dp)
            t0 = time.monotonic()
            tensors, extra = fetch_and_assemble(self.daemon, step, OldLayout.from_extra(extra),
                                                role, local={first: (metas, tensors, extra)})
            log.warning("relayout restore: layers %d-%d from the step's %sx%sx%s layout in "
                        "%.2f s", lo, hi, old.get("dp"), old.get("pp"), old.get("tp"),
                        time.monotonic() - t0)
        load_state(trainer, tensors, extra)
        if trainer.step_count != step:
            raise RuntimeError(f"restored state is of step {trainer.step_count}, not {step}")



def layer_profile(cfg: AgentConfig) -> common_pb2.LayerProfile:
    """Per-layer cost, memory and state bytes of the model, for the elastic planner."""
    m, lay = cfg.train.model, cfg.layout
    per_round = max(1, lay.dp) * max(1, lay.microbatches) * max(1, lay.grad_accum)
    shape = GPTShape(vocab=m.vocab, d_model=m.d_model, n_layers=m.n_layer, n_heads=m.n_head,
                     seq=m.seq_len, micro_batch=max(1, cfg.train.global_batch // per_round),
                     d_ff=m.d_ff)
    elastic = ElasticConfig.from_profile(gpt_profile(shape), tp=max(1, lay.tp))
    return common_pb2.LayerProfile(costs=elastic.costs, mem_bytes=elastic.mem or (),
                                   act_bytes=elastic.act or (),
                                   state_bytes=elastic.layer_bytes or ())


_GROUP_FAILURE_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out",
                        "timeout", "gloo", "nccl", "peer", "socket")


def _is_group_failure(exc: BaseException) -> bool:
    """A collective broke because another rank died or hung (or the plan moved on)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    if isinstance(exc, DaemonUnavailable) and "generation" in str(exc):
        return True  # a capture of the old generation refused after a re-plan
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _GROUP_FAILURE_HINTS)
