"""Place, the fourth stage: each encoded chunk as k + m shards on distinct daemons (and S3).

Chunks are encoded on `[erasure] encode_threads` threads side by side (zfec releases
the GIL), and a chunk's puts run while the next chunks encode; at most
IN_FLIGHT_PER_THREAD chunks per thread hold their shards in memory at once.
Placement is `core.placement.place_chunk` (rendezvous hashing over the live daemons);
a peer that cannot take its shard (dead but not yet detected as lost) is replaced
by another live daemon that holds no shard of the chunk yet, and the record says
where the shard really went.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from stalwart.core.placement import S3, Node, place_chunk
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import (
    QUIET,
    Peer,
    PeerLost,
    UntilLost,
    never_lost,
    unless_lost,
)
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.coder import Buffer, ZfecCodec, default_km
from stalwart.daemon.snapshot.holders import ShardHolders
from stalwart.daemon.snapshot.s3_tier import S3Tier
from stalwart.daemon.snapshot.shard_client import ShardTransferError
from stalwart.v1 import manifest_pb2

log = logging.getLogger("stalwart.daemon.snapshot.place")

IN_FLIGHT_PER_THREAD = 2  # chunks encoded or being put, per encode thread


class ShardPlacer:
    """Erasure-codes and places one rank's chunks for a step."""

    def __init__(self, config: DaemonConfig, metrics: Metrics, holders: ShardHolders,
                 s3: S3Tier | None, peers: Callable[[], list[Peer]],
                 until_silent: UntilLost = never_lost) -> None:
        """`until_silent`: a put to a peer that has gone quiet (suspect or lost) stops
        waiting and goes to another daemon."""
        self.config, self.metrics, self.holders, self.s3 = config, metrics, holders, s3
        self.node, self.peers, self.until_silent = config.node, peers, until_silent
        threads = config.erasure.encode_threads
        self._encoders = ThreadPoolExecutor(threads, thread_name_prefix="stalwart-encode")
        self._in_flight = threads * IN_FLIGHT_PER_THREAD

    def close(self) -> None:
        self._encoders.shutdown(wait=True)

    def coding(self, nodes: int) -> tuple[int, int]:
        """(k, m) for this many live daemons: the configured code when it fits."""
        k, m = self.config.erasure.k, self.config.erasure.m
        on_nodes = k if self.config.erasure.parity_to == "s3" else k + m
        return (k, m) if on_nodes <= nodes else default_km(nodes)

    async def place(self, step: int, generation: int, state: manifest_pb2.RankState,
                      payloads: list[bytes], *, moot: Callable[[], bool] = lambda: False
                      ) -> manifest_pb2.RankState:
        """`state` with the shard records of every chunk, once all are stored. Once
        `moot()` (the step will not commit), chunks not yet begun are left unplaced."""
        peers = self.peers()
        if len(peers) < 2 and self.s3 is None:
            return state  # a single daemon: the local disk is the only tier
        k, m = self.coding(len(peers))
        if m == 0:
            return state
        codec = ZfecCodec(k, m)
        nodes = [Node(p.node, p.labels) for p in peers]
        live = {p.node for p in peers}
        out = manifest_pb2.RankState()
        out.CopyFrom(state)
        unreachable: set[str] = set()  # peers that failed a put during this capture
        room = asyncio.Semaphore(self._in_flight)

        async def one(chunk: manifest_pb2.ChunkRecord, payload: bytes) -> None:
            async with room:
                if moot():
                    return
                await self._place_chunk(chunk, payload, codec, nodes, step, generation,
                                        live, unreachable)

        try:
            async with asyncio.TaskGroup() as group:
                for chunk, payload in zip(out.chunks, payloads, strict=True):
                    group.create_task(one(chunk, payload))
        except BaseExceptionGroup as failed:  # the first failure, as a single chunk raised it
            raise failed.exceptions[0] from None
        return out

    async def _place_chunk(self, chunk: manifest_pb2.ChunkRecord, payload: bytes,
                           codec: ZfecCodec, nodes: list[Node], step: int, generation: int,
                           live: set[str], unreachable: set[str]) -> None:
        shards, seconds = await asyncio.get_running_loop().run_in_executor(
            self._encoders, _sealed, codec, payload)
        self.metrics.coder_seconds.labels("encode").inc(seconds)
        self.metrics.coder_bytes.labels("encode").inc(len(payload))
        k, m = codec.k, codec.m
        placement = place_chunk(chunk.chunk_id, k, m, nodes, self.config.erasure.parity_to)
        puts = []
        chosen = {h for holders in placement.holders for h in holders}
        for index, holders in enumerate(placement.holders):
            body, crc = shards[index]
            sid = f"{chunk.chunk_id}.{index}"
            for holder in holders:
                chunk.shards.append(manifest_pb2.ShardRecord(
                    index=index, node=holder, location=sid, size=len(body), crc32c=crc))
                if holder == S3:
                    assert self.s3 is not None
                    puts.append(self.s3.put_shard(sid, body))
                else:
                    puts.append(self._put_shard(chunk.shards[-1], body, step, generation,
                                                live, chosen, unreachable))
        chunk.k, chunk.m = k, m
        await asyncio.gather(*puts)
        self.metrics.stored_bytes.labels(tier="shards").inc(sum(len(b) for b, _ in shards))

    async def _put_shard(self, record: manifest_pb2.ShardRecord, body: Buffer, step: int,
                         generation: int, live: set[str], chosen: set[str],
                         unreachable: set[str]) -> None:
        """Store one shard on `record.node`; when that peer cannot take it, on another live
        daemon, else on this one, and record where.

        Failing the whole step instead would drop every step captured between a node's
        death and its detection, and a job that ends meanwhile could never commit them.
        """
        node = record.node
        if node in unreachable:
            node = self._alternate(live, chosen, unreachable)
            chosen.add(node)
        while True:
            try:
                put = self.holders.client(node).put(record.location, body, step=step,
                                                    generation=generation, crc=record.crc32c)
                await (put if node == self.node else
                       unless_lost(put, node, self.until_silent, QUIET))
                break
            except (ShardTransferError, LookupError, PeerLost) as exc:
                if node == self.node:
                    raise  # this daemon's own shard store failed: nothing else to try
                unreachable.add(node)
                nxt = self._alternate(live, chosen, unreachable)
                chosen.add(nxt)  # before the next await: a sibling shard picks another
                log.warning("shard rerouted: its peer did not take it",
                            extra={"shard": record.location, "peer": node, "to": nxt,
                                   "error": str(exc)})
                node = nxt
        record.node = node

    def _alternate(self, live: set[str], chosen: set[str], unreachable: set[str]) -> str:
        """A live daemon holding no shard of this chunk yet, else this daemon."""
        spare = sorted(n for n in live if n not in chosen and n not in unreachable)
        return spare[0] if spare else self.node


def _sealed(codec: ZfecCodec, payload: bytes) -> tuple[list[tuple[Buffer, int]], float]:
    """Each shard of `payload` with its CRC32C, and the seconds that took (on an encode
    thread, so time queued for one is not counted). Data shards stay views into
    `payload`: every holder takes a buffer, and a copy here would cost as much as the
    encoding."""
    t0 = time.perf_counter()
    shards = [(shard, crc32c(shard)) for shard in codec.encode(payload)]
    return shards, time.perf_counter() - t0
