"""Where the k + m shards of a chunk live, what a set of lost nodes costs, how to repair it.

Pure functions: rendezvous hashing of the chunk id spreads load and keeps placement
stable as nodes come and go; failure-domain labels (zone, then rack) spread shards
so that one rack or zone failing costs as few shards as possible. Beyond WINDOW nodes
a chunk's candidates are the WINDOW nodes that follow its hash on a ring of the
nodes' hashes, so placing a chunk costs O(log nodes), not O(nodes), per shard.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

S3 = "s3"  # holder name of the remote tier; never lost with a node
PARITY_TARGETS = ("peers", "s3", "both")
WINDOW = 64  # candidates per chunk in a larger cluster (wide enough to spread zones, racks)


class PlacementError(ValueError):
    """A chunk cannot be placed as asked (too few nodes for distinct holders)."""


@dataclass(frozen=True)
class Node:
    """A daemon that can hold shards, with its failure-domain labels (rack, zone)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkPlacement:
    """Holders of each shard of one chunk: holders[i] names the nodes (or "s3") with shard i."""

    chunk_id: str
    k: int
    m: int
    holders: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class RepairTask:
    """Re-create shard `index` of `chunk_id` on `target`, decoding from `sources` {index: node}."""

    chunk_id: str
    index: int
    target: str
    sources: tuple[tuple[int, str], ...]


@dataclass
class RepairPlan:
    tasks: list[RepairTask]
    unrecoverable: list[str]               # chunk ids with fewer than k shards left
    unplaceable: list[tuple[str, int]]     # (chunk id, index) with no free live node


