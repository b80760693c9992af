"""Split a rank's logical state buffer into chunks and encode each as a base or a delta.

Chunks are ~chunk_bytes, cut at tensor boundaries where a tensor fits and at element
boundaries inside larger tensors, so every chunk's byte planes line up. A chunk is the
unit the erasure coder and the tiers see; its ChunkRecord says how to decode it.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from stalwart.core.manifest import BASE_CODECS, PREDICTED_CODECS, element_size
from stalwart.daemon.config_schema import default
from stalwart.daemon.snapshot import codecs, predict
from stalwart.daemon.snapshot.checksum import Buffer, crc32c
from stalwart.daemon.snapshot.codecs import Region
from stalwart.v1 import common_pb2, manifest_pb2

DEFAULT_CHUNK_BYTES: int = default("snapshot.chunk_bytes")


@dataclass(frozen=True)
class ChunkSpan:
    """Where one chunk lies in the logical buffer; regions are chunk-relative."""

    index: int
    offset: int
    size: int
    regions: tuple[Region, ...]


@dataclass
class EncodedRank:
    """One rank's encoded chunks, payloads in record order, and what the decoder sees.

    `decoded` is the buffer a reader will reconstruct: the input itself (not a copy) on
    the lossless path, the quantised reconstruction on the lossy one. Deltas of the next
    step apply to it.
    """

    chunks: list[manifest_pb2.ChunkRecord]
    payloads: list[bytes]
    decoded: np.ndarray = field(repr=False)

    @property
    def stored_bytes(self) -> int:
        return sum(len(p) for p in self.payloads)


def _tensor_regions(tensors: Sequence[common_pb2.TensorMeta]) -> list[Region]:
    regions = [Region(t.offset, t.nbytes, t.dtype) for t in tensors if t.nbytes > 0]
    for t in tensors:
        element_size(t.dtype)  # unknown dtypes fail here, by name, not deep in a codec
    return sorted(regions, key=lambda r: r.start)


def plan_chunks(tensors: Sequence[common_pb2.TensorMeta], total_bytes: int,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[ChunkSpan]:
    """Deterministic chunking of a `total_bytes` buffer holding `tensors` (bytes)."""
    if chunk_bytes < 8:
        raise ValueError(f"chunk_bytes={chunk_bytes} is below one 8-byte element")
    regions = codecs.tile(_tensor_regions(tensors), total_bytes)
    # A chunk holds one layer's tensors only: a restore of some layers then reads no
    # chunk of another (selection.closure), at the cost of a short chunk per layer.
    layer_at = {t.offset: t.layer for t in tensors if t.nbytes > 0}
    cuts = [0]
    fill = 0  # bytes in the open chunk
    layer = None
    for r in regions:
        starts = layer_at.get(r.start, layer)  # padding between tensors joins the last
        if starts != layer and fill > 0:
            cuts.append(r.start)
            fill = 0
        layer = starts
        if fill + r.size <= chunk_bytes:
            fill += r.size
            continue
        pos, left = r.start, r.size
        if r.size <= chunk_bytes and fill > 0:
            cuts.append(pos)  # a tensor that fits a chunk of its own is not split
            fill = r.size
            continue
        e = r.elem_size
        while fill + left > chunk_bytes:
            take = (chunk_bytes - fill) // e * e
            pos, left = pos + take, left - take
            if pos != cuts[-1]:
                cuts.append(pos)
            fill = 0
        fill = left
    cuts.append(total_bytes)
    cuts = sorted(set(cuts))
    index = RegionIndex(tensors)
    return [ChunkSpan(i, lo, hi - lo, tuple(index.regions(lo, hi - lo)))
            for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False))]


_PLANS_KEPT = 16  # layouts whose chunk plans are kept (a daemon's ranks, a relayout)
_plans: OrderedDict[tuple[bytes, int, int], list[ChunkSpan]] = OrderedDict()
_plans_lock = threading.Lock()


def planned_chunks(layout: bytes, tensors: Sequence[common_pb2.TensorMeta],
                   total_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                   ) -> list[ChunkSpan]:
    """`plan_chunks`, kept per `layout` (the tensors' serialised metadata, which the
    plan is a function of): a rank's layout is the same every step, and planning a
    model's hundreds of tensors cost about a millisecond per capture."""
    key = (layout, total_bytes, chunk_bytes)
    with _plans_lock:
        if (spans := _plans.get(key)) is not None:
            _plans.move_to_end(key)
            return spans
    spans = plan_chunks(tensors, total_bytes, chunk_bytes)
    with _plans_lock:
        _plans[key] = spans
        while len(_plans) > _PLANS_KEPT:
            _plans.popitem(last=False)
    return spans


class RegionIndex:
    """Typed regions of any byte range of a rank's buffer, found by bisection (a model has
    thousands of tensors and chunks; a linear scan per chunk would be quadratic)."""

    def __init__(self, tensors: Sequence[common_pb2.TensorMeta]) -> None:
        self._tensors = sorted((t for t in tensors if t.nbytes > 0), key=lambda t: t.offset)
        self._ends = [t.offset + t.nbytes for t in self._tensors]

    def regions(self, offset: int, size: int) -> list[Region]:
        """Regions of [offset, offset + size), relative to `offset`."""
        out = []
        for t in self._tensors[bisect.bisect_right(self._ends, offset):]:
            if t.offset >= offset + size:
                break
            lo, hi = max(t.offset, offset), min(t.offset + t.nbytes, offset + size)
            out.append(Region(lo - offset, hi - lo, t.dtype))
        return out


