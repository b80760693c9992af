"""Who coordinates: leader election through etcd in a cluster, a fixed node otherwise.

Both sides share one interface: `start()`, `stop()`, `is_leader`, `term` (a fencing
token that grows with every new leader), `leader()`, and `write`/`read` of small
coordinator state (the current plan) that only the seated leader can write, with
`on_elected(term)` and `on_lost(reason)` callbacks (plain or coroutine functions).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

__all__ = ["Election", "EtcdElection", "FixedCoordinator"]

log = logging.getLogger(__name__)

ElectedCallback = Callable[[int], object]
LostCallback = Callable[[str], object]


async def _call(cb: Callable[..., object] | None, arg: object) -> None:
    if cb is None:
        return
    result = cb(arg)
    if inspect.isawaitable(result):
        await result


class Election(Protocol):
    is_leader: bool
    term: int

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def leader(self) -> str | None: ...
    async def write(self, name: str, value: bytes) -> bool: ...
    async def read(self, name: str) -> bytes | None: ...


class FixedCoordinator:
    """The single-machine default: `coordinator` (default: this node) always leads."""

    def __init__(self, node: str, coordinator: str | None = None, *,
                 on_elected: ElectedCallback | None = None,
                 on_lost: LostCallback | None = None) -> None:
        self.node = node
        self.coordinator = coordinator or node
        self.on_elected, self.on_lost = on_elected, on_lost
        self.is_leader = False
        self.term = 0
        self._state: dict[str, bytes] = {}

    async def start(self) -> None:
        if self.node == self.coordinator:
            self.is_leader, self.term = True, 1
            await _call(self.on_elected, self.term)

    async def stop(self) -> None:
        if self.is_leader:
            self.is_leader = False
            await _call(self.on_lost, "stopped")

    async def leader(self) -> str | None:
        return self.coordinator

    async def write(self, name: str, value: bytes) -> bool:
        """Keep `value` under `name` (in memory: one machine, one coordinator process)."""
        if self.is_leader:
            self._state[name] = value
        return self.is_leader

    async def read(self, name: str) -> bytes | None:
        return self._state.get(name)


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

    async def write(self, name: str, value: bytes) -> bool:
        """Store coordinator state (e.g. the current plan) under `name`, only while this
        candidate still holds the seat it won in `term`; False when it no longer does, so a
        deposed coordinator cannot overwrite its successor's plan."""
        if not self.is_leader:
            return False
        c = self._client
        ok, _ = await self._bounded(c.transaction(
            compare=[c.transactions.create(self.key) == self.term],
            success=[c.transactions.put(self._state_key(name), value)],
            failure=[],
        ))
        return ok

    async def read(self, name: str) -> bytes | None:
        """Coordinator state stored under `name` by any leader, or None."""
        got = await self._bounded(self._client.get(self._state_key(name)))
        return got.value if got is not None else None

    def _state_key(self, name: str) -> bytes:
        return self.key.rsplit(b"/", 1)[0] + b"/state/" + name.encode()

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
