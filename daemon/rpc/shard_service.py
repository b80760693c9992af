"""ShardService: peers stream shards to this daemon's disk and read them back (grpc.aio).

Shards travel in ~1 MiB pieces, the first carrying the header; a shard is only
visible once its whole CRC32C matched (temp file, rename; fsynced first when every write
is synced, `[snapshot] disk_sync`). Identifiers are
checked against a strict grammar so no request can name a path outside the store.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import grpc

from stalwart.daemon.errors import disk_full
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.streams import send_within
from stalwart.daemon.snapshot.atomic import EACH_WRITE, DiskSync
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.quota import DiskQuota, QuotaExceeded
from stalwart.daemon.snapshot.shard_store import ShardStore
from stalwart.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.rpc.shard_service")

PIECE_BYTES = 1 << 20
MAX_SHARD_BYTES = 1 << 30
# Open PutShard/GetShard streams per calling host: every rank of a big node may push at
# once, and each stream holds at most ~1 MiB here, so this bounds a peer to ~64 MiB.
MAX_STREAMS_PER_PEER = 64
PIECE_IDLE_S = 30.0       # a sender silent this long between pieces is cut off (seconds)
MIN_PUT_BYTES_PER_S = 1 << 20  # a put may take PIECE_IDLE_S + size / this rate, no longer


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """"ipv4:10.0.0.5:43210" -> "ipv4:10.0.0.5": one budget per host, whatever its ports."""
    peer = context.peer() or "unknown"
    return peer if peer.startswith("unix:") else peer.rpartition(":")[0] or peer


class _Deadline:
    """When a stream must end (monotonic seconds); set once its size is known."""

    def __init__(self) -> None:
        self.end = float("inf")


async def _idle_limited(pieces, idle_s: float, deadline: _Deadline):
    """The pieces of a client stream; TimeoutError if the sender goes quiet for idle_s,
    or the stream outlives `deadline`."""
    it = pieces.__aiter__()
    while True:
        left = min(idle_s, deadline.end - time.monotonic())
        if left <= 0:
            raise TimeoutError
        try:
            piece = await asyncio.wait_for(it.__anext__(), left)
        except StopAsyncIteration:
            return
        yield piece


class ShardPolicy(Protocol):
    def may_delete(self, caller: str, owner: str, step: int) -> str:
        """Why `caller` may not delete a shard of `step` put by `owner`; "" if it may."""


class ShardServicer(peer_pb2_grpc.ShardServiceServicer):
    """stalwart.v1.ShardService backed by a directory on this node."""

    def __init__(self, store_dir: Path, metrics: Metrics,
                 max_shard_bytes: int = MAX_SHARD_BYTES,
                 max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
                 piece_idle_s: float = PIECE_IDLE_S, *, auth: Any = None,
                 quota: DiskQuota | None = None, policy: ShardPolicy | None = None,
                 sync: DiskSync = EACH_WRITE) -> None:
        """`auth` (auth.Authenticator) makes every call prove it comes from a daemon of the
        job; `policy` says who may delete what (without one, nobody may); `quota` bounds
        the bytes stored. A daemon passes all three; tests of the storage alone may not."""
        self.auth, self.quota, self.policy = auth, quota, policy
        self.store = ShardStore(store_dir, sync)
        self.metrics = metrics
        self.max_shard_bytes = max_shard_bytes
        self.max_streams_per_peer = max_streams_per_peer
        self.piece_idle_s = piece_idle_s
        self._open: collections.Counter[str] = collections.Counter()

    async def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """The calling daemon's node ("" when this servicer runs without authentication)."""
        return "" if self.auth is None else await self.auth.daemon(context)

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """Count a stream against its peer's limit; RESOURCE_EXHAUSTED (retryable) beyond."""
        peer = _peer_host(context)
        if self._open[peer] >= self.max_streams_per_peer:
            self.metrics.auth_refused.labels("peer_limit").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{peer} already has {self.max_streams_per_peer} shard transfers open on this "
                "node; retry when one ends")
        self._open[peer] += 1
        return peer

    def _done(self, peer: str) -> None:
        self._open[peer] -= 1
        if self._open[peer] <= 0:
            del self._open[peer]

    async def PutShard(self, request_iterator, context: grpc.aio.ServicerContext
                       ) -> peer_pb2.PutShardReply:
        started = time.perf_counter()
        caller = await self._caller(context)
        peer = await self._admit(context)
        deadline = _Deadline()
        try:
            return await self._receive(
                _idle_limited(request_iterator, self.piece_idle_s, deadline), context,
                started, caller, deadline)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no shard piece arrived for {self.piece_idle_s:g} s, or the "
                                f"shard took longer than {self.piece_idle_s:g} s + 1 s per MiB; "
                                "the sender should retry")
        except QuotaExceeded as exc:
            self.metrics.auth_refused.labels("quota").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"shard id clashes with a stored shard's path: {exc.strerror}")
        except OSError as exc:
            full = disk_full(exc) is not None
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.INTERNAL,
                f"cannot store the shard on this node: {exc.strerror}"
                + ("; free space or raise the quota of the shard store" if full else ""))
        finally:
            self._done(peer)

    async def _receive(self, request_iterator, context: grpc.aio.ServicerContext,
                       started: float, caller: str, deadline: _Deadline
                       ) -> peer_pb2.PutShardReply:
        header = None
        tmp: Path | None = None
        f = None
        try:
            crc = received = 0
            async for piece in request_iterator:
                if header is None:
                    if not piece.HasField("header"):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            "the first ShardPiece must carry the header")
                    header = piece.header
                    path = await self._checked_path(context, header.job_id, header.shard_id)
                    if header.size > self.max_shard_bytes:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"shard {header.shard_id} declares {header.size} bytes, more than "
                            f"the {self.max_shard_bytes}-byte limit")
                    deadline.end = (time.monotonic() + self.piece_idle_s
                                    + header.size / MIN_PUT_BYTES_PER_S)
                    if self.quota is not None:
                        self.quota.reserve(header.size)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
                    f = tmp.open("wb")
                elif piece.HasField("header"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "only the first ShardPiece may carry a header")
                elif not piece.data:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "a ShardPiece after the first must carry data")
                received += len(piece.data)
                if received > header.size:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"shard {header.shard_id} sent more than its declared {header.size} bytes")
                if piece.data:
                    crc = crc32c(piece.data, crc)
                    await asyncio.to_thread(f.write, piece.data)
            if header is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty PutShard stream")
            if received != header.size:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"shard {header.shard_id} ended after {received} of {header.size} bytes")
            if crc != header.crc32c:
                self.metrics.scrub_errors.labels("peer").inc()
                await context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"shard {header.shard_id} arrived with CRC32C {crc:#010x}, header says "
                    f"{header.crc32c:#010x}; the sender should retry")
            await asyncio.to_thread(self._finish, f, tmp, path, header, caller)
            f = None
            tmp = None
            self.metrics.stored_bytes.labels("peer").inc(received)
            self.metrics.peer_seconds.labels("serve_put").observe(time.perf_counter() - started)
            return peer_pb2.PutShardReply(stored=True)
        finally:
            if f is not None:
                f.close()
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def _finish(self, f, tmp: Path, path: Path, header: peer_pb2.ShardHeader,
                owner: str) -> None:
        f.flush()
        self.store.sync.file(f.fileno())
        f.close()
        self.store.commit(tmp, path, {"size": header.size, "crc32c": header.crc32c,
                                      "step": header.step, "generation": header.generation,
                                      "owner": owner})

    async def _checked_path(self, context: grpc.aio.ServicerContext, job_id: str,
                            shard_id: str) -> Path:
        try:
            return self.store.path(job_id, shard_id)
        except ValueError as exc:
            self.metrics.auth_refused.labels("bad_id").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort always raises; this keeps type checkers informed

    async def GetShard(self, request: peer_pb2.GetShardRequest,
                       context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        await self._caller(context)
        path = await self._checked_path(context, request.job_id, request.shard_id)
        peer = await self._admit(context)
        try:
            async for piece in self._send(request, context, path, started):
                # A reader that stops reading would hold its stream slot forever.
                if not await send_within(context, piece, self.piece_idle_s):
                    self.metrics.auth_refused.labels("stalled").inc()
                    log.warning("shard reader cut off: it took no piece for %g s",
                                self.piece_idle_s, extra={"shard": request.shard_id})
                    return
        finally:
            self._done(peer)

    async def _send(self, request: peer_pb2.GetShardRequest,
                    context: grpc.aio.ServicerContext, path: Path, started: float):
        try:
            meta = self.store.meta(path)
            f = path.open("rb")
        except (OSError, ValueError):  # absent, a folder, or a torn sidecar
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"shard {request.shard_id} of job {request.job_id} is not here")
        with f:
            header = peer_pb2.ShardHeader(job_id=request.job_id, shard_id=request.shard_id,
                                          size=meta["size"], crc32c=meta["crc32c"],
                                          step=meta["step"], generation=meta["generation"])
            crc = sent = 0
            first = True
            # One piece in memory at a time, however large the shard.
            while True:
                data = await asyncio.to_thread(f.read, PIECE_BYTES)
                crc = crc32c(data, crc)
                sent += len(data)
                if sent > meta["size"]:
                    break
                if data or first:
                    yield peer_pb2.ShardPiece(header=header if first else None, data=data)
                first = False
                if len(data) < PIECE_BYTES:
                    break
        if sent != meta["size"] or crc != meta["crc32c"]:
            # Bit rot on this disk: end the stream with an error rather than vouch for it.
            self.metrics.scrub_errors.labels("peer").inc()
            await context.abort(grpc.StatusCode.DATA_LOSS,
                                f"shard {request.shard_id} failed its checksum on this node")
        self.metrics.peer_seconds.labels("serve_get").observe(time.perf_counter() - started)

    async def DeleteShards(self, request: peer_pb2.DeleteShardsRequest,
                           context: grpc.aio.ServicerContext) -> peer_pb2.DeleteShardsReply:
        caller = await self._caller(context)

        def refuse(meta: dict) -> str:
            if self.policy is None:
                return "this shard store deletes nothing (no deletion policy)"
            return self.policy.may_delete(caller, str(meta.get("owner", "")),
                                          int(meta.get("step", 0)))

        try:
            deleted, kept = await asyncio.to_thread(
                self.store.delete, request.job_id, list(request.shard_ids),
                request.below_step, refuse)
        except ValueError as exc:
            self.metrics.auth_refused.labels("bad_id").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"cannot delete these shards: {exc.strerror}")
        if kept:
            self.metrics.auth_refused.labels("role").inc(len(kept))
            if not deleted:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{len(kept)} shards kept: {kept[0]}")
        return peer_pb2.DeleteShardsReply(deleted=deleted)
