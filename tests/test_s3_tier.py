"""Specs for the S3 tier against a real SeaweedFS server (retry pacing via botocore's Stubber)."""

from __future__ import annotations

import asyncio
import os

import boto3
import pytest
from botocore.config import Config
from botocore.stub import ANY, Stubber

from stalwart.client.ports import free_port
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.s3_tier import (
    ManifestExistsError,
    S3ChecksumError,
    S3Tier,
    S3TierError,
)

pytestmark = pytest.mark.s3


def tier_for(loc, **kw) -> S3Tier:
    return S3Tier(bucket=loc.bucket, job_id="job1", prefix=loc.prefix, metrics=kw.pop(
        "metrics", Metrics()), client=loc.server.client(request_checksum_calculation=
                                                          "when_required"), **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_shard_round_trip_stores_a_crc32c_the_server_checks(s3_location):
    tier = tier_for(s3_location)
    data = os.urandom(100_000)
    assert run(_put_get(tier, "step1/c0.3", data)) == data
    head = tier.client.head_object(Bucket=tier.bucket, Key=tier.shard_key("step1/c0.3"),
                                   ChecksumMode="ENABLED")
    assert head["Metadata"]["crc32c"] == f"{crc32c(data):08x}"


async def _put_get(tier: S3Tier, shard_id: str, data: bytes) -> bytes:
    await tier.put_shard(shard_id, data)
    return await tier.get_shard(shard_id)


def test_server_refuses_a_body_that_does_not_match_its_checksum(s3_location):
    client = s3_location.server.client()
    with pytest.raises(client.exceptions.ClientError, match="BadDigest|InvalidRequest|Checksum"):
        client.put_object(Bucket=s3_location.bucket, Key=f"{s3_location.prefix}/bad",
                          Body=b"hello", ChecksumCRC32C="AAAAAA==")


def test_large_object_goes_up_in_parts_and_reads_back_whole(s3_location):
    tier = tier_for(s3_location, multipart_threshold=5 << 20, part_bytes=5 << 20)
    data = os.urandom((11 << 20) + 7)
    assert run(_put_get(tier, "big.0", data)) == data
    head = tier.client.head_object(Bucket=tier.bucket, Key=tier.shard_key("big.0"))
    assert head["ETag"].strip('"').endswith("-3")


def test_second_manifest_for_a_step_is_refused_and_the_first_kept(s3_location):
    tier = tier_for(s3_location)

    async def scenario():
        await tier.put_manifest(7, b"first writer")
        with pytest.raises(ManifestExistsError, match="already exists"):
            await tier.put_manifest(7, b"second writer")
        await tier.put_manifest(9, b"other step")
        return await tier.get_manifest(7), await tier.list_manifest_steps()

    body, steps = run(scenario())
    assert body == b"first writer" and steps == [7, 9]


def test_object_that_no_longer_matches_its_crc_is_refused(s3_location):
    tier = tier_for(s3_location)
    tier.client.put_object(Bucket=tier.bucket, Key=tier.shard_key("c.1"), Body=b"rotten",
                           Metadata={"crc32c": f"{crc32c(b'fresh!'):08x}"})
    with pytest.raises(S3ChecksumError, match="stored as"):
        run(tier.get_shard("c.1"))
    assert tier.metrics.registry.get_sample_value(
        "stalwart_scrub_errors_total", {"tier": "s3"}) == 1


def test_delete_and_missing_key(s3_location):
    tier = tier_for(s3_location)

    async def scenario():
        await tier.put_shard("c.0", b"x")
        await tier.delete_shards(["c.0"])
        with pytest.raises(FileNotFoundError, match="does not exist"):
            await tier.get_shard("c.0")

    run(scenario())


def test_traversal_in_shard_ids_never_reaches_s3():
    tier = S3Tier(bucket="b", job_id="j", client=object())
    with pytest.raises(ValueError, match="not allowed"):
        tier.shard_key("../other-job/x")
    with pytest.raises(ValueError, match="not allowed"):
        S3Tier(bucket="b", job_id="../j", client=object())


def _stubbed() -> tuple[S3Tier, Stubber]:
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="a",
                          aws_secret_access_key="b", endpoint_url="http://127.0.0.1:9")
    tier = S3Tier(bucket="b", job_id="j", client=client, metrics=Metrics(), backoff_s=0.001)
    return tier, Stubber(client)


def test_throttling_is_retried_with_backoff_and_counted():
    tier, stub = _stubbed()
    for _ in range(2):
        stub.add_client_error("put_object", service_error_code="SlowDown",
                              http_status_code=503)
    stub.add_response("put_object", {}, {"Bucket": "b", "Key": ANY, "Body": ANY,
                                         "ChecksumCRC32C": ANY, "Metadata": ANY})
    with stub:
        run(tier.put_shard("c.0", b"data"))
    assert tier.metrics.registry.get_sample_value(
        "stalwart_s3_errors_total", {"op": "put", "code": "SlowDown"}) == 2


def test_permanent_errors_are_not_retried():
    tier, stub = _stubbed()
    stub.add_client_error("put_object", service_error_code="AccessDenied", http_status_code=403)
    with stub, pytest.raises(S3TierError, match="AccessDenied"):
        run(tier.put_shard("c.0", b"data"))


def test_unreachable_endpoint_gives_up_after_the_attempts_with_a_clear_error():
    port = free_port()  # given to nothing: nothing listens there
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="a",
                          aws_secret_access_key="b", endpoint_url=f"http://127.0.0.1:{port}",
                          config=Config(retries={"total_max_attempts": 1}, connect_timeout=1))
    tier = S3Tier(bucket="b", job_id="j", client=client, attempts=3, backoff_s=0.01,
                  metrics=Metrics())
    with pytest.raises(S3TierError, match="after 3 attempts"):
        run(tier.get_shard("c.0"))


def test_put_during_an_s3_outage_completes_once_the_server_returns(s3_location):
    server = s3_location.server
    tier = tier_for(s3_location, attempts=40, backoff_s=0.05, max_backoff_s=0.5)
    data = os.urandom(50_000)

    async def scenario():
        server.stop()
        put = asyncio.ensure_future(tier.put_shard("during-outage.0", data))
        # Wait until the outage has been seen (an error counted), then bring S3 back.
        deadline = asyncio.get_running_loop().time() + 20
        while not _errors(tier) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert not put.done()
        await asyncio.to_thread(server.start)
        await put
        return await tier.get_shard("during-outage.0")

    try:
        assert run(scenario()) == data
    finally:
        if server.proc is None:
            server.start()
    assert _errors(tier) >= 1


def _errors(tier: S3Tier) -> float:
    return sum(s.value for metric in tier.metrics.registry.collect()
               if metric.name == "stalwart_s3_errors" for s in metric.samples
               if s.name.endswith("_total"))
