"""The snapshot path of one daemon, stage by stage: intake -> encode -> place -> store
-> prepare -> commit, and restore.

A capture is answered as soon as its slot's bytes are copied out (`intake`); the
rest runs in the background, in step order per rank: delta-encode into chunks
(`local_store.encode`, `chunks`, `codecs`), spread them as erasure shards over this
node, its peers and S3 (`place`), make the rank's record durable on this node's disk
with any chunk no shards keep (`local_store.prepare`; the RAM tier caches them all),
copy the rank's record to its holders (`records`), and send phase one,
the record's seal, to the coordinator. Phase two and the read side live in
`commit` and `restore`; `repair` and `scrub` keep stored steps whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from stalwart.core import step_record as sr
from stalwart.core.placement import S3, Node
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import Peer, PeerChannels, UntilLost, never_lost
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.snapshot import repair
from stalwart.daemon.snapshot.atomic import EACH_WRITE, IN_BACKGROUND, sync_filesystem
from stalwart.daemon.snapshot.commit import Committer
from stalwart.daemon.snapshot.disk_watch import DiskWatch, refusal
from stalwart.daemon.snapshot.holders import LocalShards, ShardHolders
from stalwart.daemon.snapshot.intake import Intake
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.place import ShardPlacer
from stalwart.daemon.snapshot.protection import ProtectionWatch
from stalwart.daemon.snapshot.quota import DiskQuota
from stalwart.daemon.snapshot.records import RecordHolders
from stalwart.daemon.snapshot.restore import Restorer
from stalwart.daemon.snapshot.s3_tier import S3Tier
from stalwart.daemon.snapshot.scrub import Scrubber
from stalwart.daemon.snapshot.shard_reader import ShardReader
from stalwart.daemon.snapshot.shard_store import ShardStore
from stalwart.daemon.snapshot.slots import FdServer, SlotPool
from stalwart.v1 import manifest_pb2, peer_pb2, rank_pb2

log = logging.getLogger("stalwart.daemon.snapshot.path")

FINAL_RETRY_S = 120.0  # the job's last step is retried this long when it cannot be stored
FINAL_RETRY_EVERY_S = 1.0
T = TypeVar("T")

PrepareSender = Callable[[peer_pb2.PrepareStepRequest], Awaitable[None]]


class SnapshotPath:
    """The stages of one daemon's snapshot path, wired together."""

    def __init__(self, config: DaemonConfig, registry: Registry, metrics: Metrics,
                 data_dir: Path, peers: Callable[[], list[Peer]], channels: PeerChannels,
                 send_prepare: PrepareSender, is_leader: Callable[[], bool],
                 until_silent: UntilLost = never_lost,
                 quiet: Callable[[str], bool] = lambda node: False) -> None:
        """`until_silent`: shard puts and record copies to a peer that has gone quiet
        (suspect or lost) stop waiting for it and go elsewhere; `quiet(node)`: whether it
        has now (reads ask it last)."""
        self.quiet = quiet
        self.config, self.registry, self.metrics = config, registry, metrics
        self.node, self.peers, self.send_prepare = config.node, peers, send_prepare
        snap = config.snapshot
        self.disk_sync = EACH_WRITE if snap.disk_sync == "write" else IN_BACKGROUND
        self.data_dir = data_dir
        self.pool = SlotPool(snap.slot_bytes, token=config.token)
        self.fd_server = FdServer(self.pool, data_dir / "fd.sock")
        self._encoders = ThreadPoolExecutor(2, thread_name_prefix="delta")
        self.store = LocalStore(data_dir, job_id=config.job_id, chunk_bytes=snap.chunk_bytes,
                                base_every=snap.base_every, retain=snap.retain,
                                ram_tier_bytes=snap.ram_tier_bytes,
                                local_copy=snap.local_copy, executor=self._encoders,
                                metrics=metrics, sync=self.disk_sync)
        # Encodes, prepares and reads run side by side (the store is thread-safe).
        self._io = ThreadPoolExecutor(2, thread_name_prefix="store")
        self.s3 = None
        if config.s3.bucket:
            self.s3 = S3Tier(bucket=config.s3.bucket, job_id=config.job_id,
                             prefix=config.s3.prefix, endpoint_url=config.s3.endpoint or None,
                             region=config.s3.region or None, metrics=metrics)
        self.quota = DiskQuota([data_dir / "snapshots", data_dir / "shards"],
                               config.snapshot.disk_quota_bytes)
        self.disk = DiskWatch(self.node, snap.disk_full_replan_s, registry.roles_here,
                              registry.report)
        local = LocalShards(ShardStore(data_dir / "shards", self.disk_sync), node=self.node,
                            job_id=config.job_id, quota=self.quota, metrics=metrics)
        self.holders = ShardHolders(config, metrics, local, channels, peers)
        self.intake = Intake(self.pool, self.fd_server, registry, metrics, self.node,
                             self._make_durable)
        self.placer = ShardPlacer(config, metrics, self.holders, self.s3, peers, until_silent)
        self.records = RecordHolders(self.node, config.job_id, self.store, self.s3, peers,
                                     channels, self._copies, until_silent)
        self.committer = Committer(self.node, self.store, self.s3, is_leader)
        self.repairer = repair.Repairer(
            node=self.node, store=self.store, metrics=metrics, live=self._live_nodes,
            client=self.holders.client, reader=self._reader, records=self.records,
            s3_available=self.s3 is not None, is_leader=is_leader)
        self.restorer = Restorer(self.node, self.store, metrics, self._io, self._reader,
                                 self.records.fetch_blocking, self._live_nodes,
                                 self.s3 is not None, self.records.decoded_blocking)
        self.scrubber = Scrubber(node=self.node, job_id=config.job_id,
                                 shard_dir=data_dir / "shards", store=self.store,
                                 metrics=metrics, reader=self._reader, put_local=self._put_local,
                                 fetch_records=self.records.fetch_blocking)
        self._background: list[asyncio.Task[None]] = []
        # (step, generation) -> records of this node's ranks made durable, until all are
        self._gathering: dict[tuple[int, int], list[manifest_pb2.RankState]] = {}
        # The census of the newest committed step, for its series and for status.
        self.protection = ProtectionWatch(self.store, lambda: [p.node for p in self.peers()],
                                          metrics)
        # the holders status_storage found lost, and the records and live daemons then
        self._lost_seen: tuple[tuple[Any, ...], set[str]] | None = None

    async def start(self) -> None:
        self.records.loop = asyncio.get_running_loop()
        self.store.sweep_temporaries()
        self.fd_server.start()
        self._background = [asyncio.create_task(self.scrubber.forever(), name="scrub")]
        if not self.disk_sync.each_write:
            self._background.append(asyncio.create_task(self._write_back_forever(),
                                                        name="disk-sync"))

    async def stop(self) -> None:
        try:
            await self.intake.stop()
            for t in self._background:
                t.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self.fd_server.stop()
            self.pool.close()
            self._io.shutdown(wait=True)
            self.committer.stop()
            self._encoders.shutdown(wait=True)
            self.placer.close()
        finally:
            if not self.disk_sync.each_write:
                await self._write_back()  # a daemon stopped on purpose leaves its files on disk

    async def _write_back_forever(self) -> None:
        """With disk_sync = 'background': write this daemon's files back to its disk every
        disk_sync_every_s (steps count as stored before that, on the nodes that keep them)."""
        while True:
            await asyncio.sleep(self.config.snapshot.disk_sync_every_s)
            await self._write_back()

    async def _write_back(self) -> None:
        committed = self.store.latest_committed()
        try:
            await asyncio.to_thread(sync_filesystem, self.data_dir)
        except OSError as exc:  # the disk refuses writes: the nodes' copies still protect
            log.error("could not write the daemon's files back to disk: %s; steps stay "
                      "protected by their copies on the nodes that keep them, but would "
                      "not survive a power loss of this node; check the disk of %s",
                      exc, self.data_dir)
            return
        self.store.written_back(committed)

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, lambda: fn(*args, **kw))

    def _live_nodes(self) -> list[Node]:
        return [Node(p.node, p.labels) for p in self.peers()]

    def _copies(self) -> int:
        """Daemons besides this one that keep a copy of its ranks' records: m."""
        live = len(self.peers())
        return 0 if live < 2 else self.placer.coding(live)[1]

    def _reader(self) -> ShardReader:
        return ShardReader(node=self.node, peers=self.holders.live(), s3=self.s3,
                           metrics=self.metrics, quiet=self.quiet)

    async def _put_local(self, sid: str, body: bytes, step: int, generation: int) -> None:
        await self.holders.local.put(sid, body, step=step, generation=generation)

    async def _make_durable(self, request: rank_pb2.CaptureRequest, owned: bytes,
                            encoded: Callable[[], Awaitable[None]]) -> None:
        """Encode one capture, store it here, place its shards, send phase one."""
        step, generation = request.step, request.generation
        try:
            prepared = await self._encode(request, owned)
        except Exception:
            log.exception("step could not be encoded; it will not commit",
                          extra={"step": step, "rank": request.coord.rank})
            return
        finally:
            await encoded()
        if prepared is None or self.intake.moot(request):
            # The job moved on while this capture waited or encoded, or a hurry made its
            # step moot; it will not commit, and its record must not replace the one the
            # new plan makes of its step.
            return
        # A later step's commit makes a lost one moot, but nothing follows the job's last
        # step: that one is retried (a full disk may be freed) while its generation lasts.
        give_up = time.monotonic() + (FINAL_RETRY_S if request.final else 0.0)

        async def store_and_place() -> None:
            try:
                placed = await self.placer.place(step, generation, prepared.state,
                                                 prepared.payloads,
                                                 moot=lambda: self.intake.moot(request))
                if self.intake.moot(request):
                    return  # hurried past while placing: not written, never prepared
                # Shards put here reserved their own room; this is what is written whole.
                self.quota.reserve(self.store.disk_bytes(placed.chunks, prepared.payloads))
                states.append(await self._run(self.store.prepare, step, prepared, placed))
            except Exception as exc:
                self.disk.refused(exc, generation)
                raise
            self.disk.stored()

        states: list[manifest_pb2.RankState] = []
        if not await self._retrying(store_and_place, give_up, generation, step,
                                    request.coord.rank) or not states:
            return
        # One prepare per node and step: the last of this node's ranks to get here copies
        # every one's record to the holders and sends their seal.
        gathered = self._gathering.setdefault((step, generation), [])
        gathered += states
        if len(gathered) < self._local_ranks(generation):
            return
        del self._gathering[(step, generation)]
        # A step one of this node's ranks could not store never gathers: drop it once a
        # later step commits, or its generation ends.
        latest = self.store.latest_committed() or 0
        self._gathering = {k: v for k, v in self._gathering.items()
                           if k[1] >= generation and k[0] > latest}
        if self.intake.moot(request):
            return

        async def protect_and_prepare() -> None:
            await self.records.copy(step, gathered)
            await self.send_prepare(peer_pb2.PrepareStepRequest(
                job_id=self.config.job_id, step=step, generation=generation, node=self.node,
                seal=sr.seal(self.node, gathered), layout=request.layout, final=request.final))

        await self._retrying(protect_and_prepare, give_up, generation, step,
                             [s.rank for s in gathered])

    async def _retrying(self, work: Callable[[], Awaitable[None]], give_up: float,
                        generation: int, step: int, rank: object) -> bool:
        """`work` until it succeeds (True), or, once past `give_up` or the generation,
        logs why the step will not commit (False): an error, unless a newer plan left
        the step behind (it is redone; its files here may be gone under the write)."""
        while True:
            try:
                await work()
                return True
            except Exception as exc:
                if generation < self.registry.generation:
                    # A newer plan redoes the step, and adopting it removed the step's
                    # files here (discard_after) under this write: not a fault.
                    log.info("capture not stored: a newer plan left its step behind",
                             extra={"step": step, "rank": rank, "generation": generation,
                                    "error": str(exc)})
                    return False
                if time.monotonic() >= give_up:
                    if (why := refusal(exc)) is not None:  # a condition of the node
                        log.warning("step could not be stored here; it will not commit",
                                    extra={"step": step, "rank": rank, "why": why})
                    else:
                        log.exception("step could not be made durable; it will not commit",
                                      extra={"step": step, "rank": rank})
                    return False
                log.warning("the job's last step is not durable yet; retrying",
                            extra={"step": step, "rank": rank}, exc_info=True)
                await asyncio.sleep(FINAL_RETRY_EVERY_S)

    def _local_ranks(self, generation: int) -> int:
        """Ranks the plan of `generation` places on this node (1 before any plan)."""
        ranks = self.registry.roles_here(generation)
        return 1 if ranks is None else max(1, len(ranks))

    async def _encode(self, request: rank_pb2.CaptureRequest, owned: bytes) -> Any:
        """Delta-encode one capture (None if its step became moot meanwhile)."""
        if self.intake.moot(request):
            return None
        return await self._run(
            self.store.encode, request.step, request.coord.rank, owned,
            list(request.tensors), coord=request.coord, extra=request.extra,
            node=self.node, adamw=list(request.adamw), generation=request.generation)

    async def on_peer_lost(self, node: str) -> None:
        """A daemon is gone: records it held are copied back to m holders, and the repair
        leader re-creates its shards on live daemons."""
        log.warning("peer lost", extra={"peer": node, "repair_leader": self.repairer.is_leader()})
        await self.records.on_peer_lost(node)
        await self.repairer.run()

    def status_storage(self) -> dict[str, str]:
        """Entries for StatusReply.storage: shards and protection of the newest committed
        step (with the bases it needs) for the records held here, repair and scrub."""
        records = self.store.committed_records()
        state = self.repairer.state
        out = {}
        c, latest = self.protection.update(), self.protection.step
        # Counted again only when records change (a commit, a retirement, a repair) or
        # the live daemons do: operators and dashboards poll far more often than that.
        key = (tuple(records), frozenset(p.node for p in self.peers()), self.store.changes)
        if self._lost_seen is None or self._lost_seen[0] != key:
            gone = self.repairer.lost([self.store.held_manifest(s) for s in records]) - {S3}
            self._lost_seen = (key, gone)
        gone = self._lost_seen[1]
        if latest is not None and c is not None:
            out["shards"] = (f"step {latest} and its bases: {c.healthy} healthy, {c.missing} "
                             f"missing, {state.pending} repairing (records held here)")
            out["protection"] = (f"step {latest} survives {c.margin} more daemon losses"
                                 if c.margin >= 0 else f"step {latest} is not recoverable now")
        out["repair"] = (f"running, {state.pending} shards pending" if state.running
                         else state.last) + f"; {state.repaired} shards re-created since start"
        if gone:
            out["repair"] += f"; lost holders: {', '.join(sorted(gone))}"
        out["scrub"] = self.scrubber.state.last
        return out
