"""How protected committed state is: shards per state and the protection margin.

Pure: from manifests and the set of live nodes, count shard records on live and
lost holders, and find how many more node losses every chunk survives. A chunk
is readable while its capturing node's disk copy is (where it kept one), or while
any k distinct shard indexes are on live nodes or S3.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations

from stalwart.core.manifest import whole_on_node
from stalwart.core.placement import S3
from stalwart.v1 import manifest_pb2

__all__ = ["Census", "census", "chunk_margin"]

MAX_EXACT_NODES = 16  # holders of one chunk searched exhaustively; more are capped


@dataclass(frozen=True)
class Census:
    """Shard records by holder state, and the job's protection margin (node losses)."""

    healthy: int
    missing: int
    margin: int
    """More node losses that every chunk survives; -1 when a chunk is already unreadable,
    the number of live nodes when no node loss at all can make a chunk unreadable."""


def _readable(home: str | None, k: int, holders: dict[str, set[int]], s3: set[int],
              up: set[str]) -> bool:
    if home is not None and home in up:
        return True
    indexes = set(s3)
    for node, held in holders.items():
        if node in up:
            indexes |= held
    return k > 0 and len(indexes) >= k


def chunk_margin(home: str, chunk: manifest_pb2.ChunkRecord, live: set[str]) -> int:
    """More node losses (of `live` nodes) that `chunk`, captured on `home`, survives."""
    home = home if whole_on_node(chunk) else None
    holders: dict[str, set[int]] = {}
    s3: set[int] = set()
    for rec in chunk.shards:
        if rec.node == S3:
            s3.add(rec.index)
        else:
            holders.setdefault(rec.node, set()).add(rec.index)
    if not _readable(home, chunk.k, holders, s3, live):
        return -1
    # Only the nodes holding a copy or a shard matter; the others can all be lost.
    copies = ({home} if home else set()) | set(holders)
    relevant = sorted(copies & live)[:MAX_EXACT_NODES]
    for size in range(1, len(relevant) + 1):
        for lost in combinations(relevant, size):
            if not _readable(home, chunk.k, holders, s3, live - set(lost)):
                return size - 1
    return len(live)


def census(manifests: Iterable[manifest_pb2.Manifest], live: set[str]) -> Census:
    """Shards and margin over every chunk of `manifests` (a step and the bases it needs)."""
    healthy = missing = 0
    margin: int | None = None
    for manifest in manifests:
        for rank in manifest.ranks:
            for chunk in rank.chunks:
                for rec in chunk.shards:
                    if rec.node == S3 or rec.node in live:
                        healthy += 1
                    else:
                        missing += 1
                m = chunk_margin(rank.node, chunk, live)
                margin = m if margin is None else min(margin, m)
    return Census(healthy, missing, 0 if margin is None else margin)
