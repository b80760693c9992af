"""The coordinator: forms the first plan, commits steps, and re-plans after failures.

Every daemon runs one; only the daemon that membership (or an etcd election)
names coordinator acts. Its decisions are the pure functions of core.decide;
this module keeps their state and sends the outcome to the other daemons
through `PeerLinks` (gRPC in the daemon, in-process calls in tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stalwart.core.decide import (
    Member,
    NoChange,
    PlanDecision,
    PlanState,
    ShrinkPlanner,
    StopDecision,
    decide,
    resume,
)
from stalwart.core.failures import Failure
from stalwart.core.grow import GrowPolicy
from stalwart.core.layout import Layout
from stalwart.core.shrink import ElasticConfig, ElasticPlanner
from stalwart.daemon.background import Background, until
from stalwart.daemon.config import ElasticSettings
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.step_commits import PeerLinks, Prepared, StepCommits
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

log = logging.getLogger("stalwart.daemon.recovery.coordinator")

# The longest a re-plan waits for a step the failed ranks captured to commit. It waits as
# long as training the steps it saves took (measured) and, once every daemon answered
# that it holds its ranks' captures of the step, as long again (waiting on costs more
# than training them again from there): never longer than this.
LAND_WAIT_MAX_S = 5.0
# How much later than the daemons' own wait their answers to a hurry may come (a round
# trip on a loaded machine); an answer not in by then counts as "not held".
HURRY_ANSWER_GRACE_S = 0.5


@dataclass
class RecoveryRecord:
    """One re-plan, for status, metrics and the demo's summary."""

    kind: str
    causes: list[str]
    old_generation: int
    new_generation: int
    resume_step: int
    detected_unix: float
    decided_s: float  # seconds from the first failure report to the plan being installed
    message: str = ""
    layers_moved: int = 0


