"""Read path: rebuild a chunk from any k of its shards, cheapest tier first.

Shards are fetched from local memory, then peers, then S3; each is checked
against the CRC32C in the manifest. A failed or slow fetch is replaced by the next
candidate; the decoded chunk is checked again. With fewer than k good shards the
error names the chunk and what happened to every shard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from stalwart.core.placement import S3, ChunkPlacement
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.coder import Codec, ZfecCodec
from stalwart.daemon.snapshot.s3_tier import S3Tier
from stalwart.daemon.snapshot.shard_client import ShardClient
from stalwart.v1 import manifest_pb2

LocalLookup = Callable[[str], bytes | memoryview | None]


class BeyondToleranceError(Exception):
    """Fewer than k good shards of a chunk could be read."""

    def __init__(self, chunk_id: str, k: int, got: list[int], unavailable: dict[int, str]
                 ) -> None:
        detail = "; ".join(f"shard {i}: {why}" for i, why in sorted(unavailable.items()))
        super().__init__(
            f"chunk {chunk_id} cannot be rebuilt: {len(got)} good shards of the {k} needed "
            f"(have {got}); {detail}. More holders were lost than the code tolerates: restore "
            "the newest step that is still recoverable.")
        self.chunk_id = chunk_id
        self.unavailable = unavailable


class ChunkChecksumError(Exception):
    """Every shard matched its checksum but the decoded chunk does not."""


@dataclass(frozen=True)
class _Candidate:
    tier: int          # 0 local, 1 peer, 2 s3: lower is cheaper
    index: int
    record: manifest_pb2.ShardRecord


def shard_id_of(chunk: manifest_pb2.ChunkRecord, shard: manifest_pb2.ShardRecord) -> str:
    """The shard's identifier on its tier: its recorded location, else `<chunk_id>.<index>`."""
    return shard.location or f"{chunk.chunk_id}.{shard.index}"


def placement_of(chunk: manifest_pb2.ChunkRecord) -> ChunkPlacement:
    """The holders recorded in a manifest's chunk, for margin and repair computations."""
    holders: list[list[str]] = [[] for _ in range(chunk.k + chunk.m)]
    for rec in chunk.shards:
        if rec.index < len(holders):
            holders[rec.index].append(rec.node)
    return ChunkPlacement(chunk.chunk_id, chunk.k, chunk.m, tuple(tuple(h) for h in holders))


