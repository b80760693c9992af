"""Repair and recoverability: what the committed steps still survive, and re-creating the
shards a lost daemon held from any k survivors onto live daemons.

One daemon drives repair: the leader (the coordinator), so the repair, the S3 writer
and the plans come from one election; if it dies, the next one takes over on its own
peer-lost event. It fetches the records of every kept step (`records`), re-creates the
shards the lost daemons held, and sends the records with their new shard holders to
the daemons that keep them: their seal leaves holder names out, so the committed step
stays as it is and every copy still checks against it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.core.placement import S3, Node, decodable, repair_plan
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.records import RecordHolders
from stalwart.daemon.snapshot.shard_client import ShardClient
from stalwart.daemon.snapshot.shard_reader import ShardReader, placement_of
from stalwart.v1 import manifest_pb2

log = logging.getLogger("stalwart.daemon.snapshot.repair")

Manifests = Mapping[int, manifest_pb2.Manifest]


# recoverability (pure) ----------------------------------------------------------------

def holders(manifests: Iterable[manifest_pb2.Manifest]) -> set[str]:
    """Every node (and "s3") named as a shard holder by the manifests."""
    return {rec.node for m in manifests for r in m.ranks for c in r.chunks
            for rec in c.shards}


def chunk_readable(rank: manifest_pb2.RankState, chunk: manifest_pb2.ChunkRecord,
                   lost: set[str], local_node: str) -> bool:
    """A chunk can be read here: from this node's own disk copy, or from k live shards."""
    if rank.node == local_node and mf.whole_on_node(chunk):
        return True
    return bool(chunk.shards) and decodable(placement_of(chunk), lost)


def step_recoverable(manifests: Manifests, step: int, lost: set[str], local_node: str) -> bool:
    """Every chunk of every rank of `step` and of the bases and deltas it applies to."""
    try:
        chain = mf.plan_chain(dict(manifests), step)
    except mf.ManifestError:
        return False
    return all(chunk_readable(r, c, lost, local_node)
               for s in chain for r in manifests[s].ranks for c in r.chunks)


def recoverable(manifests: Manifests, lost: set[str], local_node: str) -> list[int]:
    """Committed steps still recoverable with `lost` gone, newest first."""
    return [s for s in sorted(manifests, reverse=True)
            if step_recoverable(manifests, s, lost, local_node)]


def failed_holders(manifests: Manifests, chunk_id: str, unavailable: Mapping[int, str]
                   ) -> set[str]:
    """Nodes whose shards (indices in `unavailable`) of chunk `chunk_id` could not be read."""
    for m in manifests.values():
        for r in m.ranks:
            for c in r.chunks:
                if c.chunk_id == chunk_id:
                    return {rec.node for rec in c.shards
                            if rec.index in unavailable and rec.node != S3}
    return set()


def beyond_tolerance(step: int, rank: int, why: str, manifests: Manifests, lost: set[str],
                     local_node: str, s3: bool) -> tuple[str, int | None]:
    """The error for a step that cannot be rebuilt, and the newest older step that can."""
    older = recoverable({s: m for s, m in manifests.items() if s < step}, lost, local_node)
    gone = ", ".join(sorted(lost - {S3})) or "none known"
    where = "surviving shards" + (" and S3" if s3 else "")
    if older:
        advice = (f"The newest step still recoverable (from {where}) is {older[0]}: restore "
                  f"it with RestoreRequest.step={older[0]}, or step=0 for the newest "
                  "recoverable step.")
    else:
        advice = (f"No committed step is recoverable from {where}: bring back one of the lost "
                  "daemons with its data_dir, or restore from an external checkpoint.")
    return (f"step {step} rank {rank} cannot be restored: more daemons are lost than the "
            f"erasure code tolerates (lost: {gone}). {why} {advice}",
            older[0] if older else None)


# repair (I/O) ----------------------------------------------------------------------------

@dataclass
class RepairState:
    """What `stalwart status` and the metrics show about repair."""

    pending: int = 0                 # shards still to re-create in the current pass
    repaired: int = 0                # shards re-created since the daemon started
    running: bool = False
    last: str = "no repair needed so far"
    unrecoverable: list[str] = field(default_factory=list)  # chunk ids below k shards


