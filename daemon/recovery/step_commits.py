"""The coordinator's side of the commit: prepares in, a step committed everywhere out.

Each daemon sends phase one for its ranks of a step: the seal of their records, not
the records. Once every rank of the step's layout is in, the step's record (the
seals, a few bytes each) is built and sent to every daemon (phase two), steps in
order: the coordinator's work and every daemon's bytes per step grow with the
prepares, never with what a rank's record weighs. A step whose prepares were lost
with an old coordinator is skipped once a later step is complete; a commit that
fails on the coordinator itself is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Protocol

from stalwart.core import step_record as sr
from stalwart.core.generation import StaleGeneration, check_generation
from stalwart.core.layout import Layout
from stalwart.daemon.background import Background
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.commit_tree import CommitKey, RelayKeys
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

COMMIT_RETRY_S = 1.0  # seconds before a commit that failed on the coordinator is retried
INTERVALS_KEPT = 8  # recent commits whose spacing gives the job's pace
log = logging.getLogger("stalwart.daemon.recovery.step_commits")


class PeerLinks(Protocol):
    """Outbound calls from the coordinator to every daemon (itself included)."""

    def nodes(self) -> list[str]:
        """Live daemons of the job, by node name."""

    def holds_seat(self) -> bool:
        """False once this daemon has lost the etcd seat it coordinated from (always True
        without etcd): a deposed coordinator must not install plans."""

    async def install_plan(self, node: str, plan: common_pb2.Plan) -> None: ...

    async def hurry_step(self, node: str, request: peer_pb2.HurryStepRequest) -> bool:
        """Tell `node` to store `request.step` next; whether it holds its ranks' captures
        of that step (see Intake.hurry_step)."""

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes
                          ) -> None:
        """Phase two on `node` (this daemon: in-process); raises when it failed."""


def world_of(lay: common_pb2.ParallelLayout) -> int:
    """Ranks that must prepare a step captured in `lay`."""
    return Layout.from_proto(lay).world_size


@dataclass(frozen=True)
class Prepared:
    """Prepares of one step that the coordinator has checked: the seal of each daemon's
    ranks (its bytes, a `RankSeal`), with its node, the number of ranks it covers, its
    first rank, and the oldest step its deltas apply to (the step itself when none).
    One daemon's direct prepare, or a column of many that came up the commit tree."""
    step: int
    generation: int
    layout: common_pb2.ParallelLayout
    final: bool
    nodes: list[str]
    sizes: list[int]
    firsts: list[int]
    seals: list[bytes]
    oldest: list[int]

    @classmethod
    def of(cls, req: peer_pb2.PrepareStepRequest) -> Prepared:
        seal = req.seal
        return cls(req.step, req.generation, req.layout, req.final, [req.node],
                   [len(seal.ranks)], [seal.ranks[0] if seal.ranks else -1],
                   [seal.SerializeToString(deterministic=True)],
                   [min(seal.bases, default=req.step)])


@dataclass
class PendingStep:
    """The prepares of one step so far. `covered` (the ranks they seal) is kept as they
    arrive: each seal costs O(1), never O(the seals already in)."""
    layout: common_pb2.ParallelLayout
    generation: int
    world: int
    # node -> (first rank, seal's bytes, ranks, oldest base) of its ranks: a daemon
    # prepares all its ranks of a step at once, and a prepare sent again replaces the
    # first (the prepare rule keeps each seal to its own node's ranks, each once, so
    # the seals cover the step's ranks once each, and sort by their first rank)
    seals: dict[str, tuple[int, bytes, int, int]] = field(default_factory=dict)
    covered: int = 0
    finals: dict[str, int] = field(default_factory=dict)  # node -> its ranks ending here

    def add(self, p: Prepared) -> None:
        seals, nodes = self.seals, p.nodes
        fresh = zip(nodes, zip(p.firsts, p.seals, p.sizes, p.oldest, strict=True), strict=True)
        if seals.keys().isdisjoint(nodes) and len(set(nodes)) == len(nodes):
            seals.update(fresh)  # the usual case, in C: each node's first seal of the step
            self.covered += sum(p.sizes)
        else:
            for node, sealed in fresh:  # some sent again: each replaces its node's last
                if (old := seals.get(node)) is not None:
                    self.covered -= old[2]
                seals[node] = sealed
                self.covered += sealed[2]
        layout = p.layout
        if layout != self.layout:
            self.layout, self.world = layout, world_of(layout)
        self.generation = p.generation
        if p.final:
            self.finals.update(zip(p.nodes, p.sizes, strict=True))

    @property
    def complete(self) -> bool:
        return self.covered >= self.world


