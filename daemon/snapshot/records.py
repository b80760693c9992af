"""Records beside the shards: where a rank's record lives and how it is found again.

A rank's record (its tensors, chunks and shard holders) stays with the daemon that
captured it; before that daemon prepares the step it copies the record to the first
m live daemons after it on the ring of node names (and to S3 when configured), so any
m daemons can be lost with every committed record still readable. The committed step
carries only the records' seal (`core.step_record`); a restore, a repair or a scrub
fetches the records it needs, owner first, then the live daemons after it on the ring
(the step's daemons and any that joined since), then S3, and checks each against its
seal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.daemon.peers import (
    QUIET,
    Peer,
    PeerChannels,
    PeerLost,
    UntilLost,
    never_lost,
    unless_lost,
)
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.s3_tier import S3Tier
from stalwart.v1 import manifest_pb2, peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.snapshot.records")

COPY_TIMEOUT_S = 10.0   # one PutRecords
HELD_IDLE_S = 2.0       # a GetHeld that sends no piece for this long is given up
FETCH_TIMEOUT_S = 30.0  # one GetRecords
HEDGE_S = 1.0           # a holder silent this long: the next one is asked as well
MAX_ASKED = 64          # live daemons asked for a record before S3


class RecordsNotProtected(RuntimeError):
    """Fewer daemons than wanted took a copy of the records: the step must not commit."""


class RecordsLost(mf.ManifestError):
    """No holder (nor S3) has a copy of records a committed step names."""


class RecordHolders:
    """Copies this daemon's ranks' records out, fetches and re-copies others'."""

    def __init__(self, node: str, job_id: str, store: LocalStore, s3: S3Tier | None,
                 peers: Callable[[], list[Peer]], channels: PeerChannels,
                 copies: Callable[[], int], until_silent: UntilLost = never_lost) -> None:
        self.node, self.job_id, self.store, self.s3 = node, job_id, store, s3
        self.peers, self.channels, self.copies = peers, channels, copies
        # A copy to a peer gone quiet goes to the next; a read from one is not waited for.
        self.until_silent = until_silent
        self.loop: asyncio.AbstractEventLoop | None = None

    def _stub(self, node: str) -> peer_pb2_grpc.PeerServiceStub:
        address = next((p.address for p in self.peers() if p.node == node), None)
        if address is None:
            raise LookupError(f"daemon {node} is not a live member of this job")
        return peer_pb2_grpc.PeerServiceStub(self.channels.get(address))

    def _live(self) -> list[str]:
        return [p.node for p in self.peers()]

    async def copy(self, step: int, states: Sequence[manifest_pb2.RankState],
                   owner: str | None = None) -> list[str]:
        """Copies of `states` (records of `owner`, this daemon by default) on the first
        m live daemons after the owner on the ring, and in S3. Returns the holders;
        RecordsNotProtected when fewer than m (or every other live daemon) took one."""
        owner = owner or self.node
        live = self._live()
        ring = [n for n in sr.successors(live, owner) if n != self.node]
        want = min(self.copies(), len(ring) + (owner != self.node))
        message = manifest_pb2.RankRecords(job_id=self.job_id, step=step, ranks=states)
        held, tried = ([self.node] if owner != self.node else []), []
        # The first `want` successors at once; one that fails is replaced by the next.
        queue = list(ring)
        while len(held) < want and queue:
            batch, queue = queue[:want - len(held)], queue[want - len(held):]
            results = await asyncio.gather(*(self._put(n, message) for n in batch),
                                           return_exceptions=True)
            for node, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    tried.append(f"{node}: {result}")
                else:
                    held.append(node)
        if self.s3 is not None:
            await asyncio.gather(*(self.s3.put_records(step, s.rank,
                                                       s.SerializeToString(deterministic=True))
                                   for s in states))
        if len(held) < want:
            raise RecordsNotProtected(
                f"step {step}: the records of ranks {[s.rank for s in states][:8]} reached "
                f"{len(held)} of the {want} daemons that must keep a copy ({'; '.join(tried)})"
                "; the step will not commit until enough daemons are up")
        return held

    async def _put(self, node: str, message: manifest_pb2.RankRecords) -> None:
        try:
            await unless_lost(self._stub(node).PutRecords(message, timeout=COPY_TIMEOUT_S),
                              node, self.until_silent, QUIET)
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"{exc.code().name}: {exc.details()}") from None

    async def fetch(self, record: manifest_pb2.StepRecord, seal: manifest_pb2.RankSeal
                    ) -> list[manifest_pb2.RankState]:
        """The records `seal` names, checked against it: owner, the live daemons after it
        on the ring, then S3. RecordsLost when none has a good copy."""
        live = set(self._live())
        # Copies sit on the owner's first m successors, or a few further on once some of
        # those were lost and the copies made again: ask the first MAX_ASKED live ones.
        order = [seal.node, *sr.successors(sr.nodes(record) + sorted(live), seal.node)]
        request = peer_pb2.GetRecordsRequest(job_id=self.job_id, step=record.step,
                                             ranks=seal.ranks)
        tried: list[str] = []
        queue = [n for n in order if n in live and n != self.node][:MAX_ASKED]
        asking: dict[asyncio.Task[list[manifest_pb2.RankState]], str] = {}
        try:
            # The next holder is asked once one fails or has not answered in HEDGE_S (a
            # frozen or cut-off daemon not yet declared lost); the first good copy wins.
            while queue or asking:
                if queue:
                    node = queue.pop(0)
                    asking[asyncio.create_task(self._ask(node, record, request))] = node
                done, _ = await asyncio.wait(asking, timeout=HEDGE_S if queue else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    node = asking.pop(task)
                    try:
                        return task.result()
                    except grpc.aio.AioRpcError as exc:
                        tried.append(f"{node}: {exc.code().name}")
                    except (LookupError, mf.ManifestError, PeerLost) as exc:
                        tried.append(f"{node}: {exc}")
        finally:
            for task in asking:
                task.cancel()
        if self.s3 is not None:
            try:
                states = [manifest_pb2.RankState.FromString(
                    await self.s3.get_records(record.step, r)) for r in seal.ranks]
                sr.check(record, states)
                return states
            except Exception as exc:
                tried.append(f"s3: {exc}")
        raise RecordsLost(f"step {record.step}: no live daemon holds a good copy of the "
                          f"records of ranks {list(seal.ranks)[:8]} (captured on "
                          f"{seal.node}; tried {'; '.join(tried) or 'no live holder'}); more "
                          "daemons are lost than the records' copies survive; restore an "
                          "older step")

    def fetch_blocking(self, record: manifest_pb2.StepRecord, seal: manifest_pb2.RankSeal
                       ) -> list[manifest_pb2.RankState]:
        """`fetch` from a worker thread (the store's reads run on one)."""
        assert self.loop is not None, "fetch_blocking before the daemon's loop started"
        return asyncio.run_coroutine_threadsafe(self.fetch(record, seal), self.loop).result(
            timeout=FETCH_TIMEOUT_S * 4)

    async def decoded(self, node: str, step: int, rank: int, positions: Sequence[int]
                   ) -> bytes | None:
        """The decoded chunks at `positions` (all when empty) of the rank's committed
        step from `node`, the daemon that captured it, where it still holds them; None
        when it does not, is this daemon, is not live, or the call fails (the caller
        reads the step's chain instead, and checks what this returns)."""
        if node == self.node or node not in self._live():
            return None
        request = peer_pb2.GetHeldRequest(job_id=self.job_id, step=step, rank=rank,
                                          chunks=positions)
        pieces = []

        async def read() -> None:
            call = self._stub(node).GetHeld(request)
            try:
                # A peer that stops sending (frozen, overloaded) costs HELD_IDLE_S, not
                # the whole read: the chain is read instead.
                while (piece := await asyncio.wait_for(call.read(), HELD_IDLE_S)) \
                        is not grpc.aio.EOF:
                    pieces.append(piece.data)
            finally:
                call.cancel()
        try:
            # A peer already suspect (its heartbeats overdue) is not waited for at all.
            await unless_lost(read(), node, self.until_silent, QUIET)
        except (grpc.aio.AioRpcError, LookupError, TimeoutError, PeerLost) as exc:
            why = (exc.code().name if isinstance(exc, grpc.aio.AioRpcError)
                   else f"no piece for {HELD_IDLE_S:g} s" if isinstance(exc, TimeoutError)
                   else str(exc))
            log.info("held state not fetched; reading the chain",
                     extra={"peer": node, "step": step, "rank": rank, "error": why})
            return None
        return b"".join(pieces)

    def decoded_blocking(self, node: str, step: int, rank: int, positions: Sequence[int]
                      ) -> bytes | None:
        """`decoded` from a worker thread (the store's reads run on one)."""
        assert self.loop is not None, "decoded_blocking before the daemon's loop started"
        return asyncio.run_coroutine_threadsafe(self.decoded(node, step, rank, positions),
                                                self.loop).result()

    async def _ask(self, node: str, record: manifest_pb2.StepRecord,
                   request: peer_pb2.GetRecordsRequest) -> list[manifest_pb2.RankState]:
        reply = await unless_lost(self._stub(node).GetRecords(request, timeout=FETCH_TIMEOUT_S),
                                  node, self.until_silent, QUIET)
        states = list(reply.ranks)
        sr.check(record, states)
        return states

    async def publish(self, step: int, states: Sequence[manifest_pb2.RankState]) -> None:
        """Repaired records (new shard holders, same seal) to every daemon that should
        hold them: their owner, its m ring successors, and this daemon if it keeps one."""
        owner = states[0].node
        live = self._live()
        targets = [owner, *sr.successors(live, owner)[:self.copies()]]
        message = manifest_pb2.RankRecords(job_id=self.job_id, step=step, ranks=states)
        if self.node in targets or self.store.held_record(step, states[0].rank) is not None:
            await asyncio.to_thread(self.store.keep_records, step, list(states))
        for node in [n for n in targets if n != self.node and n in live]:
            try:
                await self._put(node, message)
            except RuntimeError as exc:
                log.warning("repaired records not delivered; that daemon keeps the old "
                            "holders", extra={"peer": node, "step": step, "error": str(exc)})
        if self.s3 is not None:
            for s in states:
                await self.s3.put_records(step, s.rank, s.SerializeToString(deterministic=True))

    async def on_peer_lost(self, lost: str) -> None:
        """Copies back to m: this daemon re-copies its own ranks' records of every kept
        step, and those of `lost` where it is the first live daemon after it holding them."""
        for step, record in (await asyncio.to_thread(self.store.committed_records)).items():
            ring = sr.nodes(record)
            for seal in record.seals:
                if seal.node == self.node:
                    mine = True
                elif seal.node == lost:
                    after = [n for n in sr.successors(ring, lost) if n in self._live()]
                    mine = bool(after) and after[0] == self.node
                else:
                    continue
                if not mine:
                    continue
                try:
                    states = await asyncio.to_thread(self.store.records, step, seal)
                    await self.copy(step, states, owner=seal.node)
                except (sr.MissingRecords, mf.ManifestError, RecordsNotProtected) as exc:
                    log.warning("records not copied back to m holders",
                                extra={"step": step, "ranks": list(seal.ranks)[:8],
                                       "error": str(exc)})

    def accept(self, message: manifest_pb2.RankRecords) -> None:
        """A copy a peer sent (PutRecords): kept unless it would replace a record this
        daemon captured itself before commit, or fails the seal of a committed step."""
        step = message.step
        committed = step in self.store.committed_steps()
        states = list(message.ranks)
        if committed:
            record = self.store.load_record(step)
            by_rank = {s.rank: s for s in states}
            for ranks in {tuple(sr.seal_of(record, r).ranks) for r in by_rank}:
                if not set(ranks) <= set(by_rank):
                    raise ValueError(f"step {step}: a copy of part of the records of ranks "
                                     f"{list(ranks)[:8]}; send every rank of their seal")
                sr.check(record, [by_rank[r] for r in ranks])
        else:
            for s in states:
                if self.store.captured_here(step, s.rank, self.node):
                    raise ValueError(f"step {step} rank {s.rank} was captured on this "
                                     "daemon; its record is not replaced by a copy")
        self.store.keep_records(step, states)

    def held(self, request: peer_pb2.GetRecordsRequest) -> manifest_pb2.RankRecords:
        """The records this daemon holds for the ranks asked (LookupError if not all)."""
        states = [self.store.held_record(request.step, r) for r in request.ranks]
        missing = [r for r, s in zip(request.ranks, states, strict=True) if s is None]
        if missing:
            raise LookupError(f"{self.node} holds no record of step {request.step} ranks "
                              f"{missing[:8]}")
        return manifest_pb2.RankRecords(job_id=self.job_id, step=request.step, ranks=states)


def from_disks(stores: Sequence[LocalStore]) -> Callable[[manifest_pb2.StepRecord,
                                                          manifest_pb2.RankSeal],
                                                         list[manifest_pb2.RankState]]:
    """Records from other stores on this machine, for `LocalStore.load_manifest`: the
    data dirs of a local cluster, or the disks of a stopped job gathered in one place."""
    def fetch(record: manifest_pb2.StepRecord, seal: manifest_pb2.RankSeal
              ) -> list[manifest_pb2.RankState]:
        for store in stores:
            held = [store.held_record(record.step, r) for r in seal.ranks]
            if all(h is not None for h in held):
                try:
                    sr.check(record, held)
                except mf.ManifestError:
                    continue
                return held
        raise sr.MissingRecords(record.step, list(seal.ranks))
    return fetch
