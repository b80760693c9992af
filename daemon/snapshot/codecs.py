"""Chunk codecs: raw bytes in, bytes out, numpy only (the daemon never imports torch).

Lossless: a full base (byte-plane shuffle + zstd) and a delta (XOR of bit patterns
against a reference, shuffle, zstd) that decode bitwise exact, NaN payloads and -0.0
included. Lossy (opt-in, never the default): int8-quantised float32 deltas against
the decoder's own reconstruction, so quantisation errors never accumulate.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from stalwart.core.manifest import DTYPE_SIZE
from stalwart.daemon.snapshot.checksum import Buffer
from stalwart.v1 import common_pb2, manifest_pb2

try:  # the same loops in C (daemon/snapshot/_kernels.c), built by `pip install`
    from stalwart.daemon.snapshot import _kernels as native
except ImportError:  # no compiler where this was installed: numpy below, slower
    native = None
if sys.byteorder != "little":
    native = None  # its planes are defined on little-endian words

DEFAULT_LEVEL = -1
"""zstd's fastest regular level but one: measured on the tiny GPT's AdamW deltas, 9% less
daemon CPU per step than level 1 for 1.4% more bytes stored (`stalwart bench erasure`)."""
QUANT_BLOCK = 1024  # float32 elements sharing one scale in the lossy codec


@dataclass(frozen=True)
class Region:
    """A run of same-typed bytes inside a chunk: [start, start + size) in bytes."""

    start: int
    size: int
    dtype: int = common_pb2.UINT8

    @property
    def elem_size(self) -> int:
        return DTYPE_SIZE.get(self.dtype, 1)


class CodecError(ValueError):
    """A payload does not decode into the size and regions its record promises."""


_local = threading.local()


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    # Compressors are not thread-safe; one per thread and setting avoids re-creation.
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _u8(data: Buffer) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def tile(regions: list[Region], size: int) -> list[Region]:
    """`regions` sorted, with any uncovered bytes of [0, size) added as uint8 regions."""
    out: list[Region] = []
    cursor = 0
    for r in sorted(regions, key=lambda r: r.start):
        if r.start < cursor or r.start + r.size > size:
            raise CodecError(f"region {r} overlaps another or lies outside {size} bytes")
        if r.start > cursor:
            out.append(Region(cursor, r.start - cursor))
        out.append(r)
        cursor = r.start + r.size
    if cursor < size:
        out.append(Region(cursor, size - cursor))
    return out


_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


BATCH_BELOW = 1 << 12
"""Regions of fewer elements than this get their planes from one pass over their run (a
model's biases, norms and step counts): one vectorised pass per region cost more in
calls than in bytes."""


def scratch(n: int, dtype: type, use: str = "") -> np.ndarray:
    """This thread's scratch array for `use`, n elements (reused: fresh pages cost more
    than the work on them). Valid until the next call for `use` on this thread; nothing
    that outlives the caller's work may hold it. Sized by chunks, never by whole
    states: each thread keeps the largest it was asked for."""
    cache = _local.__dict__.setdefault("scratch", {})
    buf = cache.get((use, dtype))
    if buf is None or buf.size < n:
        buf = cache[(use, dtype)] = np.empty(max(n, 1 << 16), dtype=dtype)
    return buf[:n]


def _split_planes(elems: np.ndarray, planes: np.ndarray) -> None:
    """Byte planes (`planes`, e rows of n bytes) of n little-endian e-byte elements:
    plane k is each element shifted right by 8k bits and truncated to a byte, one
    vectorised pass per plane (faster than a strided byte copy, same bytes)."""
    e, n = planes.shape
    words = elems.view(_WORDS[e])
    planes[0] = words  # the assignment keeps the low byte
    shifted = scratch(n, _WORDS[e])
    for k in range(1, e):
        np.right_shift(words, 8 * k, out=shifted)
        planes[k] = shifted


def _runs(regions: list[Region]) -> list[list[Region]]:
    """Tiled regions in order, grouped: a run of small regions of one element size (and
    the untyped padding between them, where it keeps their elements aligned to the run's
    start) shares one pass; every other region is a run of its own."""
    runs: list[list[Region]] = []
    run: list[Region] = []
    for r in regions:
        e = r.elem_size
        if run:
            e0, start = run[0].elem_size, run[0].start
            small = r.size < BATCH_BELOW * e0
            joins = small and e in (e0, 1) and (r.start - start) % e0 == 0 and \
                r.size % e0 == 0
            if joins:
                run.append(r)
                continue
            runs.append(run)
            run = []
        if e in _WORDS and r.size % e == 0 and r.size < BATCH_BELOW * e:
            run = [r]
        else:
            runs.append([r])
    if run:
        runs.append(run)
    return runs


def _split_run(src: np.ndarray, out: np.ndarray, run: list[Region]) -> None:
    """The planes of a run of small regions: one pass over the run's bytes, then each
    region's planes (and its padding's bytes) copied to their places."""
    e, lo = run[0].elem_size, run[0].start
    n = (run[-1].start + run[-1].size - lo) // e
    planes = scratch(e * n, np.uint8, "run").reshape(e, n)
    _split_planes(src[lo:lo + e * n], planes)
    for r in run:
        if r.elem_size == e:
            a = (r.start - lo) // e
            out[r.start:r.start + r.size].reshape(e, r.size // e)[...] = \
                planes[:, a:a + r.size // e]
        else:
            out[r.start:r.start + r.size] = src[r.start:r.start + r.size]


def _table(tiled: list[Region]) -> np.ndarray:
    """Tiled regions as the C loops take them: int64 (start, size, element size) rows."""
    return np.array([(r.start, r.size, r.elem_size) for r in tiled], dtype=np.int64)


def _planes(data: Buffer, regions: list[Region], forward: bool,
            out: np.ndarray | None = None, reference: Buffer | None = None) -> np.ndarray:
    """Into `out`: the byte planes of `data` XOR `reference`, or (`forward` False) the
    elements of planes `data`, XOR `reference`. `reference` (optional) is in element
    order either way."""
    src = _u8(data)
    out = np.empty_like(src) if out is None else out
    tiled = tile(regions, src.size)
    if native is not None:
        (native.planes if forward else native.unplanes)(
            src, None if reference is None else _u8(reference), out, _table(tiled))
        return out
    if forward and reference is not None:
        src = xor(src, reference, scratch(src.size, np.uint8, "xor"))
    fast = forward and sys.byteorder == "little"
    for run in (_runs(tiled) if fast else [[r] for r in tiled]):
        if len(run) > 1:
            _split_run(src, out, run)
            continue
        r = run[0]
        e, n = r.elem_size, r.size // r.elem_size
        lo, mid, hi = r.start, r.start + n * e, r.start + r.size
        if fast and e in _WORDS and n > 0:
            _split_planes(src[lo:mid], out[lo:mid].reshape(e, n))
        elif e > 1 and n > 0:
            # One strided copy per byte plane: ~3x faster than a transposed assignment.
            elems, planes = (src, out) if forward else (out, src)
            by_elem = elems[lo:mid].reshape(n, e)
            by_plane = planes[lo:mid].reshape(e, n)
            for k in range(e):
                if forward:
                    by_plane[k] = by_elem[:, k]
                else:
                    by_elem[:, k] = by_plane[k]
        else:
            mid = lo
        out[mid:hi] = src[mid:hi]
    return out if forward or reference is None else xor(out, reference, out)


def shuffle(data: Buffer, regions: list[Region]) -> np.ndarray:
    """Byte planes of each region side by side (byte 0 of every element, then byte 1...)."""
    return _planes(data, regions, forward=True)


def unshuffle(data: Buffer, regions: list[Region]) -> np.ndarray:
    """Inverse of `shuffle`."""
    return _planes(data, regions, forward=False)


def xor(a: Buffer, b: Buffer, out: np.ndarray | None = None) -> np.ndarray:
    """Bitwise XOR of two equal-length buffers (uint8 result, into `out` if given)."""
    x, y = _u8(a), _u8(b)
    if x.size != y.size:
        raise CodecError(f"delta of {x.size} bytes against a reference of {y.size} bytes")
    out = np.empty_like(x) if out is None else out
    whole = x.size - x.size % 8  # 8-byte words are several times faster than bytes
    np.bitwise_xor(x[:whole].view(np.uint64), y[:whole].view(np.uint64),
                   out=out[:whole].view(np.uint64))
    np.bitwise_xor(x[whole:], y[whole:], out=out[whole:])
    return out


def _zstd(data: np.ndarray, level: int, threads: int) -> bytes:
    return _compressor(level, threads).compress(data)


def _into(out: np.ndarray, data: np.ndarray) -> np.ndarray:
    out[...] = data
    return out


def _unzstd(payload: Buffer, size: int) -> np.ndarray:
    raw = _decompressor().decompress(payload, max_output_size=size)
    if len(raw) != size:
        raise CodecError(f"payload decompressed to {len(raw)} bytes, record says {size}")
    return _u8(raw)


def _shuffled(data: Buffer, regions: list[Region], reference: Buffer | None = None
              ) -> np.ndarray:
    """`shuffle` (of data XOR reference, when given) into this thread's scratch: valid
    until its next call on this thread."""
    return _planes(data, regions, True, scratch(len(_u8(data)), np.uint8, "planes"),
                   reference)


def encode_full(data: Buffer, regions: list[Region], *, level: int = DEFAULT_LEVEL,
                threads: int = 0) -> bytes:
    """A self-contained base chunk: shuffle + zstd."""
    return _zstd(_shuffled(data, regions), level, threads)


def decode_full(payload: Buffer, regions: list[Region], size: int,
                out: np.ndarray | None = None) -> np.ndarray:
    return _planes(_unzstd(payload, size), regions, False, out)


def _check_reference(size: int, reference: Buffer) -> None:
    if len(_u8(reference)) != size:
        raise CodecError(f"delta of {size} bytes against a reference of "
                         f"{len(_u8(reference))} bytes")


def encode_xor(data: Buffer, reference: Buffer, regions: list[Region], *,
               level: int = DEFAULT_LEVEL, threads: int = 0) -> bytes:
    """A lossless delta chunk: XOR against `reference`, shuffle, zstd."""
    _check_reference(len(_u8(data)), reference)
    return _zstd(_shuffled(data, regions, reference), level, threads)


def decode_xor(payload: Buffer, reference: Buffer, regions: list[Region], size: int,
               out: np.ndarray | None = None) -> np.ndarray:
    _check_reference(size, reference)
    if out is not None and np.may_share_memory(out, _u8(reference)):
        raise CodecError("a delta cannot decode into its own reference's memory")
    return _planes(_unzstd(payload, size), regions, False, out, reference)


def encode(codec: int, data: Buffer, regions: list[Region], reference: Buffer | None = None, *,
           level: int = DEFAULT_LEVEL, threads: int = 0) -> bytes:
    """Encode one chunk with a lossless ChunkCodec (see `encode_quant` for the lossy one)."""
    if codec == manifest_pb2.RAW:
        return bytes(_u8(data))
    if codec == manifest_pb2.ZSTD:
        return encode_full(data, regions, level=level, threads=threads)
    if codec == manifest_pb2.XOR_DELTA_ZSTD:
        return encode_xor(data, reference, regions, level=level, threads=threads)
    raise CodecError(f"codec {codec} cannot be encoded losslessly by encode()")


def decode(codec: int, payload: Buffer, regions: list[Region], size: int,
           reference: Buffer | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Decode one chunk of `size` bytes (into `out` when given, and returned); deltas need
    the reference's bytes of the same range, in a buffer other than `out`."""
    if codec == manifest_pb2.RAW:
        raw = _u8(payload)
        if raw.size != size:
            raise CodecError(f"raw chunk holds {raw.size} bytes, record says {size}")
        return raw if out is None else _into(out, raw)
    if codec == manifest_pb2.ZSTD:
        return decode_full(payload, regions, size, out)
    if codec == manifest_pb2.XOR_DELTA_ZSTD:
        return decode_xor(payload, reference, regions, size, out)
    if codec == manifest_pb2.QUANT_DELTA:
        decoded = decode_quant(payload, reference, regions, size)
        return decoded if out is None else _into(out, decoded)
    raise CodecError(f"unknown chunk codec {codec}; a newer stalwart wrote this step")


