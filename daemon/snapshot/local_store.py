"""The daemon's local snapshot tiers: a bounded RAM cache over local disk.

Two-phase commit: `prepare` writes one rank's record (temp file, rename; fsynced first
when every write is synced, `[snapshot] disk_sync`) with its encoded chunks, `commit`
then writes the step's record (`StepRecord`: the
seals of every prepare, not the records) atomically, so a step is either fully visible
or not at all. The store holds the records of its own ranks and the copies peers sent
it; the others are fetched where needed (`FetchRecords`) and checked against their
seal. Reads (`chain_reader`) follow the base/delta chain and verify every CRC32C.

A chunk that has erasure shards is durable as those shards; its whole encoded bytes
go to the RAM tier only, and to disk too with `local_copy`. A chunk without shards
(one daemon, m = 0) is always written to disk: it is the only copy.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stalwart.core import step_record as sr
from stalwart.core.manifest import whole_on_node
from stalwart.daemon.config_schema import default
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot import codecs
from stalwart.daemon.snapshot.atomic import EACH_WRITE, DiskSync, fsync_dir, write_atomic
from stalwart.daemon.snapshot.catalogue import Catalogue, FetchRecords
from stalwart.daemon.snapshot.chain_reader import ChainReader, Fetch, FetchHeld
from stalwart.daemon.snapshot.checksum import Buffer
from stalwart.daemon.snapshot.chunks import DEFAULT_CHUNK_BYTES, encode_rank
from stalwart.daemon.snapshot.ram_tier import RamTier
from stalwart.daemon.snapshot.selection import Layers
from stalwart.v1 import common_pb2, manifest_pb2


@dataclass
class PreparedRank:
    """One rank's encoded step, ready for `prepare`; `root_step` is the full base its
    chain starts from (the Manifest's base_step)."""

    step: int
    state: manifest_pb2.RankState
    payloads: list[bytes] = field(repr=False)
    decoded: np.ndarray = field(repr=False)
    root_step: int = 0


@dataclass
class _Reference:
    """The decoded buffer that a rank's next delta may apply to, and its chain."""

    step: int
    buffer: np.ndarray
    root: int          # full-base step the chain starts from
    length: int        # deltas since the root
    delta_bytes: int   # stored bytes of those deltas
    base_bytes: int    # stored bytes of the root
    layout: bytes      # serialised tensor metas: a changed layout forces a new base


class LocalStore(Catalogue):
    """RAM + disk tiers of one job's snapshots under `data_dir` (one writer process).

    Ranks may be encoded and prepared from several threads at once; commits and garbage
    collection are serialised by a lock (the RAM tier has its own).
    """

    def __init__(self, data_dir: Path, *, job_id: str = default("job_id"),
                 ram_tier_bytes: int = default("snapshot.ram_tier_bytes"),
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 base_every: int = default("snapshot.base_every"),
                 max_chain: int | None = None, retain: int = default("snapshot.retain"),
                 delta_against: str = "previous", lossy: bool = False,
                 level: int = codecs.DEFAULT_LEVEL,
                 local_copy: bool = default("snapshot.local_copy"),
                 executor: Executor | None = None, metrics: Metrics | None = None,
                 sync: DiskSync = EACH_WRITE) -> None:
        """`ram_tier_bytes`: encoded chunks kept in memory for reads (bytes, 0 = none);
        `base_every`: steps between full bases; `max_chain`: most deltas before a base
        (default base_every); `delta_against`: "previous" committed step or the chain's
        "base"; `lossy`: opt-in quantised deltas (restores are then NOT bitwise exact);
        `local_copy`: keep chunks that have shards on disk as well;
        `executor`: threads to encode chunks in parallel (zstd releases the GIL);
        `sync`: when written records and chunks reach the disk (a rollback's removals
        always at once: a step rolled back must not come back)."""
        if delta_against not in ("previous", "base"):
            raise ValueError(f"delta_against={delta_against!r}: use 'previous' or 'base'")
        super().__init__(Path(data_dir) / "snapshots" / job_id, sync)
        self.job_id, self.chunk_bytes = job_id, chunk_bytes
        self.base_every, self.retain, self.level = base_every, retain, level
        self.max_chain = base_every if max_chain is None else max_chain
        self.delta_against, self.lossy, self.metrics = delta_against, lossy, metrics
        self.executor, self.local_copy = executor, local_copy
        self.ram = RamTier(ram_tier_bytes, self._ram_protected)
        self.reader = ChainReader(self)
        self._refs: dict[int, _Reference] = {}
        # Files reach the disk in the background: the newest committed step known to be
        # on it (its files written before a completed write-back). Retention keeps it.
        self._on_disk_through = 0
        self._pending: dict[tuple[int, int], _Reference] = {}
        # The newest plan generation seen: an encode of an older one that finishes late
        # must not become the pending reference of a step the new generation redoes.
        self._generation = 0

    def sweep_temporaries(self) -> None:
        """Remove leftovers of writes a crash interrupted. Only the daemon that holds the
        data dir's lock may: another one's writes in flight use the same names."""
        for tmp in self.root.rglob("*.tmp"):
            tmp.unlink(missing_ok=True)

    # --- paths (records: `Catalogue`) ---------------------------------------------

    def chunk_path(self, step: int, rank: int, index: int) -> Path:
        """Disk location of a chunk payload (tests and scrubbers use it)."""
        return self._rank_dir(step, rank) / f"c{index}.chunk"

    # --- write path ----------------------------------------------------------------

    def encode(self, step: int, rank: int, data: Buffer,
               tensors: Sequence[common_pb2.TensorMeta], *,
               coord: common_pb2.RankCoord | None = None, extra: bytes = b"", node: str = "",
               adamw: Sequence[manifest_pb2.AdamWHint] = (),
               generation: int | None = None) -> PreparedRank:
        """Encode a rank's state buffer as a base or a delta, by this store's policy.

        `adamw` hints (one per parameter) let deltas apply to the predicted optimizer update:
        still lossless, several times smaller on AdamW state. `generation`: the plan the
        capture was taken in; one older than a plan seen since is encoded but never
        becomes a reference (its step is redone under the new plan).
        """
        layout = b"".join(t.SerializeToString(deterministic=True) for t in tensors)
        ref = self._refs.get(rank)
        # An owned copy: the next delta applies to it, and capture slots get reused.
        buf = np.frombuffer(data, dtype=np.uint8)
        if not isinstance(data, bytes):  # immutable bytes are already the store's own
            buf = buf.copy()
        fresh_base = (ref is None or ref.layout != layout or ref.buffer.size != buf.size
                      or step - ref.root >= self.base_every or ref.length >= self.max_chain
                      or ref.delta_bytes > ref.base_bytes or ref.step >= step)
        encoded = encode_rank(
            step, rank, buf, tensors, chunk_bytes=self.chunk_bytes, level=self.level,
            reference=None if fresh_base else ref.buffer,
            reference_step=None if fresh_base else ref.step, lossy=self.lossy,
            # The prediction models one optimizer step; older references only waste work.
            adamw=adamw if not fresh_base and ref.step == step - 1 else (),
            executor=self.executor, layout=layout)
        size = encoded.stored_bytes
        if fresh_base:
            nxt = _Reference(step, encoded.decoded, step, 0, 0, size, layout)
        else:
            # Chained deltas are all read on restore; deltas against the base only one.
            chained = self.delta_against == "previous"
            nxt = _Reference(step, encoded.decoded, ref.root, ref.length + 1,
                             ref.delta_bytes * chained + size, ref.base_bytes, layout)
        with self._lock:
            if generation is None or generation >= self._generation:
                self._generation = max(self._generation, generation or 0)
                self._pending[(step, rank)] = nxt
        state = manifest_pb2.RankState(
            rank=rank, coord=coord or common_pb2.RankCoord(rank=rank), tensors=tensors,
            chunks=encoded.chunks, total_bytes=buf.size, extra=extra, node=node, adamw=adamw)
        return PreparedRank(step, state, encoded.payloads, encoded.decoded, nxt.root)

    def decoded(self, step: int, rank: int) -> np.ndarray | None:
        """The rank's decoded buffer at committed `step` where this store captured it and
        still holds it: the newest committed capture of the rank, kept whole as its next
        delta's reference (read-only: later encodes make new buffers). None otherwise."""
        ref = self._refs.get(rank)
        return ref.buffer if ref is not None and ref.step == step else None

    def on_disk(self, chunk: manifest_pb2.ChunkRecord) -> bool:
        """Whether this store keeps the chunk's encoded bytes on its disk (as opposed to
        its shards alone) when it captured it."""
        return self.local_copy or not chunk.shards

    def prepare(self, step: int, prepared: PreparedRank,
                state: manifest_pb2.RankState | None = None) -> manifest_pb2.RankState:
        """Phase one: make the rank's record durable on disk, with each chunk that its
        shards do not already keep (`state`: the record naming them, once placed)."""
        state = prepared.state if state is None else state
        rank_dir = self._rank_dir(step, state.rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        written = 0
        for index, (c, payload) in enumerate(zip(state.chunks, prepared.payloads,
                                                 strict=True)):
            c.whole_on_node = self.on_disk(c)
            if c.whole_on_node:
                write_atomic(self.chunk_path(step, state.rank, index), payload, self.sync)
                written += len(payload)
            self.ram.put((step, state.rank, index), payload)
        write_atomic(rank_dir / "rank.pb", state.SerializeToString(), self.sync)
        self.sync.folder(rank_dir)
        self.sync.folder(rank_dir.parent)
        if self.metrics:
            self.metrics.stored_bytes.labels(tier="disk").inc(written)
        return state

    def disk_bytes(self, chunks: Sequence[manifest_pb2.ChunkRecord],
                   payloads: Sequence[bytes]) -> int:
        """What `prepare` will write whole of these placed chunks (for the disk quota)."""
        return sum(len(p) for c, p in zip(chunks, payloads, strict=True) if self.on_disk(c))

    def captured_here(self, step: int, rank: int, node: str) -> bool:
        """Whether `node` (this daemon) captured the rank's record of `step`."""
        held = self.held_record(step, rank)
        return held is not None and held.node == node

    def commit(self, record: manifest_pb2.StepRecord, *, local_node: str | None = None,
               verified: bool = False) -> None:
        """Phase two: publish a step atomically once every rank's chunks are stored.

        With `local_node`, only the ranks that node sealed must be on this disk (records
        and chunks); the others are durable on their own daemons and as shards. With
        `verified`, the caller has just run `step_record.verify` on this very record."""
        with self._lock:
            self._commit(record, local_node, verified)

    def _commit(self, record: manifest_pb2.StepRecord, local_node: str | None,
                verified: bool) -> None:
        if not verified:
            sr.verify(record)
        step = record.step
        path = self._record_path(step)
        data = record.SerializeToString(deterministic=True)
        if path.exists():
            if path.read_bytes() == data:
                return  # a retried commit of the same step
            raise ValueError(f"step {step} is already committed with a different record")
        mine = [seal for seal in record.seals if local_node is None or seal.node == local_node]
        states = []
        for seal in mine:
            held = [self.held_record(step, r) for r in seal.ranks]
            if any(h is None for h in held):
                raise ValueError(f"cannot commit step {step}: the records of ranks "
                                 f"{list(seal.ranks)[:8]} are not stored here; prepare first")
            sr.check(record, held)
            for state in held:
                for index, c in enumerate(state.chunks):
                    p = self.chunk_path(step, state.rank, index)
                    if not whole_on_node(c):
                        continue  # durable as its shards (whatever local_copy says now)
                    if not p.exists() or p.stat().st_size != c.stored_size:
                        raise ValueError(f"cannot commit step {step}: rank {state.rank} chunk "
                                         f"{c.chunk_id} is not stored at {p}; prepare it "
                                         "first")
                self._checked[(step, state.rank)] = state
            states += held
        sr.plan_chain({**self.committed_records(), step: record}, step)  # its bases exist
        write_atomic(path, data, self.sync)
        self._steps_written()
        self.sync.folder(path.parent)
        self._records[step] = record
        for state in states:
            ref = self._pending.pop((step, state.rank), None)
            if ref is not None and (self.delta_against == "previous" or ref.length == 0
                                    or state.rank not in self._refs):
                self._refs[state.rank] = ref
            elif ref is not None:  # deltas keep applying to the chain's base
                base = self._refs[state.rank]
                base.length, base.delta_bytes = ref.length, ref.delta_bytes
        self._pending = {k: v for k, v in self._pending.items() if k[0] > step}
        if self.metrics:
            self.metrics.commits.inc()
            self.metrics.last_committed_step.set(step)
            if states:
                stored = sum(c.stored_size for r in states for c in r.chunks)
                self.metrics.compression_ratio.set(
                    sum(r.total_bytes for r in states) / max(stored, 1))
        self.collect_garbage()

    def discard_after(self, step: int, generation: int = 0) -> list[int]:
        """Forget committed steps newer than `step` (training resumes from it and will
        commit those step numbers again, in plan `generation`); returns them."""
        with self._lock:
            self._generation = max(self._generation, generation)
            newer = [s for s in self.committed_steps() if s > step]
            try:
                for s in sorted(newer, reverse=True):
                    self._record_path(s).unlink()
                    self._records.pop(s, None)
            finally:
                self._steps_written()
            self._checked = {k: v for k, v in self._checked.items() if k[0] <= step}
            self._forget_held(newer)
            fsync_dir(self.root / "manifests")
            for step_dir in (self.root / "steps").iterdir():
                if int(step_dir.name) > step:
                    shutil.rmtree(step_dir, ignore_errors=True)
            self.ram.drop_steps(s for s in self.ram.steps() if s > step)
            # A rank's reference of `step` or older stays: the restore of the resume step
            # reads it (`decoded`), and the redone step's delta applies to it.
            self._refs = {r: ref for r, ref in self._refs.items() if ref.step <= step}
            self._pending.clear()
            return newer

    # --- read path: `ChainReader` ------------------------------------------------------

    def read_rank(self, step: int, rank: int, fetch: Fetch | None = None,
                  fetch_records: FetchRecords | None = None,
                  fetch_held: FetchHeld | None = None) -> bytes:
        """The rank's logical state buffer at a committed step (`ChainReader.read_rank`)."""
        return self.reader.read_rank(step, rank, fetch, fetch_records, fetch_held)

    def read_layers(self, step: int, rank: int, layers: Layers, fetch: Fetch | None = None,
                    fetch_records: FetchRecords | None = None,
                    fetch_held: FetchHeld | None = None
                    ) -> tuple[manifest_pb2.RankState, bytearray]:
        """Some layers of the rank's state at a committed step (`ChainReader.read_layers`)."""
        return self.reader.read_layers(step, rank, layers, fetch, fetch_records, fetch_held)

    # --- RAM tier ------------------------------------------------------------------

    def _ram_protected(self, steps: set[int]) -> set[int]:
        """Steps the RAM tier should keep: in flight, or needed to restore the newest."""
        records = self.committed_records()
        latest = max(records, default=-1)
        needed = set(sr.plan_chain(records, latest)) if records else set()
        return {s for s in steps if s > latest or s in needed}

    def ram_used(self) -> int:
        """Bytes of chunk payloads held in the RAM tier."""
        return self.ram.used

    # --- retention -----------------------------------------------------------------

    def written_back(self, step: int | None) -> None:
        """Every file of committed `step` and older is on the disk (a write-back that began
        after it committed has completed)."""
        if step is not None:
            with self._lock:
                self._on_disk_through = max(step, self._on_disk_through)

    def collect_garbage(self) -> list[int]:
        """Delete steps outside the newest `retain` and their chains; returns them.

        Manifests go first, so a crash mid-collection never leaves a visible step with
        missing chunks. Uncommitted steps newer than the latest commit are in flight
        and kept.
        """
        with self._lock:
            return self._collect_garbage()

    def _collect_garbage(self) -> list[int]:
        manifests = self.committed_records()
        if not manifests:
            return []
        kept = sr.retained_steps(manifests, self.retain)
        # Prepared-but-uncommitted deltas, and the next capture of every rank, apply to
        # chains that may be older than the newest `retain` steps: keep those chains too.
        for ref in [*self._pending.values(), *self._refs.values()]:
            kept.update(s for s in manifests if ref.root <= s <= ref.step)
        latest = max(manifests)
        on_disk = [s for s in manifests if s <= self._on_disk_through]
        if on_disk and not self.sync.each_write:
            # Until newer steps are on disk, the newest one that is stays there (with its
            # chain): a power loss then costs the steps since, not every step. (Before the
            # first write-back no step is known to be on disk: none is kept for it.)
            kept.update(sr.plan_chain(manifests, max(on_disk)))
        # Other daemons' ranks have chains this store does not hold the records of: keep
        # every step a recent chain may use.
        for s in [s for s in manifests if s >= latest - 2 * self.max_chain]:
            kept.update(sr.plan_chain(manifests, s))
        dropped = [s for s in manifests if s not in kept]
        try:
            for s in dropped:
                self._record_path(s).unlink()
                self._records.pop(s, None)
        finally:
            self._steps_written()
        self._checked = {k: v for k, v in self._checked.items() if k[0] not in dropped}
        self._forget_held(dropped)
        if dropped:  # a retired step that came back after a power loss is retired again
            self.sync.folder(self.root / "manifests")
        for step_dir in (self.root / "steps").iterdir():
            s = int(step_dir.name)
            if s not in kept and s < latest:
                shutil.rmtree(step_dir, ignore_errors=True)
        self.ram.drop_steps(s for s in self.ram.steps() if s not in kept and s < latest)
        return sorted(dropped)
