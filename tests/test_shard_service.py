"""Specs for ShardService over a real grpc.aio server on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.shard_client import (
    ByteBudget,
    ShardChecksumError,
    ShardClient,
    ShardTransferError,
    piece_bytes,
)
from stalwart.daemon.snapshot.shard_store import validate_id
from stalwart.v1 import peer_pb2, peer_pb2_grpc


class AnyDeletes:
    """A deletion policy for the storage tests: every delete is allowed (the daemon's own
    policy is tested in test_hostile_peers.py)."""

    def may_delete(self, caller: str, owner: str, step: int) -> str:
        return ""


@contextlib.asynccontextmanager
async def shard_server(store: Path, metrics: Metrics | None = None):
    server = grpc.aio.server()
    servicer = ShardServicer(store, metrics or Metrics(), policy=AnyDeletes())
    peer_pb2_grpc.add_ShardServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(grace=None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_multi_mib_shard_round_trips_in_pieces(tmp_path):
    data = os.urandom(5 * (1 << 20) + 12345)

    async def scenario():
        async with shard_server(tmp_path) as (address, _):
            client = ShardClient(address, job_id="job1")
            await client.put("step3/rank0/c0.1", data, step=3)
            got = await client.get("step3/rank0/c0.1", expected_crc=crc32c(data),
                                   expected_size=len(data))
            await client.close()
            return got

    assert run(scenario()) == data
    assert (tmp_path / "job1" / "step3" / "rank0" / "c0.1").read_bytes() == data


def test_corrupt_stream_is_rejected_and_not_stored(tmp_path):
    metrics = Metrics()

    async def scenario():
        async with shard_server(tmp_path, metrics) as (address, _):
            async with grpc.aio.insecure_channel(address) as channel:
                stub = peer_pb2_grpc.ShardServiceStub(channel)
                header = peer_pb2.ShardHeader(job_id="j", shard_id="c.0", size=8,
                                              crc32c=crc32c(b"abcdefgh"))
                pieces = [peer_pb2.ShardPiece(header=header, data=b"abcd"),
                          peer_pb2.ShardPiece(data=b"XXXX")]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.PutShard(iter(pieces), timeout=10)
                return err.value.code(), err.value.details()

    code, details = run(scenario())
    assert code == grpc.StatusCode.DATA_LOSS and "CRC32C" in details
    assert not (tmp_path / "j" / "c.0").exists()
    assert not [p for p in (tmp_path / "j").iterdir()]  # no temp file left behind
    assert metrics.registry.get_sample_value("stalwart_scrub_errors_total", {"tier": "peer"}) == 1


@pytest.mark.parametrize("shard_id", ["../../etc/passwd", "/etc/passwd", "a/../../b", "a//b",
                                      ".hidden", "c.0\n", "c 0", "x" * 300, "", "c.0.meta.json"])
def test_traversal_and_odd_ids_are_refused(tmp_path, shard_id):
    store = tmp_path / "store"

    async def scenario():
        async with shard_server(store) as (address, _):
            client = ShardClient(address, job_id="job1", attempts=1)
            with pytest.raises(ShardTransferError, match="INVALID_ARGUMENT"):
                await client.put(shard_id, b"payload")
            with pytest.raises(ShardTransferError, match="INVALID_ARGUMENT"):
                await client.get(shard_id)
            await client.close()

    run(scenario())
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_job_id_may_not_contain_a_slash():
    with pytest.raises(ValueError, match="not allowed"):
        validate_id("a/b", "job_id", allow_slash=False)


def test_bit_rot_on_disk_is_reported_as_data_loss(tmp_path):
    async def scenario():
        async with shard_server(tmp_path) as (address, servicer):
            client = ShardClient(address, job_id="j", attempts=2, backoff_s=0.01)
            await client.put("c.2", b"0123456789")
            (tmp_path / "j" / "c.2").write_bytes(b"0123456780")
            assert servicer.store.scrub() == ["j/c.2"]
            with pytest.raises(ShardChecksumError, match="DATA_LOSS"):
                await client.get("c.2")
            await client.close()

    run(scenario())


def test_missing_shard_is_not_found_without_retries(tmp_path):
    async def scenario():
        async with shard_server(tmp_path) as (address, _):
            client = ShardClient(address, job_id="j")
            with pytest.raises(ShardTransferError, match="NOT_FOUND"):
                await client.get("nope.0")
            await client.close()

    run(scenario())


def test_delete_by_id_and_below_step(tmp_path):
    async def scenario():
        async with shard_server(tmp_path) as (address, _):
            client = ShardClient(address, job_id="j")
            for step in (1, 2, 3):
                await client.put(f"s{step}.0", b"x", step=step)
                await client.put(f"s{step}.1", b"y", step=step)
            deleted = await client.delete(["s3.1"], below_step=3)
            await client.close()
            return deleted

    assert run(scenario()) == 5
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["s3.0", "s3.0.meta.json"]


def test_byte_budget_bounds_bytes_in_flight():
    async def scenario():
        budget = ByteBudget(100)
        peak = 0

        async def worker(n: int) -> None:
            nonlocal peak
            held = await budget.acquire(n)
            peak = max(peak, budget.capacity - budget.available)
            await asyncio.sleep(0)
            await budget.release(held)

        await asyncio.gather(*(worker(40) for _ in range(10)), worker(500))
        return peak, budget.available

    peak, available = run(scenario())
    assert peak <= 100 and available == 100


@pytest.mark.parametrize("size", [0, 1 << 20, 2 << 20])
def test_empty_and_piece_aligned_shards_round_trip(tmp_path, size):
    data = os.urandom(size)

    async def scenario():
        async with shard_server(tmp_path) as (address, _):
            client = ShardClient(address, job_id="j")
            await client.put("c.0", data)
            got = await client.get("c.0", expected_crc=crc32c(data), expected_size=size)
            await client.close()
            return got

    assert run(scenario()) == data


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=300), first=st.booleans(), size=st.integers(0, 2**40))
def test_a_piece_framed_around_its_bytes_is_the_message_protobuf_writes(data, first, size):
    # The client puts pieces as wire bytes it frames itself: they must parse to, and
    # equal, the ShardPiece protobuf would write.
    header = peer_pb2.ShardHeader(job_id="j", shard_id="s0", size=size, crc32c=7, step=3)
    want = peer_pb2.ShardPiece(header=header if first else None, data=data)
    framed = piece_bytes(memoryview(data), header if first else None)
    assert peer_pb2.ShardPiece.FromString(framed) == want
    if data:  # protobuf leaves an empty bytes field out; the framing writes it empty
        assert framed == want.SerializeToString()


def test_shard_id_clashing_with_a_stored_path_is_refused(tmp_path):
    async def scenario():
        async with shard_server(tmp_path) as (address, _):
            client = ShardClient(address, job_id="j", attempts=1)
            await client.put("a", b"x")
            with pytest.raises(ShardTransferError, match="INVALID_ARGUMENT.*clashes"):
                await client.put("a/b", b"y")
            await client.close()

    run(scenario())


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_accepted_shard_id_stays_inside_the_store(tmp_path_factory, shard_id):
    from stalwart.daemon.snapshot.shard_store import ShardStore

    root = tmp_path_factory.getbasetemp() / "store"
    store = ShardStore(root)
    try:
        path = store.path("job", shard_id)
    except ValueError:
        return
    assert path.resolve().is_relative_to((root / "job").resolve())
    assert ".." not in path.relative_to(root).parts
