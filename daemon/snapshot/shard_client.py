"""Async client for a peer daemon's ShardService: put, get and delete shards.

Every call has a deadline and is retried with jittered exponential backoff on
transient failures; a byte budget shared by all clients of a daemon bounds the
shard bytes in flight; every shard read is checked against its CRC32C.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from stalwart.core import wire
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.shard_service import PIECE_BYTES
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.v1 import peer_pb2, peer_pb2_grpc

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

_SHARDS = peer_pb2.DESCRIPTOR.services_by_name["ShardService"]
PUT_SHARD = f"/{_SHARDS.full_name}/{_SHARDS.methods_by_name['PutShard'].name}"
_HEADER = wire.tag(peer_pb2.ShardPiece.DESCRIPTOR, "header")
_DATA = wire.tag(peer_pb2.ShardPiece.DESCRIPTOR, "data")


def piece_bytes(data: Buffer, header: peer_pb2.ShardHeader | None = None) -> bytes:
    """A ShardPiece on the wire, framed around `data` in one copy (a message object
    would copy it twice more, on the event loop)."""
    head = [] if header is None else wire.delimited(_HEADER, [header.SerializeToString()])
    return b"".join([*head, *wire.delimited(_DATA, [data])])

# Worth another try: the peer may be restarting, overloaded, or got a corrupt stream.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
             grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNKNOWN}


class ShardTransferError(Exception):
    """A shard could not be moved to or from a peer; says which, where and why."""

    def __init__(self, peer: str, shard_id: str, op: str, reason: str, *,
                 full: bool = False) -> None:
        """`full`: the store refused the shard for want of room (disk full, or quota)."""
        super().__init__(f"{op} of shard {shard_id} on peer {peer} failed: {reason}")
        self.peer = peer
        self.shard_id = shard_id
        self.reason = reason
        self.full = full


class ShardChecksumError(ShardTransferError):
    """A peer returned bytes that do not match the expected CRC32C or size."""


class ByteBudget:
    """A semaphore counted in bytes: callers wait while too many bytes are in flight.

    A request larger than the whole budget is let through alone, so nothing deadlocks.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"byte budget must be positive, got {capacity}")
        self.capacity = capacity
        self.available = capacity
        self._cond = asyncio.Condition()

    async def acquire(self, nbytes: int) -> int:
        """Wait for `nbytes` (clamped to the capacity); returns the amount to release."""
        need = min(nbytes, self.capacity)
        async with self._cond:
            await self._cond.wait_for(lambda: self.available >= need)
            self.available -= need
        return need

    async def release(self, nbytes: int) -> None:
        async with self._cond:
            self.available += nbytes
            self._cond.notify_all()


