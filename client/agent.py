"""The elastic agent: one rank's life across generations, whatever it trains.

register -> wait for a role -> build groups -> hand the generation to the program
(restore, train, capture every step) -> on a failure or a new plan: drop the groups,
take the new role, hand the next generation to the program. Survivors never restart
their process; a spare waits, registered, until a plan gives it a role.

A program is what the rank trains: Stalwart's 3D loop over a model's layers
(`client/trainer_program.py`) or the user's own loop (`client/user_loop.py`). What a
generation offers it (restore, capture, commit waits, leaving for a newer plan) is
`client/generation.py`.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from stalwart.client.daemon_client import DaemonClient, DaemonUnavailable
from stalwart.client.generation import Generation, PlanChanged, RestoreAhead
from stalwart.client.link_bytes import LinkBytes
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.watchdog import GroupFailure, Watchdog
from stalwart.core.failures import Failure
from stalwart.core.layout import Layout
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.client.agent")

# One attempt to reach a generation's store; between attempts a newer plan is looked for.
STORE_ATTEMPT_S = 1.0
# The longest `run` waits, before returning, for a broken generation's groups to finish
# shutting down on their thread (seconds; they take tens of milliseconds).
ENDING_WAIT_S = 30.0
# How long a spare that finds its job completed waits for the job's ranks, started with
# it, to resume the job (see ElasticAgent._relaunched_after).
RELAUNCH_SPARE_WAIT_S = 10.0


class JobStopped(RuntimeError):
    """The coordinator found no viable plan and no spare came while this rank waited
    (resume_wait_s); training stopped at the last committed step."""


@dataclass(kw_only=True)
class AgentConfig:
    spare: bool = False
    """Register without a role and wait for one."""
    collective_timeout_s: float = 10.0
    """Deadline of every collective; a longer wait counts as a hang (seconds)."""
    plan_timeout_s: float = 120.0
    """Longest wait for a new plan after a failure (seconds)."""
    resume_wait_s: float = 1800.0
    """How long a rank waits at a stop for the plan that resumes the job (seconds); 0
    leaves at once with JobStopped."""
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


class Program(Protocol):
    """What a rank trains, generation after generation."""

    def start_layout(self) -> common_pb2.ParallelLayout:
        """The layout the job starts with (the coordinator's first plan)."""

    def profile(self) -> common_pb2.LayerProfile:
        """Per-layer cost, memory and state bytes, for the elastic planner."""

    def warm_up(self) -> None:
        """Work every generation needs, done once before any failure."""

    def train(self, gen: Generation) -> None:
        """Run generation `gen` to the end of training; raise on a broken group."""

    def restore_request(self, plan: common_pb2.Plan, role: common_pb2.RankAssignment
                        ) -> tuple[int, tuple[int, int] | None]:
        """The old rank and layers this role restores first when `plan` resumes from a
        committed step (as its `train` asks `gen.restore_rank`): fetched while the
        generation's groups are built."""


class ElasticAgent:
    """Runs one rank of the job until its program has trained or the job stops."""

    def __init__(self, program: Program, cfg: AgentConfig, daemon: DaemonClient,
                 store: Any = None, on_step: Callable[[int, float], None] | None = None) -> None:
        # `store`: a fixed store for every generation (a launcher's); without one, each
        # generation starts from the store a rank of its plan serves (a survivor).
        self.program, self.cfg, self.daemon, self.store = program, cfg, daemon, store
        self._served: Any = None  # the store this rank serves, for plans that name it
        self.on_step = on_step
        self.result = AgentResult()
        self.links = LinkBytes()  # what each step sent, by link; heartbeats carry it
        self._plans: queue.Queue[common_pb2.Plan | None] = queue.Queue()
        self._newest = 0
        self._replaced = 0  # the newest generation of a plan that is not the completion
        # Notified whenever a plan arrives: calls left running while a newer plan may
        # come (`run_unless`) are given up on the moment it does.
        self.news = threading.Condition()
        self._ending: list[threading.Thread] = []  # broken generations' groups shutting down
        # An abandoned generation's capturer closing (Generation.close_capturer)
        self.closing_capturer: threading.Thread | None = None

    # plans ----------------------------------------------------------------------

    def _watch(self) -> None:
        """Background: every plan the daemon announces goes into the queue."""
        while True:
            try:
                for event in self.daemon.watch_plan(known_generation=self._newest):
                    self._newest = max(self._newest, event.plan.generation)
                    if not (event.plan.stop and event.plan.completed):
                        # The completion ends nothing still running: every rank committed
                        # its last step, and what they do after it (the job's digest)
                        # runs through their groups, which it must not abandon.
                        self._replaced = max(self._replaced, event.plan.generation)
                    # Heartbeats speak for the newest generation at once; collectives and
                    # captures keep the one they run in until the rank rebuilds.
                    self.daemon.generation = max(self.daemon.generation, self._newest)
                    self._plans.put(event.plan)
                    with self.news:
                        self.news.notify_all()
            except Exception as exc:  # the channel closes when the rank ends
                log.debug("plan watch ended: %s", exc)
                self._plans.put(None)  # a waiter learns its daemon is gone
                return

    def superseded(self, generation: int) -> bool:
        """Whether a plan newer than `generation` has been announced (other than the
        job's completion)."""
        return self._replaced > generation

    def _next_plan(self, after: int, timeout_s: float | None) -> common_pb2.Plan:
        """The first plan newer than generation `after`; waits `timeout_s` (None: as long
        as the daemon's plan stream lasts)."""
        wait = timeout_s
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no plan newer than generation {after} within "
                                   f"{wait:g} s; is the coordinator up?")
            try:
                plan = self._plans.get(timeout=left)
            except queue.Empty:
                continue
            if plan is None:
                self._plans.put(None)  # for the next waiter too
                raise RuntimeError("this rank's daemon stopped sending plans (it is gone "
                                   "or restarted); the job goes on without this rank")
            if plan.generation > after:
                return self._newest_queued(plan)

    def _newest_queued(self, plan: common_pb2.Plan) -> common_pb2.Plan:
        """`plan`, or a newer one already queued behind it: a rank that was held up (a
        frozen process, a slow restore) skips the generations that are already over
        instead of building their groups with peers that have moved on."""
        while True:
            try:
                later = self._plans.get_nowait()
            except queue.Empty:
                return plan
            if later is None:
                self._plans.put(None)
                return plan
            if later.generation > plan.generation:
                plan = later

    def _await_resume(self, stop: common_pb2.Plan) -> common_pb2.Plan:
        """The job stopped: wait up to resume_wait_s for the plan that resumes it (a
        spare registered, a host came back); JobStopped after that. A rank that arrives
        at a stopped job (it never trained in it) is what the stop waits for: like a
        spare, it waits for its place as long as its daemon lives."""
        arrived = not self.result.generations
        wait = self.cfg.resume_wait_s
        if arrived:
            log.warning("the job is stopped at committed step %d; this rank waits to be "
                        "placed when the plan that resumes it comes", stop.resume_step)
        elif wait > 0:
            log.warning("the job stopped at committed step %d; this rank waits up to %g s "
                        "for it to resume: %s", stop.resume_step, wait, stop.stop_message)
        deadline = time.monotonic() + wait
        plan = stop
        while plan.stop and not plan.completed:
            try:
                plan = self._next_plan(after=plan.generation, timeout_s=None if arrived
                                       else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.result.stopped = plan.stop_message
                waited = f" This rank waited {wait:g} s for that and left." if wait else ""
                raise JobStopped(plan.stop_message + waited) from None
        if not plan.stop:
            log.warning("the job resumes from step %d (generation %d)", plan.resume_step,
                        plan.generation)
        return plan

    def _relaunched_after(self, done: common_pb2.Plan) -> common_pb2.Plan:
        """This rank registered with daemons whose job had completed: it was started
        again with the job's other ranks (to train it longer, or to have its state back),
        and once all of them registered the coordinator places them in a plan that
        resumes from the last step. Waits up to plan_timeout_s for that plan (a spare,
        started with them, at most RELAUNCH_SPARE_WAIT_S: one that comes after a relaunch
        that had nothing to train is too late for it); `done` after that (this rank then
        returns without a role)."""
        wait = self.cfg.plan_timeout_s
        if self.cfg.spare:
            wait = min(wait, RELAUNCH_SPARE_WAIT_S)
        log.warning("the job completed before this rank registered (%s); waiting up to "
                    "%g s for the job's other ranks to register again and resume it",
                    done.stop_message, wait)
        try:
            return self._next_plan(after=done.generation, timeout_s=wait)
        except TimeoutError:
            log.warning("no plan resumed the completed job: this rank leaves without a role")
            return done

    def _role(self, plan: common_pb2.Plan) -> common_pb2.RankAssignment | None:
        return next((a for a in plan.assignments
                     if a.rank_id == self.daemon.rank_id and not a.spare), None)

    # the loop -------------------------------------------------------------------

    def run(self) -> AgentResult:
        try:
            return self._run()
        finally:
            for ending in self._ending:
                ending.join(ENDING_WAIT_S)

    def _run(self) -> AgentResult:
        import torch.distributed as dist

        self._served = dist.TCPStore("0.0.0.0", 0, None, True, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=self.cfg.plan_timeout_s))
        reply = self.daemon.register(spare=self.cfg.spare, device=self.cfg.device,
                                     layout=self.program.start_layout(),
                                     profile=self.program.profile(),
                                     store_port=self._served.port,
                                     # A rank in a network of its own (a pod) names its address.
                                     store_host=os.environ.get("STALWART_ADVERTISE_HOST", ""))
        self.result.rank_id = reply.rank_id
        self.daemon.start_heartbeats()
        threading.Thread(target=self._watch, name="stalwart-plan-watch", daemon=True).start()
        # Work every generation needs, done before any failure: a spare then takes over
        # in a fraction of a second. The first optimizer pulls in torch._dynamo (~1.5 s).
        import torch._dynamo  # noqa: F401

        self.program.warm_up()
        plan = self._next_plan(after=0, timeout_s=self.cfg.plan_timeout_s)
        if plan.stop and plan.completed:
            plan = self._relaunched_after(plan)
        while True:
            if plan.stop and plan.completed:
                return self.result  # the job trained its last step without this rank
            if plan.stop:
                plan = self._await_resume(plan)
                continue
            role = self._role(plan)
            if role is None:  # a spare, or a rank the plan left out: waits for a role
                plan = self._next_plan(after=plan.generation, timeout_s=None)
                continue
            try:
                self._generation(plan, role)
                return self.result
            except PlanChanged:
                pass
            except (GroupFailure, dist.DistError) as exc:
                # A peer died or hung (the watchdog reported a hang), or the store of the
                # generation is gone; anything else is a bug and ends the rank loudly (a
                # spare takes over).
                log.warning("generation %d broke: %s", plan.generation, exc)
            plan = self._next_plan(after=plan.generation, timeout_s=self.cfg.plan_timeout_s)

    def _store_of(self, plan: common_pb2.Plan) -> Any:
        """The store the generation's groups start from: the one a rank of the plan
        serves (this rank's own when the plan names it), else the launcher's.

        Each generation talks to it through a client of its own. A store client runs one
        request at a time, and a generation left while building its groups leaves a
        thread blocked in a wait on its client until that wait times out: sharing the
        client, the next generation's build would queue behind it."""
        if plan.store_rank_id == self.daemon.rank_id:
            return _store_client("127.0.0.1", self._served.port, self.cfg.plan_timeout_s)
        if plan.store:
            return self._connect(plan)
        if self.store is None:
            raise RuntimeError(f"plan {plan.generation} names no store and this rank has no "
                               "launcher store (MASTER_ADDR); is every daemon up to date?")
        return self.store

    def _connect(self, plan: common_pb2.Plan) -> Any:
        """A client of the store `plan` names, tried in short attempts: its host may have
        died with the plan, and then a newer plan comes that this rank must not miss
        while it waits out one long connect (PlanChanged)."""
        import torch.distributed as dist

        host, _, port = plan.store.rpartition(":")
        give_up = time.monotonic() + self.cfg.collective_timeout_s * 3
        while True:
            try:
                return _store_client(host.strip("[]"), int(port), STORE_ATTEMPT_S)
            except (dist.DistError, RuntimeError):
                if self.superseded(plan.generation):
                    raise PlanChanged() from None
                if time.monotonic() >= give_up:
                    raise

    def _restore_ahead(self, plan: common_pb2.Plan, role: common_pb2.RankAssignment
                       ) -> RestoreAhead | None:
        if plan.resume_step <= 0:
            return None
        try:
            rank, layers = self.program.restore_request(plan, role)
        except Exception as exc:  # only costs the head start: the program restores itself
            log.warning("no restore ahead for generation %d: %s", plan.generation, exc)
            return None
        return RestoreAhead(self.daemon, plan.resume_step, rank, layers)

    def _report_hang(self, failure: Failure) -> None:
        """The watchdog's hang, told to the daemon unless the job already moved on."""
        if self.superseded(failure.generation):
            return  # the coordinator already re-planned; the hang was a consequence
        try:
            self.daemon.report_failure(failure.kind.value, failure.subject, failure.evidence,
                                       generation=failure.generation)
        except DaemonUnavailable as exc:
            log.warning("could not report the hang: %s", exc)

    def _generation(self, plan: common_pb2.Plan, role: common_pb2.RankAssignment) -> None:
        if self.superseded(plan.generation):
            raise PlanChanged()  # superseded before its groups were built: skip it
        lay, cfg = plan.layout, self.cfg
        received_unix = time.time()
        self.daemon.generation = plan.generation
        node_of = {a.coord.rank: a.node for a in plan.assignments if not a.spare}
        t_build = time.monotonic()
        ahead = self._restore_ahead(plan, role)
        try:
            store = self._store_of(plan)
            watchdog = Watchdog(self._report_hang, deadline_s=cfg.collective_timeout_s,
                                subject=self.daemon.rank_id, generation=plan.generation)
            dims = ParallelDims(Layout.from_proto(lay)).build(
                store, role.coord.rank, plan.generation, backend=cfg.backend,
                timeout_s=cfg.collective_timeout_s, node_of=node_of, links=self.links,
                watchdog=watchdog, superseded=partial(self.superseded, plan.generation),
                news=self.news)
        except BaseException:
            if ahead is not None:  # a newer plan (or a broken build) ended it first
                ahead.cancel()
            raise
        self.result.coord = {"rank": role.coord.rank, "dp": role.coord.dp,
                             "pp": role.coord.pp, "tp": role.coord.tp}
        record = {"generation": plan.generation, "resume_step": plan.resume_step,
                  "layout": {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp,
                             "grad_accum": lay.grad_accum,
                             "microbatch_total": lay.microbatch_total},
                  "rebuild_s": None, "restore_s": None, "restored_ahead": False,
                  "first_step_s": None,
                  "reason": plan.reason, "plan_received_unix": received_unix,
                  "first_step_unix": None, "t_build": t_build}
        self.result.generations.append(record)
        gen = Generation(plan, role, dims, self, record, store, ahead=ahead)
        broke = True
        try:
            self.program.train(gen)
            broke = False
        finally:
            if gen.ahead is not None:  # the program never asked for it
                gen.ahead.cancel()
            record.pop("t_build", None)
            record.pop("t_trained_from", None)
            if gen.abandoned and cfg.backend == "nccl":
                # A step of this generation is stuck in a collective with a dead or hung
                # peer: NCCL aborts its communicators in-process.
                log.warning("aborting generation %d with a step still in flight",
                            plan.generation)
                dims.abort()
            elif gen.abandoned:
                # gloo cannot abort the stuck collective and destroying its groups would
                # block until their timeout. Leave them to that timeout; the next
                # generation uses new groups under a new store prefix.
                log.warning("abandoning generation %d with a step still in flight",
                            plan.generation)
            elif broke and cfg.backend == "gloo":
                # Shutting gloo groups down joins their threads (tens of ms): done beside
                # the next generation's build instead of before it.
                ending = threading.Thread(target=dims.destroy, daemon=True,
                                          name=f"stalwart-end-g{plan.generation}")
                ending.start()
                self._ending.append(ending)
            else:
                dims.destroy()


def _store_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of the TCPStore served at host:port (`timeout_s`: its connect and waits)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
