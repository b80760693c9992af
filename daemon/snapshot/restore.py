"""Restore, the last stage: a rank's state for a committed step, read back and verified.

The newest committed step whose chain this rank's surviving holders can still rebuild
is chosen (or the step asked for). The rank's records come from this disk or their
holders (`records`). The newest committed capture comes decoded from the daemon that
made it where that daemon still holds it (here, or a peer: `records.decoded`); otherwise
chunks this daemon holds come from its own tiers, the others are rebuilt from any k
of their shards, cheapest holder first (`shard_reader`). The state
reaches the rank in a shared-memory slot it maps (as a capture leaves it), or, where
there is no room for one, in PIECE_BYTES pieces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.core.layout import Layout
from stalwart.core.placement import S3, Node
from stalwart.daemon.errors import NotFound, NotRecoverable
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot import repair
from stalwart.daemon.snapshot.catalogue import FetchRecords
from stalwart.daemon.snapshot.chain_reader import FetchHeld
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.selection import Layers
from stalwart.daemon.snapshot.shard_reader import BeyondToleranceError, ShardReader
from stalwart.v1 import manifest_pb2, rank_pb2

PIECE_BYTES = 1 << 20  # restore stream message size
FETCH_TIMEOUT_S = 120.0  # one chunk this daemon does not hold, rebuilt from shards

# A state's bytes -> (slot_id, fd socket) of the slot now holding them, or None.
Slotter = Callable[[bytes], "tuple[str, str] | None"]


class Restorer:
    """Reads committed state back for this node's ranks."""

    def __init__(self, node: str, store: LocalStore, metrics: Metrics, executor: Executor,
                 reader: Callable[[], ShardReader], fetch_records: FetchRecords,
                 live: Callable[[], list[Node]], s3_available: bool,
                 fetch_held: FetchHeld | None = None) -> None:
        self.node, self.store, self.metrics, self.executor = node, store, metrics, executor
        self.reader, self.fetch_records, self.live = reader, fetch_records, live
        self.fetch_held = fetch_held
        self.s3_available = s3_available
        self.loop: asyncio.AbstractEventLoop | None = None

    async def _run(self, fn: Callable[..., object], *args: object, **kw: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: fn(*args, **kw))

    def _fetch_chunk(self, chunk: manifest_pb2.ChunkRecord) -> bytes:
        """Called from the store thread for a chunk this daemon does not hold."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(self.reader().read_chunk(chunk), self.loop)
        return fut.result(timeout=FETCH_TIMEOUT_S)

    def _views(self, records: dict[int, manifest_pb2.StepRecord], steps: list[int],
               rank: int) -> tuple[dict[int, manifest_pb2.Manifest], dict[int, str]]:
        """Per step, a manifest of `rank`'s record alone (fetched where not held here):
        what deciding whether its chain is readable needs, without the other ranks'.
        Beside it, why a step's record could not be had."""
        views, why = {}, {}
        for s in steps:
            try:
                state = self.store.rank_record(s, rank, self.fetch_records)
            except (sr.MissingRecords, mf.ManifestError, KeyError) as exc:
                why[s] = str(exc)
                continue
            views[s] = manifest_pb2.Manifest(step=s, layout=records[s].layout, ranks=[state])
        return views, why

    def _lost(self, views: dict[int, manifest_pb2.Manifest]) -> set[str]:
        names = {n.name for n in self.live()}
        gone = {h for h in repair.holders(views.values()) if h != S3 and h not in names}
        return gone if self.s3_available else gone | {S3}

    async def restore(self, step: int, rank: int, into: Slotter | None = None,
                      layers: Layers | None = None) -> AsyncIterator[rank_pb2.RestorePiece]:
        """The rank's record, then its bytes; `step` 0 is the newest step whose chain of
        this rank's records and chunks is still readable. With `into`, the bytes go into
        the slot it makes where it can, and the record names that slot. With `layers`,
        only their tensors and those of no layer (`LocalStore.read_layers`), and only
        the chunks holding them are read. Raises NotFound, NotRecoverable (naming the
        newest recoverable step) or CorruptChunkError."""
        self.loop = asyncio.get_running_loop()
        records = await self._run(self.store.committed_records)
        if not records:
            raise NotFound("no step is committed yet; nothing to restore")
        if step and step not in records:
            raise NotFound(f"step {step} is not committed here; committed: "
                           f"{sorted(records)[-5:]}")
        newest = step or max(records)
        world = Layout.from_proto(records[newest].layout).world_size
        if rank >= world:
            raise NotFound(f"step {newest} has no rank {rank} (its layout has {world} ranks)")
        # A step asked for needs only its own chain's records of this rank (the seals
        # name the steps it applies to); the newest recoverable one needs them all.
        try:
            wanted = sr.plan_chain(records, step, rank) if step else sorted(records)
        except mf.ManifestError:
            wanted = [step]
        views, why = await self._run(self._views, records, wanted, rank)
        lost = self._lost(views)
        steps = [step] if step else (
            repair.recoverable(views, lost, self.node) or [max(records)])
        for candidate in steps:
            if candidate not in (steps[0], steps[-1]) and not repair.step_recoverable(
                    views, candidate, lost, self.node):
                continue  # a holder failed while reading a newer step; skip what needs it
            t0 = time.perf_counter()
            try:
                if candidate not in views:
                    raise mf.ManifestError(why.get(candidate, f"step {candidate}: no record "
                                                   f"of rank {rank}"))
                state = views[candidate].ranks[0]
                if layers is None:
                    data = await self._run(self.store.read_rank, candidate, rank,
                                           fetch=self._fetch_chunk,
                                           fetch_records=self.fetch_records,
                                           fetch_held=self.fetch_held)
                else:
                    state, data = await self._run(self.store.read_layers, candidate, rank,
                                                  layers, fetch=self._fetch_chunk,
                                                  fetch_records=self.fetch_records,
                                                  fetch_held=self.fetch_held)
            except (BeyondToleranceError, sr.MissingRecords, mf.ManifestError) as exc:
                if isinstance(exc, BeyondToleranceError):
                    lost |= repair.failed_holders(views, exc.chunk_id, exc.unavailable)
                if step or candidate == steps[-1]:
                    older = [s for s in records if s < candidate and s not in views]
                    if older:  # which older step would do: only the error needs to know
                        views.update((await self._run(self._views, records, older, rank))[0])
                    message, newest_ok = repair.beyond_tolerance(
                        candidate, rank, str(exc), views, lost, self.node, self.s3_available)
                    raise NotRecoverable(message, newest_ok) from exc
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