class Repairer:
    """Re-creates shards of lost daemons; `run()` is safe to call on every peer loss."""

    def __init__(self, *, node: str, store: LocalStore, metrics: Metrics,
                 live: Callable[[], list[Node]], client: Callable[[str], ShardClient],
                 reader: Callable[[], ShardReader], records: RecordHolders,
                 s3_available: bool, is_leader: Callable[[], bool]) -> None:
        self.node, self.store, self.metrics = node, store, metrics
        self.live, self.client, self.reader, self.records = live, client, reader, records
        self.s3_available = s3_available
        self.is_leader = is_leader  # the coordinator repairs (core of one election)
        self.state = RepairState()
        self._lock = asyncio.Lock()
        self._again = False

    def lost(self, manifests: Iterable[manifest_pb2.Manifest]) -> set[str]:
        """Holders named by the manifests that are not live (and S3 when not configured)."""
        names = {n.name for n in self.live()}
        gone = {h for h in holders(manifests) if h != S3 and h not in names}
        return gone if self.s3_available else gone | {S3}

    async def run(self) -> None:
        """Repair passes until no loss arrived during the last one (leader only)."""
        self._again = True
        if self._lock.locked():
            return  # the running pass will go again
        async with self._lock:
            while self._again:
                self._again = False
                if not self.is_leader():
                    return
                try:
                    await self._pass()
                except Exception as exc:
                    self.state.last = f"repair pass failed: {exc}"
                    log.exception("repair pass failed")
                finally:
                    self.state.running = False
                    self._pending(0)

    def _kept_steps(self) -> dict[int, manifest_pb2.Manifest]:
        """Every kept step whole, records fetched from their holders (a repair needs the
        chunks of every rank; a step whose records are lost cannot be repaired)."""
        out = {}
        for step in self.store.committed_steps():
            try:
                out[step] = self.store.load_manifest(step, self.records.fetch_blocking)
            except (mf.ManifestError, sr.MissingRecords, FileNotFoundError) as exc:
                log.error("step not repaired: its records are not readable",
                          extra={"step": step, "error": str(exc)})
        return out

    async def _pass(self) -> None:
        manifests = await asyncio.to_thread(self._kept_steps)
        lost = self.lost(manifests.values())
        live = self.live()
        work = []
        unrecoverable: set[str] = set()
        for step in sorted(manifests, reverse=True):  # newest first: it matters most
            for r in manifests[step].ranks:
                for c in r.chunks:
                    if not c.shards:
                        continue
                    plan = repair_plan([placement_of(c)], lost - {S3}, live)
                    unrecoverable.update(plan.unrecoverable)
                    if plan.tasks:
                        work.append((step, c.chunk_id, {t.index: t.target for t in plan.tasks}))
        self.state.unrecoverable = sorted(unrecoverable)
        total = sum(len(w[2]) for w in work)
        if not work:
            if unrecoverable:
                self.state.last = (f"{len(unrecoverable)} chunks have fewer than k shards left; "
                                   "they cannot be repaired")
            return
        self.state.running = True
        self._pending(total)
        started = time.monotonic()
        log.warning("repair started", extra={"lost": sorted(lost), "shards": total})
        reader = self.reader()
        by_step: dict[int, dict[str, dict[int, str]]] = {}
        for step, chunk_id, targets in work:
            by_step.setdefault(step, {})[chunk_id] = targets
        done = 0
        for step, chunks in by_step.items():
            record = await asyncio.to_thread(self.store.load_record, step)
            by_rank = {r.rank: r for r in manifests[step].ranks}
            for seal in record.seals:
                states = [by_rank[r] for r in seal.ranks]
                changed = False
                for c in (c for r in states for c in r.chunks if c.chunk_id in chunks):
                    await self._repair_chunk(reader, step, record.generation, c,
                                             chunks[c.chunk_id], lost)
                    done += len(chunks[c.chunk_id])
                    self._pending(total - done)
                    changed = True
                if changed:
                    await self.records.publish(step, states)
        self.state.last = (f"re-created {done} shards of {len(by_step)} steps after losing "
                           f"{', '.join(sorted(lost - {S3}))} in "
                           f"{time.monotonic() - started:.1f} s")
        log.warning("repair finished", extra={"shards": done, "steps": sorted(by_step)})

    def _pending(self, shards: int) -> None:
        self.state.pending = shards
        self.metrics.repair_pending.set(shards)
        self.metrics.shards.labels("repairing").set(shards)

    async def _repair_chunk(self, reader: ShardReader, step: int, generation: int,
                            chunk: manifest_pb2.ChunkRecord, targets: dict[int, str],
                            lost: set[str]) -> None:
        """Rebuild shards `targets` {index: node} of `chunk`, store them, and record the
        new holders in `chunk` (in place)."""
        bodies = await reader.recreate_shards(chunk, sorted(targets))
        records = {rec.index: rec for rec in chunk.shards if rec.node in lost}
        for index, target in targets.items():
            rec = records[index]
            body = bodies[index]
            await self.client(target).put(rec.location or f"{chunk.chunk_id}.{index}", body,
                                           step=step, generation=generation, crc=crc32c(body))
            rec.node = target
            self.state.repaired += 1
            self.metrics.repaired_shards.inc()