@dataclass
class StepCommits:
    node: str
    job_id: str
    metrics: Metrics
    links: PeerLinks
    latest_committed: Callable[[], int | None]
    load_record: Callable[[int], manifest_pb2.StepRecord] | None
    generation: Callable[[], int | None]  # the plan's generation, None before one
    committed: Callable[[int], None]  # a step of this generation committed everywhere
    finished: Callable[[int], Awaitable[None]]  # every rank committed its last step
    # The commit tree (daemon/snapshot/commit_tree.py): this coordinator sends a step to
    # `fanout` daemons, which pass it on, once the daemons hold a plan with its key.
    fanout: int = 0
    key: CommitKey = field(default_factory=CommitKey)
    relay_keys: RelayKeys = field(default_factory=RelayKeys)  # tags of relayed prepares
    keyed: bool = False  # a plan with `key` went out
    # (generation, step) the coordinator last hurried: that plan's earlier steps are moot
    # on every daemon, so a step of them that never completes is no loss (`_commit_ready`)
    hurried: tuple[int, int] = (0, 0)
    steps: dict[int, PendingStep] = field(default_factory=dict)  # awaiting their commit
    _committing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The record first sent for each pending step: a retry sends the same bytes, so a
    # daemon that committed the first attempt accepts it again (a rebuilt one differs).
    _built: dict[int, tuple[manifest_pb2.StepRecord, list[bytes]]] = field(
        default_factory=dict)
    _retry: asyncio.TimerHandle | None = None
    _retrying: asyncio.Future[None] | None = None
    # (monotonic time, step) of the recent commits: their spacing is the pace of the job
    _commit_times: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=INTERVALS_KEPT + 1))
    _landed: asyncio.Condition = field(default_factory=asyncio.Condition)
    # While the coordinator decides a plan from the committed step: no later step commits
    # (its plan would resume below a committed step); see `hold`.
    _held_above: int | None = None
    # The commit on this daemon's own store of the step being committed: once it is done,
    # that step is committed (the other daemons' acknowledgements may still be on their way).
    _local: asyncio.Future[None] | None = None
    _released: asyncio.Future[None] | None = None  # the commits `release` started
    _soon: Background = field(default_factory=Background)  # the commits `prepared_soon` started

    def seconds_per_step(self) -> float | None:
        """Median seconds of training per step between the recent commits (None before
        two): what redoing a step costs the job."""
        times = list(self._commit_times)
        paces = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in
                 zip(times, times[1:], strict=False) if s1 > s0]
        return statistics.median(paces) if paces else None

    async def landed(self, step: int, timeout_s: float) -> bool:
        """Wait until `step` (or a later one) is committed, at most `timeout_s`; True
        when it is."""
        def done() -> bool:
            latest = self.latest_committed()
            return latest is not None and latest >= step
        async with self._landed:
            try:
                await asyncio.wait_for(self._landed.wait_for(done), timeout_s)
            except TimeoutError:
                return done()
        return True

    async def prepared(self, *reqs: peer_pb2.PrepareStepRequest | Prepared) -> None:
        """Phase one from daemons (one, or columns from the commit tree): each one's
        ranks' records for a step are durable. StaleGeneration for a lone direct prepare
        of an older generation; otherwise such prepares are skipped and the rest taken.
        The bookkeeping is synchronous; the commit, if one became due, runs once per
        call."""
        await self._after_taking(*self._take_all(reqs))

    def prepared_soon(self, *reqs: peer_pb2.PrepareStepRequest | Prepared) -> None:
        """`prepared`, its commit in the background: the bookkeeping now (raising what
        it raises), the commit it made due, and any commit to send again, after. A
        prepare's sender (a daemon's snapshot path, behind which its ranks' next
        captures queue) waits for neither: phase two waits for every daemon's
        acknowledgement, and a frozen daemon gives none until it is declared lost."""
        due, again = self._take_all(reqs)
        if not (due or again):
            return

        async def after() -> None:
            try:
                await self._after_taking(due, again)
            except Exception:  # no sender is left to tell
                log.exception("commit after a prepare failed", extra={
                    "steps": sorted({r.step for r in reqs})[:8]})
        self._soon.start(after())

    def _take_all(self, reqs: tuple[peer_pb2.PrepareStepRequest | Prepared, ...]
                  ) -> tuple[bool, list[Prepared]]:
        """Each prepare into its step: whether a step became complete, and the prepares
        of steps committed already."""
        again: list[Prepared] = []
        due = False
        generation, latest = self.generation(), self.latest_committed()
        for req in reqs:
            p = req if isinstance(req, Prepared) else Prepared.of(req)
            try:
                taken = self._take(p, generation, latest)
            except StaleGeneration:
                if len(reqs) == 1 and not isinstance(req, Prepared):
                    raise
                log.warning("prepare of an older generation skipped",
                            extra={"nodes": p.nodes[:8], "generation": p.generation})
                continue
            if taken is None:
                again.append(p)
            due = due or taken is True
        return due, again

    async def _after_taking(self, due: bool, again: list[Prepared]) -> None:
        for p in again:
            # Sent again after a change of coordinator, by daemons that may have missed
            # the commit: send them the commit.
            await self.resend(p.step, p.nodes)
        if due:
            await self._commit_ready()

    def _take(self, p: Prepared, generation: int | None, latest: int | None) -> bool | None:
        """Prepares into their step, under the plan's `generation` with `latest` the last
        committed step: True when the step became complete, None when it is committed
        already."""
        step = p.step
        if generation is not None:
            check_generation(p.generation, generation, f"prepare of step {step}")
        if latest is not None and step <= latest:
            return None
        pending = self.steps.get(step)
        if pending is None or pending.generation < p.generation:
            # A newer plan trains the step again: the older plan's prepares of it are moot.
            pending = self.steps[step] = PendingStep(p.layout, p.generation,
                                                     world_of(p.layout))
        pending.add(p)
        return pending.complete

    async def hold(self) -> int:
        """The committed step a plan is to be decided from; nothing after it commits until
        `release`. A commit already on its way to this daemon's store ends first (a
        lost peer's acknowledgement is not waited for). Prepares are still taken; what
        the plan abandons is dropped."""
        while self._local is not None and not self._local.done():
            with contextlib.suppress(Exception):  # a failed commit is retried, held
                await asyncio.shield(self._local)
        self._held_above = step = self.latest_committed() or 0
        return step

    def release(self) -> None:
        """End `hold`; a later step that became complete meanwhile (the plan kept its
        generation) commits now, in the background: a commit still waiting for a lost
        daemon's acknowledgement must not hold up the coordinator."""
        self._held_above = None
        if self.steps:
            self._released = asyncio.ensure_future(self._commit_ready())

    def abandon_after(self, step: int) -> None:
        """Steps prepared by an old generation after the resume point will not commit."""
        self.steps = {s: p for s, p in self.steps.items() if s <= step}
        self._built = {s: m for s, m in self._built.items() if s <= step}

    async def resend(self, step: int, nodes: list[str]) -> None:
        """Send the committed record of `step` again to `nodes` (not this daemon): a
        coordinator that died while sending phase two left it on some daemons only."""
        others = [n for n in nodes if n != self.node]
        if self.load_record is None or not others:
            return
        try:
            record = self.load_record(step)
        except (FileNotFoundError, KeyError, ValueError) as exc:
            log.error("cannot re-send a commit", extra={"step": step, "error": str(exc)})
            return
        await commit_tree.pass_on(peer_pb2.CommitStepRequest(record=record), others,
                                  self.links.commit_step)

    async def _commit_ready(self) -> None:
        async with self._committing:
            latest = self.latest_committed()
            for step in sorted(self.steps):
                if latest is not None and step <= latest:
                    del self.steps[step]
                    continue
                if self._held_above is not None and step > self._held_above:
                    return  # a plan is being decided from an earlier step
                pending = self.steps[step]
                if not pending.complete:
                    if self._complete_after(step):
                        # Every rank prepares in step order, so a complete later step means
                        # this one's missing prepares are lost (they went to a coordinator
                        # that died, or a hurry made the step moot and the daemons dropped
                        # its captures): skip it instead of blocking every later commit.
                        if (pending.generation == self.hurried[0]
                                and step < self.hurried[1]):
                            log.info("step skipped: a hurry before a re-plan made it moot",
                                     extra={"step": step, "have": pending.covered})
                        else:
                            log.warning("step skipped: some ranks' prepares were lost",
                                        extra={"step": step, "have": pending.covered})
                        del self.steps[step]
                        continue
                    return  # steps commit in order; a later one waits for this one
                if not self.links.holds_seat():
                    # Deposed (its etcd seat lapsed): the successor commits this step. A
                    # commit from here would be on this daemon alone, and later steps'
                    # deltas there would need a step no other daemon has.
                    log.warning("step not committed: this daemon no longer holds the "
                                "coordinator seat", extra={"step": step})
                    return
                if not await self._commit(step, pending):
                    return
                latest = step
                if sum(pending.finals.values()) >= pending.world:
                    await self.finished(step)

    async def _commit(self, step: int, pending: PendingStep) -> bool:
        """Phase two of one complete step on every daemon; False to try again later."""
        order = sorted(pending.seals.values())  # by first rank
        seals = [s[1] for s in order]
        built = self._built.get(step)
        if built is not None and built[0].generation == pending.generation \
                and built[1] == seals:
            record = built[0]
        else:
            record = sr.build_from_bytes(
                job_id=self.job_id, step=step, generation=pending.generation,
                layout=pending.layout, seals=seals,
                base_step=min(map(itemgetter(3), order), default=step))
            self._built[step] = (record, seals)
        t0 = time.monotonic()
        nodes = sorted(pending.seals)  # the record's, as commit_tree.nodes_of gives them
        request, targets = self._phase_two(record, nodes)
        local = self._local = asyncio.ensure_future(self.links.commit_step(self.node, request))
        passing = asyncio.ensure_future(
            commit_tree.pass_on(request, targets, self.links.commit_step, nodes))
        try:
            [mine] = await asyncio.gather(local, return_exceptions=True)
        finally:
            if self._local is local:
                self._local = None
        if isinstance(mine, BaseException):
            # Not committed here means not committed: keep it pending and retry soon,
            # since the last prepares of a job may already be in.
            await asyncio.gather(passing, return_exceptions=True)
            log.error("commit failed on the coordinator itself",
                      extra={"step": step, "error": str(mine)})
            self._retry_later()
            return False
        # Committed here, so committed: a re-plan waiting for this step goes on now, not
        # once every daemon has acknowledged it (one that is frozen, not yet declared
        # lost, would hold it until then); a daemon that lacks the commit takes it from
        # this one before it adopts a plan resuming from it (JobGate).
        self._commit_times.append((time.monotonic(), step))
        self.steps.pop(step, None)  # a plan decided meanwhile may have abandoned it
        self._built = {s: m for s, m in self._built.items() if s in self.steps}
        async with self._landed:
            self._landed.notify_all()
        generation = self.generation()
        if generation is not None and pending.generation >= generation:
            self.committed(pending.generation)
        missed = await passing  # the next step's phase two follows this one's
        if missed:
            log.warning("commit not acknowledged by every daemon",
                        extra={"step": step, "missed": missed})
        self.metrics.commit_seconds.observe(time.monotonic() - t0)
        return True

    def _phase_two(self, record: manifest_pb2.StepRecord, nodes: list[str]
                   ) -> tuple[peer_pb2.CommitStepRequest, list[str]]:
        """The request that commits `record`, and the daemons this coordinator sends it
        to: every live one, or with the commit tree over `nodes` (those the record's
        seals name, sorted) its children in it (and its own children there, and the
        daemons outside the tree)."""
        live = [n for n in self.links.nodes() if n != self.node]
        if not self.keyed or self.fanout <= 0 or len(live) <= self.fanout:
            return peer_pb2.CommitStepRequest(record=record), live
        inside = set(nodes)
        targets = dict.fromkeys([*commit_tree.children(nodes, None, self.fanout),
                                 *commit_tree.children(nodes, self.node, self.fanout),
                                 *(n for n in live if n not in inside)])
        targets.pop(self.node, None)
        return peer_pb2.CommitStepRequest(record=record, fanout=self.fanout,
                                          signature=self.key.sign(record)), list(targets)

    def _retry_later(self) -> None:
        if self._retry is None:
            def retry() -> None:
                self._retry = None
                self._retrying = asyncio.ensure_future(self._commit_ready())
            self._retry = asyncio.get_running_loop().call_later(COMMIT_RETRY_S, retry)

    def _complete_after(self, step: int) -> bool:
        return any(s > step and p.complete for s, p in self.steps.items())