@dataclass
class Coordinator:
    node: str
    job_id: str
    metrics: Metrics
    links: PeerLinks
    latest_committed: Callable[[], int | None]
    shrink_planner: ShrinkPlanner | None = None
    load_record: Callable[[int], manifest_pb2.StepRecord] | None = None
    elastic: ElasticSettings | None = None
    profile: common_pb2.LayerProfile | None = None
    original_world: int = 0
    stragglers_fail: bool = False
    commit_fanout: int = 0  # the commit tree's (0: this daemon sends every commit)
    plan: PlanState | None = None
    announced: dict[str, peer_pb2.RankAnnouncement] = field(default_factory=dict)
    completed: bool = False  # every rank trained its last step: nothing is re-planned
    _since_completed: set[str] = field(default_factory=set)  # ranks registered after it
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    _in_flight: PlanDecision | None = None
    _stopped: StopDecision | None = None  # the job waits at a stop for spares to arrive
    _joined: set[str] = field(default_factory=set)  # ranks that came after the last plan
    # A stopped job that registering ranks could resume only smaller waits for them to
    # stop coming: until this monotonic time, which each registration moves on.
    _settle_until: float = 0.0
    _settling: asyncio.Task[None] | None = None  # resumes the job once that time passed
    took_over_at: float = float("-inf")  # monotonic time this daemon became coordinator
    _installed_at: float = field(default_factory=time.monotonic)  # of the newest plan
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # hurries still being sent, and widenings of the plan after a prepare
    _spawned: Background = field(default_factory=Background)
    # Set when a failure is queued while this one is handled: a wait for a captured
    # step past the job's pace ends then (the news may be that the step cannot land).
    _news: asyncio.Event = field(default_factory=asyncio.Event)
    heard: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by every rank announcement (`announced` has grown or changed)."""
    commits: StepCommits = field(init=False)

    def __post_init__(self) -> None:
        self.commits = StepCommits(
            self.node, self.job_id, self.metrics, self.links, self.latest_committed,
            self.load_record, generation=lambda: self.plan.generation if self.plan else None,
            committed=self.recovery_done, finished=self._complete, fanout=self.commit_fanout)

    # membership ---------------------------------------------------------------

    def take_over(self, installed: common_pb2.Plan) -> bool:
        """This daemon became coordinator: continue from the plan every daemon installed.

        Spares are re-announced by their daemons; prepares sent to the old coordinator
        are lost, so those steps are skipped rather than waited for. True when this call
        took over.
        """
        if self.plan is None and installed.assignments and installed.completed:
            try:  # kept, so that its ranks started again resume it (a newer generation)
                self.plan = PlanState.from_proto(installed)
            except ValueError as exc:
                log.error("the completed job's installed plan is inconsistent (%s)", exc)
                return False
            self.completed = True
            self.took_over_at = time.monotonic()
            return True
        if self.plan is None and installed.assignments and not installed.completed:
            try:
                self.plan = PlanState.from_proto(installed)
            except ValueError as exc:
                log.error("cannot take over: the installed plan is inconsistent (%s); "
                          "waiting for ranks to register", exc)
                return False
            # Ranks re-announced under the installed plan before this daemon knew it
            # coordinates (a peer saw the seat move first) are spares the plan does not
            # name; an announcement from before that plan may name a rank gone since.
            known = {m.rank_id for m in (*self.plan.members, *self.plan.spares)}
            early = tuple(Member(a.rank_id, a.node) for a in self.announced.values()
                          if a.rank_id not in known and a.rank_id not in installed.lost
                          and a.generation >= installed.generation)
            if early:
                self._joined.update(m.rank_id for m in early)
                self.plan = dataclasses.replace(self.plan, spares=(*self.plan.spares, *early))
            if installed.stop:  # the job waits at a stop: resume it when spares come
                self._stopped = StopDecision(installed.generation, installed.resume_step,
                                             installed.stop_message, (),
                                             frozenset(installed.lost))
                if early:  # they came already: their announcements again change nothing
                    self._spawned.start(self._resume_with_early())
            log.warning("took over as coordinator", extra={"generation": installed.generation})
            self.took_over_at = time.monotonic()
            return True
        return False

    async def announce(self, a: peer_pb2.RankAnnouncement) -> None:
        """A rank registered with some daemon: form the first plan once the world is here.
        (An announcement with `finished_at` is not a registration: see `_finished`.)"""
        async with self._lock:
            if a.finished_at:
                await self._finished(a.rank_id, a.finished_at)
                return
            known = a.rank_id in self.announced  # announced again (a new coordinator)
            self.announced[a.rank_id] = a
            self.heard.set()
            # The size the job was launched at (a successor coordinator learns it from
            # the ranks that announce themselves again): plans widen back to it.
            self.original_world = max(self.original_world, a.world_size)
            if self.profile is None and a.profile.costs:
                self.profile = a.profile
                if self._stopped is not None:
                    # Stopped for want of the layer profile (a successor that decided
                    # before any rank re-announced): shrinking may fit now.
                    await self._maybe_resume()
            if self.plan is None:
                await self._maybe_form_first_plan()
            elif self.completed:
                # Not a rank of the completed run (announced again to a new coordinator).
                if not known and a.rank_id not in {
                        m.rank_id for m in (*self.plan.members, *self.plan.spares)}:
                    self._since_completed.add(a.rank_id)
                    await self._maybe_relaunch_completed()
            elif a.rank_id not in {m.rank_id for m in self.plan.members}:
                spare = Member(a.rank_id, a.node)
                if a.rank_id not in {s.rank_id for s in self.plan.spares}:
                    self._joined.add(a.rank_id)
                    self.plan = PlanState(
                        generation=self.plan.generation, layout=self.plan.layout,
                        members=self.plan.members, spares=(*self.plan.spares, spare),
                        resume_step=self.plan.resume_step, reason=self.plan.reason)
                    log.info("spare registered", extra={"rank_id": a.rank_id, "node": a.node})
                    if self._stopped is not None:
                        await self._maybe_resume(joined=True)
                    else:
                        await self._maybe_grow()

    def _elastic_config(self) -> ElasticConfig | None:
        if self.profile is None or not self.profile.costs:
            return None
        p = self.profile
        cap = self.elastic.mem_cap_bytes if self.elastic else 0
        checked = bool(cap) and bool(p.mem_bytes)  # memory is planned only against a cap
        return ElasticConfig(costs=tuple(p.costs),
                             mem=tuple(p.mem_bytes) if checked else None,
                             act=tuple(p.act_bytes) or None if checked else None,
                             mem_cap=float(cap) if checked else None,
                             layer_bytes=tuple(p.state_bytes) or None)

    def _shrink_planner(self) -> ElasticPlanner | None:
        if self.shrink_planner is not None:
            return self.shrink_planner  # type: ignore[return-value]
        if self.elastic is not None and not self.elastic.shrink:
            return None
        config = self._elastic_config()
        return ElasticPlanner(config) if config is not None else None

    def _grow_policy(self, config: ElasticConfig) -> GrowPolicy:
        return GrowPolicy(config, self.elastic.grow_threshold if self.elastic else 0.1)

    async def _maybe_grow(self) -> None:
        """A rank joined: widen a shrunk plan when the predicted gain is worth the pause."""
        assert self.plan is not None
        config = self._elastic_config()
        # Only capacity that came back counts: ranks a shrink left idle were weighed then.
        if (config is None or self._in_flight is not None or not self._joined
                or self.plan.layout.world_size >= self.original_world):
            return
        committed = self.latest_committed() or 0
        grown = self._grow_policy(config)(self.plan, committed)
        self._joined.clear()  # weighed now; the next joiner triggers another look
        if grown is None:
            return
        previous = self.plan
        self.plan = grown
        self.commits.abandon_after(committed)  # the wider plan trains them again
        await self._install(grown.to_proto())
        self.metrics.plan_changes.labels("grow").inc()
        self.recoveries.append(RecoveryRecord(
            kind="grow", causes=[], old_generation=previous.generation,
            new_generation=grown.generation, resume_step=committed, detected_unix=time.time(),
            decided_s=0.0, message=grown.reason))
        log.info("plan widened", extra={"reason": grown.reason})

    async def _maybe_relaunch_completed(self) -> None:
        """The job completed, and its ranks were started again next to the same daemons
        (to train it longer, or to have its final state back): once every launch rank
        registered again, each takes the role its RANK names in the launched layout and
        resumes from the last step, as at a first plan. Ranks and spares registered
        since the completion are the new plan's; those of the completed run are gone."""
        assert self.plan is not None
        step = self.plan.resume_step
        plan = _launch_plan([a for r, a in self.announced.items() if r in self._since_completed],
                            self.plan.generation + 1, step, "launched again after it completed")
        if plan is None:
            return
        self.plan, self.completed = plan, False
        self._since_completed.clear()
        self._joined.clear()
        await self._install(self.plan.to_proto())
        self.metrics.plan_changes.labels("relaunch").inc()
        log.info("the completed job was launched again", extra={"step": step})

    async def _maybe_form_first_plan(self) -> None:
        plan = _launch_plan(list(self.announced.values()), 1, self.latest_committed() or 0,
                            "first plan")
        if plan is not None:
            self.plan = plan
            await self._install(self.plan.to_proto())

    def _relaunched(self, committed: int) -> PlanDecision | None:
        """The plan that resumes a job that lost every rank, when the ranks registered
        since hold every launch rank again (the job was started again): the launched
        layout, each rank in the role its RANK names, as the first plan had them."""
        assert self.plan is not None and self._stopped is not None
        if any(m.rank_id not in self._stopped.failed for m in self.plan.members):
            return None  # survivors keep their roles: spares fill the lost ones
        launched = _launched(self.announced[s.rank_id] for s in self.plan.spares
                             if s.rank_id in self.announced)
        if launched is None:
            return None
        layout, members = launched
        taken = {m.rank_id for m in members}
        plan = PlanState(generation=self.plan.generation + 1, layout=layout, members=members,
                         spares=tuple(s for s in self.plan.spares if s.rank_id not in taken),
                         resume_step=committed,
                         reason=f"relaunched: {len(members)} ranks in their launched roles")
        return PlanDecision("relaunch", self.plan, plan, {}, self._stopped.causes)

    async def _install(self, plan: common_pb2.Plan) -> None:
        """Send a plan to every live daemon (this one included); log who refused."""
        if not self.links.holds_seat():
            # Deposed while deciding (its etcd seat expired): the successor decides.
            log.error("plan not installed: this daemon no longer coordinates",
                      extra={"generation": plan.generation})
            return
        plan.coordinator, plan.commit_key = self.node, self.commits.key.public
        self._installed_at = time.monotonic()
        plan.commit_fanout = self.commit_fanout
        if not plan.stop:
            self._name_store(plan)
        # A daemon without the step the plan resumes from (its coordinator died while
        # sending phase two) takes it from this one before adopting the plan (JobGate).
        nodes = self.links.nodes()
        results = await asyncio.gather(*(self.links.install_plan(n, plan) for n in nodes),
                                       return_exceptions=True)
        self.commits.keyed = True
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("plan not delivered", extra={"node": node, "error": str(result),
                                                         "generation": plan.generation})

    def _name_store(self, plan: common_pb2.Plan) -> None:
        """The generation's process groups start from a store a rank of the plan serves:
        the lowest global rank with one, a survivor, so no host outside the plan is
        needed (a rank that served an older generation's store may be gone)."""
        holders = sorted((a.coord.rank, a.rank_id) for a in plan.assignments if not a.spare
                         and self.announced.get(a.rank_id, peer_pb2.RankAnnouncement()).store)
        if holders:
            rank_id = holders[0][1]
            plan.store, plan.store_rank_id = self.announced[rank_id].store, rank_id

    # failures -----------------------------------------------------------------

    async def on_failures(self, failures: list[Failure]) -> None:
        """Decide and install the next plan (or the stop) after `failures`."""
        t0 = time.monotonic()
        await self._let_captured_land(failures)
        async with self._lock:
            if self.completed:
                log.info("failure after the job completed; nothing to re-plan",
                         extra={"failures": [f.describe() for f in failures]})
                return
            if self.plan is None:
                log.warning("failure before the first plan; nothing to re-plan",
                            extra={"failures": [f.describe() for f in failures]})
                return
            # The plan resumes from `committed`: a step of the old plan that completes
            # while it is decided and installed must not commit past it.
            committed = await self.commits.hold()
            try:
                await self._decide_and_carry_out(failures, committed, t0)
            finally:
                self.commits.release()

    async def _decide_and_carry_out(self, failures: list[Failure], committed: int,
                                    t0: float) -> None:
        assert self.plan is not None
        planner = self._shrink_planner()
        stopped = self._stopped
        # On a thread: a shrink of thousands of GPUs searches for a fraction of a second,
        # and heartbeats and commits must not wait for it.
        decision = await self._decide(failures, committed, planner, stopped)
        if isinstance(decision, NoChange):
            self.plan = decision.plan
            return
        if stopped is not None and isinstance(decision, StopDecision):
            if decision.failed <= stopped.failed:
                return  # nothing lost that the stop did not know of: it stands
            # The stop stands for the reason it came; say what was lost since.
            lost = [m for m in self.plan.members if m.rank_id in decision.failed]
            since = ", ".join(sorted(decision.failed - stopped.failed))
            decision = dataclasses.replace(decision, message=(
                f"{stopped.message} Lost since the stop: {since}; {len(lost)} role(s) "
                "now wait for a spare."))
        await self._carry_out(decision, [f.describe() for f in failures], t0, planner)

    async def _let_captured_land(self, failures: list[Failure]) -> None:
        """A step every failed rank's daemon took a capture of before the failure commits
        once the survivors' captures of it are stored too: wait for it, so the plan
        resumes from it instead of redoing it. The wait lasts as long as the training it
        saves took (measured: the job's pace between commits, or since the plan began);
        past that, as long again while every daemon holds its ranks' captures of the
        step (then nothing but storing stands between the step and its commit; beyond
        twice, waiting on costs more than training the steps again). Nothing is awaited
        for a lost node (its captures went with it) or a failure that says nothing of
        captures."""
        if not failures or any(f.names_node or f.captured_step <= 0 for f in failures):
            return
        plan, latest = self.plan, self.latest_committed()
        if plan is None or self.completed or self._stopped is not None or \
                any(f.generation < plan.generation for f in failures):
            return  # a report from an older generation: its steps were left behind
        step, since = min(f.captured_step for f in failures), latest or plan.resume_step
        if step <= since:
            return
        pace = self.commits.seconds_per_step()
        if pace is None:  # no two commits yet: the plan's steps so far set the pace
            pace = (time.monotonic() - self._installed_at) / max(1, step - plan.resume_step)
        t0 = time.monotonic()
        self._news.clear()  # what was queued before is in this batch
        worth = min((step - since) * pace, LAND_WAIT_MAX_S)
        # The daemons store that step next, dropping the earlier captures still waiting
        # (the wait is then one step's storing, not the whole backlog's), and answer
        # whether they hold their ranks' captures of it.
        self.commits.hurried = max(self.commits.hurried, (plan.generation, step))
        members = {m.node for m in plan.members}
        answers = self._spawned.start(self._hurry(peer_pb2.HurryStepRequest(
            job_id=self.job_id, generation=plan.generation, step=step, wait_s=worth), members))
        landed, held = await self.commits.landed(step, worth), False
        if not landed:
            answered = await _within(answers, worth + HURRY_ANSWER_GRACE_S -
                                     (time.monotonic() - t0))
            # Held by the daemon of every node the plan gives a role: a node that left
            # (its loss not handled yet) holds nothing.
            held = answered is not None and members <= answered
            if held:
                landed = await self._landed_unless_news(
                    step, min(2 * worth, LAND_WAIT_MAX_S) - (time.monotonic() - t0))
        log.info("captured step %s before re-planning", "committed" if landed else
                 "did not commit", extra={"step": step, "waited_s": time.monotonic() - t0,
                                          "worth_s": worth, "held_everywhere": held})

    async def _hurry(self, request: peer_pb2.HurryStepRequest, members: set[str]
                     ) -> set[str]:
        """Hurry every live daemon; the nodes of `members` (those with a role in the plan)
        whose daemon holds its ranks' captures of the step. Only their answers are waited
        for: another daemon stores shards alone, and one frozen (not yet declared lost)
        would hold the answer until its loss."""
        async def one(node: str) -> bool:
            try:
                return await self.links.hurry_step(node, request)
            except Exception as exc:  # it only makes that daemon slower
                log.info("hurry not delivered", extra={"node": node, "error": str(exc),
                                                       "step": request.step})
                return False

        nodes = self.links.nodes()
        for node in nodes:
            if node not in members:
                self._spawned.start(one(node))
        asked = [node for node in nodes if node in members]
        held = await asyncio.gather(*map(one, asked))
        return {node for node, holding in zip(asked, held, strict=True) if holding}

    def failure_queued(self) -> None:
        """Another failure waits to be handled (see `_news`)."""
        self._news.set()

    async def _landed_unless_news(self, step: int, timeout_s: float) -> bool:
        """`commits.landed`, ended early (False) by a failure queued meanwhile."""
        landing = await until(self.commits.landed(step, timeout_s), self._news.wait())
        return not landing.cancelled() and landing.result()

    async def _decide(self, failures: list[Failure], committed: int,
                      planner: ElasticPlanner | None, stopped: StopDecision | None
                      ) -> PlanDecision | StopDecision | NoChange:
        """`decide` (or `resume` after a stop) on a thread: a shrink of thousands of GPUs
        searches for a fraction of a second, and heartbeats and commits must not wait.
        Decided again if the plan changed meanwhile (a takeover outside the lock)."""
        def run(plan: PlanState, in_flight: PlanDecision | None
                ) -> PlanDecision | StopDecision | NoChange:
            if stopped is None:
                return decide(plan, failures, committed, in_flight=in_flight,
                              stragglers_fail=self.stragglers_fail, shrink_planner=planner)
            return resume(plan, stopped, failures, committed,
                          stragglers_fail=self.stragglers_fail, shrink_planner=planner)

        while True:
            plan, in_flight = self.plan, self._in_flight
            assert plan is not None
            decision = await asyncio.to_thread(run, plan, in_flight)
            if self.plan is plan and self._in_flight is in_flight:
                return decision

    async def _maybe_resume(self, *, joined: bool = False, settled: bool = False) -> None:
        """A spare registered (`joined`) while the job waits at a stop: resume when the
        spares now fill every lost role; otherwise keep waiting. A smaller plan that fits
        waits until ranks have stopped registering for `resume_settle_s` (`settled`):
        the ranks of a relaunched job, or a wave of spares, come one by one, and resuming
        on the first would widen the plan again, with new groups, as each of the others
        came (and train the steps in between on another layout)."""
        assert self.plan is not None and self._stopped is not None
        t0 = time.monotonic()
        committed = self.latest_committed() or 0
        planner = self._shrink_planner()
        decision = self._relaunched(committed) or resume(
            self.plan, self._stopped, [], committed, stragglers_fail=self.stragglers_fail,
            shrink_planner=planner)
        if isinstance(decision, StopDecision):
            log.info("still stopped: too few spares to resume",
                     extra={"spares": len(self.plan.spares), "why": decision.message})
            return
        decision = self._widened(decision, committed)
        settle_s = self.elastic.resume_settle_s if self.elastic else 0.0
        if decision.plan.layout.world_size < self.original_world and settle_s > 0 and \
                not settled and (joined or self._settling is not None):
            self._settle_until = time.monotonic() + settle_s
            if self._settling is None:
                self._settling = self._spawned.start(self._resume_once_settled())
            log.info("a smaller plan fits the registered ranks; resuming with it once "
                     "none has registered for resume_settle_s",
                     extra={"spares": len(self.plan.spares), "settle_s": settle_s})
            return
        await self._carry_out(decision, ["spare registered"], t0, planner)

    def _widened(self, decision: PlanDecision, committed: int) -> PlanDecision:
        """`decision`, a plan that resumes a stop, widened onto the spares it leaves out
        where that is worth it: a job stopped after it had shrunk (its ranks lost one
        after another) resumes at the size the registered ranks allow, in one
        generation, not in the stop's layout and then wider."""
        config = self._elastic_config()
        if config is None or decision.plan.layout.world_size >= self.original_world:
            return decision
        grown = self._grow_policy(config)(decision.plan, committed)
        if grown is None:
            return decision
        return dataclasses.replace(decision, kind="grow", plan=dataclasses.replace(
            grown, generation=decision.plan.generation))

    async def _resume_with_early(self) -> None:
        """Resume the stopped job taken over if the spares that came before may."""
        async with self._lock:
            if self.plan is not None and self._stopped is not None:
                await self._maybe_resume(joined=True)

    async def _resume_once_settled(self) -> None:
        """Resume the stopped job once no rank registered for resume_settle_s."""
        while True:
            if (left := self._settle_until - time.monotonic()) > 0:
                await asyncio.sleep(left)
                continue
            async with self._lock:
                if self._settle_until > time.monotonic():
                    continue  # a rank registered while this waited for the lock
                self._settling = None
                if self.plan is not None and self._stopped is not None:
                    await self._maybe_resume(settled=True)
                return

    async def _carry_out(self, decision: PlanDecision | StopDecision, causes: list[str],
                         t0: float, planner: ShrinkPlanner | None) -> None:
        """Install `decision` (a new plan or a stop) and record it as a recovery."""
        assert self.plan is not None
        old = self.plan.generation
        if isinstance(decision, StopDecision):
            # The roles stay in the stop plan: a successor coordinator resumes from it.
            msg = self.plan.to_proto()
            msg.generation, msg.stop, msg.reason = decision.generation, True, "stopped"
            msg.stop_message, msg.resume_step = decision.message, decision.last_committed_step
            msg.lost.extend(sorted(decision.failed))
            log.error("no viable plan; stopping until spares register",
                      extra={"why": decision.message})
            self.metrics.recoveries.labels("stopped").inc()
            await self._install(msg)
            kind, resume_step, message = "stop", decision.last_committed_step, decision.message
            self.plan = PlanState(generation=decision.generation, layout=self.plan.layout,
                                  members=self.plan.members, spares=self.plan.spares,
                                  resume_step=resume_step, reason="stopped")
            self._in_flight, self._stopped = None, decision
        else:
            was_stopped = self._stopped is not None
            if self._settling is not None:  # resumed by ranks that filled every role
                self._settling.cancel()
                self._settling = None
            self.plan = decision.plan
            self._in_flight, self._stopped = decision, None
            await self._install(decision.plan.to_proto())
            self.metrics.plan_changes.labels(decision.kind).inc()
            kind, resume_step, message = decision.kind, decision.plan.resume_step, \
                decision.summary()
            if was_stopped:
                kind, message = f"resume ({decision.kind})", "resumed after the stop: " + message
            last = getattr(planner, "last", None)
            if decision.kind == "shrink" and last is not None:
                moved = last.layers_moved
                self.metrics.layers_moved.inc(moved)
                message += (f"; layout {last.plan.layout.dp}x{last.plan.layout.pp}x"
                            f"{last.plan.layout.tp}, {moved} layer shards move "
                            f"({last.bytes_moved / 1e6:.1f} MB), predicted speed "
                            f"{last.speed_ratio:.2f}x of before")
            log.info("new plan installed", extra={"summary": message})
        decided = time.monotonic() - t0
        self.metrics.recovery_phase.labels("plan").observe(decided)
        self.recoveries.append(RecoveryRecord(
            kind=kind, causes=causes, old_generation=old,
            new_generation=decision.generation, resume_step=resume_step,
            detected_unix=time.time(), decided_s=decided, message=message))
        self.commits.abandon_after(resume_step)

    def recovery_done(self, generation: int) -> None:
        """Every rank of `generation` trained a step: the recovery is over."""
        if self._in_flight is not None and self._in_flight.generation <= generation:
            self._in_flight = None
            self.metrics.recoveries.labels("completed").inc()

    # commit -------------------------------------------------------------------

    async def prepared(self, *reqs: peer_pb2.PrepareStepRequest | Prepared) -> None:
        """Phase one from daemons (see StepCommits); a joiner that came during a
        recovery may widen the plan afterwards."""
        await self.commits.prepared(*reqs)
        await self._grow_if_joined()

    def prepared_soon(self, *reqs: peer_pb2.PrepareStepRequest | Prepared) -> None:
        """`prepared` as a daemon's prepare takes it: the bookkeeping now (raising
        StaleGeneration), the commit and any widening of the plan in the background."""
        self.commits.prepared_soon(*reqs)
        if self._may_grow():  # checked here: no task per prepare when nobody joined
            self._spawned.start(self._grow_if_joined())

    def _may_grow(self) -> bool:
        return self.plan is not None and bool(self._joined) and self._in_flight is None

    async def _grow_if_joined(self) -> None:
        if self._may_grow():
            async with self._lock:
                await self._maybe_grow()

    async def _finished(self, rank_id: str, step: int) -> None:
        """A member left after its loop trained the job's whole length, ending at `step`,
        which it saw committed first. The last step's commit ends a job before this comes,
        except where the ranks were launched again after that commit: they restore the
        step, train nothing and leave, and without this the spares would wait for a role
        forever. Every rank trains to the same length, so one member that finished ends
        the job, whatever the others do (one may fail while it restores)."""
        if self.plan is None or self.completed:
            return
        if rank_id not in {m.rank_id for m in self.plan.members}:
            return  # a rank of an earlier plan: its news is old
        if (self.latest_committed() or 0) >= step:
            log.info("a rank left at the job's last step, committed before",
                     extra={"step": step, "rank_id": rank_id})
            await self._complete(step)

    async def _complete(self, step: int) -> None:
        """Every rank committed its last step: tell every daemon (and through them the
        spares, which then leave) that the job is done."""
        assert self.plan is not None
        if self.completed:
            return  # both the last commit and a rank's leaving said so
        generation = self.plan.generation + 1
        done = self.plan.to_proto()  # who held which role, for status after the end
        done.MergeFrom(common_pb2.Plan(
            generation=generation, stop=True, completed=True, resume_step=step,
            reason="completed",
            stop_message=f"the job completed: its last step {step} is committed"))
        # Before the install's await: what runs meanwhile sees the job complete.
        self.plan = dataclasses.replace(self.plan, generation=generation, resume_step=step,
                                        reason="completed")
        self.completed, self._stopped = True, None
        await self._install(done)
        log.info("job completed", extra={"step": step})


