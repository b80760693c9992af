"""What one daemon knows about its ranks: registrations, heartbeats, failures and the plan.

Runs on the daemon's event loop thread, without locks. Time comes from an
injectable clock, so detection is tested in-process by moving the clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.core.failures import AFTER_RAISING, RAISED_CHARS, Failure, FailureKind
from stalwart.core.generation import StaleGeneration, check_generation
from stalwart.core.layout import Layout
from stalwart.core.straggler import StragglerConfig, StragglerDetector
from stalwart.daemon.errors import NotFound, NotReady
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.liveness import (
    ALIVE,
    DEAD,
    LATE,
    ProcessIdentity,
    heartbeat_state,
    process_alive,
    process_identity,
)
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.daemon.recovery.registry")

SPARE = "spare"
LEFT = "left"  # stopped cleanly (final heartbeat with leaving=True)
KEEP_ISSUED = 1 << 16  # rank ids remembered so that no later process gets one again
KEEP_DEAD = 256  # dead or departed ranks kept for `stalwart status` before the oldest is dropped
KEEP_FAILURES = 100
# A rank with a role that heartbeats but makes no step for this long is stalled: alone
# in its job (no peer's collective can time out on it), or as a backstop behind the
# peers' collective timeouts; and never sooner than STALL_STEPS of its own step times.
STALL_ALONE_S = 10.0
STALL_BACKSTOP_S = 120.0
STALL_STEPS = 20
STRAGGLER_WINDOW_HEARTBEATS = 4  # heartbeat intervals per straggler window (at least 2 s)
RANK_PHASES = ("rebuild", "restore")  # recovery phases a rank times and reports


class UnknownRank(NotFound):
    pass


class RankFenced(NotReady):
    """The rank was declared dead; its heartbeats are refused until it registers again."""


@dataclass
class RankRecord:
    rank_id: str
    pid: int
    rank: int
    world_size: int
    local_rank: int
    hostname: str
    spare: bool
    device: str
    generation: int
    registered_unix: float
    last_heartbeat: float  # registry clock (monotonic seconds)
    process: ProcessIdentity | None = None
    step: int = 0
    step_time_s: float = 0.0
    # (generation, step) of the newest of its captures this daemon took in
    captured: tuple[int, int] = (0, 0)
    progress_at: float = 0.0  # registry clock of its last step change (or plan change)
    state: str = ALIVE
    cause: str = ""  # evidence of the death, once dead
    raised: str = ""  # the exception its training raised, told just before its exit
    finished_at: int = 0  # left after its loop trained the job's length, ending at this step
    instance: str = ""  # the random name the process registered with (RegisterRequest)

    @property
    def ended(self) -> bool:
        """Declared dead, or left cleanly: nothing of this rank runs any more."""
        return self.state in (DEAD, LEFT)

    @property
    def shown_state(self) -> str:
        """State as `stalwart status` shows it: a live spare reads "spare"."""
        return SPARE if self.spare and self.state == ALIVE else self.state


@dataclass
class Registry:
    """Ranks of this node, their liveness, and the current generation and plan."""

    node: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    metrics: Metrics
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    generation: int = 1
    plan: common_pb2.Plan | None = None
    previous_plan: common_pb2.Plan | None = None
    _ranks: dict[str, RankRecord] = field(default_factory=dict)
    _issued: dict[str, None] = field(default_factory=dict)  # rank ids given, oldest first
    failures: deque[Failure] = field(default_factory=lambda: deque(maxlen=KEEP_FAILURES))
    _listeners: list[Callable[[Failure], None]] = field(default_factory=list)
    _leave_listeners: list[Callable[[str], None]] = field(default_factory=list)
    _plan_changed: asyncio.Event = field(default_factory=asyncio.Event)
    stragglers: StragglerDetector = field(default_factory=lambda: StragglerDetector(
        StragglerConfig(mark_as_failure=True)))
    _window_end: float | None = None
    _last_check: float | None = None
    _straggling: set[str] = field(default_factory=set)
    _phases_seen: set[tuple[str, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        # Every state and failure kind shows from the first scrape, at 0.
        self._update_gauges()
        for kind in FailureKind:
            self.metrics.failures.labels(kind.name.lower())
        self.stragglers.reporter = self.node
        self.stragglers.generation = self.generation

    # ranks ---------------------------------------------------------------

    def register(self, *, pid: int, rank: int, world_size: int, local_rank: int,
                 hostname: str, spare: bool, device: str, watch_pid: bool,
                 instance: str = "") -> RankRecord:
        """Add a rank (or refresh it when the same process, by `instance`, registers
        again). Its id is "<node>/<pid>"; a process whose pid another rank has or had (one
        in a pid namespace of its own, as a container's processes are: started again, or
        beside another pod's) is "<node>/<pid>.<n>", its n-th, since plans and the
        coordinator may still name the other one."""
        rank_id, n = f"{self.node}/{pid}", 1
        # A held record counts even when its id has left the remembered ones.
        while (rank_id in self._issued or rank_id in self._ranks) and not (
                (held := self._ranks.get(rank_id)) is not None and not held.ended
                and held.instance == instance):
            n += 1
            rank_id = f"{self.node}/{pid}.{n}"
        self._issued[rank_id] = None
        if len(self._issued) > KEEP_ISSUED:
            del self._issued[next(iter(self._issued))]
        record = RankRecord(
            rank_id=rank_id, pid=pid, rank=rank, world_size=world_size, local_rank=local_rank,
            hostname=hostname, spare=spare, device=device, generation=self.generation,
            registered_unix=self.wall(), last_heartbeat=self.clock(),
            process=process_identity(pid) if watch_pid else None, instance=instance)
        self._ranks[rank_id] = record
        self._prune_dead()
        self._update_gauges()
        log.info("rank registered", extra={
            "rank_id": rank_id, "rank": rank, "pid": pid, "spare": spare,
            "watch_pid": record.process is not None})
        return record

    def heartbeat(self, rank_id: str, generation: int, step: int, step_time_s: float,
                  leaving: bool = False, raised: str = "",
                  recovery_phases: dict[str, float] | None = None,
                  finished_at: int = 0) -> RankRecord:
        """Record a heartbeat; refuses unknown ranks, dead ranks and older generations
        (whose beat still counts as alive).

        A `leaving` heartbeat ends the rank's watch without counting as a failure;
        `raised` names the exception the rank is about to exit with, for the report of
        its exit.
        `recovery_phases` (seconds by phase) are the rank's timings of joining
        `generation`; each is observed once per rank and generation. `finished_at`, with
        `leaving`: the step its loop ended at having trained the job's length.
        """
        record = self._ranks.get(rank_id)
        if record is None:
            raise UnknownRank(
                f"rank {rank_id!r} is not registered with daemon {self.node}; "
                "register again (the daemon may have restarted)")
        if record.ended:
            raise RankFenced(
                f"rank {rank_id} was declared dead ({record.cause}); register again to rejoin")
        # Proof of life even from an older generation: a rank that has not seen the new
        # plan yet (busy leaving the old one) is catching up, not gone. Its step is not
        # taken: it belongs to the generation the rank is told to leave.
        record.last_heartbeat = self.clock()
        if raised:  # whatever generation it speaks for: its exit is reported all the same
            record.raised = raised[:RAISED_CHARS]
        check_generation(generation, self.generation, f"heartbeat of rank {rank_id}")
        if step > record.step and step_time_s > 0:  # a new step finished: one sample
            self.stragglers.observe(rank_id, step_time_s)
        if step != record.step:
            record.progress_at = record.last_heartbeat
        record.step, record.step_time_s = step, step_time_s
        self._observe_phases(rank_id, generation, recovery_phases or {})
        if leaving:
            record.state, record.cause = LEFT, "left cleanly"
            record.finished_at = finished_at
            self._forget_series(record.rank_id)
            self._update_gauges()
            log.info("rank left", extra={"rank_id": rank_id, "step": step})
            for listener in self._leave_listeners:
                listener(rank_id)
            if self.plan is not None and self.plan.stop and not self.plan.completed:
                # It gave up waiting at the stop: its role must be filled too when the job
                # resumes, so the coordinator hears of it as of any rank that is gone.
                self.report(Failure(FailureKind.PROCESS_EXIT, rank_id,
                                    "left the stopped job (its wait for a resume ended)",
                                    generation=self.generation, reporter=self.node,
                                    details={"pid": record.pid}))
            return record
        if record.state == LATE:
            record.state = ALIVE
            log.info("rank heartbeat resumed", extra={"rank_id": rank_id})
        self.metrics.heartbeats.inc()
        self.metrics.training_step.labels(rank_id).set(step)
        self.metrics.step_time.labels(rank_id).set(step_time_s)
        if rank_id not in self._straggling:
            self.metrics.straggler.labels(rank_id).set(0)
        return record

    def _observe_phases(self, rank_id: str, generation: int, phases: dict[str, float]) -> None:
        if not phases or (rank_id, generation) in self._phases_seen:
            return
        self._phases_seen.add((rank_id, generation))
        for phase, seconds in phases.items():
            if phase in RANK_PHASES and seconds >= 0:
                self.metrics.recovery_phase.labels(phase).observe(seconds)

    def live_with_pid(self, pid: int) -> RankRecord | None:
        """The rank of this node that registered `pid` and has not ended, if any."""
        return next((r for r in self._ranks.values() if r.pid == pid and not r.ended), None)

    def ranks(self) -> list[RankRecord]:
        return sorted(self._ranks.values(), key=lambda r: (r.spare, r.rank, r.rank_id))

    def live_rank_ids(self) -> list[str]:
        """The ranks of this node not declared dead, as its heartbeats name them."""
        return [r.rank_id for r in self.ranks() if r.state != "dead"]

    def get(self, rank_id: str) -> RankRecord | None:
        return self._ranks.get(rank_id)

    def _stalled(self, record: RankRecord, now: float) -> str | None:
        """Evidence that a rank with a role stopped making steps while it heartbeats (a
        hang no peer can see: a job of one rank), or None. With peers, their collective
        timeouts see a hang first; this is then only a backstop."""
        if self.plan is None or self.plan.stop or record.step == 0 or not record.progress_at:
            return None
        if not any(a.rank_id == record.rank_id and not a.spare for a in self.plan.assignments):
            return None  # a spare, or a rank the plan left out
        if heartbeat_state(self.heartbeat_age_s(record), self.heartbeat_interval_s,
                           self.heartbeat_timeout_s) != ALIVE:
            return None  # not heartbeating (paused, say): the heartbeat timeout judges it
        alone = Layout.from_proto(self.plan.layout).world_size == 1
        limit = max(STALL_ALONE_S if alone else STALL_BACKSTOP_S,
                    STALL_STEPS * record.step_time_s)
        idle = now - record.progress_at
        if idle <= limit:
            return None
        return (f"heartbeating but no step for {idle:.1f} s after step {record.step} "
                f"(limit {limit:.0f} s)")

    def heartbeat_age_s(self, record: RankRecord) -> float:
        return max(0.0, self.clock() - record.last_heartbeat)

    # detection -----------------------------------------------------------

    def check(self) -> list[Failure]:
        """Apply the liveness rules to every rank; returns the failures found now."""
        found = []
        now, last = self.clock(), self._last_check
        self._last_check = now
        paused = last is not None and now - last > self.heartbeat_timeout_s
        if paused:
            log.warning("this daemon was paused; its ranks get a fresh heartbeat deadline",
                        extra={"paused_s": round(now - last, 3)})
        for record in list(self._ranks.values()):
            if record.ended:
                continue
            if record.process is not None and not process_alive(record.process):
                raised = f"{AFTER_RAISING}{record.raised}" if record.raised else ""
                found.append(self._declare_dead(
                    record, FailureKind.PROCESS_EXIT, f"process {record.pid} exited{raised}"))
                continue
            if paused:  # its heartbeats queued behind this daemon's pause, not the rank's
                record.last_heartbeat = max(record.last_heartbeat, now - self.heartbeat_interval_s)
                record.progress_at = max(record.progress_at, now - self.heartbeat_interval_s)
                continue
            if (stalled := self._stalled(record, now)) is not None:
                found.append(self._declare_dead(record, FailureKind.STALLED, stalled))
                continue
            age = self.heartbeat_age_s(record)
            state = heartbeat_state(age, self.heartbeat_interval_s, self.heartbeat_timeout_s)
            if state == DEAD:
                found.append(self._declare_dead(
                    record, FailureKind.HEARTBEAT_MISSED,
                    f"no heartbeat for {age:.2f} s (timeout {self.heartbeat_timeout_s:g} s)"))
            elif state != record.state:
                record.state = state
                log.warning("rank heartbeat late", extra={"rank_id": record.rank_id,
                                                          "age_s": round(age, 3)})
        self._update_gauges()
        found += self._judge_stragglers()
        return found

    def _judge_stragglers(self) -> list[Failure]:
        """Close a straggler window every few heartbeat intervals; flag and report."""
        now = self.clock()
        window_s = max(2.0, STRAGGLER_WINDOW_HEARTBEATS * self.heartbeat_interval_s)
        if self._window_end is None:
            self._window_end = now + window_s
        if now < self._window_end:
            return []
        self._window_end = now + window_s
        verdict = self.stragglers.close_window()
        for report in verdict.new:
            self._straggling.add(report.rank_id)
            self.metrics.straggler.labels(report.rank_id).set(1)
            log.warning("straggler", extra={"rank_id": report.rank_id,
                                            "evidence": report.evidence()})
        for rank_id in verdict.cleared:
            self._straggling.discard(rank_id)
            if rank_id in self._ranks:
                self.metrics.straggler.labels(rank_id).set(0)
        return [self.report(f) for f in verdict.failures]

    def _declare_dead(self, record: RankRecord, kind: FailureKind, evidence: str) -> Failure:
        record.state, record.cause = DEAD, f"{kind.name.lower()}: {evidence}"
        self._forget_series(record.rank_id)
        generation, captured = record.captured
        if generation != self.generation and self.plan is not None:
            # Captured under an older plan: past this plan's resume step, that step is
            # being trained again, and the capture says nothing of it.
            captured = min(captured, self.plan.resume_step)
        return self.report(Failure(kind, record.rank_id, evidence, generation=self.generation,
                                   reporter=self.node, captured_step=captured,
                                   details={"pid": record.pid}))

    def _forget_series(self, rank_id: str) -> None:
        self.stragglers.forget(rank_id)
        self._straggling.discard(rank_id)
        for series in (self.metrics.training_step, self.metrics.step_time,
                       self.metrics.straggler):
            try:
                series.remove(rank_id)
            except KeyError:
                pass  # older prometheus-client: the rank never sent a heartbeat

    def report(self, failure: Failure) -> Failure:
        """Record a failure (detected here or reported by a client) and tell listeners."""
        self.failures.append(failure)
        self.metrics.failures.labels(failure.kind.name.lower()).inc()
        log.warning("failure detected", extra={"kind": failure.kind.name.lower(),
                                               "subject": failure.subject,
                                               "evidence": failure.evidence})
        for listener in self._listeners:
            listener(failure)
        return failure

    def on_failure(self, listener: Callable[[Failure], None]) -> None:
        """Call `listener(failure)` for every failure from now on (the coordinator hooks here)."""
        self._listeners.append(listener)

    def on_leave(self, listener: Callable[[str], None]) -> None:
        """Call `listener(rank_id)` for every rank that leaves cleanly from now on."""
        self._leave_listeners.append(listener)

    def _prune_dead(self) -> None:
        dead = [r for r in self._ranks.values() if r.ended]
        for record in dead[: max(0, len(dead) - KEEP_DEAD)]:
            del self._ranks[record.rank_id]

    def _update_gauges(self) -> None:
        counts = {ALIVE: 0, LATE: 0, DEAD: 0, SPARE: 0, LEFT: 0}
        for record in self._ranks.values():
            counts[record.shown_state] += 1
        for state, n in counts.items():
            self.metrics.ranks.labels(state).set(n)

    # plan ----------------------------------------------------------------

    def install_plan(self, plan: common_pb2.Plan) -> None:
        """Adopt a plan of a newer generation and wake every WatchPlan stream. The ids
        it gives this node's ranks are never given to another process (a daemon started
        again does not remember the ids it gave, but the coordinator hands it the plan)."""
        for a in plan.assignments:
            if a.node == self.node:
                self._issued[a.rank_id] = None
        if plan.generation < self.generation or (
                plan.generation == self.generation and self.plan is not None):
            raise StaleGeneration(
                f"plan of generation {plan.generation} is not newer than the current "
                f"generation {self.generation}")
        self.previous_plan = self.current_plan()
        self.generation, self.plan = plan.generation, plan
        now = self.clock()
        for record in self._ranks.values():  # restoring for the new plan is not a stall
            record.progress_at = now if record.progress_at else 0.0
        self.stragglers.generation = plan.generation
        self.metrics.generation.set(self.generation)
        self.metrics.plan.info(plan_labels(plan))
        log.info("plan installed", extra={"generation": self.generation, "reason": plan.reason})
        self._plan_changed.set()
        self._plan_changed = asyncio.Event()

    def current_plan(self) -> common_pb2.Plan:
        return self.plan if self.plan is not None else common_pb2.Plan(generation=self.generation)

    def roles_here(self, generation: int) -> list[str] | None:
        """The ranks holding a role on this node in plan `generation`; None unless that
        is the current plan."""
        if self.plan is None or self.plan.generation != generation:
            return None
        return [a.rank_id for a in self.plan.assignments if a.node == self.node and not a.spare]

    async def plan_after(self, known_generation: int, timeout_s: float) -> common_pb2.Plan | None:
        """The plan if its generation exceeds `known_generation`, waiting up to timeout_s.

        Returns None on timeout or when woken without a newer plan (shutdown).
        """
        if self.plan is None or self.plan.generation <= known_generation:
            try:
                await asyncio.wait_for(self._plan_changed.wait(), timeout_s)
            except TimeoutError:
                pass
        if self.plan is None or self.plan.generation <= known_generation:
            return None
        return self.plan

    async def next_plan(self) -> None:
        """Until the next plan is installed (or watchers are woken at shutdown)."""
        await self._plan_changed.wait()

    def wake_watchers(self) -> None:
        """Wake plan watchers without a change (used at shutdown so streams end at once)."""
        self._plan_changed.set()
        self._plan_changed = asyncio.Event()


def plan_labels(plan: common_pb2.Plan) -> dict[str, str]:
    """The plan as labels of `stalwart_plan_info`."""
    lay = plan.layout
    return {"generation": str(plan.generation), "dp": str(lay.dp), "pp": str(lay.pp),
            "tp": str(lay.tp), "schedule": lay.schedule,
            "stages": " ".join(f"{s.first_layer}-{s.last_layer}" for s in lay.stages)}
