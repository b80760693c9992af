"""The remote tier: shards, records and committed steps of a job in any S3-compatible
bucket (boto3).

Keys live under `<prefix>/<job_id>/`; a committed step's record is created at most once
(If-None-Match: *), so two writers can never overwrite a committed step. Every
object carries its CRC32C; throttling and outages are retried with backoff; boto3
runs in worker threads so the daemon's event loop never blocks on S3.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import Callable
from typing import TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.shard_store import validate_id

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

MULTIPART_THRESHOLD = 16 << 20
PART_BYTES = 8 << 20     # S3 needs >= 5 MiB for every part but the last
# Codes worth retrying: throttling, server trouble, a racing conditional write.
RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
               "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500",
               "ConditionalRequestConflict"}


class S3TierError(Exception):
    """An S3 operation failed for good; names the key and the last error."""


class ManifestExistsError(S3TierError):
    """Another writer already created this step's manifest (HTTP 412)."""


class S3ChecksumError(S3TierError):
    """An object read back does not match the CRC32C it was stored with."""


def _b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class S3Tier:
    """Shards and manifests of one job in `bucket` under `prefix/job_id/`."""

    def __init__(self, *, bucket: str, job_id: str, prefix: str = "stalwart",
                 endpoint_url: str | None = None, region: str | None = None,
                 metrics: Metrics | None = None, client=None, attempts: int = 6,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 multipart_threshold: int = MULTIPART_THRESHOLD,
                 part_bytes: int = PART_BYTES, timeout_s: float = 30.0) -> None:
        validate_id(job_id, "job_id", allow_slash=False)
        if prefix:
            validate_id(prefix, "s3 prefix")
        self.bucket = bucket
        self.root = f"{prefix}/{job_id}" if prefix else job_id
        self.metrics = metrics
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.multipart_threshold = max(multipart_threshold, part_bytes)
        self.part_bytes = part_bytes
        # We retry ourselves (to count and pace every error); checksums are ours too,
        # so botocore need not compute them ("when_required" nearly doubles PUT speed).
        self.client = client or boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=Config(retries={"total_max_attempts": 1}, connect_timeout=timeout_s,
                          read_timeout=timeout_s, request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def shard_key(self, shard_id: str) -> str:
        return f"{self.root}/shards/{validate_id(shard_id, 'shard_id')}"

    def manifest_key(self, step: int) -> str:
        return f"{self.root}/manifests/{step:020d}.pb"

    async def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run a blocking boto3 call in a thread, retrying transient errors with backoff."""
        last = ""
        for attempt in range(self.attempts):
            started = time.perf_counter()
            try:
                result = await asyncio.to_thread(fn)
            except ClientError as exc:
                err = exc.response.get("Error", {})
                code = str(err.get("Code") or exc.response.get("ResponseMetadata", {})
                           .get("HTTPStatusCode", "unknown"))
                self._count(op, code)
                if code in ("PreconditionFailed", "412") and op == "put_manifest":
                    raise ManifestExistsError(
                        f"manifest {key} already exists: another writer committed this step; "
                        "re-read it instead of overwriting") from None
                if code in ("NoSuchKey", "404"):
                    raise FileNotFoundError(f"s3://{self.bucket}/{key} does not exist") from None
                if code not in RETRY_CODES:
                    raise S3TierError(f"S3 {op} of s3://{self.bucket}/{key} failed: {code}: "
                                      f"{err.get('Message', exc)}") from None
                last = f"{code}: {err.get('Message', exc)}"
            except BotoCoreError as exc:  # endpoint unreachable, connection reset, timeout
                self._count(op, type(exc).__name__)
                last = str(exc)
            else:
                if self.metrics is not None:
                    self.metrics.s3_seconds.labels(op).observe(time.perf_counter() - started)
                return result
            if attempt + 1 < self.attempts:
                await asyncio.sleep(random.uniform(
                    0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt)))
        raise S3TierError(f"S3 {op} of s3://{self.bucket}/{key} failed after {self.attempts} "
                          f"attempts: {last}; check the endpoint and credentials, the "
                          "daemon keeps the data locally meanwhile")

    def _count(self, op: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.s3_errors.labels(op, code).inc()

    async def put_shard(self, shard_id: str, data: Buffer) -> None:
        """Store a shard (overwriting is fine: a shard id always names the same bytes)."""
        await self._put(self.shard_key(shard_id), memoryview(data).cast("B"), "put")

    async def _put(self, key: str, view: memoryview, op: str, **extra: str) -> None:
        crc = crc32c(view)
        meta = {"crc32c": f"{crc:08x}"}
        if len(view) >= self.multipart_threshold and not extra:
            await self._multipart(key, view, meta)
        else:
            await self._call(op, key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=bytes(view), ChecksumCRC32C=_b64(crc),
                Metadata=meta, **extra))
        if self.metrics is not None:
            self.metrics.stored_bytes.labels("s3").inc(len(view))

    async def _multipart(self, key: str, view: memoryview, meta: dict[str, str]) -> None:
        created = await self._call("create_multipart", key, lambda: self.client
                                   .create_multipart_upload(Bucket=self.bucket, Key=key,
                                                            ChecksumAlgorithm="CRC32C",
                                                            Metadata=meta))
        upload_id = created["UploadId"]
        try:
            parts = []
            for number, at in enumerate(range(0, len(view), self.part_bytes), start=1):
                body = bytes(view[at:at + self.part_bytes])
                part_crc = _b64(crc32c(body))
                reply = await self._call("upload_part", key, lambda n=number, b=body, c=part_crc:
                                         self.client.upload_part(
                                             Bucket=self.bucket, Key=key, UploadId=upload_id,
                                             PartNumber=n, Body=b, ChecksumCRC32C=c,
                                             ChecksumAlgorithm="CRC32C"))
                parts.append({"PartNumber": number, "ETag": reply["ETag"],
                              "ChecksumCRC32C": part_crc})
            await self._call("complete_multipart", key, lambda: self.client
                             .complete_multipart_upload(Bucket=self.bucket, Key=key,
                                                        UploadId=upload_id,
                                                        MultipartUpload={"Parts": parts}))
        except BaseException:
            # Leave no orphaned parts behind (they cost storage until a lifecycle rule runs).
            await asyncio.shield(asyncio.to_thread(
                lambda: self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                           UploadId=upload_id)))
            raise

    async def get_shard(self, shard_id: str) -> bytes:
        """A shard's bytes, verified against the CRC32C stored with it."""
        return await self._get(self.shard_key(shard_id), "get")

    async def _get(self, key: str, op: str) -> bytes:
        def fetch() -> tuple[bytes, dict]:
            reply = self.client.get_object(Bucket=self.bucket, Key=key)
            return reply["Body"].read(), reply.get("Metadata", {})

        data, meta = await self._call(op, key, fetch)
        want = meta.get("crc32c")
        if want is not None and int(want, 16) != crc32c(data):
            self._count(op, "ChecksumMismatch")
            if self.metrics is not None:
                self.metrics.scrub_errors.labels("s3").inc()
            raise S3ChecksumError(f"s3://{self.bucket}/{key} read back with CRC32C "
                                  f"{crc32c(data):08x}, stored as {want}")
        return data

    async def delete_shards(self, shard_ids: list[str]) -> None:
        keys = [self.shard_key(s) for s in shard_ids]
        for at in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[at:at + 1000]]
            await self._call("delete", keys[at], lambda b=batch: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}))

    def records_key(self, step: int, rank: int) -> str:
        return f"{self.root}/records/{step:020d}/r{rank}.pb"

    async def put_records(self, step: int, rank: int, data: bytes) -> None:
        """A rank's record of `step` (its capturing daemon writes it, before the commit)."""
        await self._put(self.records_key(step, rank), memoryview(data), "put_records")

    async def get_records(self, step: int, rank: int) -> bytes:
        return await self._get(self.records_key(step, rank), "get_records")

    async def put_manifest(self, step: int, data: bytes) -> None:
        """Create the committed record of `step` once (a `StepRecord`; the ranks' records
        are keyed apart); ManifestExistsError if anyone already did."""
        await self._put(self.manifest_key(step), memoryview(data), "put_manifest",
                        IfNoneMatch="*")

    async def get_manifest(self, step: int) -> bytes:
        return await self._get(self.manifest_key(step), "get_manifest")

    async def list_manifest_steps(self) -> list[int]:
        """Steps with a manifest in the bucket, oldest first."""
        prefix = f"{self.root}/manifests/"

        def listing() -> list[int]:
            steps = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix):]
                    if name.endswith(".pb") and name[:-3].isdigit():
                        steps.append(int(name[:-3]))
            return sorted(steps)

        return await self._call("list", prefix, listing)
