"""Who leads the job: one daemon coordinates, repairs lost shards and uploads manifests.

`Leadership` is the one interface every such decision asks. In a cluster with etcd
the leader is the holder of a lease-based seat (`EtcdElection`, whose `term` grows
with every new leader); without etcd it is membership's rule (the daemon that
decided the installed plan while it lives, else the smallest eligible live name).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.recovery.membership import SUSPECT, UP, Membership

__all__ = ["EtcdElection", "Leadership"]

log = logging.getLogger(__name__)

ElectedCallback = Callable[[int], object]
LostCallback = Callable[[str], object]


async def _call(cb: Callable[..., object] | None, arg: object) -> None:
    if cb is None:
        return
    result = cb(arg)
    if inspect.isawaitable(result):
        await result


class EtcdElection:
    """Lease-based election on one etcd key per job (`/stalwart/<job_id>/coordinator`).

    A candidate creates the key only if it is absent, attached to its lease of `ttl_s`
    seconds, and refreshes the lease every `ttl_s / 3`. It steps down (`on_lost`) as soon
    as a refresh fails to land within `ttl_s` of the last good one, before etcd could hand
    the key to someone else. The others watch the key and campaign when it is deleted.
    `term` is the key's create revision: larger for every later leader.
    """

    def __init__(self, candidate: str, *, endpoint: str = "127.0.0.1:2379",
                 job_id: str = "default", ttl_s: int = 2,
                 on_elected: ElectedCallback | None = None,
                 on_lost: LostCallback | None = None) -> None:
        import aetcd  # imported here: a single-machine daemon never needs it

        host, _, port = endpoint.rpartition(":")
        self.candidate = candidate
        self.key = f"/stalwart/{job_id}/coordinator".encode()
        self.ttl_s = max(2, int(ttl_s))  # etcd grants at least ~2 s with default timeouts
        self.on_elected, self.on_lost = on_elected, on_lost
        self.is_leader = False
        self.term = 0
        self._aetcd = aetcd
        self._client = aetcd.Client(host=host or "127.0.0.1", port=int(port),
                                    timeout=self.ttl_s)
        self._lease: Any = None
        self._task: asyncio.Task | None = None
        self._abandoned: set[asyncio.Task] = set()

    async def _bounded(self, call: Awaitable[Any], timeout_s: float | None = None) -> Any:
        """Await one etcd call for at most `timeout_s` (default: two lease times).

        asyncio.wait_for is not enough: on timeout or cancellation it waits for the call
        to finish unwinding, and a cancelled aetcd stream (lease keep-alive, watch) can
        take forever to do that under load. A call that overruns is cancelled and left
        to unwind in the background; the caller goes on at once.
        """
        limit = timeout_s or 2.0 * self.ttl_s
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=limit)
        except asyncio.CancelledError:
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError(f"etcd did not answer within {limit:.1f} s")
        return task.result()

    def _abandon(self, task: asyncio.Task) -> None:
        task.cancel()
        self._abandoned.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as unhandled

    async def start(self) -> None:
        """Begin campaigning in the background; returns at once."""
        self._task = asyncio.create_task(self._campaign(), name=f"election-{self.candidate}")

    async def stop(self) -> None:
        """Stop campaigning; a leader resigns (revokes its lease) so another takes over now."""
        if self._task is not None:
            self._task.cancel()
            # Bounded: the campaign's own etcd calls are, but do not trust that with a stop.
            await asyncio.wait({self._task}, timeout=2.0 * self.ttl_s)
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._bounded(self._lease.revoke())
        if self.is_leader:
            self.is_leader = False
            await _call(self.on_lost, "resigned")
        with contextlib.suppress(Exception):
            await self._bounded(self._client.close())

    async def leader(self) -> str | None:
        """The current leader's name, or None while the seat is empty."""
        got = await self._bounded(self._client.get(self.key))
        return got.value.decode() if got is not None else None

    async def _campaign(self) -> None:
        while True:
            try:
                if await self._try_acquire():
                    self.is_leader = True
                    log.info("%s elected coordinator (term %d)", self.candidate, self.term)
                    await _call(self.on_elected, self.term)
                    reason = await self._hold()
                    self.is_leader = False
                    log.warning("%s lost the coordinator seat: %s", self.candidate, reason)
                    await _call(self.on_lost, reason)
                else:
                    await self._wait_vacancy()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd unreachable or restarting: retry after a pause
                log.warning("election on %s: %s; retrying", self.key.decode(), exc)
                if self.is_leader:
                    self.is_leader = False
                    await _call(self.on_lost, f"etcd error: {exc}")
                await asyncio.sleep(self.ttl_s / 3)

    async def _try_acquire(self) -> bool:
        c = self._client
        self._lease = await self._bounded(c.lease(self.ttl_s))
        ok, responses = await self._bounded(c.transaction(
            compare=[c.transactions.create(self.key) == 0],
            success=[c.transactions.put(self.key, self.candidate.encode(), lease=self._lease)],
            failure=[],
        ))
        if ok:
            self.term = responses[0].response_put.header.revision
            return True
        await self._bounded(self._lease.revoke())
        self._lease = None
        return False

    async def _hold(self) -> str:
        """Keep the lease alive; return why leadership ended."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            sent = time.monotonic()
            try:
                reply = await self._bounded(
                    self._client.refresh_lease(self._lease.id),
                    max(0.1, self.ttl_s - (sent - last_ok)))
            except (TimeoutError, self._aetcd.ClientError) as exc:
                if time.monotonic() - last_ok >= self.ttl_s:
                    return f"could not renew the lease within {self.ttl_s} s ({exc!r})"
                continue
            if reply is None or reply.TTL <= 0:
                self._lease = None
                return "lease expired or revoked"
            last_ok = sent

    async def _wait_vacancy(self) -> None:
        got = await self._bounded(self._client.get(self.key))
        if got is None:
            return
        with contextlib.suppress(self._aetcd.WatchTimeoutError, TimeoutError):
            # From the revision after the one read, so a delete in between is not missed.
            await self._bounded(self._client.watch_once(self.key, timeout=self.ttl_s * 2,
                                                        start_revision=got.header.revision + 1),
                                self.ttl_s * 3)


class Leadership:
    """The job's leader as this daemon sees it: etcd's seat holder, else membership's rule."""

    def __init__(self, config: DaemonConfig, membership: Membership) -> None:
        self.node, self.config, self.membership = config.node, config, membership
        self.seat = ""  # the etcd seat holder last seen, "" while none is known
        self.on_won: Callable[[], None] = lambda: None  # this daemon took the seat
        self.etcd: EtcdElection | None = None
        if config.etcd:
            self.etcd = EtcdElection(config.node, endpoint=config.etcd, job_id=config.job_id,
                                     ttl_s=config.etcd_lease_s, on_elected=self._won,
                                     on_lost=self._lost)
        self._task: asyncio.Task[None] | None = None

    def leader(self) -> str:
        """The leading daemon's node name ("" while the etcd seat is empty)."""
        return self.seat if self.etcd is not None else self.membership.by_rule()

    def is_leader(self) -> bool:
        return self.leader() == self.node

    def holds_seat(self) -> bool:
        """False once this daemon has lost the etcd seat it led from (always True
        without etcd): a deposed coordinator must not install plans."""
        return self.etcd is None or self.etcd.is_leader

    async def start(self) -> None:
        if self.etcd is not None:
            await self.etcd.start()
            self._task = asyncio.create_task(self._track_seat(), name="seat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.etcd is not None:
            await self.etcd.stop()  # a leader resigns: a successor need not wait

    def _won(self, term: int) -> None:
        log.warning("this daemon coordinates the job (etcd term %d)", term)
        self.seat = self.node
        self.on_won()

    def _lost(self, reason: str) -> None:
        log.error("this daemon no longer coordinates: %s", reason)
        if self.seat == self.node:
            self.seat = ""

    async def _track_seat(self) -> None:
        """Learn who holds the seat when it is not this daemon (read once per heartbeat);
        the last holder seen stays the answer while the seat is empty between leaders."""
        assert self.etcd is not None
        interval, complained = self.config.heartbeat_interval_s, False
        while True:
            if not self.etcd.is_leader:
                try:
                    holder = await self.etcd.leader()
                    complained = False
                except Exception as exc:  # etcd down: keep the last holder, say so once
                    if not complained:
                        log.error("cannot read the coordinator seat from etcd at %s: %s",
                                  self.config.etcd, exc)
                    complained, holder = True, None
                if holder and holder != self.seat:
                    self.seat = holder
            await asyncio.sleep(interval)

    async def known(self) -> str:
        """The leader's name, waiting up to one lease time for a first election (within a
        rank's registration deadline, so it gets this error, not a timeout)."""
        deadline = time.monotonic() + self.config.etcd_lease_s
        while not (holder := self.leader()) and time.monotonic() < deadline:
            await asyncio.sleep(self.config.heartbeat_interval_s / 4)
        if not holder:
            raise LookupError(f"no coordinator is elected in etcd at {self.config.etcd}: is "
                              "etcd up and reachable from every daemon (see the daemon log)?")
        return holder

    async def confirm(self, node: str) -> bool:
        """Whether a call from `node` may be the leader's, even if this daemon's view lags."""
        if self.leader() == node:
            return True
        if self.etcd is None:
            # The rule is the smallest live name, and views lag: a caller that takes over
            # when the old coordinator died is believed once every smaller node this daemon
            # knows has gone quiet (suspect or lost). It must itself be a live peer.
            peers = self.membership.peers()
            live = {p.node for p in peers if p.state in (UP, SUSPECT)}
            smaller_up = [p for p in peers if p.node and p.node < node and p.state == UP]
            return node in live and self.node > node and not smaller_up
        try:  # the seat may have moved since this daemon last read it
            return await self.etcd.leader() == node
        except Exception as exc:  # etcd unreachable: no proof of the seat
            log.warning("cannot confirm the coordinator seat: %s", exc)
            return False
