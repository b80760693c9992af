"""The daemon's snapshot path: slot -> delta -> erasure shards -> prepare -> commit.

RankService forwards OpenSlot, Capture, WaitCommitted and Restore here. A
capture is answered as soon as the slot's bytes are encoded (the rank may then
reuse the slot); making them durable — local disk, shards on peers and S3,
phase one at the coordinator — continues in the background, in step order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from stalwart.core import manifest as mf
from stalwart.core.placement import S3, Node, place_chunk
from stalwart.core.protection import census
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.security.tls import aio_channel, client_credentials
from stalwart.daemon.snapshot import repair
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.coder import ZfecCodec, default_km
from stalwart.daemon.snapshot.local_store import CorruptChunkError, LocalStore
from stalwart.daemon.snapshot.quota import DiskQuota, QuotaExceeded  # noqa: F401 - re-exported
from stalwart.daemon.snapshot.s3_tier import ManifestExistsError, S3Tier
from stalwart.daemon.snapshot.scrub import Scrubber
from stalwart.daemon.snapshot.shard_client import ByteBudget, ShardClient, ShardTransferError
from stalwart.daemon.snapshot.shard_reader import BeyondToleranceError, ShardReader
from stalwart.daemon.snapshot.slots import FdServer, SlotError, SlotPool
from stalwart.v1 import manifest_pb2, peer_pb2, peer_pb2_grpc, rank_pb2

log = logging.getLogger("stalwart.daemon.snapshot.path")

PIECE_BYTES = 1 << 20       # restore stream message size
SHARD_BYTES_IN_FLIGHT = 256 << 20  # shard bytes being sent to or read from peers
MAX_BACKLOG = 3             # captures per rank copied but not yet encoded, at most
PUSH_TIMEOUT_S = 10.0       # a repaired manifest sent to one peer
FINAL_RETRY_S = 120.0       # the job's last step is retried this long when it cannot be stored
FINAL_RETRY_EVERY_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True)
class Peer:
    node: str
    address: str
    labels: dict[str, str]


PrepareSender = Callable[[peer_pb2.PrepareStepRequest], Awaitable[None]]


class SnapshotPath:
    """Snapshot handlers and stores of one daemon."""

    def __init__(self, config: DaemonConfig, registry: Registry, metrics: Metrics,
                 data_dir: Path, peers: Callable[[], list[Peer]],
                 send_prepare: PrepareSender) -> None:
        self.config, self.registry, self.metrics = config, registry, metrics
        self.node = config.node
        self.peers = peers
        self.send_prepare = send_prepare
        snap = config.snapshot
        self.pool = SlotPool(snap.slot_bytes, token=config.token)
        self.fd_server = FdServer(self.pool, data_dir / "fd.sock")
        self._encoders = ThreadPoolExecutor(2, thread_name_prefix="delta")
        self.store = LocalStore(data_dir, job_id=config.job_id, chunk_bytes=snap.chunk_bytes,
                                base_every=snap.base_every, retain=snap.retain,
                                ram_tier_bytes=snap.ram_tier_bytes,
                                executor=self._encoders, metrics=metrics)
        # Encodes, prepares and reads run side by side (the store is thread-safe); commits
        # get their own thread so a backlog of captures never delays publishing a step.
        self._io = ThreadPoolExecutor(2, thread_name_prefix="store")
        self._commit_io = ThreadPoolExecutor(1, thread_name_prefix="commit")
        self.s3 = None
        if config.s3.bucket:
            self.s3 = S3Tier(bucket=config.s3.bucket, job_id=config.job_id,
                             prefix=config.s3.prefix, endpoint_url=config.s3.endpoint or None,
                             region=config.s3.region or None, metrics=metrics)
        self._clients: dict[str, ShardClient] = {}
        self.stamp: list[grpc.aio.ClientInterceptor] = []  # auth.stamp, set by the Daemon
        # One byte budget for every peer: shard bytes in flight stay bounded per daemon,
        # however many peers it sends to.
        self._shard_budget = ByteBudget(SHARD_BYTES_IN_FLIGHT)
        self._committed = asyncio.Condition()
        self._durable: dict[str, asyncio.Task[None]] = {}  # per rank: last durability task
        self._backlog: dict[str, int] = {}  # per rank: captures copied but not yet encoded
        self._encoded = asyncio.Condition()
        self.quota = DiskQuota([data_dir / "snapshots", data_dir / "shards"],
                               config.snapshot.disk_quota_bytes)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.repairer = repair.Repairer(
            node=self.node, store=self.store, metrics=metrics, live=self._live_nodes,
            client=lambda node: self._client(self._peer(node)), reader=self._reader,
            publish=self._publish, s3_available=self.s3 is not None)
        self.scrubber = Scrubber(node=self.node, job_id=config.job_id,
                                 shard_dir=data_dir / "shards", store=self.store,
                                 metrics=metrics, reader=self._reader, put_local=self._put_local)
        self._background: list[asyncio.Task[None]] = []
        self._push_channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.fd_server.start()
        self._background = [asyncio.create_task(self.scrubber.forever(), name="scrub")]

    async def stop(self) -> None:
        tasks = list(self._durable.values()) + self._background
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self._clients.values():
            await c.close()
        for ch in self._push_channels.values():
            await ch.close()
        self.fd_server.stop()
        self.pool.close()
        self._io.shutdown(wait=True)
        self._commit_io.shutdown(wait=True)
        self._encoders.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, lambda: fn(*args, **kw))

    async def _run_commit(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._commit_io, lambda: fn(*args, **kw))

    # RankService handlers -----------------------------------------------------

    async def OpenSlot(self, request: rank_pb2.OpenSlotRequest,
                       context: grpc.aio.ServicerContext) -> rank_pb2.OpenSlotReply:
        if self.registry.get(request.rank_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"rank {request.rank_id!r} is not registered with "
                                f"{self.node}; call Register first")
        try:
            slots = await asyncio.to_thread(self.pool.open, request.rank_id, request.nbytes)
        except SlotError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return rank_pb2.OpenSlotReply(slot_id=slots[0].slot_id, size=slots[0].size,
                                      fd_socket=str(self.fd_server.path),
                                      slot_ids=[s.slot_id for s in slots])

    async def Capture(self, request: rank_pb2.CaptureRequest,
                      context: grpc.aio.ServicerContext) -> rank_pb2.CaptureReply:
        if request.generation < self.registry.generation:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"capture of step {request.step} is from generation "
                                f"{request.generation}; the job is at generation "
                                f"{self.registry.generation}: follow the new plan")
        try:
            slot = self.pool.get(request.slot_id)
        except SlotError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        if slot.rank_id != request.rank_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"slot {request.slot_id} belongs to another rank")
        total = max((t.offset + t.nbytes for t in request.tensors), default=0)
        if total > slot.size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"tensors describe {total} bytes but slot {request.slot_id} "
                                f"holds {slot.size}")
        if request.step > 1:
            self.metrics.capture_stall.labels(request.rank_id).observe(request.stall_s)
        # Backpressure, bounded memory: while encoding is MAX_BACKLOG captures behind,
        # the slot is held (the rank blocks only if it needs it again). Skipping steps
        # instead would need every rank to skip the same ones, or no step would commit.
        async with self._encoded:
            await self._encoded.wait_for(
                lambda: self._backlog.get(request.rank_id, 0) < MAX_BACKLOG)
            self._backlog[request.rank_id] = self._backlog.get(request.rank_id, 0) + 1
        # Copy out of the slot (memory speed) and hand it back at once; the encode
        # runs behind, so the rank's next capture finds the slot free.
        owned = await asyncio.to_thread(bytes, memoryview(slot.view)[:total])
        self.metrics.captured_bytes.inc(total)
        previous = self._durable.get(request.rank_id)
        self._durable[request.rank_id] = asyncio.create_task(self._make_durable(
            previous, request, owned))
        return rank_pb2.CaptureReply(accepted=True)

    async def _make_durable(self, previous: asyncio.Task[None] | None,
                            request: rank_pb2.CaptureRequest, owned: bytes) -> None:
        step, generation = request.step, request.generation
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)  # keep step order
        try:
            prepared = await self._encode(request, owned)
        except Exception:
            log.exception("step could not be encoded; it will not commit",
                          extra={"step": step, "rank": request.coord.rank})
            return
        if prepared is None:
            return  # the job moved on while this capture waited; it will not commit
        # A later step's commit makes a lost one moot, but nothing follows the job's last
        # step: that one is retried (a full disk may be freed) while its generation lasts.
        give_up = time.monotonic() + (FINAL_RETRY_S if request.final else 0.0)
        while True:
            try:
                self.quota.reserve(sum(len(p) for p in prepared.payloads))
                state = await self._run(self.store.prepare, step, prepared)
                state = await self._protect(step, generation, state, prepared.payloads)
                await self.send_prepare(peer_pb2.PrepareStepRequest(
                    job_id=self.config.job_id, step=step, generation=generation,
                    node=self.node, ranks=[state], layout=request.layout, final=request.final))
                return
            except Exception:
                if time.monotonic() >= give_up or generation < self.registry.generation:
                    log.exception("step could not be made durable; it will not commit",
                                  extra={"step": step, "rank": request.coord.rank})
                    return
                log.warning("the job's last step is not durable yet; retrying",
                            extra={"step": step, "rank": request.coord.rank}, exc_info=True)
                await asyncio.sleep(FINAL_RETRY_EVERY_S)

    async def _encode(self, request: rank_pb2.CaptureRequest, owned: bytes) -> Any:
        """Delta-encode one capture (None if its generation is over); frees its backlog."""
        try:
            if request.generation < self.registry.generation:
                return None
            return await self._run(
                self.store.encode, request.step, request.coord.rank, owned,
                list(request.tensors), coord=request.coord, extra=request.extra,
                node=self.node, adamw=list(request.adamw))
        finally:
            await self._encode_done(request.rank_id)

    async def _encode_done(self, rank_id: str) -> None:
        async with self._encoded:
            self._backlog[rank_id] -= 1
            self._encoded.notify_all()

    async def on_peer_lost(self, node: str) -> None:
        """A daemon is gone: the repair leader re-creates its shards on live daemons."""
        log.warning("peer lost", extra={"peer": node, "repair_leader": self.repairer.is_leader()})
        await self.repairer.run()

    # erasure coding -----------------------------------------------------------

    def _client(self, peer: Peer) -> ShardClient:
        c = self._clients.get(peer.node)
        if c is None or c.address != peer.address:
            c = self._clients[peer.node] = ShardClient(peer.address, job_id=self.config.job_id,
                                                       credentials=client_credentials(
                                                           self.config.tls),
                                                       metrics=self.metrics,
                                                       budget=self._shard_budget,
                                                       interceptors=self.stamp)
        return c

    def _peer(self, node: str) -> Peer:
        peer = next((p for p in self.peers() if p.node == node), None)
        if peer is None:
            raise LookupError(f"daemon {node} is not a live member of this job")
        return peer

    def _live_nodes(self) -> list[Node]:
        return [Node(p.node, p.labels) for p in self.peers()]

    def _reader(self) -> ShardReader:
        return ShardReader(node=self.node,
                           peers={p.node: self._client(p) for p in self.peers()},
                           s3=self.s3, metrics=self.metrics)

    async def _put_local(self, sid: str, body: bytes, step: int, generation: int) -> None:
        await self._client(self._peer(self.node)).put(sid, body, step=step,
                                                      generation=generation, crc=crc32c(body))

    def coding(self, nodes: int) -> tuple[int, int]:
        """(k, m) for this many live daemons: the configured code when it fits."""
        k, m = self.config.erasure.k, self.config.erasure.m
        on_nodes = k if self.config.erasure.parity_to == "s3" else k + m
        return (k, m) if on_nodes <= nodes else default_km(nodes)

    async def _protect(self, step: int, generation: int, state: manifest_pb2.RankState,
                       payloads: list[bytes]) -> manifest_pb2.RankState:
        """Spread each chunk as k + m shards over distinct daemons (and S3)."""
        peers = self.peers()
        if len(peers) < 2 and self.s3 is None:
            return state  # a single daemon: the local disk is the only tier
        k, m = self.coding(len(peers))
        if m == 0:
            return state
        codec = ZfecCodec(k, m)
        nodes = [Node(p.node, p.labels) for p in peers]
        by_node = {p.node: p for p in peers}
        out = manifest_pb2.RankState()
        out.CopyFrom(state)
        unreachable: set[str] = set()  # peers that failed a put during this capture
        for chunk, payload in zip(out.chunks, payloads, strict=True):
            t0 = time.perf_counter()
            shards = await asyncio.to_thread(codec.encode, payload)
            self.metrics.coder_seconds.labels("encode").inc(time.perf_counter() - t0)
            self.metrics.coder_bytes.labels("encode").inc(len(payload))
            placement = place_chunk(chunk.chunk_id, k, m, nodes,
                                    self.config.erasure.parity_to)
            puts = []
            chosen = {h for holders in placement.holders for h in holders}
            for index, holders in enumerate(placement.holders):
                body = bytes(shards[index])
                sid = f"{chunk.chunk_id}.{index}"
                crc = crc32c(body)
                for holder in holders:
                    chunk.shards.append(manifest_pb2.ShardRecord(
                        index=index, node=holder, location=sid, size=len(body), crc32c=crc))
                    if holder == S3:
                        assert self.s3 is not None
                        puts.append(self.s3.put_shard(sid, body))
                    else:
                        puts.append(self._put_shard(
                            chunk.shards[-1], body, step, generation, by_node, chosen,
                            unreachable))
            chunk.k, chunk.m = k, m
            await asyncio.gather(*puts)
            self.metrics.stored_bytes.labels(tier="shards").inc(
                sum(len(bytes(s)) for s in shards))
        return out

    async def _put_shard(self, record: manifest_pb2.ShardRecord, body: bytes, step: int,
                         generation: int, by_node: dict[str, Peer], chosen: set[str],
                         unreachable: set[str]) -> None:
        """Store one shard on `record.node`; when that peer cannot take it (dead but not
        yet detected as lost), on another live daemon, else on this one, and record where.

        Failing the whole step instead would drop every step captured between a node's
        death and its detection, and a job that ends meanwhile could never commit them.
        """
        node = record.node
        if node in unreachable:
            node = self._alternate(by_node, chosen, unreachable)
            chosen.add(node)
        while True:
            try:
                await self._client(by_node[node]).put(record.location, body, step=step,
                                                      generation=generation,
                                                      crc=record.crc32c)
                break
            except ShardTransferError as exc:
                if node == self.node:
                    raise  # this daemon's own shard store failed: nothing else to try
                unreachable.add(node)
                nxt = self._alternate(by_node, chosen, unreachable)
                chosen.add(nxt)  # before the next await: a sibling shard picks another
                log.warning("shard rerouted: its peer did not take it",
                            extra={"shard": record.location, "peer": node, "to": nxt,
                                   "error": str(exc)})
                node = nxt
        record.node = node

    def _alternate(self, by_node: dict[str, Peer], chosen: set[str],
                   unreachable: set[str]) -> str:
        """A live daemon holding no shard of this chunk yet, else this daemon."""
        spare = sorted(n for n in by_node if n not in chosen and n not in unreachable)
        return spare[0] if spare else self.node

    # commit -------------------------------------------------------------------

    async def commit(self, manifest: manifest_pb2.Manifest) -> None:
        """Phase two, sent by the coordinator to every daemon; also a repaired manifest
        (same step, new shard holders) sent by the repair leader."""
        if manifest.step in self.store.committed_steps():
            if self.store.load_manifest(manifest.step) == manifest:
                return  # phase two re-sent by a new coordinator: already done here
            await self._run_commit(repair.install_repaired, self.store, manifest)
            return
        latest = self.store.latest_committed()
        if latest is not None and manifest.step < latest:
            # New steps commit above the latest one (discard_after lowers it first), so
            # this is a repaired copy of a step retired here: nothing to update.
            log.info("repaired manifest of a step not kept here ignored",
                     extra={"step": manifest.step})
            return
        await self._run_commit(self.store.commit, manifest, local_node=self.node)
        if self.s3 is not None and self.node == min(p.node for p in self.peers()):
            data = manifest.SerializeToString(deterministic=True)
            try:
                await self.s3.put_manifest(manifest.step, data)
            except ManifestExistsError:
                # The previous uploader (a daemon since lost) got there first: the same
                # commit is fine; a different one means two writers disagree.
                if await self.s3.get_manifest(manifest.step) != data:
                    raise

        async with self._committed:
            self._committed.notify_all()

    async def WaitCommitted(self, request: rank_pb2.WaitCommittedRequest,
                            context: grpc.aio.ServicerContext) -> rank_pb2.WaitCommittedReply:
        deadline = time.monotonic() + (request.timeout_s or 30.0)

        def reached() -> bool:
            latest = self.store.latest_committed()
            return latest is not None and latest >= request.step

        async with self._committed:
            while not reached():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._committed.wait(), left)
                except TimeoutError:
                    break
        latest = self.store.latest_committed()
        return rank_pb2.WaitCommittedReply(
            committed=reached(), latest_committed=latest or 0,
            message="" if reached() else f"step {request.step} not committed within "
            f"{request.timeout_s or 30.0:g} s; latest committed is {latest}")

    # repair and its state ------------------------------------------------------

    async def _publish(self, manifest: manifest_pb2.Manifest) -> None:
        """Replace a repaired step's manifest here and on every other live daemon."""
        if not await self._run_commit(repair.install_repaired, self.store, manifest):
            return  # retired or discarded meanwhile: the other daemons drop it too
        request = peer_pb2.CommitStepRequest(manifest=manifest)
        for p in self.peers():
            if p.node == self.node:
                continue
            ch = self._push_channels.get(p.address)
            if ch is None:
                ch = self._push_channels[p.address] = aio_channel(
                    p.address, self.config.tls, interceptors=self.stamp)
            try:
                await peer_pb2_grpc.PeerServiceStub(ch).CommitStep(request,
                                                                   timeout=PUSH_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("repaired manifest not delivered; that daemon keeps the old "
                            "holders", extra={"peer": p.node, "step": manifest.step,
                                              "error": exc.details()})

    def status_storage(self) -> dict[str, str]:
        """Entries for StatusReply.storage: shards and protection of the newest committed
        step (with the bases it needs), repair and scrub progress."""
        manifests = self.store.committed_manifests()
        live = {p.node for p in self.peers()}
        state = self.repairer.state
        out = {}
        latest = max(manifests, default=None)
        if latest is not None:
            c = census((manifests[s] for s in mf.plan_chain(manifests, latest)), live)
            out["shards"] = (f"step {latest} and its bases: {c.healthy} healthy, {c.missing} "
                             f"missing, {state.pending} repairing")
            out["protection"] = (f"step {latest} survives {c.margin} more daemon losses"
                                 if c.margin >= 0 else f"step {latest} is not recoverable now")
        out["repair"] = (f"running, {state.pending} shards pending" if state.running
                         else state.last) + f"; {state.repaired} shards re-created since start"
        gone = self.repairer.lost(manifests) - {S3}
        if gone:
            out["repair"] += f"; lost holders: {', '.join(sorted(gone))}"
        out["scrub"] = self.scrubber.state.last
        return out

    # restore ------------------------------------------------------------------

    def _fetch_chunk(self, chunk: manifest_pb2.ChunkRecord) -> bytes:
        """Called from the store thread for a chunk this daemon does not hold."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._reader().read_chunk(chunk), self.loop)
        return fut.result(timeout=120)

    async def Restore(self, request: rank_pb2.RestoreRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[rank_pb2.RestorePiece]:
        manifests = await self._run(self.store.committed_manifests)
        if not manifests:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                "no step is committed yet; nothing to restore")
        if request.step and request.step not in manifests:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"step {request.step} is not committed here; committed: "
                                f"{sorted(manifests)[-5:]}")
        lost = self.repairer.lost(manifests)
        # step 0: the newest committed step that the surviving holders can still rebuild.
        steps = [request.step] if request.step else (
            repair.recoverable(manifests, lost, self.node) or [max(manifests)])
        for step in steps:
            if step not in (steps[0], steps[-1]) and not repair.step_recoverable(
                    manifests, step, lost, self.node):
                continue  # a holder failed while reading a newer step; skip what needs it
            state = next((r for r in manifests[step].ranks if r.rank == request.rank), None)
            if state is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"step {step} has no rank {request.rank} (its layout has "
                                    f"{len(manifests[step].ranks)} ranks)")
            t0 = time.perf_counter()
            try:
                data = await self._run(self.store.read_rank, step, request.rank,
                                       fetch=self._fetch_chunk)
            except BeyondToleranceError as exc:
                lost |= repair.failed_holders(manifests, exc.chunk_id, exc.unavailable)
                if request.step or step == steps[-1]:
                    await self._beyond_tolerance(context, step, request.rank, exc, manifests,
                                                 lost)
                continue
            except CorruptChunkError as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
            self.metrics.recovery_phase.labels("restore_read").observe(
                time.perf_counter() - t0)
            yield rank_pb2.RestorePiece(state=state, step=step)
            view = memoryview(data)
            for offset in range(0, len(view), PIECE_BYTES):
                yield rank_pb2.RestorePiece(offset=offset,
                                            data=bytes(view[offset:offset + PIECE_BYTES]))
            return

    async def _beyond_tolerance(self, context: grpc.aio.ServicerContext, step: int, rank: int,
                                exc: BeyondToleranceError, manifests: repair.Manifests,
                                lost: set[str]) -> None:
        """Abort naming the newest step still recoverable; its number also travels in the
        trailing metadata `stalwart-recoverable-step` (absent when none is)."""
        message, newest = repair.beyond_tolerance(step, rank, str(exc), manifests, lost,
                                                  self.node, self.s3 is not None)
        if newest is not None:
            context.set_trailing_metadata((("stalwart-recoverable-step", str(newest)),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
