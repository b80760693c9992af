"""Failures this daemon learns of, on their way to the coordinator's decision.

Detectors (registry, membership, GPU health, rank reports) put typed failures on one
queue. The coordinator decides on the facts it holds the moment one arrives (hang
reports wait a window, since they need every rank's word) and believes only what the
subject's daemon confirms; any other daemon forwards each report at once, and keeps
what it could not deliver for the next coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.daemon.recovery.registry import Registry
from stalwart.v1 import peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.recovery.reports")

RPC_TIMEOUT_S = 10.0
HANG_WINDOW_S = 1.5   # collect hang reports this long before deciding (seconds)
RETRY_MAX_S = 10.0  # the longest pause before a batch whose handling failed is retried
# Other failures are facts, decided on at once with whatever else is queued by then: a
# daemon's liveness check reports every rank of its node it finds gone together, and a
# fact that comes later is met by a second plan. Waiting for a burst to pause would put
# that pause on every recovery's path.


class FailureReports:
    """The queue of failures, and what happens to them on this daemon."""

    def __init__(self, coordinator: Coordinator, registry: Registry, metrics: Metrics,
                 is_leader: Callable[[], bool],
                 stub: Callable[[], peer_pb2_grpc.PeerServiceStub],
                 confirmed: Callable[[Failure], Awaitable[bool]],
                 catch_up: Callable[[], Awaitable[None]], heartbeat_interval_s: float,
                 live_ranks: Callable[[], set[str]] = set) -> None:
        self.coordinator, self.registry, self.metrics = coordinator, registry, metrics
        self.is_leader, self.stub, self.confirmed = is_leader, stub, confirmed
        self.catch_up = catch_up  # commits the predecessor did not finish sending
        # The live ranks of the live daemons, as their heartbeats name them: those a new
        # coordinator waits to hear re-announced before it decides.
        self.live_ranks = live_ranks
        self.interval_s = heartbeat_interval_s
        self._queue: asyncio.Queue[Failure] = asyncio.Queue()
        self._unsent: list[Failure] = []  # reports the coordinator never received
        # Reports on their way to the coordinator, by the task sending them: a frozen
        # coordinator (SIGSTOP, a hung host) holds its calls open until their deadline,
        # and they must not hold up the queue, nor stay with it once the seat moves.
        self._sending: dict[asyncio.Task[None], list[Failure]] = {}
        self._retry_in = 0.0  # the pause before a batch whose handling failed is retried

    def put(self, failure: Failure) -> None:
        self._queue.put_nowait(failure)
        self.coordinator.failure_queued()

    def redeliver(self) -> None:
        """A new coordinator: what the old one never received goes to it, and so do the
        reports still on their way to the old one (called back)."""
        sending, self._sending = self._sending, {}
        for task, failures in sending.items():
            task.cancel()
            self._unsent.extend(failures)
        unsent, self._unsent = self._unsent, []
        for failure in unsent:
            self._queue.put_nowait(failure)

    async def forever(self) -> None:
        while True:
            first = await self._queue.get()
            if not self.is_leader():
                # Only the coordinator batches: a second window here would deliver these
                # reports after the coordinator's own window closed, and a hang it sees
                # reported by fewer ranks blames every silent one.
                self._forward_soon([first])
                continue
            batch = [first]
            if first.kind is FailureKind.COLLECTIVE_HANG:
                loop = asyncio.get_running_loop()
                end = loop.time() + HANG_WINDOW_S
                while (left := end - loop.time()) > 0:
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), left))
                    except TimeoutError:
                        break
            await asyncio.sleep(0)  # reports already handed to the loop reach the queue
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._decide(batch)
            except Exception:
                # Dropping the batch would leave its failures unhandled until another
                # came: it is queued again after a pause that grows while this lasts.
                self._retry_in = min(RETRY_MAX_S, max(self.interval_s, 2 * self._retry_in))
                log.exception("failure handling failed; trying again in %.1f s",
                              self._retry_in, extra={"failures": [f.describe() for f in batch]})
                asyncio.get_running_loop().call_later(self._retry_in, self._requeue, batch)
            else:
                self._retry_in = 0.0

    async def _decide(self, failures: list[Failure]) -> None:
        if not self.is_leader():
            self._forward_soon(failures)  # the seat moved during the window
            return
        failures = [f for f in failures if await self._believed(f)]
        if not failures:
            return
        self.coordinator.take_over(self.registry.current_plan())
        await self._settle()
        await self.catch_up()
        await self.coordinator.on_failures(failures)

    async def _settle(self) -> None:
        """A new coordinator knows only the installed plan: it decides once every live
        rank the live daemons' heartbeats name (spares that came after that plan, and
        the store each rank serves) has been re-announced to it, which each daemon does
        within a heartbeat of seeing the seat move; at most 3 heartbeats after it took
        the seat (a rank that died meanwhile is never announced)."""
        until = self.coordinator.took_over_at + 3 * self.interval_s
        while (left := until - time.monotonic()) > 0:
            self.coordinator.heard.clear()
            if self.live_ranks() <= set(self.coordinator.announced):
                return
            with contextlib.suppress(TimeoutError):  # heartbeats may change the set too
                await asyncio.wait_for(self.coordinator.heard.wait(),
                                       min(left, self.interval_s))

    def _requeue(self, failures: list[Failure]) -> None:
        for f in failures:
            self.put(f)

    def _forward_soon(self, failures: list[Failure]) -> None:
        """`failures` to the coordinator on a task of their own (`_sending`)."""
        task = asyncio.get_running_loop().create_task(self._forward(failures))
        self._sending[task] = failures
        task.add_done_callback(lambda done: self._sending.pop(done, None))

    async def _forward(self, failures: list[Failure]) -> None:
        for i, f in enumerate(failures):
            try:
                ack = await self.stub().ReportFailure(f.to_proto(), timeout=RPC_TIMEOUT_S)
                if not ack.accepted:
                    log.info("failure report set aside by the coordinator: %s", ack.message,
                             extra={"failure": f.describe()})
            except (grpc.aio.AioRpcError, LookupError) as exc:
                # The coordinator may be the thing that died: resend to its successor.
                log.warning("failure report not delivered; will resend to the next "
                            "coordinator: %s", exc)
                self._unsent.extend(failures[i:])
                return

    async def _believed(self, failure: Failure) -> bool:
        if await self.confirmed(failure):
            return True
        self.metrics.auth_refused.labels("unconfirmed").inc()
        log.warning("failure report not believed: the subject's daemon reports it alive",
                    extra={"failure": failure.describe()})
        return False