def _score(chunk_id: str, node: str) -> int:
    digest = hashlib.blake2b(f"{chunk_id}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@functools.lru_cache(maxsize=16)
def _ring(names: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """The nodes' hashes in ring order, and each one's index in `names`."""
    points = sorted((_score("", name), i) for i, name in enumerate(names))
    return [p for p, _ in points], [i for _, i in points]


def _window(chunk_id: str, candidates: Sequence[Node], count: int) -> Sequence[Node]:
    """The candidates a chunk chooses among: all of a small cluster; in a large one the
    max(WINDOW, 4 x count) nodes after the chunk's hash on the ring (consistent hashing:
    a node that joins or leaves changes the window of the chunks next to it only)."""
    size = max(WINDOW, 4 * count)
    if len(candidates) <= size:
        return candidates
    keys, order = _ring(tuple(n.name for n in candidates))
    start = bisect.bisect_left(keys, _score(chunk_id, ""))
    return [candidates[order[(start + j) % len(keys)]] for j in range(size)]


def _spread(chunk_id: str, candidates: Sequence[Node], count: int,
            taken: Iterable[Node] = ()) -> list[Node]:
    """`count` nodes, greedily from the least-used zone then rack, ties by hash order."""
    zones = Counter(n.labels.get("zone", "") for n in taken)
    racks = Counter(n.labels.get("rack", "") for n in taken)
    pool = sorted(_window(chunk_id, candidates, count), key=lambda n: _score(chunk_id, n.name),
                  reverse=True)
    chosen: list[Node] = []
    for _ in range(count):
        best = min(range(len(pool)), key=lambda i: (zones[pool[i].labels.get("zone", "")],
                                                    racks[pool[i].labels.get("rack", "")], i))
        node = pool.pop(best)
        zones[node.labels.get("zone", "")] += 1
        racks[node.labels.get("rack", "")] += 1
        chosen.append(node)
    return chosen


def place_chunk(chunk_id: str, k: int, m: int, nodes: Sequence[Node],
                parity_to: str = "peers") -> ChunkPlacement:
    """Holders for the k + m shards of a chunk, each on a distinct node.

    parity_to: "peers" (all shards on nodes), "s3" (parity only in S3) or "both"
    (parity on nodes and a copy in S3).
    """
    if parity_to not in PARITY_TARGETS:
        raise PlacementError(f"parity_to must be one of {PARITY_TARGETS}, got {parity_to!r}")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names) or S3 in names:
        raise PlacementError(f"node names must be distinct and not {S3!r}: {names}")
    on_nodes = k if parity_to == "s3" else k + m
    if on_nodes > len(nodes):
        raise PlacementError(
            f"{on_nodes} shards of chunk {chunk_id} need {on_nodes} distinct nodes, only "
            f"{len(nodes)} available; lower k/m or send parity to S3")
    chosen = [n.name for n in _spread(chunk_id, nodes, on_nodes)]
    holders: list[tuple[str, ...]] = [(name,) for name in chosen[:k]]
    for j in range(m):
        if parity_to == "s3":
            holders.append((S3,))
        elif parity_to == "both":
            holders.append((chosen[k + j], S3))
        else:
            holders.append((chosen[k + j],))
    return ChunkPlacement(chunk_id, k, m, tuple(holders))


def _alive(p: ChunkPlacement, lost: set[str]) -> dict[int, list[str]]:
    """Shard index -> its holders that are not lost (indices with none left are absent)."""
    out: dict[int, list[str]] = {}
    for i, hs in enumerate(p.holders):
        live = [h for h in hs if h not in lost]
        if live:
            out[i] = live
    return out


def chunk_margin(p: ChunkPlacement, lost: Iterable[str] = ()) -> int:
    """How many more node losses the chunk survives (-1: already undecodable)."""
    lost = set(lost)
    alive = _alive(p, lost)
    spare = len(alive) - p.k  # shards that may still go
    if spare < 0:
        return -1
    # Shards with a copy in S3 do not go with any node.
    exposed = {i: hs for i, hs in alive.items() if S3 not in hs}
    to_break = spare + 1
    if len(exposed) < to_break:
        return len({h for hs in exposed.values() for h in hs})  # losing every node is survived
    if all(len(hs) == 1 for hs in exposed.values()):
        # One holder per shard: the worst case takes the nodes holding the most shards first.
        per_node = sorted(Counter(hs[0] for hs in exposed.values()).values(), reverse=True)
        gone = 0
        for taken, count in enumerate(per_node, start=1):
            gone += count
            if gone >= to_break:
                return taken - 1
    node_names = sorted({h for hs in exposed.values() for h in hs})
    for r in range(1, len(node_names) + 1):
        for combo in itertools.combinations(node_names, r):
            dead = set(combo)
            if sum(all(h in dead for h in hs) for hs in exposed.values()) >= to_break:
                return r - 1
    return len(node_names)


def decodable(p: ChunkPlacement, lost: Iterable[str] = ()) -> bool:
    """True while at least k distinct shards of the chunk have a live holder."""
    return len(_alive(p, set(lost))) >= p.k


def step_margin(chunks: Iterable[ChunkPlacement], lost: Iterable[str] = ()) -> int:
    """Node losses a step survives: the weakest of its chunks (-1: not recoverable now)."""
    lost = set(lost)
    return min((chunk_margin(p, lost) for p in chunks), default=-1)


def recoverable_steps(steps: Mapping[int, Iterable[ChunkPlacement]],
                      lost: Iterable[str]) -> list[int]:
    """Steps whose every chunk is still decodable after `lost`, newest first."""
    lost = set(lost)
    return sorted((s for s, chunks in steps.items()
                   if all(decodable(p, lost) for p in chunks)), reverse=True)


def repair_plan(placements: Iterable[ChunkPlacement], lost_nodes: Iterable[str],
                live_nodes: Sequence[Node]) -> RepairPlan:
    """Shards to re-create after `lost_nodes`, on live nodes not yet holding that chunk.

    Sources are k surviving shards, data shards and peers before S3 (cheaper to read).
    """
    lost = set(lost_nodes)
    live = [n for n in live_nodes if n.name not in lost]
    by_name = {n.name: n for n in live}
    plan = RepairPlan([], [], [])
    for p in placements:
        alive = _alive(p, lost)
        missing = [i for i in range(len(p.holders)) if i not in alive]
        if not missing:
            continue
        if len(alive) < p.k:
            plan.unrecoverable.append(p.chunk_id)
            continue
        ranked = sorted(alive.items(), key=lambda kv: (all(h == S3 for h in kv[1]), kv[0]))
        sources = tuple((i, sorted(hs, key=lambda h: h == S3)[0]) for i, hs in ranked[:p.k])
        holding = {h for hs in alive.values() for h in hs}
        taken = [by_name[h] for h in holding if h in by_name]
        free = [n for n in live if n.name not in holding]
        targets = _spread(p.chunk_id, free, min(len(missing), len(free)), taken)
        for index, target in zip(missing, targets, strict=False):
            plan.tasks.append(RepairTask(p.chunk_id, index, target.name, sources))
        plan.unplaceable.extend((p.chunk_id, i) for i in missing[len(targets):])
    return plan
