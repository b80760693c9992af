"""Chunking of a rank's state buffer: boundaries, coverage, and base/delta records."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshot_states import state, tensors

from stalwart.core.manifest import DTYPE_SIZE
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.chunks import (
    chunk_regions,
    decode_rank,
    encode_rank,
    plan_chunks,
    planned_chunks,
)
from stalwart.v1 import common_pb2, manifest_pb2


@st.composite
def layouts(draw):
    metas, offset = [], 0
    for i in range(draw(st.integers(0, 8))):
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZE)))
        n = draw(st.integers(0, 3000))
        offset += draw(st.integers(0, 7))
        metas.append(common_pb2.TensorMeta(name=f"t{i}", dtype=dtype, shape=[n],
                                           nbytes=n * DTYPE_SIZE[dtype], offset=offset))
        offset += n * DTYPE_SIZE[dtype]
    return metas, offset + draw(st.integers(0, 5))


@settings(max_examples=200, deadline=None)
@given(layouts(), st.sampled_from([64, 1000, 4096]))
def test_chunks_tile_the_buffer_and_cut_only_at_element_boundaries(layout, chunk_bytes) -> None:
    metas, total = layout
    spans = plan_chunks(metas, total, chunk_bytes)
    assert [s.offset for s in spans] == [sum(x.size for x in spans[:i]) for i in range(len(spans))]
    assert sum(s.size for s in spans) == total
    assert all(0 < s.size <= chunk_bytes for s in spans)
    for s in spans[:-1]:
        cut = s.offset + s.size
        for t in metas:
            if t.offset < cut < t.offset + t.nbytes:
                assert (cut - t.offset) % DTYPE_SIZE[t.dtype] == 0


@settings(max_examples=50, deadline=None)
@given(layouts(), layouts())
def test_a_kept_chunk_plan_is_the_plan_of_the_same_layout(first, second) -> None:
    # Plans are kept per serialised layout: asked again, or after another layout's, the
    # plan is the one plan_chunks makes of that layout.
    def key(metas: list) -> bytes:
        return b"".join(t.SerializeToString(deterministic=True) for t in metas)

    for metas, total in (first, second, first):
        assert planned_chunks(key(metas), metas, total, 1000) == plan_chunks(metas, total, 1000)


def test_a_tensor_that_fits_a_chunk_is_never_split() -> None:
    f32 = common_pb2.FLOAT32
    metas = [common_pb2.TensorMeta(name="a", dtype=f32, shape=[150], nbytes=600, offset=0),
             common_pb2.TensorMeta(name="b", dtype=f32, shape=[200], nbytes=800, offset=600)]
    spans = plan_chunks(metas, 1400, 1024)
    assert [(s.offset, s.size) for s in spans] == [(0, 600), (600, 800)]


def test_a_large_tensor_is_split_into_full_aligned_chunks() -> None:
    meta = common_pb2.TensorMeta(name="w", dtype=common_pb2.INT64, shape=[1000], nbytes=8000,
                                 offset=0)
    spans = plan_chunks([meta], 8000, 1020)
    assert {s.size for s in spans[:-1]} == {1016}  # 1020 rounded down to 8-byte elements
    assert sum(s.size for s in spans) == 8000


def test_regions_carry_each_tensors_dtype() -> None:
    metas = tensors()
    regions = chunk_regions(metas, 0, metas[-1].offset + metas[-1].nbytes)
    assert [r.dtype for r in regions] == [t.dtype for t in metas]


def test_base_then_delta_records_and_round_trip() -> None:
    metas = tensors()
    s1, s2 = state(1), state(2)
    base = encode_rank(1, 0, s1, metas, chunk_bytes=8192)
    step2 = encode_rank(2, 0, s2, metas, chunk_bytes=8192, reference=base.decoded,
                        reference_step=1)
    assert {c.codec for c in base.chunks} == {manifest_pb2.ZSTD}
    assert {(c.codec, c.base_step) for c in step2.chunks} == {(manifest_pb2.XOR_DELTA_ZSTD, 1)}
    for index, (c, payload) in enumerate(zip(step2.chunks, step2.payloads, strict=True)):
        assert c.chunk_id == f"s2-r0-c{index}"
        assert (c.stored_size, c.stored_crc32c) == (len(payload), crc32c(payload))
        assert c.crc32c == crc32c(s2[c.offset:c.offset + c.size])
    record = manifest_pb2.RankState(tensors=metas, chunks=step2.chunks, total_bytes=len(s2))
    decoded = decode_rank(record, step2.payloads, {1: np.frombuffer(s1, np.uint8)})
    assert decoded.tobytes() == s2


def test_threaded_encoding_gives_the_same_chunks() -> None:
    from concurrent.futures import ThreadPoolExecutor

    metas = tensors(scale=4)
    with ThreadPoolExecutor(2) as pool:
        threaded = encode_rank(5, 1, state(5, 1, 4), metas, chunk_bytes=4096, executor=pool)
    serial = encode_rank(5, 1, state(5, 1, 4), metas, chunk_bytes=4096)
    assert threaded.chunks == serial.chunks and threaded.payloads == serial.payloads
