"""Intake, the first stage of the snapshot path: a rank's capture, out of its slot.

A rank copies its state into a shared-memory slot and calls Capture. The bytes are
copied out (memory speed) and the slot handed back at once; encoding and making the
step durable continue in the background, one capture after another per rank, so
steps stay in order. At most MAX_BACKLOG captures per rank wait to be encoded.

After a failure the coordinator waits for one step to commit (the newest the failed
ranks' daemons took in) before it re-plans; it tells every daemon (`hurry`), and the
earlier steps of that plan become moot: those still waiting here are dropped, one
being stored stops at its next stage (`moot`), and the hurried step waits for none of
them. Every daemon drops the same steps (those before it), and the coordinator skips a
step that some daemons never prepared once a later one is complete. The plan's later
steps (a survivor's, taken in after that step) wait for the re-plan, which redoes them
and drops them here: stored now, they would only take the cores the hurried step needs.
Each daemon answers whether it holds its ranks' captures of the hurried step (taken in,
so they will be stored): the coordinator waits longer for a step every daemon holds.
Once a newer plan is adopted, every capture of an older one is moot the same way: the
new plan resumes from a committed step and redoes the later ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from stalwart.core.generation import check_generation
from stalwart.daemon.background import Background
from stalwart.daemon.errors import Invalid, NotFound, NotReady, Refused
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.snapshot.slots import FdServer, Slot, SlotBudgetExceeded, SlotPool
from stalwart.v1 import rank_pb2

log = logging.getLogger("stalwart.daemon.snapshot.intake")

MAX_BACKLOG = 3  # captures per rank copied but not yet encoded, at most
HURRY_HOLD_S = 5.0
"""After a hurry, a later step of that plan waits at most this long for the re-plan
(the coordinator's wait for the hurried step is as long at most, LAND_WAIT_MAX_S)."""

# (request, owned bytes, release): encode and make durable; call release() once encoded.
Durable = Callable[[rank_pb2.CaptureRequest, bytes, Callable[[], Awaitable[None]]],
                   Awaitable[None]]


@dataclass(frozen=True)
class _Work:
    """A capture handed on: the task that encodes and stores it."""

    generation: int
    step: int
    task: asyncio.Task[None]


class Intake:
    """Slots for this node's ranks, and their captures handed on in step order."""

    def __init__(self, pool: SlotPool, fd_server: FdServer, registry: Registry,
                 metrics: Metrics, node: str, durable: Durable) -> None:
        self.pool, self.fd_server, self.registry, self.metrics = pool, fd_server, registry, metrics
        self.node, self.durable = node, durable
        self._tail: dict[str, _Work] = {}  # per rank: its newest capture's work
        self._backlog: dict[str, int] = {}  # per rank: captures copied but not yet encoded
        self._encoded = asyncio.Condition()
        self._taken = asyncio.Condition()  # notified when a capture has been taken in
        # (generation, step): captures of that generation's earlier steps are not stored
        self._hurry = (0, 0)
        self._hurried = asyncio.Event()  # set, and replaced, by each hurry
        self._taking = Background()  # captures being taken in, the rank's call gone or not
        self._taking_of: dict[str, asyncio.Task[None]] = {}  # per rank: its newest take-in
        # Per rank: the tensors its last capture named, serialised as a CaptureRequest,
        # for a capture that names them `same_tensors`.
        self._tensors: dict[str, bytes] = {}

    async def open_slot(self, request: rank_pb2.OpenSlotRequest) -> rank_pb2.OpenSlotReply:
        if self.registry.get(request.rank_id) is None:
            raise NotFound(f"rank {request.rank_id!r} is not registered with {self.node}; "
                           "call Register first")
        slots = await asyncio.to_thread(self.pool.open, request.rank_id, request.nbytes)
        return rank_pb2.OpenSlotReply(slot_id=slots[0].slot_id, size=slots[0].size,
                                      fd_socket=str(self.fd_server.path),
                                      slot_ids=[s.slot_id for s in slots])

    def restore_slot(self, rank_id: str, data: bytes) -> tuple[str, str] | None:
        """A restore's state in a one-time slot for `rank_id` to map: (slot_id,
        fd_socket); None when the rank is not registered here or the slot budget has no
        room (the state is streamed instead). Called on a worker thread."""
        record = self.registry.get(rank_id)
        if not data or record is None or record.ended:
            return None
        try:
            slot = self.pool.open_once(rank_id, len(data))
        except (SlotBudgetExceeded, OSError) as exc:  # no room, no memfd: stream it
            log.info("restore streamed, not in a slot: %s", exc, extra={"rank_id": rank_id})
            return None
        try:
            slot.view[:len(data)] = data
        except BaseException:
            self.pool.forget(slot.slot_id)
            raise
        return slot.slot_id, str(self.fd_server.path)

    def forget_slot(self, slot_id: str) -> None:
        """A restore's slot whose reply did not reach its rank."""
        self.pool.forget(slot_id)

    async def capture(self, request: rank_pb2.CaptureRequest) -> None:
        """Take the slot's bytes; returns once the slot may be reused."""
        check_generation(request.generation, self.registry.generation,
                         f"capture of step {request.step}")
        slot = self.pool.get(request.slot_id)
        if slot.rank_id != request.rank_id:
            raise Refused(f"slot {request.slot_id} belongs to another rank")
        self._name_tensors(request)
        total = max((t.offset + t.nbytes for t in request.tensors), default=0)
        if total > slot.size:
            raise Invalid(f"tensors describe {total} bytes but slot {request.slot_id} "
                          f"holds {slot.size}")
        if request.step > 1:
            self.metrics.capture_stall.labels(request.rank_id).observe(request.stall_s)
        # Taken in even if the rank dies meanwhile and its call is cancelled: the slot
        # outlives the rank, and a dead rank's slots are freed only after (forget_rank).
        taking = self._taking_of[request.rank_id] = self._taking.start(
            self._take_in(request, slot, total))
        await asyncio.shield(taking)

    def _name_tensors(self, request: rank_pb2.CaptureRequest) -> None:
        """`request.tensors` filled in from the rank's last capture where it names them
        `same_tensors`, else kept for its next one."""
        if not request.same_tensors:
            self._tensors[request.rank_id] = rank_pb2.CaptureRequest(
                tensors=request.tensors).SerializeToString()
            return
        if request.tensors:
            raise Invalid("a capture names its tensors or sends same_tensors, not both")
        known = self._tensors.get(request.rank_id)
        if known is None:
            raise NotReady(f"rank {request.rank_id} sent no tensors with an earlier capture "
                           f"here; send them with step {request.step}")
        request.MergeFromString(known)

    async def forget_rank(self, rank_id: str) -> None:
        """A rank that is gone (dead, or left cleanly): once its last capture is out of its
        slot, its slots are freed. They count against this node's slot budget, and a spare
        taking its place, or the next job's rank, needs the room."""
        self._tensors.pop(rank_id, None)
        taking = self._taking_of.pop(rank_id, None)
        if taking is not None:
            await asyncio.gather(taking, return_exceptions=True)
        await self._took_in()  # a hurry waiting for its capture answers now
        await asyncio.to_thread(self.pool.drop_rank, rank_id)

    async def _take_in(self, request: rank_pb2.CaptureRequest, slot: Slot, total: int
                       ) -> None:
        # Backpressure, bounded memory: while encoding is MAX_BACKLOG captures behind,
        # the slot is held (the rank blocks only if it needs it again). Skipping steps
        # instead would need every rank to skip the same ones, or no step would commit.
        rank = request.rank_id
        async with self._encoded:
            await self._encoded.wait_for(lambda: self._backlog.get(rank, 0) < MAX_BACKLOG)
            self._backlog[rank] = self._backlog.get(rank, 0) + 1
        try:
            owned = await asyncio.to_thread(_copy_out, slot, total)
        except ValueError:
            if not slot.view.closed:
                raise
            # The rank died with this capture in flight, and its slots were freed
            # (forget_rank) while the capture waited for room: nothing of it can commit.
            await self._give_room(rank)
            raise NotFound(f"rank {rank} is gone and its slots are freed; its capture of "
                           f"step {request.step} was not taken") from None
        self.metrics.captured_bytes.inc(total)
        if (record := self.registry.get(rank)) is not None:
            # Once taken in, the step commits even if the rank dies now: a failure
            # report says so, and the coordinator lets the step land before re-planning
            # (a capture still waiting for room is left out: counting it made that wait
            # outlast what the step saves, and the plan resume before it).
            record.captured = (request.generation, request.step)
        self._tail[rank] = _Work(request.generation, request.step, asyncio.create_task(
            self._after(self._tail.get(rank), request, owned)))
        await self._took_in()

    async def _give_room(self, rank: str) -> None:
        """A capture of `rank` left the backlog (encoded, dropped or never taken)."""
        async with self._encoded:
            self._backlog[rank] -= 1
            self._encoded.notify_all()

    async def _took_in(self) -> None:
        """A rank's captures changed (one taken in, or the rank forgotten): wake hurries."""
        async with self._taken:
            self._taken.notify_all()

    def hurry(self, generation: int, step: int) -> None:
        """Store `step` of plan `generation` next: that plan's earlier steps are moot
        (they will not commit; the coordinator waits for `step` to re-plan from it)."""
        self._hurry = max(self._hurry, (generation, step))
        self._hurried.set()
        self._hurried = asyncio.Event()

    async def hurry_step(self, generation: int, step: int, wait_s: float) -> bool:
        """`hurry`, then whether every rank of plan `generation` on this node has had its
        capture of `step` (or a later one) taken in: the step then commits unless
        something else fails. Waits at most `wait_s` for captures still being copied;
        False as soon as a rank that lacks it has ended (and been forgotten here)."""
        self.hurry(generation, step)
        ranks = self.registry.roles_here(generation)
        if ranks is None:
            return False

        def held(rank_id: str) -> bool:
            record = self.registry.get(rank_id)
            return record is not None and record.captured >= (generation, step)

        def settled() -> bool:
            return all(held(r) or (record := self.registry.get(r)) is None or record.ended
                       for r in ranks)
        async with self._taken:
            try:
                await asyncio.wait_for(self._taken.wait_for(settled), wait_s)
            except TimeoutError:
                pass
        return all(map(held, ranks))

    def moot(self, request: rank_pb2.CaptureRequest) -> bool:
        """Whether this capture's step will not commit, so its work stops where it is."""
        return self._why_moot(request) is not None

    def _why_moot(self, request: rank_pb2.CaptureRequest) -> str | None:
        if request.generation < self.registry.generation:
            return "a newer plan redoes its step"
        if self._hurried_past(request.generation, request.step):
            return "a later step is stored first, for a re-plan"
        return None

    def _hurried_past(self, generation: int, step: int) -> bool:
        return generation == self._hurry[0] and step < self._hurry[1]

    async def _turn(self, previous: _Work | None, request: rank_pb2.CaptureRequest) -> None:
        """Until the rank's previous capture is stored (steps stay in order), or until
        either one is moot: a hurried step waits for no earlier step of its plan, and a
        moot one is dropped at once, freeing its room in the backlog."""
        while previous is not None and not previous.task.done():
            if self.moot(request) or self._hurried_past(previous.generation, previous.step):
                return
            await self._until_news_or(previous.task)

    async def _hold(self, request: rank_pb2.CaptureRequest) -> None:
        """While a hurry of this capture's plan names an earlier step: until the next
        plan (which redoes this step: the capture is then dropped as an old plan's), a
        hurry of this step or a later one, or HURRY_HOLD_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HURRY_HOLD_S
        while request.generation == self._hurry[0] == self.registry.generation and \
                request.step > self._hurry[1]:
            left = deadline - loop.time()
            if left <= 0:
                log.info("no re-plan followed the hurry; storing the later step",
                         extra={"step": request.step, "rank_id": request.rank_id})
                return
            planned = asyncio.ensure_future(
                self.registry.plan_after(request.generation, left))
            try:
                await self._until_news_or(planned)
            finally:
                planned.cancel()

    async def _until_news_or(self, other: asyncio.Future[Any]) -> None:
        """Until the next hurry or plan, or `other` is done (it is left running). A
        plan matters as much as a hurry: it makes every capture of an older plan moot,
        and one waiting behind a capture still being stored (its shards' peer frozen)
        would otherwise hold its room in the rank's backlog until that one ends."""
        news = [asyncio.ensure_future(self._hurried.wait()),
                asyncio.ensure_future(self.registry.next_plan())]
        try:
            await asyncio.wait({other, *news}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in news:
                waiter.cancel()

    async def _after(self, previous: _Work | None, request: rank_pb2.CaptureRequest,
                     owned: bytes) -> None:
        await self._turn(previous, request)
        await self._hold(request)
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await self._give_room(request.rank_id)
        try:
            if (why := self._why_moot(request)) is not None:
                log.info("capture dropped: %s", why,
                         extra={"step": request.step, "rank_id": request.rank_id})
            else:
                await self.durable(request, owned, release)
        finally:
            await release()

    async def stop(self) -> None:
        await self._taking.cancel()
        tasks = [w.task for w in self._tail.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _copy_out(slot: Slot, total: int) -> bytes:
    """The slot's first `total` bytes, copied; the views of its mapping are released
    before this returns (a view the executor's thread still held when the caller moved
    on kept the slot from closing: "cannot close exported pointers exist")."""
    with memoryview(slot.view) as whole, whole[:total] as part:
        return bytes(part)
