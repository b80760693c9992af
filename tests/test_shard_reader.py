"""Specs for the read path: any k verified shards, cheapest tier first, fallbacks on trouble."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import grpc
import pytest

from stalwart.client.ports import free_port
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.coder import ZfecCodec
from stalwart.daemon.snapshot.s3_tier import S3Tier
from stalwart.daemon.snapshot.shard_client import ShardClient
from stalwart.daemon.snapshot.shard_reader import BeyondToleranceError, ShardReader, read_chunks
from stalwart.v1 import manifest_pb2, peer_pb2_grpc

JOB = "job1"


@contextlib.asynccontextmanager
async def peers(tmp_path, names):
    """One real ShardService per name on a loopback port: {name: (address, store_dir)}."""
    servers, out = [], {}
    for name in names:
        server = grpc.aio.server()
        peer_pb2_grpc.add_ShardServiceServicer_to_server(
            ShardServicer(tmp_path / name, Metrics()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        out[name] = (f"127.0.0.1:{port}", tmp_path / name)
    try:
        yield out
    finally:
        for server in servers:
            await server.stop(grace=None)


def clients(addresses: dict[str, str], **kw) -> dict[str, ShardClient]:
    return {name: ShardClient(addr, job_id=JOB, backoff_s=0.01, **kw)
            for name, addr in addresses.items()}


async def store_chunk(chunk_id: str, data: bytes, k: int, m: int, holders: list[str],
                      peer_clients: dict[str, ShardClient], s3: S3Tier | None = None,
                      local: dict[str, bytes] | None = None) -> manifest_pb2.ChunkRecord:
    """Encode `data` and put shard i on holders[i] ("s3", "local" or a peer name)."""
    shards = ZfecCodec(k, m).encode(data)
    record = manifest_pb2.ChunkRecord(chunk_id=chunk_id, size=len(data), crc32c=crc32c(data),
                                      k=k, m=m)
    for i, (shard, holder) in enumerate(zip(shards, holders, strict=True)):
        sid = f"{chunk_id}.{i}"
        body = bytes(shard)
        if holder == "s3":
            await s3.put_shard(sid, body)
        elif holder == "local":
            local[sid] = body
        else:
            await peer_clients[holder].put(sid, body, step=1)
        record.shards.add(index=i, node="me" if holder == "local" else holder, location=sid,
                          size=len(body), crc32c=crc32c(body))
    return record


def closed_port() -> int:
    return free_port()  # given to nothing: nothing listens there


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=90))


DATA = os.urandom(3 * (1 << 20) + 99)


def test_healthy_peers_give_back_the_chunk_bitwise(tmp_path):
    async def scenario():
        async with peers(tmp_path, ["a", "b", "c", "d"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()})
            rec = await store_chunk("s1/r0/c0", DATA, 2, 2, ["a", "b", "c", "d"], cl)
            reader = ShardReader(node="me", peers=cl)
            return await read_chunks(reader, [rec, rec])

    assert run(scenario()) == [DATA, DATA]


def test_local_memory_is_preferred_and_enough_on_its_own():
    local: dict[str, bytes] = {}

    async def scenario():
        rec = await store_chunk("c", DATA, 2, 1, ["local", "local", "local"], {}, local=local)
        return await ShardReader(node="me", peers={}, local=local.get).read_chunk(rec)

    assert run(scenario()) == DATA


def test_corrupted_shard_on_disk_is_read_around(tmp_path):
    metrics = Metrics()

    async def scenario():
        async with peers(tmp_path, ["a", "b", "c"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()}, attempts=1)
            rec = await store_chunk("c", DATA, 2, 1, ["a", "b", "c"], cl)
            path = ps["a"][1] / JOB / "c.0"
            rotten = bytearray(path.read_bytes())
            rotten[1000] ^= 0xFF
            path.write_bytes(bytes(rotten))
            reader = ShardReader(node="me", peers=cl, metrics=metrics)
            return await reader.fetch_shards(rec), await reader.read_chunk(rec)

    shards, data = run(scenario())
    assert sorted(shards) == [1, 2] and data == DATA


def test_peer_serving_wrong_bytes_is_caught_by_the_manifest_checksum(tmp_path):
    async def scenario():
        async with peers(tmp_path, ["a", "b", "c"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()}, attempts=1)
            rec = await store_chunk("c", DATA, 2, 1, ["a", "b", "c"], cl)
            # A consistent but wrong shard: right framing, CRC of other bytes.
            await cl["b"].put("c.1", os.urandom(rec.shards[1].size), step=1)
            return await ShardReader(node="me", peers=cl).read_chunk(rec)

    assert run(scenario()) == DATA


def test_unreachable_peer_falls_back_within_the_deadline(tmp_path):
    async def scenario():
        async with peers(tmp_path, ["a", "b", "c"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()})
            rec = await store_chunk("c", DATA, 2, 1, ["a", "b", "c"], cl)
            cl["a"] = ShardClient(f"127.0.0.1:{closed_port()}", job_id=JOB, backoff_s=0.01)
            return await ShardReader(node="me", peers=cl, deadline_s=20).read_chunk(rec)

    assert run(scenario()) == DATA


@pytest.mark.parametrize(("hedge_after_s", "quiet"), [(0.2, ""), (30.0, "a")])
def test_peer_that_never_answers_is_hedged_around_or_asked_last(tmp_path, hedge_after_s,
                                                                quiet):
    # Holder "a" never answers. Not yet suspect, it costs the hedge (0.2 s) before the
    # next holder is asked too; already suspect (its heartbeats overdue), it is asked
    # only after every other holder, so it costs nothing (its hedge would be 30 s).
    with socket.socket() as black_hole:
        # Listening but never accepting: TCP connects, gRPC never gets an answer.
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(8)

        async def scenario():
            async with peers(tmp_path, ["a", "b", "c"]) as ps:
                cl = clients({n: a for n, (a, _) in ps.items()})
                rec = await store_chunk("c", DATA, 2, 1, ["a", "b", "c"], cl)
                cl["a"] = ShardClient(f"127.0.0.1:{black_hole.getsockname()[1]}", job_id=JOB)
                reader = ShardReader(node="me", peers=cl, deadline_s=60,
                                     hedge_after_s=hedge_after_s,
                                     quiet=lambda node: node == quiet)
                return await asyncio.wait_for(reader.read_chunk(rec), 10)

        assert run(scenario()) == DATA


def test_parity_in_s3_stands_in_for_lost_peers(tmp_path, s3_location):
    async def scenario():
        s3 = S3Tier(bucket=s3_location.bucket, job_id=JOB, prefix=s3_location.prefix,
                    client=s3_location.server.client())
        async with peers(tmp_path, ["a", "b"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()})
            rec = await store_chunk("c", DATA, 2, 2, ["a", "b", "s3", "s3"], cl, s3=s3)
            del cl["a"], cl["b"]  # both peers lost
            return await ShardReader(node="me", peers=cl, s3=s3).read_chunk(rec)

    assert run(scenario()) == DATA


def test_too_many_lost_holders_name_the_chunk_and_each_missing_shard(tmp_path):
    async def scenario():
        async with peers(tmp_path, ["a", "b", "c"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()}, attempts=1)
            rec = await store_chunk("s5/r1/c3", DATA, 2, 1, ["a", "b", "c"], cl)
            (ps["c"][1] / JOB / "s5/r1/c3.2").unlink()
            del cl["a"]
            await ShardReader(node="me", peers=cl).read_chunk(rec)

    with pytest.raises(BeyondToleranceError) as err:
        run(scenario())
    message = str(err.value)
    assert "chunk s5/r1/c3" in message and "1 good shards of the 2 needed" in message
    assert set(err.value.unavailable) == {0, 2}
    assert "node a" in err.value.unavailable[0] and "NOT_FOUND" in err.value.unavailable[2]


def test_placement_of_a_chunk_record_feeds_the_margin_math():
    from stalwart.core.placement import chunk_margin
    from stalwart.daemon.snapshot.shard_reader import placement_of

    rec = manifest_pb2.ChunkRecord(chunk_id="c", k=2, m=2)
    for i, node in enumerate(["a", "b", "c", "s3"]):
        rec.shards.add(index=i, node=node)
    rec.shards.add(index=3, node="d")
    p = placement_of(rec)
    assert p.holders == (("a",), ("b",), ("c",), ("s3", "d"))
    assert chunk_margin(p, {"a"}) == 1


def test_shards_of_a_lost_node_are_recreated_bitwise_from_survivors(tmp_path):
    async def scenario():
        async with peers(tmp_path, ["a", "b", "c", "d"]) as ps:
            cl = clients({n: a for n, (a, _) in ps.items()})
            rec = await store_chunk("c", DATA, 2, 2, ["a", "b", "c", "d"], cl)
            lost = {0: (ps["a"][1] / JOB / "c.0").read_bytes(),
                    3: (ps["d"][1] / JOB / "c.3").read_bytes()}
            del cl["a"], cl["d"]
            return lost, await ShardReader(node="me", peers=cl).recreate_shards(rec, [0, 3])

    lost, rebuilt = run(scenario())
    assert rebuilt == lost
