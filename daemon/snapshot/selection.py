"""Part of a rank's state: the tensors of some layers, which chunks hold them, and the
packed record and bytes a restore of just those hands back.

A rank that takes a new role after a re-plan needs only the layers of its new stage
from each old rank it reads. The chunks to read follow from the tensors wanted, but a
chunk only checks out (its CRC32C) when every tensor in it is decoded, and an AdamW
prediction decodes a parameter from its two moments. So the set of tensors is closed
under both before the chunks are chosen; the same set serves every step of a chain,
whose tensors and chunking cannot change (a changed layout starts a new base).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from stalwart.core.manifest import TENSOR_ALIGN
from stalwart.v1 import common_pb2, manifest_pb2

LAYER_PREFIXES = ("model/", "optim/")  # tensors that belong to a layer; others are kept


@dataclass(frozen=True)
class Layers:
    """The inclusive layer range a restore asks for."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if self.first > self.last:
            raise ValueError(f"layers {self.first}-{self.last}: the first is after the last")

    def wants(self, meta: common_pb2.TensorMeta) -> bool:
        """Layer tensors in the range, and every tensor that belongs to no layer (RNG
        states and the like, layer -1: small, and the new role may need them)."""
        return (meta.layer < 0 or not meta.name.startswith(LAYER_PREFIXES)
                or self.first <= meta.layer <= self.last)


def wanted(state: manifest_pb2.RankState, layers: Layers) -> set[str]:
    return {t.name for t in state.tensors if layers.wants(t)}


def closure(states: Iterable[manifest_pb2.RankState], names: set[str]) -> set[str]:
    """`names` and every tensor that decoding them drags in: the other tensors of an AdamW
    triple, and those sharing a chunk with one already in, in any of `states`."""
    indexes = [_Index(state) for state in states]
    out, todo = set(names), set(names)
    while todo:
        found: set[str] = set()
        for index in indexes:
            found |= index.partners(todo)
        todo = found - out
        out |= todo
    return out


def chunk_positions(state: manifest_pb2.RankState, names: set[str]) -> list[int]:
    """Positions in `state.chunks` of the chunks that hold any byte of the tensors `names`."""
    return sorted(_Index(state).chunk_indexes(names))


class _Index:
    """Tensors and chunks of one record by offset, for lookups by bisection (a model has
    thousands of each)."""

    def __init__(self, state: manifest_pb2.RankState) -> None:
        self.state = state
        self.by_name = {t.name: t for t in state.tensors if t.nbytes > 0}
        self.tensors = sorted(self.by_name.values(), key=lambda t: t.offset)
        self.tensor_ends = [t.offset + t.nbytes for t in self.tensors]
        self.order = sorted(range(len(state.chunks)), key=lambda i: state.chunks[i].offset)
        self.chunk_ends = [state.chunks[i].offset + state.chunks[i].size for i in self.order]
        self.triples: dict[str, set[str]] = {}
        for h in state.adamw:
            triple = {h.param, h.exp_avg, h.exp_avg_sq}
            for name in triple:
                self.triples.setdefault(name, set()).update(triple)

    def chunk_indexes(self, names: Iterable[str]) -> set[int]:
        out: set[int] = set()
        for name in names:
            t = self.by_name.get(name)
            if t is None:
                continue
            at = bisect.bisect_right(self.chunk_ends, t.offset)
            while at < len(self.order) and \
                    self.state.chunks[self.order[at]].offset < t.offset + t.nbytes:
                out.add(self.order[at])
                at += 1
        return out

    def partners(self, names: set[str]) -> set[str]:
        """Tensors that decoding `names` also decodes: AdamW triples and chunk mates."""
        out = {p for name in names for p in self.triples.get(name, ())}
        for i in self.chunk_indexes(names | out):
            c = self.state.chunks[i]
            at = bisect.bisect_right(self.tensor_ends, c.offset)
            while at < len(self.tensors) and self.tensors[at].offset < c.offset + c.size:
                out.add(self.tensors[at].name)
                at += 1
        return out


def packed(state: manifest_pb2.RankState, names: set[str]) -> manifest_pb2.RankState:
    """The record a partial restore hands back: only the tensors `names`, in record order,
    at aligned offsets into a buffer of just them (`total_bytes`); no chunks, which
    describe the whole buffer. Everything else of the record (coordinates, extra) is kept."""
    out = manifest_pb2.RankState()
    out.CopyFrom(state)
    del out.tensors[:]
    del out.chunks[:]
    del out.adamw[:]
    out.adamw.extend(h for h in state.adamw if h.param in names)
    offset = 0
    for t in state.tensors:
        if t.name in names:
            meta = out.tensors.add()
            meta.CopyFrom(t)
            meta.offset = offset
            offset += -(-t.nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
    out.total_bytes = offset
    return out


def pack(whole: memoryview | bytes, state: manifest_pb2.RankState, names: set[str]
         ) -> tuple[manifest_pb2.RankState, bytearray]:
    """`packed(state, names)` and its buffer, cut out of the rank's `whole` buffer
    (regions not decoded are never read)."""
    view, layout = memoryview(whole), packed(state, names)
    out = bytearray(layout.total_bytes)
    for t, meta in zip((t for t in state.tensors if t.name in names), layout.tensors,
                       strict=True):
        out[meta.offset:meta.offset + t.nbytes] = view[t.offset:t.offset + t.nbytes]
    return layout, out
