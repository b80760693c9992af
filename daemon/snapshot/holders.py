"""Where shard puts and gets go: this node's own shard store directly, peers over gRPC.

`ShardHolders.client(node)` answers with one object per holder that offers `put` and
`get`; for this daemon's own node that is `LocalShards`, so a daemon never sends its
own shards to itself over a socket, nor reads them back through one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.errors import disk_full
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import Peer, PeerChannels
from stalwart.daemon.snapshot.checksum import Buffer, crc32c
from stalwart.daemon.snapshot.quota import DiskQuota, QuotaExceeded
from stalwart.daemon.snapshot.shard_client import (
    ByteBudget,
    ShardChecksumError,
    ShardClient,
    ShardTransferError,
)
from stalwart.daemon.snapshot.shard_store import ShardStore

SHARD_BYTES_IN_FLIGHT = 256 << 20  # shard bytes being sent to or read from peers


class LocalShards:
    """This node's shard store, with ShardClient's put/get (and its errors)."""

    def __init__(self, store: ShardStore, *, node: str, job_id: str, quota: DiskQuota,
                 metrics: Metrics) -> None:
        self.store, self.node, self.job_id = store, node, job_id
        self.quota, self.metrics = quota, metrics
        self.address = f"{node} (local)"

    async def put(self, shard_id: str, data: Buffer, *, step: int = 0, generation: int = 0,
                  crc: int | None = None, deadline_s: float | None = None) -> None:
        view = memoryview(data).cast("B")
        meta = {"size": len(view), "crc32c": crc32c(view) if crc is None else crc,
                "step": step, "generation": generation, "owner": self.node}
        try:
            self.quota.reserve(len(view))
            await asyncio.to_thread(self.store.put, self.job_id, shard_id, view, meta)
        except OSError as exc:
            full = disk_full(exc) is not None
            raise ShardTransferError(self.address, shard_id, "put", exc.strerror
                                     + (" (disk full)" if full else ""), full=full) from exc
        except Exception as exc:  # quota, a bad id: this store cannot take it
            raise ShardTransferError(self.address, shard_id, "put", str(exc),
                                     full=isinstance(exc, QuotaExceeded)) from exc
        self.metrics.stored_bytes.labels("peer").inc(len(view))

    async def get(self, shard_id: str, *, expected_crc: int | None = None,
                  expected_size: int | None = None, deadline_s: float | None = None) -> bytes:
        try:
            data, meta = await asyncio.to_thread(self.store.read, self.job_id, shard_id)
        except (OSError, ValueError) as exc:
            raise ShardTransferError(self.address, shard_id, "get", "not here") from exc
        want = meta["crc32c"] if expected_crc is None else expected_crc
        if len(data) != meta["size"] or (expected_size is not None
                                         and len(data) != expected_size):
            raise ShardChecksumError(self.address, shard_id, "get",
                                     f"{len(data)} bytes on disk, expected {meta['size']}")
        if crc32c(data) != want:
            self.metrics.scrub_errors.labels("local").inc()
            raise ShardChecksumError(self.address, shard_id, "get",
                                     "failed its checksum on this node")
        return data


class ShardHolders:
    """A put/get client per holder node: local for this node, gRPC for the others."""

    def __init__(self, config: DaemonConfig, metrics: Metrics, local: LocalShards,
                 channels: PeerChannels, peers: Callable[[], list[Peer]]) -> None:
        self.config, self.metrics, self.local = config, metrics, local
        self.channels, self.peers = channels, peers
        # One byte budget for every peer: shard bytes in flight stay bounded per daemon,
        # however many peers it sends to.
        self.budget = ByteBudget(SHARD_BYTES_IN_FLIGHT)
        self._remote: dict[str, ShardClient] = {}

    def client(self, node: str) -> LocalShards | ShardClient:
        """The holder `node` (a live member of the job), else LookupError."""
        if node == self.config.node:
            return self.local
        peer = next((p for p in self.peers() if p.node == node), None)
        if peer is None:
            raise LookupError(f"daemon {node} is not a live member of this job")
        c = self._remote.get(node)
        if c is None or c.address != peer.address:
            c = self._remote[node] = ShardClient(
                peer.address, job_id=self.config.job_id, metrics=self.metrics,
                budget=self.budget, channel=self.channels.get(peer.address))
        return c

    def live(self) -> dict[str, LocalShards | ShardClient]:
        """Every live holder by node name, this one included."""
        return {p.node: self.client(p.node) for p in self.peers()}