async def _within(answer: asyncio.Task[set[str]], timeout_s: float) -> set[str] | None:
    """`answer`'s result if it comes within `timeout_s` (it goes on running), else None."""
    try:
        return await asyncio.wait_for(asyncio.shield(answer), max(0.0, timeout_s))
    except TimeoutError:
        return None


def _launch_plan(announced: list[peer_pb2.RankAnnouncement], generation: int, step: int,
                 why: str) -> PlanState | None:
    """The plan of launch ranks that `announced` holds every one of, each in the role its
    RANK names and the others its spares, resuming from `step`; None until all came."""
    launched = _launched(announced)
    if launched is None:
        return None
    layout, members = launched
    taken = {m.rank_id for m in members}
    return PlanState(generation=generation, layout=layout, members=members,
                     spares=tuple(Member(a.rank_id, a.node) for a in announced
                                  if a.rank_id not in taken),
                     resume_step=step, reason=f"{why}: {len(members)} ranks")


def _launched(announced: Iterable[peer_pb2.RankAnnouncement]
              ) -> tuple[Layout, tuple[Member, ...]] | None:
    """The layout a job was launched with and a member per launch rank in the role its
    RANK names, when `announced` holds every rank 0..WORLD_SIZE-1 (a spare holds none;
    of two processes with one RANK, the later counts)."""
    ranked = [a for a in announced if a.rank >= 0]
    if not ranked:
        return None
    world = ranked[0].world_size
    by_rank = {a.rank: a for a in ranked}
    if sorted(by_rank) != list(range(world)):
        return None
    layout = Layout.from_proto(ranked[0].layout, world_size=world)
    return layout, tuple(Member(by_rank[r].rank_id, by_rank[r].node, layout.coords(r))
                         for r in range(world))