def chunk_regions(tensors: Sequence[common_pb2.TensorMeta], offset: int,
                  size: int) -> list[Region]:
    """Typed regions of the chunk [offset, offset + size), relative to its start."""
    return RegionIndex(tensors).regions(offset, size)


def chunk_id(step: int, rank: int, index: int) -> str:
    return f"s{step}-r{rank}-c{index}"


def encode_rank(step: int, rank: int, data: Buffer, tensors: Sequence[common_pb2.TensorMeta], *,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, reference: Buffer | None = None,
                reference_step: int | None = None, lossy: bool = False,
                level: int = codecs.DEFAULT_LEVEL,
                adamw: Sequence[manifest_pb2.AdamWHint] = (),
                executor: Executor | None = None, layout: bytes | None = None
                ) -> EncodedRank:
    """Encode a rank's buffer: a base when `reference` is None, else a delta against it.

    `reference` is the decoded buffer of `reference_step` (same size, same layout).
    `adamw` hints select ADAM_PREDICTED_XOR_ZSTD_V2 (lossless, several times smaller on
    AdamW state); `lossy=True` selects the opt-in QUANT_DELTA codec instead. `layout`:
    the tensors' serialised metadata, when the caller has it (their chunk plan is kept).
    """
    buf = np.frombuffer(data, dtype=np.uint8)
    if reference is not None:
        ref = np.frombuffer(reference, dtype=np.uint8)
        if ref.size != buf.size or reference_step is None or reference_step >= step:
            raise ValueError(f"step {step} rank {rank}: reference of step {reference_step} "
                             f"({ref.size} bytes) does not fit a {buf.size}-byte buffer")
    spans = plan_chunks(tensors, buf.size, chunk_bytes) if layout is None else \
        planned_chunks(layout, tensors, buf.size, chunk_bytes)
    decoded = buf if not (lossy and reference is not None) else buf.copy()
    delta_codec = manifest_pb2.XOR_DELTA_ZSTD
    predicted = None
    if reference is not None and adamw and not lossy:
        delta_codec = manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2
        predicted = predict.Reference(ref, buf, tensors, adamw)

    def one(span: ChunkSpan) -> tuple[manifest_pb2.ChunkRecord, bytes]:
        piece = buf[span.offset:span.offset + span.size]
        regions = list(span.regions)
        if reference is None:
            codec, base_step = manifest_pb2.ZSTD, step
            payload = codecs.encode_full(piece, regions, level=level)
        else:
            base_step = reference_step
            ref_piece = ref[span.offset:span.offset + span.size] if predicted is None \
                else predicted.piece(span.offset, span.size)
            if lossy:
                codec = manifest_pb2.QUANT_DELTA
                payload, recon = codecs.encode_quant(piece, ref_piece, regions, level=level)
                decoded[span.offset:span.offset + span.size] = recon
                piece = recon
            else:
                codec = delta_codec
                payload = codecs.encode_xor(piece, ref_piece, regions, level=level)
        record = manifest_pb2.ChunkRecord(
            chunk_id=chunk_id(step, rank, span.index), offset=span.offset, size=span.size,
            stored_size=len(payload), crc32c=crc32c(piece), stored_crc32c=crc32c(payload),
            codec=codec, base_step=base_step)
        return record, payload

    results = list(executor.map(one, spans)) if executor else [one(s) for s in spans]
    return EncodedRank([r for r, _ in results], [p for _, p in results], decoded)


def decode_rank(state: manifest_pb2.RankState, payloads: Sequence[Buffer],
                references: Mapping[int, np.ndarray], positions: Sequence[int] | None = None,
                adamw: Sequence[manifest_pb2.AdamWHint] | None = None) -> np.ndarray:
    """A rank's decoded buffer from its chunk payloads (record order).

    `references` maps each base_step named by a delta chunk to that step's decoded
    buffer. Checksums are the caller's: it knows which tier each payload came from.
    With `positions`, only those chunks (payloads in that order) are decoded, applying
    the `adamw` hints given (those of the tensors they hold, `selection.closure`); the
    rest of the buffer is left undefined.
    """
    out = np.empty(state.total_bytes, dtype=np.uint8)
    index = RegionIndex(state.tensors)
    predicted_from, one_nan = None, True
    chunks = state.chunks if positions is None else [state.chunks[i] for i in positions]
    for c, payload in zip(chunks, payloads, strict=True):
        ref = None
        if c.codec not in BASE_CODECS:
            if c.base_step not in references:
                raise KeyError(f"chunk {c.chunk_id} applies to step {c.base_step}, "
                               "whose decoded buffer was not supplied")
            ref = references[c.base_step][c.offset:c.offset + c.size]
        codec = c.codec
        if codec in PREDICTED_CODECS:
            predicted_from, one_nan = c.base_step, codec == manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2
            codec = manifest_pb2.XOR_DELTA_ZSTD
        regions = index.regions(c.offset, c.size)
        codecs.decode(codec, payload, regions, c.size, ref, out[c.offset:c.offset + c.size])
    if predicted_from is not None:
        predict.correct(out, references[predicted_from], state.tensors,
                        state.adamw if adamw is None else adamw, one_nan=one_nan)
    return out
