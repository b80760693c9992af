"""Reading a rank's state back out of a store: the base/delta chain of a committed
step, each chunk from the RAM tier, the disk or (through `fetch`) its erasure shards,
every CRC32C verified; with a layer range, only the chunks that hold those layers
(`selection`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from stalwart.core import step_record as sr
from stalwart.daemon.errors import DataLoss, Invalid
from stalwart.daemon.snapshot.catalogue import FetchRecords
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.chunks import decode_rank
from stalwart.daemon.snapshot.selection import Layers, chunk_positions, closure, pack, wanted
from stalwart.v1 import manifest_pb2

if TYPE_CHECKING:
    from stalwart.daemon.snapshot.local_store import LocalStore

Fetch = Callable[[manifest_pb2.ChunkRecord], bytes]
# (node, step, rank, chunk positions; none: all) -> the decoded bytes of those chunks that
# the daemon `node` holds for the rank's committed step, or None where it holds none.
FetchHeld = Callable[[str, int, int, Sequence[int]], "bytes | None"]
PREFETCH_THREADS = 8  # chunks fetched from shards at once for one read
PREFETCH_BYTES = 1 << 30  # encoded bytes one read fetches ahead of its decoding, at most


class CorruptChunkError(DataLoss):
    """A stored chunk is missing or fails its checksum in every tier that holds it."""

    def __init__(self, step: int, rank: int, chunk_id: str, tier: str, detail: str) -> None:
        self.step, self.rank, self.chunk_id, self.tier = step, rank, chunk_id, tier
        super().__init__(
            f"step {step} rank {rank} chunk {chunk_id} in tier {tier!r}: {detail}; restore "
            "another committed step, or read this one from a tier that still holds it")


class ChainReader:
    """Reads of one store's committed steps: its records, RAM tier and chunk files."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def read_rank(self, step: int, rank: int, fetch: Fetch | None = None,
                  fetch_records: FetchRecords | None = None,
                  fetch_held: FetchHeld | None = None) -> bytes:
        """The rank's logical state buffer at a committed step, every CRC verified.

        `fetch(chunk)` returns a chunk's stored bytes from elsewhere (erasure shards)
        when this disk lacks it or holds a corrupt copy; `fetch_records` the records of
        a rank captured elsewhere; `fetch_held` the decoded bytes the daemon that
        captured it may still hold (tried before the chain)."""
        return self._read(step, rank, fetch, fetch_records, None, fetch_held)[0].tobytes()

    def read_layers(self, step: int, rank: int, layers: Layers, fetch: Fetch | None = None,
                    fetch_records: FetchRecords | None = None,
                    fetch_held: FetchHeld | None = None
                    ) -> tuple[manifest_pb2.RankState, bytearray]:
        """Part of the rank's state at a committed step: the tensors of `layers` and those
        of no layer, as a record of just them and their bytes (`selection.packed`). Only
        the chunks that hold them are read, along the whole chain (or, held elsewhere,
        fetched decoded)."""
        out, state, keep = self._read(step, rank, fetch, fetch_records, layers, fetch_held)
        assert keep is not None  # given layers, _read names the tensors they want
        return pack(out.data, state, keep)

    def held_regions(self, step: int, rank: int, positions: Sequence[int]
                     ) -> list[memoryview] | None:
        """Views of the decoded bytes of the rank's chunks at `positions` (every chunk
        when empty), in that order, in the buffer this store holds for committed `step`
        (see `_held`; it is never written again); None when it holds none. What a
        peer's `fetch_held` reads."""
        buffer = self.store.decoded(step, rank)
        if buffer is None:
            return None
        view = memoryview(buffer).cast("B")
        if not positions:
            return [view]
        chunks = self.store.rank_record(step, rank).chunks
        if max(positions) >= len(chunks):
            raise Invalid(f"step {step} rank {rank} has {len(chunks)} chunks; asked for "
                          f"position {max(positions)}")
        return [view[chunks[i].offset:chunks[i].offset + chunks[i].size] for i in positions]

    def _read(self, step: int, rank: int, fetch: Fetch | None,
              fetch_records: FetchRecords | None, layers: Layers | None,
              fetch_held: FetchHeld | None = None
              ) -> tuple[np.ndarray, manifest_pb2.RankState, set[str] | None]:
        """The rank's buffer at `step`, its record, and with `layers` the tensors they
        want (`selection.wanted`): then only the chunks holding those (and what decoding
        them drags in, `selection.closure`) are read and checked."""
        records = self.store.committed_records()
        if step not in records:
            raise FileNotFoundError(f"step {step} is not committed; latest committed is "
                                    f"{self.store.latest_committed()}")
        held = self._held(step, rank, fetch_records, layers)
        if held is None and fetch_held is not None:
            held = self._held_elsewhere(step, rank, fetch_records, layers, fetch_held)
        if held is not None:
            return held
        chain = sr.plan_chain(records, step, rank)
        users = {s: {t for t in chain if s in sr.seal_of(records[t], rank).bases}
                 for s in chain}
        states = {s: self.store.rank_record(s, rank, fetch_records) for s in chain}
        keep = None if layers is None else wanted(states[step], layers)
        names = None if keep is None else closure(states.values(), keep)
        positions = {s: range(len(st.chunks)) if names is None else chunk_positions(st, names)
                     for s, st in states.items()}
        fetched = self._prefetch(rank, states, positions, fetch)
        decoded: dict[int, np.ndarray] = {}
        for s in chain:
            decoded[s] = self._decode_rank(s, states[s], decoded, positions[s], fetched,
                                           fetch, names)
            for done in [d for d in decoded if d != step and max(users[d], default=-1) <= s]:
                del decoded[done]  # no later step in the chain applies to it
        return decoded[step], states[step], keep

    def _held(self, step: int, rank: int, fetch_records: FetchRecords | None,
              layers: Layers | None
              ) -> tuple[np.ndarray, manifest_pb2.RankState, set[str] | None] | None:
        """The rank's buffer at `step` without reading or decoding a chunk, where this
        store captured that step of the rank and still holds its decoded buffer (the
        reference of the rank's next delta: its newest committed capture, what a restore
        after a failure usually asks for). Its CRC32Cs are checked as a decode's are;
        None when it is not held or fails them (the chain is read instead)."""
        buffer = self.store.decoded(step, rank)
        if buffer is None:
            return None
        state = self.store.rank_record(step, rank, fetch_records)
        if buffer.size != state.total_bytes or _first_bad(buffer, state.chunks) is not None:
            if self.store.metrics:
                self.store.metrics.scrub_errors.labels(tier="ram").inc()
            return None
        return buffer, state, None if layers is None else wanted(state, layers)

    def _held_elsewhere(self, step: int, rank: int, fetch_records: FetchRecords | None,
                        layers: Layers | None, fetch_held: FetchHeld
                        ) -> tuple[np.ndarray, manifest_pb2.RankState, set[str] | None] | None:
        """`_held`, from the daemon that captured the rank's step (a spare on another
        node replacing a rank whose daemon lives): the decoded bytes of the chunks the
        read wants, checked against their CRC32Cs; None when that daemon holds none, or
        they fail (the chain is read instead)."""
        state = self.store.rank_record(step, rank, fetch_records)
        keep = None if layers is None else wanted(state, layers)
        positions = (list(range(len(state.chunks))) if keep is None
                     else chunk_positions(state, keep))
        if not state.node or not positions:
            return None
        data = fetch_held(state.node, step, rank, [] if keep is None else positions)
        if data is None:
            return None
        chunks = [state.chunks[i] for i in positions]
        if len(data) != sum(c.size for c in chunks):
            return self._bad_peer_copy()
        if keep is None:
            buffer = np.frombuffer(data, dtype=np.uint8)
        else:  # the chunks' regions of a whole buffer; the rest is never read
            buffer, at = np.zeros(state.total_bytes, dtype=np.uint8), 0
            for c in chunks:
                buffer[c.offset:c.offset + c.size] = np.frombuffer(data, np.uint8, c.size, at)
                at += c.size
        if buffer.size != state.total_bytes or _first_bad(buffer, chunks) is not None:
            return self._bad_peer_copy()
        return buffer, state, keep

    def _bad_peer_copy(self) -> None:
        if self.store.metrics:
            self.store.metrics.scrub_errors.labels(tier="peer").inc()

    def _prefetch(self, rank: int, states: dict[int, manifest_pb2.RankState],
                  positions: dict[int, Sequence[int]], fetch: Fetch | None
                  ) -> dict[str, bytes]:
        """The chunks to read that neither tier here holds, fetched side by side: each is
        k shard reads from peers, and one at a time a chain of deltas took seconds. In
        chain order up to PREFETCH_BYTES, so a long chain of a large rank is not held in
        memory at once (the rest is fetched as it is decoded); one failed fetch cancels
        those not started, and the restore goes on to its next candidate."""
        missing, budget = [], PREFETCH_BYTES
        for s, st in states.items():
            for i in positions[s]:
                c = st.chunks[i]
                if (c.shards and self.store.ram.get((s, rank, i)) is None
                        and not self.store.chunk_path(s, rank, i).exists()
                        and budget >= c.stored_size):
                    missing.append(((s, rank, i), c))
                    budget -= c.stored_size
        if fetch is None or len(missing) < 2:
            return {}
        with ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="prefetch") as pool:
            # A failed fetch ends the map, which cancels the fetches not yet started.
            payloads = list(pool.map(fetch, (c for _, c in missing)))
        for (key, _), payload in zip(missing, payloads, strict=True):
            self.store.ram.put(key, payload)  # as a chunk fetched alone is: the next read is local
        return {c.chunk_id: p for (_, c), p in zip(missing, payloads, strict=True)}

    def _decode_rank(self, step: int, state: manifest_pb2.RankState,
                     decoded: dict[int, np.ndarray], positions: Sequence[int],
                     fetched: dict[str, bytes], fetch: Fetch | None = None,
                     names: set[str] | None = None) -> np.ndarray:
        """The rank's buffer at `step` from the chunks at `positions` (with `names`, those
        that hold them), taking `fetched` payloads before fetching any other."""
        payloads = [self._read_or_fetch(step, state.rank, i, state.chunks[i], fetch)
                    if (got := fetched.pop(state.chunks[i].chunk_id, None)) is None else got
                    for i in positions]
        out = decode_rank(state, payloads, decoded, positions=positions,
                          adamw=None if names is None else
                          [h for h in state.adamw if h.param in names])
        bad = _first_bad(out, [state.chunks[i] for i in positions])
        if bad is not None:
            raise CorruptChunkError(step, state.rank, bad.chunk_id, "decoded",
                                    f"decoded bytes fail CRC32C (base step {bad.base_step})")
        return out

    def _read_or_fetch(self, step: int, rank: int, index: int, c: manifest_pb2.ChunkRecord,
                       fetch: Fetch | None) -> bytes:
        try:
            return self._read_payload(step, rank, index, c)
        except CorruptChunkError:
            if fetch is None or not c.shards:
                raise
        payload = fetch(c)  # verified against the manifest by the shard reader
        self.store.ram.put((step, rank, index), payload)
        return payload

    def _read_payload(self, step: int, rank: int, index: int,
                      c: manifest_pb2.ChunkRecord) -> bytes:
        key = (step, rank, index)
        cached = self.store.ram.get(key)
        if cached is not None:
            if crc32c(cached) == c.stored_crc32c:
                return cached
            self.store.ram.drop(key)  # a bad RAM copy: fall through to disk
            if self.store.metrics:
                self.store.metrics.scrub_errors.labels(tier="ram").inc()
        path = self.store.chunk_path(step, rank, index)
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            raise CorruptChunkError(step, rank, c.chunk_id, "disk",
                                    f"file {path} is missing") from None
        if len(payload) != c.stored_size or crc32c(payload) != c.stored_crc32c:
            if self.store.metrics:
                self.store.metrics.scrub_errors.labels(tier="disk").inc()
            raise CorruptChunkError(step, rank, c.chunk_id, "disk",
                                    f"file {path} fails CRC32C ({len(payload)} bytes, "
                                    f"expected {c.stored_size})")
        self.store.ram.put(key, payload)
        return payload


def _first_bad(buffer: np.ndarray, chunks: Sequence[manifest_pb2.ChunkRecord]
               ) -> manifest_pb2.ChunkRecord | None:
    """The first of `chunks` whose decoded bytes in `buffer` fail its CRC32C, or None."""
    return next((c for c in chunks if crc32c(buffer[c.offset:c.offset + c.size]) != c.crc32c),
                None)
