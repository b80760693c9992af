"""This node's ranks and spares, made known to the coordinator, and again to each new one.

A rank that registers here is announced to the coordinator (so it can be placed,
or kept as a spare). An announcement the coordinator cannot take (it died, is paused,
or does not count this daemon a member yet) leaves the rank registered here and is
sent again, backing off from one heartbeat interval to RETRY_MAX_S, until one is
taken: a spare that starts while its coordinator fails over waits for the next one
instead of dying. When the coordinator changes, the new one is told about every
live local rank, gets the prepares and failure reports the old one may have died
with, and, if it is this daemon, takes over from the installed plan.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

import grpc

from stalwart.daemon.background import Background
from stalwart.daemon.recovery.coordinator import Coordinator
from stalwart.daemon.recovery.election import Leadership
from stalwart.daemon.recovery.liveness import ALIVE, LATE
from stalwart.daemon.recovery.registry import RankRecord, Registry
from stalwart.v1 import common_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.recovery.announce")

# One try of an announcement the coordinator may not answer, the election wait included:
# inside a rank's Register call within the rank's own 5 s deadline (a paused coordinator
# delays a registration, never fails it), and on each retry (so `follow` is never held
# up for long).
TRY_S = 4.0
MIN_RPC_S = 0.5  # the least time the coordinator's answer is given
RETRY_MAX_S = 30.0  # retries back off from one interval up to this, with jitter
# Refusals a later try can get past: a coordinator that is dead, paused or overloaded,
# or that does not count this daemon a live member of the job yet. Any other refusal
# (a token the coordinator does not share, a malformed announcement) goes to the rank.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.CANCELLED, grpc.StatusCode.PERMISSION_DENIED,
                       grpc.StatusCode.FAILED_PRECONDITION,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
Registration = tuple[common_pb2.ParallelLayout, common_pb2.LayerProfile | None,
                     tuple[str, int] | None]


class Announcer:
    """Announcements of this node's ranks to whichever daemon coordinates."""

    def __init__(self, node: str, registry: Registry, leadership: Leadership,
                 coordinator: Coordinator, address: Callable[[], str],
                 stub: Callable[[str], peer_pb2_grpc.PeerServiceStub],
                 redeliver: Callable[[], Awaitable[None]], interval_s: float) -> None:
        self.node, self.registry, self.leadership = node, registry, leadership
        self.coordinator, self.address, self.stub = coordinator, address, stub
        self.redeliver, self.interval_s = redeliver, interval_s
        # rank_id -> (layout, layer profile, store (host, port)) each local rank registered,
        # kept for a later coordinator: without the layer profile it could not shrink.
        self._registered: dict[str, Registration] = {}
        self._seen = ""
        self._had_coordinator = False
        self._undelivered: set[str] = set()  # live local ranks no coordinator has taken yet
        self._retry_gap_s = interval_s
        self._retry_at = 0.0  # monotonic time of the next retry
        self._decisions = Background()  # this daemon's own coordinator deciding
        # Local ranks that left having trained the job's length (see `finished`), and
        # those of them no coordinator has taken yet.
        self._finished: dict[str, peer_pb2.RankAnnouncement] = {}
        self._unsent: set[str] = set()

    async def on_register(self, record: RankRecord, layout: common_pb2.ParallelLayout,
                          profile: common_pb2.LayerProfile | None = None,
                          store: tuple[str, int] | None = None) -> None:
        """Keep a local rank's registration and announce it. A coordinator that does not
        answer (it died, is paused, or cannot be reached yet) is not the rank's problem:
        `follow` sends the announcement again. Raises for what the rank must be told:
        LookupError when no coordinator is elected at all (etcd down or misconfigured),
        the RPC error when the coordinator refuses it for good."""
        self._registered[record.rank_id] = (layout, profile, store)
        await self._deliver(record, tell=True)

    async def _deliver(self, record: RankRecord, tell: bool = False) -> bool:
        """Announce `record`; False when it is kept to send again. With `tell`, a refusal
        no retry can get past is raised instead of logged."""
        try:
            await self._announce(record)
            if self._undelivered:  # the coordinator answers: the others need not wait
                self._retry_at = 0.0
            return True
        except TimeoutError:
            self._keep(record.rank_id, f"no answer within {TRY_S:g} s")
        except asyncio.CancelledError:  # the rank stopped waiting: it is still registered
            self._keep(record.rank_id, "the rank's call was cancelled")
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in TRANSIENT:
                self._undelivered.discard(record.rank_id)
                if tell:
                    raise
                log.error("the coordinator refused a rank's announcement",
                          extra={"rank_id": record.rank_id, "error": exc.details()})
                return True  # nothing more to send: a retry would be refused the same way
            self._keep(record.rank_id, exc.details() or exc.code().name)
        except LookupError as exc:
            if tell:  # the rank is refused and ends: nothing to announce later
                raise
            self._keep(record.rank_id, str(exc))
        return False

    async def finished(self, rank_id: str) -> None:
        """A local rank left after training the job's whole length: tell the coordinator
        (it ends a job whose ranks were launched again after its last step committed,
        where no commit does). Sent again while it is not taken, and to each new
        coordinator: one that took the seat as the ranks left would not know."""
        record = self.registry.get(rank_id)
        if record is None or not record.finished_at:
            return
        self._finished[rank_id] = peer_pb2.RankAnnouncement(
            node=self.node, rank_id=rank_id, rank=-1 if record.spare else record.rank,
            world_size=record.world_size, finished_at=record.finished_at)
        await self._send_finished(rank_id)

    async def _send_finished(self, rank_id: str) -> None:
        a = self._finished[rank_id]
        a.generation = self.registry.generation
        try:
            await self.announce(a)
            self._unsent.discard(rank_id)
        except (TimeoutError, LookupError, grpc.aio.AioRpcError) as exc:
            if rank_id not in self._unsent:
                log.warning("could not tell the coordinator a rank finished; sending it "
                            "again", extra={"rank_id": rank_id, "error": str(exc)})
            self._unsent.add(rank_id)

    def _keep(self, rank_id: str, error: str) -> None:
        if rank_id not in self._undelivered:
            log.warning("rank registered here but not yet announced to the coordinator; "
                        "sending it again", extra={"rank_id": rank_id, "error": error})
        self._undelivered.add(rank_id)

    async def _announce(self, record: RankRecord) -> None:
        layout, profile, store = self._registered.get(
            record.rank_id, (common_pb2.ParallelLayout(), None, None))
        endpoint = ""
        if store is not None:  # the rank's own host, else this daemon's (the same node)
            endpoint = f"{store[0] or self.address().rpartition(':')[0]}:{store[1]}"
        await self.announce(peer_pb2.RankAnnouncement(
            node=self.node, rank_id=record.rank_id, rank=-1 if record.spare else record.rank,
            world_size=record.world_size, layout=layout, generation=self.registry.generation,
            profile=profile, store=endpoint))
        if record.rank_id in self._undelivered:
            self._undelivered.discard(record.rank_id)
            log.info("rank announced to the coordinator", extra={"rank_id": record.rank_id})

    def _live(self) -> list[RankRecord]:
        return [r for r in self.registry.ranks() if r.state in (ALIVE, LATE)]

    async def announce(self, a: peer_pb2.RankAnnouncement) -> None:
        """Tell the coordinator, waiting TRY_S at most for the election and its answer
        together: TimeoutError past that. This daemon's own coordinator decides to the end
        however long that takes (a decision stopped halfway would install a plan on some
        daemons only); waiting past TRY_S for it is not needed, it has the rank."""
        deadline = time.monotonic() + TRY_S
        coordinator = await asyncio.wait_for(self.leadership.known(), TRY_S)
        left = max(MIN_RPC_S, deadline - time.monotonic())
        if coordinator == self.node:
            self.coordinator.take_over(self.registry.current_plan())
            decision = self._decisions.start(self.coordinator.announce(a))
            done, _ = await asyncio.wait({decision}, timeout=left)  # never cancels it
            if done:
                decision.result()
            return
        await self.stub(coordinator).Announce(a, timeout=left)

    async def follow(self) -> None:
        """When the coordinator changes, tell the new one about this node's ranks."""
        while True:
            await asyncio.sleep(self.interval_s)
            current = self.leadership.leader()
            if current == self._seen:
                await self._retry_undelivered()
                for rank_id in sorted(self._unsent):
                    await self._send_finished(rank_id)
                continue
            self._seen = current
            if not current:
                continue  # the etcd seat is empty: wait for its next holder
            if not self._had_coordinator:
                self._had_coordinator = True
                self._retry_gap_s, self._retry_at = self.interval_s, 0.0
                await self._retry_undelivered()
                continue  # the first coordinator this daemon sees: nothing to hand over
            log.warning("coordinator changed", extra={"coordinator": current})
            if current == self.node:
                self.coordinator.take_over(self.registry.current_plan())
                # The layer profile is the model's, the same from every rank: with the
                # one a local rank registered, the failures redelivered next can already
                # be met by shrinking, before other daemons re-announce their ranks.
                if self.coordinator.profile is None:
                    self.coordinator.profile = next(
                        (p for _, p, _ in self._registered.values() if p is not None
                         and p.costs), None)
            await self.redeliver()
            # The new coordinator has not heard them (those the registry still holds).
            self._finished = {r: a for r, a in self._finished.items()
                              if self.registry.get(r) is not None}
            self._unsent.update(self._finished)
            self._retry_gap_s, self._retry_at = self.interval_s, 0.0
            live = self._live()
            for i, record in enumerate(live):
                if not await self._deliver(record):
                    # It does not answer: the rest wait for the retries, not in line here.
                    self._undelivered.update(r.rank_id for r in live[i + 1:])
                    break

    async def _retry_undelivered(self) -> None:
        """Announce again the live local ranks no coordinator has taken yet, backing off
        while none is taken (so a slow new coordinator is not flooded)."""
        if not self._undelivered or time.monotonic() < self._retry_at:
            return
        live = {r.rank_id: r for r in self._live()}
        self._undelivered &= live.keys()  # a rank that ended needs no announcing
        taken = await asyncio.gather(*(self._deliver(live[r]) for r in sorted(self._undelivered)))
        if all(taken):
            self._retry_gap_s = self.interval_s
        else:
            self._retry_gap_s = min(2 * self._retry_gap_s, RETRY_MAX_S)
            self._retry_at = time.monotonic() + self._retry_gap_s * random.uniform(0.5, 1.0)
