"""Chunk codecs: lossless codecs are bitwise exact on any bit pattern; lossy is opt-in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.daemon.snapshot import codecs
from stalwart.daemon.snapshot.codecs import Region
from stalwart.v1 import common_pb2, manifest_pb2

# Bit patterns worth a special look: NaNs with payloads (quiet, signalling, negative),
# +-0.0, +-inf, the smallest and largest denormals, the largest finite value.
F32_SPECIAL = [0x7FC00001, 0x7F800001, 0xFFC12345, 0x80000000, 0x00000000, 0x7F800000,
               0xFF800000, 0x00000001, 0x007FFFFF, 0x7F7FFFFF]
F16_SPECIAL = [0x7E01, 0x7C01, 0xFE55, 0x8000, 0x0000, 0x7C00, 0x0001, 0x03FF, 0x7BFF]
BF16_SPECIAL = [0x7FC1, 0x7F81, 0xFFC3, 0x8000, 0x0000, 0x7F80, 0x0001, 0x007F, 0x7F7F]

WIDTH = {common_pb2.FLOAT32: np.uint32, common_pb2.FLOAT16: np.uint16,
         common_pb2.BFLOAT16: np.uint16, common_pb2.INT64: np.uint64}
SPECIAL = {common_pb2.FLOAT32: F32_SPECIAL, common_pb2.FLOAT16: F16_SPECIAL,
           common_pb2.BFLOAT16: BF16_SPECIAL, common_pb2.INT64: [0, 2**63, 2**64 - 1]}


@st.composite
def typed_buffers(draw):
    """(current, reference, regions): two same-layout buffers of mixed dtypes."""
    regions, parts_cur, parts_ref, offset = [], [], [], 0
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(list(WIDTH)))
        width = WIDTH[dtype]
        bits = st.one_of(st.sampled_from(SPECIAL[dtype]),
                         st.integers(0, int(np.iinfo(width).max)))
        n = draw(st.integers(0, 40))
        cur = np.array(draw(st.lists(bits, min_size=n, max_size=n)), dtype=width)
        flips = np.array(draw(st.lists(bits, min_size=n, max_size=n)), dtype=width)
        ref = cur ^ np.where(np.arange(n) % 3 == 0, flips, 0).astype(width)
        gap = draw(st.integers(0, 3))  # untyped padding between tensors
        pad = np.frombuffer(draw(st.binary(min_size=gap, max_size=gap)), dtype=np.uint8)
        regions.append(Region(offset, cur.nbytes, dtype))
        parts_cur += [cur.view(np.uint8), pad]
        parts_ref += [ref.view(np.uint8), pad[::-1]]
        offset += cur.nbytes + gap
    return (np.concatenate(parts_cur).tobytes(), np.concatenate(parts_ref).tobytes(), regions)


@settings(max_examples=100, deadline=None)
@given(typed_buffers())
def test_shuffle_then_unshuffle_is_identity(case) -> None:
    cur, _, regions = case
    assert codecs.unshuffle(codecs.shuffle(cur, regions), regions).tobytes() == cur


@settings(max_examples=100, deadline=None)
@given(typed_buffers(), st.sampled_from([manifest_pb2.RAW, manifest_pb2.ZSTD,
                                         manifest_pb2.XOR_DELTA_ZSTD]))
def test_lossless_codecs_round_trip_bitwise(case, codec) -> None:
    cur, ref, regions = case
    payload = codecs.encode(codec, cur, regions, ref)
    assert codecs.decode(codec, payload, regions, len(cur), ref).tobytes() == cur


@settings(max_examples=40, deadline=None)
@given(typed_buffers())
def test_lossy_decode_reproduces_the_encoders_reconstruction(case) -> None:
    cur, ref, regions = case
    payload, recon = codecs.encode_quant(cur, ref, regions)
    decoded = codecs.decode(manifest_pb2.QUANT_DELTA, payload, regions, len(cur), ref)
    assert decoded.tobytes() == recon.tobytes()


@pytest.mark.parametrize("batch_below", [0, 5, codecs.BATCH_BELOW])
@settings(max_examples=100, deadline=None)
@given(case=typed_buffers())
def test_shuffle_lays_out_each_regions_bytes_plane_by_plane(case, batch_below: int) -> None:
    # The stored format: the encoder may compute the planes any way (region by region,
    # or small regions in runs), never change them.
    cur, _, regions = case
    expected = bytearray()
    for r in codecs.tile(regions, len(cur)):
        e, n = r.elem_size, r.size // r.elem_size
        body = cur[r.start:r.start + n * e]
        for k in range(e):
            expected += body[k::e]
        expected += cur[r.start + n * e:r.start + r.size]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codecs, "BATCH_BELOW", batch_below)
        assert codecs.shuffle(cur, regions).tobytes() == bytes(expected)


def test_byte_planes_group_bytes_by_significance() -> None:
    data = np.array([0x04030201, 0x08070605], dtype=np.uint32).view(np.uint8)
    planes = codecs.shuffle(data, [Region(0, 8, common_pb2.FLOAT32)])
    assert list(planes) == [1, 5, 2, 6, 3, 7, 4, 8]


def test_xor_delta_of_a_small_update_is_smaller_than_a_full_base() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1 << 16).astype(np.float32)
    cur = ref + np.float32(1e-4) * rng.standard_normal(ref.size).astype(np.float32)
    regions = [Region(0, cur.nbytes, common_pb2.FLOAT32)]
    full = codecs.encode_full(cur, regions)
    xor = codecs.encode_xor(cur, ref, regions)
    assert len(xor) < 0.75 * len(full) < cur.nbytes


def test_lossy_errors_do_not_accumulate_over_steps() -> None:
    rng = np.random.default_rng(1)
    truth = rng.standard_normal(4096).astype(np.float32)
    regions = [Region(0, truth.nbytes, common_pb2.FLOAT32)]
    recon = truth.copy()
    for _ in range(30):
        truth = truth + np.float32(1e-2) * rng.standard_normal(truth.size).astype(np.float32)
        _, out = codecs.encode_quant(truth, recon, regions)
        recon = out.view(np.float32)
    # one step's quantisation error (<= scale / 2 of a ~4-sigma delta / 127), not 30 steps'
    assert np.abs(recon - truth).max() < 4e-2 * 4 / 127
    assert np.array_equal(np.signbit(recon), np.signbit(truth))


def test_lossy_keeps_non_finite_values_exact() -> None:
    cur = np.array([1.0, np.nan, -np.inf, 2.0], dtype=np.float32)
    ref = np.array([1.5, 0.0, 0.0, 2.5], dtype=np.float32)
    regions = [Region(0, cur.nbytes, common_pb2.FLOAT32)]
    _, recon = codecs.encode_quant(cur, ref, regions)
    assert recon.tobytes() == cur.tobytes()
    huge = np.array([3e38, -3e38], dtype=np.float32)  # their difference overflows float32
    _, recon = codecs.encode_quant(huge, -huge, [Region(0, 8, common_pb2.FLOAT32)])
    assert recon.tobytes() == huge.tobytes()


def test_truncated_payload_is_refused() -> None:
    data = np.arange(1000, dtype=np.float32)
    regions = [Region(0, data.nbytes, common_pb2.FLOAT32)]
    payload = codecs.encode_full(data, regions)
    with pytest.raises(Exception, match="(?i)size|data|frame|decompress"):
        codecs.decode_full(payload[:-4], regions, data.nbytes)


def test_delta_against_a_reference_of_another_size_is_refused() -> None:
    with pytest.raises(codecs.CodecError, match="reference"):
        codecs.encode_xor(b"\x00" * 8, b"\x00" * 4, [])