class ShardClient:
    """Talks to one peer's ShardService at `address` ("host:port")."""

    def __init__(self, address: str, *, job_id: str, metrics: Metrics | None = None,
                 budget: ByteBudget | None = None, deadline_s: float = 10.0,
                 attempts: int = 3, backoff_s: float = 0.05, max_backoff_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 interceptors: list[grpc.aio.ClientInterceptor] | None = None,
                 channel: grpc.aio.Channel | None = None) -> None:
        """`channel`: the daemon's own channel to this peer (its PeerChannels), kept open
        by its owner; without one (tools, tests) the client makes and closes its own."""
        self.address = address
        self.job_id = job_id
        self.metrics = metrics
        self.budget = budget or ByteBudget(256 << 20)
        self.deadline_s = deadline_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._credentials = credentials
        self._interceptors = interceptors or None  # the daemon's token and node (auth.stamp)
        self._channel: grpc.aio.Channel | None = channel
        self._owns_channel = channel is None
        self._put_call: tuple[grpc.aio.Channel, grpc.aio.StreamUnaryMultiCallable] | None = None

    def _open(self) -> grpc.aio.Channel:
        # Channels are made lazily, inside the event loop (and process) that uses them.
        if self._channel is None:
            if self._credentials is None:
                self._channel = grpc.aio.insecure_channel(self.address,
                                                          interceptors=self._interceptors)
            else:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials,
                                                        interceptors=self._interceptors)
        return self._channel

    def _stub(self) -> peer_pb2_grpc.ShardServiceStub:
        return peer_pb2_grpc.ShardServiceStub(self._open())

    def _put(self) -> grpc.aio.StreamUnaryMultiCallable:
        """PutShard taking its pieces as their wire bytes (`piece_bytes`), made once per
        channel."""
        channel = self._open()
        if self._put_call is None or self._put_call[0] is not channel:
            self._put_call = (channel, channel.stream_unary(
                PUT_SHARD, response_deserializer=peer_pb2.PutShardReply.FromString,
                _registered_method=True))
        return self._put_call[1]

    async def close(self) -> None:
        if self._channel is not None and self._owns_channel:
            await self._channel.close()
            self._channel = None

    async def _retrying(self, op: str, shard_id: str, attempt_fn: Callable[[float], Awaitable[T]],
                        deadline_s: float | None) -> T:
        """Run `attempt_fn(timeout_s)` until it succeeds, the attempts or the deadline run out."""
        total = self.deadline_s if deadline_s is None else deadline_s
        end = time.monotonic() + total
        reason = "no attempt made"
        corrupt = False  # last failure was bad bytes rather than no answer
        for attempt in range(self.attempts):
            left = end - time.monotonic()
            if left <= 0:
                reason = f"deadline of {total:.2f} s passed ({reason})"
                break
            started = time.perf_counter()
            try:
                result = await attempt_fn(left)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
                corrupt = exc.code() == grpc.StatusCode.DATA_LOSS
                self._count_error(op)
                if exc.code() not in RETRYABLE:
                    raise ShardTransferError(self.address, shard_id, op, reason) from None
            except ShardChecksumError as exc:
                reason = exc.reason
                corrupt = True
                self._count_error(op)
            else:
                if self.metrics is not None:
                    self.metrics.peer_seconds.labels(op).observe(time.perf_counter() - started)
                return result
            if attempt + 1 < self.attempts:
                pause = random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))
                await asyncio.sleep(min(pause, max(0.0, end - time.monotonic())))
        cls = ShardChecksumError if corrupt else ShardTransferError
        raise cls(self.address, shard_id, op, f"{reason} after {self.attempts} attempts")

    def _count_error(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.peer_errors.labels(self.address, op).inc()

    async def put(self, shard_id: str, data: Buffer, *, step: int = 0, generation: int = 0,
                  crc: int | None = None, deadline_s: float | None = None) -> None:
        """Store `data` as `shard_id` on the peer; waits for byte budget first."""
        view = memoryview(data).cast("B")
        crc = crc32c(view) if crc is None else crc
        header = peer_pb2.ShardHeader(job_id=self.job_id, shard_id=shard_id, size=len(view),
                                      crc32c=crc, step=step, generation=generation)

        async def pieces() -> AsyncIterator[bytes]:
            for at in range(0, max(len(view), 1), PIECE_BYTES):
                yield piece_bytes(view[at:at + PIECE_BYTES], header if at == 0 else None)

        async def attempt(timeout: float) -> None:
            reply = await self._put()(pieces(), timeout=timeout)
            if not reply.stored:
                raise ShardTransferError(self.address, shard_id, "put", reply.message)

        held = await self.budget.acquire(len(view))
        try:
            await self._retrying("put", shard_id, attempt, deadline_s)
        finally:
            await self.budget.release(held)

    async def get(self, shard_id: str, *, expected_crc: int | None = None,
                  expected_size: int | None = None, deadline_s: float | None = None) -> bytes:
        """The shard's bytes, verified against the header and the expected CRC32C/size."""

        async def attempt(timeout: float) -> bytes:
            call = self._stub().GetShard(
                peer_pb2.GetShardRequest(job_id=self.job_id, shard_id=shard_id), timeout=timeout)
            header = None
            parts: list[bytes] = []
            crc = received = 0
            async for piece in call:
                if header is None:
                    header = piece.header
                    if expected_size is not None and header.size != expected_size:
                        raise self._mismatch(shard_id, f"{header.size} bytes, expected "
                                                       f"{expected_size}")
                received += len(piece.data)
                if received > header.size:
                    raise self._mismatch(shard_id, f"more than the {header.size} bytes announced")
                crc = crc32c(piece.data, crc)
                parts.append(piece.data)
            if header is None or received != header.size:
                raise self._mismatch(shard_id, f"stream ended after {received} bytes")
            want = header.crc32c if expected_crc is None else expected_crc
            if crc != want or crc != header.crc32c:
                raise self._mismatch(shard_id, f"CRC32C {crc:#010x}, expected {want:#010x}")
            return b"".join(parts)

        held = await self.budget.acquire(expected_size or PIECE_BYTES)
        try:
            return await self._retrying("get", shard_id, attempt, deadline_s)
        finally:
            await self.budget.release(held)

    def _mismatch(self, shard_id: str, what: str) -> ShardChecksumError:
        return ShardChecksumError(self.address, shard_id, "get", f"peer sent {what}")

    async def delete(self, shard_ids: list[str], *, below_step: int = 0,
                     deadline_s: float | None = None) -> int:
        """Delete the named shards (and those of steps below `below_step`); returns the count."""

        async def attempt(timeout: float) -> int:
            reply = await self._stub().DeleteShards(peer_pb2.DeleteShardsRequest(
                job_id=self.job_id, shard_ids=shard_ids, below_step=below_step), timeout=timeout)
            return reply.deleted

        return await self._retrying("delete", ",".join(shard_ids) or "*", attempt, deadline_s)
