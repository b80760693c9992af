"""Specs for the placer, the daemon's encode-and-place stage: a capture's chunks are encoded
on several threads and put while the next ones encode, and what lands on the holders is
bitwise what zfec makes of each chunk; a put that fails fails the capture with its own
error. In-process, with holders that record what they are given."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from stalwart.daemon.config import DaemonConfig, ErasureConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import Peer, UntilLost, never_lost
from stalwart.daemon.snapshot.coder import ZfecCodec
from stalwart.daemon.snapshot.place import ShardPlacer
from stalwart.daemon.snapshot.shard_client import ShardTransferError
from stalwart.v1 import manifest_pb2

K, M = 4, 2


class Holders:
    """Each node's shards as put, and the threads that encoded (seen through the puts)."""

    def __init__(self, refuse: str = "", frozen: str = "") -> None:
        self.stored: dict[tuple[str, str], bytes] = {}
        self.refuse, self.frozen = refuse, frozen
        self.in_flight = self.most_in_flight = 0
        self.frozen_called = asyncio.Event()  # a put reached the frozen peer

    def client(self, node: str) -> Holders.Client:
        return Holders.Client(self, node)

    class Client:
        def __init__(self, holders: Holders, node: str) -> None:
            self.holders, self.node = holders, node

        async def put(self, sid: str, body: bytes, **_: object) -> None:
            h = self.holders
            h.in_flight += 1
            h.most_in_flight = max(h.most_in_flight, h.in_flight)
            try:
                if self.node == h.frozen:  # the peer's process is stopped: no answer
                    h.frozen_called.set()
                    await asyncio.Event().wait()
                await asyncio.sleep(0.01)  # a network put takes a while
                if self.node == h.refuse:
                    raise ShardTransferError(self.node, sid, "put", "disk full")
                h.stored[(self.node, sid)] = bytes(body)
            finally:
                h.in_flight -= 1


def placer(holders: Holders, threads: int, node: str = "n0", nodes: int = K + M,
           until_silent: UntilLost = never_lost) -> ShardPlacer:
    config = DaemonConfig(node=node, erasure=ErasureConfig(k=K, m=M, encode_threads=threads))
    peers = [Peer(f"n{i}", f"127.0.0.1:{9000 + i}", {}) for i in range(nodes)]
    return ShardPlacer(config, Metrics(), holders, None, lambda: peers, until_silent)


def capture(chunks: list[bytes]) -> manifest_pb2.RankState:
    return manifest_pb2.RankState(chunks=[manifest_pb2.ChunkRecord(chunk_id=f"c{i}")
                                          for i in range(len(chunks))])


def test_every_chunk_lands_as_zfecs_shards_on_distinct_holders_with_threads() -> None:
    chunks = [os.urandom(50_000 + 997 * i) for i in range(24)]
    holders = Holders()
    encoders: set[str] = set()
    p = placer(holders, threads=2)
    encode = ZfecCodec.encode

    def watched(self: ZfecCodec, chunk: bytes) -> list:
        encoders.add(threading.current_thread().name)
        return encode(self, chunk)

    try:
        ZfecCodec.encode = watched  # type: ignore[method-assign]
        placed = asyncio.run(p.place(3, 1, capture(chunks), chunks))
    finally:
        ZfecCodec.encode = encode  # type: ignore[method-assign]
        p.close()
    codec = ZfecCodec(K, M)
    for chunk, record in zip(chunks, placed.chunks, strict=True):
        assert (record.k, record.m) == (K, M)
        assert sorted(s.index for s in record.shards) == list(range(K + M))
        assert len({s.node for s in record.shards}) == K + M
        expected = codec.encode(chunk)
        for s in record.shards:
            assert holders.stored[(s.node, s.location)] == bytes(expected[s.index])
    assert len(encoders) == 2 and all(n.startswith("stalwart-encode") for n in encoders)
    assert holders.most_in_flight > K + M  # a chunk's puts overlapped another chunk's


def test_a_put_that_fails_on_this_daemon_fails_the_capture_with_its_own_error() -> None:
    chunks = [os.urandom(10_000) for _ in range(6)]
    p = placer(Holders(refuse="n0"), threads=2, node="n0")
    try:
        with pytest.raises(ShardTransferError, match="disk full"):
            asyncio.run(p.place(3, 1, capture(chunks), chunks))
    finally:
        p.close()


def test_the_erasure_benchmark_times_the_placer_beside_single_thread_zfec() -> None:
    import numpy as np

    from stalwart.bench.erasure import _coder_figures

    buf = np.random.default_rng(0).integers(0, 256, 12 << 20, dtype=np.uint8)
    figures = _coder_figures(buf, K, M, repeats=1)
    assert figures["encode_threads"] == DaemonConfig().erasure.encode_threads == 2
    assert figures["encode_gbps"] > 0 and figures["zfec_single_thread_gbps"] > 0
    assert figures["encode_speedup_vs_single_thread"] == pytest.approx(  # both rounded
        figures["encode_gbps"] / figures["zfec_single_thread_gbps"], rel=0.05, abs=0.02)


def test_once_the_step_is_moot_no_further_chunk_is_placed() -> None:
    # A hurry made the step moot while its first chunks were being put (the coordinator
    # re-plans from a later step): the chunks not yet begun are neither encoded nor put.
    chunks = [os.urandom(40_000) for _ in range(24)]
    holders = Holders()
    p = placer(holders, threads=2)
    try:
        placed = asyncio.run(p.place(3, 1, capture(chunks), chunks,
                                     moot=lambda: len(holders.stored) > 0))
    finally:
        p.close()
    begun = [c for c in placed.chunks if c.shards]
    assert 0 < len(begun) < len(chunks)
    assert len(holders.stored) == len(begun) * (K + M)


def test_a_put_to_a_peer_gone_quiet_goes_to_another_daemon_at_once() -> None:
    # A peer's process is stopped (SIGSTOP): its socket is open but a put never ends.
    # Once membership suspects it (a heartbeat overdue), the puts waiting on it stop and
    # their shards go to a daemon holding none of the chunk's, without waiting out the
    # put's deadline.
    chunks = [os.urandom(20_000) for _ in range(8)]
    holders = Holders(frozen="n3")

    async def until_silent(node: str) -> None:
        if node == "n3":
            await holders.frozen_called.wait()  # suspected once it is seen frozen
        else:
            await asyncio.Event().wait()

    async def main() -> manifest_pb2.RankState:
        return await asyncio.wait_for(p.place(3, 1, capture(chunks), chunks), 30)

    p = placer(holders, threads=2, nodes=K + M + 1, until_silent=until_silent)
    try:
        placed = asyncio.run(main())
    finally:
        p.close()
    assert holders.frozen_called.is_set()
    codec = ZfecCodec(K, M)
    for chunk, record in zip(chunks, placed.chunks, strict=True):
        nodes = [s.node for s in record.shards]
        assert "n3" not in nodes and len(set(nodes)) == K + M
        expected = codec.encode(chunk)
        for s in record.shards:
            assert holders.stored[(s.node, s.location)] == bytes(expected[s.index])