# --- lossy, opt-in --------------------------------------------------------------------

_EXACT, _QUANT = 0, 1


def _quant_region(cur: np.ndarray, ref: np.ndarray,
                  diff: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Quantise diff = cur - ref per block; returns payload parts and the reconstruction."""
    n = cur.size
    nblocks = -(-n // QUANT_BLOCK)
    pad = nblocks * QUANT_BLOCK - n
    delta = np.pad(diff, (0, pad)).reshape(nblocks, QUANT_BLOCK)
    scale = (np.abs(delta).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(delta / safe[:, None]), -127, 127).astype(np.int8)
    recon = _dequant(ref, q, scale, n)
    # Signs are kept exact (a second moment must stay >= 0): wrong-signed elements are
    # stored verbatim as (index, value) exceptions.
    bad = np.flatnonzero((np.signbit(recon) != np.signbit(cur))
                         | ~np.isfinite(recon)).astype(np.uint32)
    recon[bad] = cur[bad]
    parts = [np.uint32(bad.size).tobytes(), scale.tobytes(), q.tobytes(), bad.tobytes(),
             cur[bad].tobytes()]
    return parts, recon


def _dequant(ref: np.ndarray, q: np.ndarray, scale: np.ndarray, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # an overflow becomes an exact exception entry
        step = (q.astype(np.float32) * scale[:, None]).reshape(-1)[:n]
        return (ref + step).astype(np.float32)


def encode_quant(data: Buffer, reference: Buffer, regions: list[Region], *,
                 level: int = DEFAULT_LEVEL) -> tuple[bytes, np.ndarray]:
    """LOSSY: int8 deltas of float32 regions against `reference`, which must be the
    decoder's reconstruction of the previous step (error feedback). Other regions and
    non-finite float32 regions are XOR-coded exactly. Returns (payload, reconstruction);
    keep the reconstruction as the next call's reference."""
    cur_all, ref_all = _u8(data), _u8(reference)
    recon_all = cur_all.copy()
    parts: list[bytes] = []
    flags = bytearray()
    regions = tile(regions, cur_all.size)
    for r in regions:
        cur = cur_all[r.start:r.start + r.size]
        ref = ref_all[r.start:r.start + r.size]
        if r.dtype == common_pb2.FLOAT32 and r.size % 4 == 0 and r.size > 0:
            cf, rf = cur.view(np.float32), ref.view(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                diff = cf - rf  # non-finite when either side is, or on overflow
            if np.isfinite(diff).all():
                region_parts, recon = _quant_region(cf, rf, diff)
                flags.append(_QUANT)
                parts.extend(region_parts)
                recon_all[r.start:r.start + r.size] = recon.view(np.uint8)
                continue
        flags.append(_EXACT)
        parts.append(xor(cur, ref).tobytes())
    body = bytes(flags) + b"".join(parts)
    return _compressor(level, 0).compress(body), recon_all


def decode_quant(payload: Buffer, reference: Buffer, regions: list[Region],
                 size: int) -> np.ndarray:
    """LOSSY: rebuild the reconstruction `encode_quant` returned, bit for bit."""
    body = _decompressor().decompressobj().decompress(payload)
    ref_all = _u8(reference)
    if ref_all.size != size:
        raise CodecError(f"lossy delta of {size} bytes against a reference of {ref_all.size}")
    out = np.empty_like(ref_all)
    regions = tile(regions, size)
    pos = len(regions)
    for flag, r in zip(body[:len(regions)], regions, strict=True):
        ref = ref_all[r.start:r.start + r.size]
        if flag == _EXACT:
            out[r.start:r.start + r.size] = xor(_u8(body[pos:pos + r.size]), ref)
            pos += r.size
            continue
        n = r.size // 4
        nblocks = -(-n // QUANT_BLOCK)
        nbad = int(np.frombuffer(body, np.uint32, 1, pos)[0])
        pos += 4
        scale = np.frombuffer(body, np.float32, nblocks, pos)
        pos += 4 * nblocks
        q = np.frombuffer(body, np.int8, nblocks * QUANT_BLOCK, pos).reshape(nblocks,
                                                                        QUANT_BLOCK)
        pos += nblocks * QUANT_BLOCK
        bad = np.frombuffer(body, np.uint32, nbad, pos)
        pos += 4 * nbad
        exact = np.frombuffer(body, np.float32, nbad, pos)
        pos += 4 * nbad
        recon = _dequant(ref.view(np.float32), q, scale, n)
        recon[bad] = exact
        out[r.start:r.start + r.size] = recon.view(np.uint8)
    if pos != len(body):
        raise CodecError(f"lossy payload has {len(body) - pos} unexpected trailing bytes")
    return out
