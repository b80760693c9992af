"""Commit, the fifth stage: phase one out (prepares to the coordinator), phase two in.

A daemon tells the coordinator when its ranks' records for a step are durable and
copied (`PrepareOutbox`, which keeps the prepares until the step commits, for a
coordinator that takes over); a prepare carries the records' seal, not the records.
The coordinator's CommitStep brings the step's small record (`StepRecord`), which
`Committer.commit` makes visible here atomically, wakes the ranks waiting on it, and
the leader uploads to S3.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from stalwart.core.generation import StaleGeneration
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.s3_tier import ManifestExistsError, S3Tier
from stalwart.v1 import manifest_pb2, peer_pb2, rank_pb2

log = logging.getLogger("stalwart.daemon.snapshot.commit")

DEFAULT_WAIT_S = 30.0  # WaitCommitted without a timeout


class Committer:
    """Committed steps on this daemon: install one, wait for one."""

    def __init__(self, node: str, store: LocalStore, s3: S3Tier | None,
                 is_leader: Callable[[], bool]) -> None:
        self.node, self.store, self.s3, self.is_leader = node, store, s3, is_leader
        # Commits get their own thread so a backlog of captures never delays publishing.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="commit")
        self._committed = asyncio.Condition()

    async def _run(self, fn: Callable[..., object], *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def commit(self, record: manifest_pb2.StepRecord, verified: bool = False) -> None:
        """Phase two, sent by the coordinator to every daemon (again by a new one).
        `verified`: the caller has just checked the record (`step_record.verify`), as the
        RPCs that carry one do (rpc/validate.py); else the store checks it."""
        latest = self.store.latest_committed()
        if record.step not in self.store.committed_steps() and latest is not None \
                and record.step < latest:
            # New steps commit above the latest one (discard_after lowers it first), so
            # this is a late copy of a step retired here: nothing to do.
            log.info("commit of a step not kept here ignored", extra={"step": record.step})
            return
        await self._run(lambda: self.store.commit(record, local_node=self.node,
                                                  verified=verified))
        if self.s3 is not None and self.is_leader():
            data = record.SerializeToString(deterministic=True)
            try:
                await self.s3.put_manifest(record.step, data)
            except ManifestExistsError:
                # The previous uploader (a daemon since lost) got there first: the same
                # commit is fine; a different one means two writers disagree.
                if await self.s3.get_manifest(record.step) != data:
                    raise
        async with self._committed:
            self._committed.notify_all()

    async def wait_committed(self, step: int, timeout_s: float) -> rank_pb2.WaitCommittedReply:
        """Whether `step` commits within `timeout_s` (0: DEFAULT_WAIT_S) seconds."""
        timeout_s = timeout_s or DEFAULT_WAIT_S
        deadline = time.monotonic() + timeout_s

        def reached() -> bool:
            latest = self.store.latest_committed()
            return latest is not None and latest >= step

        async with self._committed:
            while not reached():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._committed.wait(), left)
                except TimeoutError:
                    break
        latest = self.store.latest_committed()
        return rank_pb2.WaitCommittedReply(
            committed=reached(), latest_committed=latest or 0,
            message="" if reached() else f"step {step} not committed within "
            f"{timeout_s:g} s; latest committed is {latest}")

    def stop(self) -> None:
        self._io.shutdown(wait=True)


Deliver = Callable[[peer_pb2.PrepareStepRequest], Awaitable[None]]


def _left_behind(exc: Exception) -> bool:
    """Whether a prepare was refused for its generation, by this daemon's coordinator
    (StaleGeneration) or another's (ABORTED, the peer service's one status for it)."""
    return isinstance(exc, StaleGeneration) or (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.ABORTED)


class PrepareOutbox:
    """Phase one from this daemon: prepares to the coordinator, kept until their step
    commits here, so a coordinator that takes over gets them again."""

    def __init__(self, deliver: Deliver, latest_committed: Callable[[], int | None],
                 generation: Callable[[], int]) -> None:
        self.deliver, self.latest_committed, self.generation = \
            deliver, latest_committed, generation
        self._pending: dict[int, list[peer_pb2.PrepareStepRequest]] = {}

    async def send(self, req: peer_pb2.PrepareStepRequest) -> None:
        latest = self.latest_committed() or 0
        for step in [s for s in self._pending if s <= latest]:
            del self._pending[step]
        self._pending.setdefault(req.step, []).append(req)
        try:
            await self.deliver(req)
        except (grpc.aio.AioRpcError, LookupError, StaleGeneration) as exc:
            if _left_behind(exc):
                # A newer plan resumes before this step: it will never commit. Expected
                # after every re-plan that caught a step in flight.
                waiting = self._pending.get(req.step, [])
                if req in waiting:  # a concurrent send may have let the step go
                    waiting.remove(req)
                if not waiting:
                    self._pending.pop(req.step, None)
                log.info("prepare dropped: a newer plan left its step behind",
                         extra={"step": req.step, "generation": req.generation})
                return
            # The coordinator may be the thing that died: its successor gets it.
            log.warning("prepare not delivered; will resend to the next coordinator",
                        extra={"step": req.step, "error": str(exc)})

    async def resend(self) -> None:
        """Phase one again, for a new coordinator: every step prepared here that has not
        committed here (a coordinator that already committed one sends the commit back)."""
        latest = self.latest_committed() or 0
        generation = self.generation()
        for step in sorted(self._pending):
            for req in self._pending[step]:
                if step <= latest or req.generation < generation:
                    continue
                try:
                    await self.deliver(req)
                except (grpc.aio.AioRpcError, LookupError, StaleGeneration) as exc:
                    log.warning("prepare not resent", extra={"step": step, "error": str(exc)})