class ShardReader:
    """Fetches and decodes chunks for one node (`node` names this daemon)."""

    def __init__(self, *, node: str, peers: Mapping[str, ShardClient],
                 local: LocalLookup | None = None, s3: S3Tier | None = None,
                 deadline_s: float = 10.0, hedge_after_s: float = 2.0,
                 metrics: Metrics | None = None,
                 codec_for: Callable[[int, int], Codec] = ZfecCodec,
                 quiet: Callable[[str], bool] = lambda node: False) -> None:
        """`quiet(node)`: that peer is suspect (a heartbeat overdue); its shards are asked
        for only after every other holder's (a frozen peer would take `hedge_after_s`)."""
        self.node = node
        self.quiet = quiet
        self.peers = peers
        self.local = local
        self.s3 = s3
        self.deadline_s = deadline_s
        self.hedge_after_s = hedge_after_s
        self.metrics = metrics
        self._codec_for = codec_for
        self._codecs: dict[tuple[int, int], Codec] = {}

    def _codec(self, k: int, m: int) -> Codec:
        if (k, m) not in self._codecs:
            self._codecs[(k, m)] = self._codec_for(k, m)
        return self._codecs[(k, m)]

    def _candidates(self, chunk: manifest_pb2.ChunkRecord) -> list[_Candidate]:
        out = []
        for rec in chunk.shards:
            if rec.node == S3:
                out.append(_Candidate(2, rec.index, rec))
                continue
            if rec.node == self.node and self.local is not None:
                out.append(_Candidate(0, rec.index, rec))
            if rec.node in self.peers:  # this node's own disk is reached as a peer too
                out.append(_Candidate(1, rec.index, rec))
        # Cheapest tier first, a quiet peer's after the others'; data shards before
        # parity (no decode work if all k are data).
        return sorted(out, key=lambda c: (c.tier, c.tier == 1 and self.quiet(c.record.node),
                                          c.index))

    async def _fetch(self, chunk: manifest_pb2.ChunkRecord, c: _Candidate,
                     timeout_s: float) -> bytes:
        sid = shard_id_of(chunk, c.record)
        if c.tier == 0:
            data = self.local(sid)
            if data is None:
                raise LookupError("not in local memory")
            data = bytes(data)
        elif c.tier == 2:
            if self.s3 is None:
                raise LookupError("no S3 tier configured")
            data = await asyncio.wait_for(self.s3.get_shard(sid), timeout_s)
        else:
            data = await self.peers[c.record.node].get(sid, expected_crc=c.record.crc32c,
                                    expected_size=c.record.size, deadline_s=timeout_s)
        if len(data) != c.record.size or crc32c(data) != c.record.crc32c:
            if self.metrics is not None:
                self.metrics.scrub_errors.labels(("local", "peer", "s3")[c.tier]).inc()
            raise ValueError(f"checksum mismatch ({len(data)} bytes, CRC32C "
                             f"{crc32c(data):#010x}, manifest says {c.record.crc32c:#010x})")
        return data

    async def read_chunk(self, chunk: manifest_pb2.ChunkRecord) -> bytes:
        """The chunk's stored (pre-erasure) bytes, verified against its CRC32C."""
        shards = await self.fetch_shards(chunk)
        size = chunk.stored_size or chunk.size
        want = chunk.stored_crc32c if chunk.stored_size else chunk.crc32c
        data = await asyncio.to_thread(self._codec(chunk.k, chunk.m).decode, shards, size)
        if crc32c(data) != want:
            raise ChunkChecksumError(
                f"chunk {chunk.chunk_id} decoded from shards {sorted(shards)} has CRC32C "
                f"{crc32c(data):#010x}, the manifest says {want:#010x}")
        return data

    async def recreate_shards(self, chunk: manifest_pb2.ChunkRecord,
                              indices: list[int]) -> dict[int, bytes]:
        """Shards `indices` of a chunk rebuilt from any k survivors, each checked against
        the CRC32C in the manifest (for repair after a node loss)."""
        data = await self.read_chunk(chunk)
        codec = self._codec(chunk.k, chunk.m)
        shards = await asyncio.to_thread(codec.encode, data)
        want = {rec.index: rec.crc32c for rec in chunk.shards}
        out = {}
        for i in indices:
            body = bytes(shards[i])
            if i in want and crc32c(body) != want[i]:
                raise ChunkChecksumError(
                    f"re-created shard {i} of chunk {chunk.chunk_id} does not match the "
                    "manifest; was it written with another code?")
            out[i] = body
        return out

    async def fetch_shards(self, chunk: manifest_pb2.ChunkRecord) -> dict[int, bytes]:
        """Any k verified shards {index: bytes}, or BeyondToleranceError."""
        k = chunk.k
        queue = self._candidates(chunk)
        end = time.monotonic() + self.deadline_s
        good: dict[int, bytes] = {}
        failed: dict[int, str] = {}
        running: dict[asyncio.Task, _Candidate] = {}

        def launch() -> bool:
            busy = {c.index for c in running.values()}
            for pos, c in enumerate(queue):
                if c.index not in good and c.index not in busy:
                    del queue[pos]
                    left = max(0.0, end - time.monotonic())
                    running[asyncio.ensure_future(self._fetch(chunk, c, left))] = c
                    return True
            return False

        try:
            while len(good) < k:
                while len(good) + len(running) < k and launch():
                    pass
                if not running:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    for c in running.values():
                        failed.setdefault(c.index, f"no answer within {self.deadline_s:.1f} s")
                    break
                done, _ = await asyncio.wait(running, timeout=min(left, self.hedge_after_s),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    launch()  # hedge: a slow holder gets company from the next candidate
                    continue
                for task in done:
                    c = running.pop(task)
                    if task.exception() is None:
                        good.setdefault(c.index, task.result())
                        failed.pop(c.index, None)
                    else:
                        failed[c.index] = f"{_where(c)}: {task.exception()}"
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        if len(good) < k:
            for rec in chunk.shards:
                failed.setdefault(rec.index, f"{_where_rec(rec)}: not reachable from here")
            for i in good:
                failed.pop(i, None)
            raise BeyondToleranceError(chunk.chunk_id, k, sorted(good), failed)
        return dict(sorted(good.items())[:k]) if len(good) > k else good


def _where(c: _Candidate) -> str:
    return ("local memory", f"peer {c.record.node}", "S3")[c.tier]


def _where_rec(rec: manifest_pb2.ShardRecord) -> str:
    return "S3" if rec.node == S3 else f"node {rec.node}"


async def read_chunks(reader: ShardReader, chunks: list[manifest_pb2.ChunkRecord],
                      concurrency: int = 8) -> list[bytes]:
    """Read many chunks with at most `concurrency` in flight, results in input order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(chunk: manifest_pb2.ChunkRecord) -> bytes:
        async with gate:
            return await reader.read_chunk(chunk)

    return list(await asyncio.gather(*(one(c) for c in chunks)))
