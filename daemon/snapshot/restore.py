"""Restore, the last stage: a rank's state for a committed step, read back and verified.

The newest committed step that the surviving holders can still rebuild is chosen
(or the step asked for). Chunks this daemon holds come from its own tiers; the
others are rebuilt from any k of their shards, cheapest holder first
(`shard_reader`). The state reaches the rank in a shared-memory slot it maps (as a
capture leaves it), or, where there is no room for one, in PIECE_BYTES pieces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

from stalwart.daemon.errors import NotFound, NotRecoverable
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot import repair
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.shard_reader import BeyondToleranceError, ShardReader
from stalwart.v1 import manifest_pb2, rank_pb2

PIECE_BYTES = 1 << 20  # restore stream message size
FETCH_TIMEOUT_S = 120.0  # one chunk this daemon does not hold, rebuilt from shards

# A state's bytes -> (slot_id, fd socket) of the slot now holding them, or None.
Slotter = Callable[[bytes], "tuple[str, str] | None"]


class Restorer:
    """Reads committed state back for this node's ranks."""

    def __init__(self, node: str, store: LocalStore, metrics: Metrics, executor: Executor,
                 reader: Callable[[], ShardReader], lost: Callable[[repair.Manifests], set[str]],
                 s3_available: bool) -> None:
        self.node, self.store, self.metrics, self.executor = node, store, metrics, executor
        self.reader, self.lost, self.s3_available = reader, lost, s3_available
        self.loop: asyncio.AbstractEventLoop | None = None

    async def _run(self, fn: Callable[..., object], *args: object, **kw: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: fn(*args, **kw))

    def _fetch_chunk(self, chunk: manifest_pb2.ChunkRecord) -> bytes:
        """Called from the store thread for a chunk this daemon does not hold."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(self.reader().read_chunk(chunk), self.loop)
        return fut.result(timeout=FETCH_TIMEOUT_S)

    async def restore(self, step: int, rank: int, into: Slotter | None = None
                      ) -> AsyncIterator[rank_pb2.RestorePiece]:
        """The rank's record, then its bytes; `step` 0 is the newest recoverable step.
        With `into`, the bytes go into the slot it makes where it can, and the record
        names that slot. Raises NotFound, NotRecoverable (naming the newest recoverable
        step) or CorruptChunkError."""
        self.loop = asyncio.get_running_loop()
        manifests = await self._run(self.store.committed_manifests)
        if not manifests:
            raise NotFound("no step is committed yet; nothing to restore")
        if step and step not in manifests:
            raise NotFound(f"step {step} is not committed here; committed: "
                           f"{sorted(manifests)[-5:]}")
        lost = self.lost(manifests)
        steps = [step] if step else (
            repair.recoverable(manifests, lost, self.node) or [max(manifests)])
        for candidate in steps:
            if candidate not in (steps[0], steps[-1]) and not repair.step_recoverable(
                    manifests, candidate, lost, self.node):
                continue  # a holder failed while reading a newer step; skip what needs it
            state = next((r for r in manifests[candidate].ranks if r.rank == rank), None)
            if state is None:
                raise NotFound(f"step {candidate} has no rank {rank} (its layout has "
                               f"{len(manifests[candidate].ranks)} ranks)")
            t0 = time.perf_counter()
            try:
                data = await self._run(self.store.read_rank, candidate, rank,
                                       fetch=self._fetch_chunk)
            except BeyondToleranceError as exc:
                lost |= repair.failed_holders(manifests, exc.chunk_id, exc.unavailable)
                if step or candidate == steps[-1]:
                    message, newest = repair.beyond_tolerance(
                        candidate, rank, str(exc), manifests, lost, self.node,
                        self.s3_available)
                    raise NotRecoverable(message, newest) from exc
                continue
            self.metrics.recovery_phase.labels("restore_read").observe(
                time.perf_counter() - t0)
            placed = await self._run(into, data) if into is not None else None
            if placed is not None:
                slot_id, fd_socket = placed
                yield rank_pb2.RestorePiece(state=state, step=candidate, slot_id=slot_id,
                                            fd_socket=fd_socket)
                return
            yield rank_pb2.RestorePiece(state=state, step=candidate)
            view = memoryview(data)
            for offset in range(0, len(view), PIECE_BYTES):
                yield rank_pb2.RestorePiece(offset=offset,
                                            data=bytes(view[offset:offset + PIECE_BYTES]))
            return
