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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from stalwart.core import step_record as sr
from stalwart.core.generation import check_generation
from stalwart.core.layout import Layout
from stalwart.daemon.metrics import Metrics
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

COMMIT_RETRY_S = 1.0  # seconds before a commit that failed on the coordinator is retried
log = logging.getLogger("stalwart.daemon.recovery.step_commits")


class PeerLinks(Protocol):
    """Outbound calls from the coordinator to every daemon (itself included)."""

    def nodes(self) -> list[str]:
        """Live daemons of the job, by node name."""

    def holds_seat(self) -> bool:
        """False once this daemon has lost the etcd seat it coordinated from (always True
        without etcd): a deposed coordinator must not install plans."""

    async def install_plan(self, node: str, plan: common_pb2.Plan) -> None: ...

    async def commit_step(self, node: str, record: manifest_pb2.StepRecord) -> None: ...


def covered(seals: dict[int, manifest_pb2.RankSeal]) -> int:
    """Ranks the prepares of a step have sealed so far: O(prepares), not O(ranks)."""
    return sum(len(s.ranks) for s in seals.values())


def world_of(lay: common_pb2.ParallelLayout) -> int:
    """Ranks that must prepare a step captured in `lay`."""
    return Layout.from_proto(lay).world_size


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
    # step -> first rank of a prepare's seal -> that seal (a prepare sent again replaces
    # its first copy); the seals of a step cover its ranks once each
    pending: dict[int, dict[int, manifest_pb2.RankSeal]] = field(default_factory=dict)
    layouts: dict[int, common_pb2.ParallelLayout] = field(default_factory=dict)
    generations: dict[int, int] = field(default_factory=dict)
    finals: dict[int, set[int]] = field(default_factory=dict)  # step -> ranks ending there
    _committing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The record first sent for each pending step: a retry sends the same bytes, so a
    # daemon that committed the first attempt accepts it again (a rebuilt one differs).
    _built: dict[int, manifest_pb2.StepRecord] = field(default_factory=dict)
    _retry: asyncio.TimerHandle | None = None
    _retrying: asyncio.Future[None] | None = None

    async def prepared(self, req: peer_pb2.PrepareStepRequest) -> None:
        """Phase one from one daemon: its ranks' records for a step are durable."""
        if (generation := self.generation()) is not None:
            check_generation(req.generation, generation, f"prepare of step {req.step}")
        latest = self.latest_committed()
        if latest is not None and req.step <= latest:
            # Sent again after a change of coordinator, by a daemon that may have missed
            # the commit: send it the commit.
            await self.resend(req.step, [req.node])
            return
        self.pending.setdefault(req.step, {})[req.seal.ranks[0]] = req.seal
        self.layouts[req.step] = req.layout
        self.generations[req.step] = req.generation
        if req.final:
            self.finals.setdefault(req.step, set()).update(req.seal.ranks)
        await self._commit_ready()

    def abandon_after(self, step: int) -> None:
        """Steps prepared by an old generation after the resume point will not commit."""
        self.pending = {s: r for s, r in self.pending.items() if s <= step}
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
        results = await asyncio.gather(*(self.links.commit_step(n, record) for n in others),
                                       return_exceptions=True)
        for node, result in zip(others, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("commit not re-sent",
                            extra={"node": node, "step": step, "error": str(result)})

    async def _commit_ready(self) -> None:
        async with self._committing:
            latest = self.latest_committed()
            for step in sorted(self.pending):
                if latest is not None and step <= latest:
                    del self.pending[step]
                    continue
                lay = self.layouts[step]
                if covered(self.pending[step]) < world_of(lay):
                    if self._complete_after(step):
                        # Every rank prepares in step order, so a complete later step means
                        # this one's missing prepares are lost (they went to a coordinator
                        # that died): skip it instead of blocking every later commit.
                        log.warning("step skipped: some ranks' prepares were lost",
                                    extra={"step": step, "have": covered(self.pending[step])})
                        del self.pending[step]
                        continue
                    return  # steps commit in order; a later one waits for this one
                if not await self._commit(step, lay):
                    return
                latest = step
                if len(self.finals.pop(step, ())) >= world_of(lay):
                    await self.finished(step)

    async def _commit(self, step: int, lay: common_pb2.ParallelLayout) -> bool:
        """Phase two of one complete step on every daemon; False to try again later."""
        seals = list(self.pending[step].values())
        record = self._built.get(step)
        if (record is None or record.generation != self.generations[step]
                or sorted(x.SerializeToString() for x in record.seals)
                != sorted(x.SerializeToString() for x in seals)):
            bases = [b for x in seals for b in x.bases]
            record = self._built[step] = sr.build(
                job_id=self.job_id, step=step, generation=self.generations[step],
                layout=lay, seals=seals, base_step=min(bases, default=step))
        t0 = time.monotonic()
        nodes = self.links.nodes()
        results = await asyncio.gather(*(self.links.commit_step(n, record) for n in nodes),
                                       return_exceptions=True)
        errors = {n: r for n, r in zip(nodes, results, strict=True)
                  if isinstance(r, BaseException)}
        failed = [f"{n}: {r}" for n, r in errors.items()]
        if self.node in errors:
            # Not committed here means not committed: keep it pending and retry soon,
            # since the last prepares of a job may already be in.
            log.error("commit failed on the coordinator itself",
                      extra={"step": step, "errors": failed})
            self._retry_later()
            return False
        if failed:
            log.warning("commit not acknowledged by every daemon",
                        extra={"step": step, "errors": failed})
        self.metrics.commit_seconds.observe(time.monotonic() - t0)
        generation = self.generation()
        if generation is not None and self.generations[step] >= generation:
            self.committed(self.generations[step])
        del self.pending[step]
        self.layouts.pop(step, None)
        self.generations.pop(step, None)
        self._built = {s: m for s, m in self._built.items() if s in self.pending}
        return True

    def _retry_later(self) -> None:
        if self._retry is None:
            def retry() -> None:
                self._retry = None
                self._retrying = asyncio.ensure_future(self._commit_ready())
            self._retry = asyncio.get_running_loop().call_later(COMMIT_RETRY_S, retry)

    def _complete_after(self, step: int) -> bool:
        for s, seals in self.pending.items():
            lay = self.layouts.get(s)
            if s > step and lay is not None and covered(seals) >= world_of(lay):
                return True
        return False
