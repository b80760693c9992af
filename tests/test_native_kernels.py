"""The daemon's C encode loops write exactly the bytes of their numpy counterparts.

Snapshots encoded where the C loops ran must decode where they did not build (and back),
so every output is compared bit for bit with numpy's: byte planes of any layout, and the
AdamW predictions on any bit pattern (NaN payloads, infinities, denormals).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_delta import typed_buffers
from test_predict import hint

from stalwart.daemon.snapshot import codecs, predict


def numpy_only(fn, *args):
    """`fn(*args)` with the C loops switched off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codecs, "native", None)
        return fn(*args)


def test_the_c_loops_were_built_by_the_install() -> None:
    # `make venv` (pip install -e .) compiles daemon/snapshot/_kernels.c; this machine has
    # a compiler, so a missing module means the build broke, not that it was optional.
    assert codecs.native is not None, "daemon/snapshot/_kernels.c did not build"


@settings(max_examples=150, deadline=None)
@given(typed_buffers(), st.booleans())
def test_planes_of_data_xor_reference_and_back_match_numpys(case, against_reference: bool
                                                            ) -> None:
    cur, ref, regions = case
    ref = ref if against_reference else None
    got = codecs._shuffled(cur, regions, ref).tobytes()
    assert got == numpy_only(lambda: codecs._shuffled(cur, regions, ref).tobytes())
    # ...and back: the elements out of those planes, XOR the reference again.
    back = codecs._planes(got, regions, False, None, ref)
    assert back.tobytes() == cur
    assert numpy_only(codecs._planes, got, regions, False, None, ref).tobytes() == cur


def test_planes_of_long_regions_match_numpys() -> None:
    # Long enough for the vector loops (16 elements at a time) and their scalar tails.
    rng = np.random.default_rng(1)
    regions, offset = [], 0
    for dtype, size in [(codecs.common_pb2.FLOAT32, 4 * 1000 + 3), (codecs.common_pb2.BFLOAT16,
                        2 * 333), (codecs.common_pb2.INT64, 8 * 77), (codecs.common_pb2.UINT8, 5),
                        (codecs.common_pb2.FLOAT32, 4 * 4096)]:
        regions.append(codecs.Region(offset, size, dtype))
        offset += size + 7
    cur, ref = rng.bytes(offset), rng.bytes(offset)
    for reference in (ref, None):
        got = codecs._shuffled(cur, regions, reference).tobytes()
        assert got == numpy_only(codecs.shuffle, codecs.xor(cur, reference) if reference
                                 else cur, regions).tobytes()
    payload = codecs.encode_xor(cur, ref, regions)
    assert payload == numpy_only(codecs.encode_xor, cur, ref, regions)
    assert numpy_only(codecs.decode_xor, payload, ref, regions, offset).tobytes() == cur
    assert codecs.decode_xor(payload, ref, regions, offset).tobytes() == cur
    base = codecs.encode_full(cur, regions)
    assert base == numpy_only(codecs.encode_full, cur, regions)
    assert codecs.decode_full(base, regions, offset).tobytes() == cur


def _nan_heavy(n: int, shift: int, rng: np.random.Generator) -> np.ndarray:
    """n float32 at `shift` elements past an allocation, half of them NaNs with random
    payloads (quiet and signalling, either sign), the rest any bit pattern."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    nans = (bits & np.uint32(0x807FFFFF)) | np.uint32(0x7F800001)
    out = np.zeros(n + 8, np.uint32)[shift:shift + n]
    out[...] = np.where(rng.random(n) < 0.5, nans, bits)
    return out.view(np.float32)


@pytest.mark.parametrize("shift", range(4))
def test_nans_with_different_payloads_predict_the_same_nan(shift: int) -> None:
    # IEEE 754 leaves open which payload an operation on two NaNs keeps; numpy's loops and
    # the C differ, and by alignment. Every NaN predicted is one NaN (codec V2).
    rng = np.random.default_rng(shift)
    h = hint(beta1=0.5, beta2=0.5, lr=0.5, weight_decay=0.5, step=1)
    for n in (5, 13, 37, 301):
        a, b, c = (_nan_heavy(n, shift, rng) for _ in range(3))
        for fn in (predict.predict_second_moment, predict.predict_param):
            got = fn(a, b, c, h)
            assert np.isnan(got).any()
            assert (got.view(np.uint32)[np.isnan(got)] == predict.ONE_NAN).all()
            assert np.array_equal(got.view(np.uint32),
                                  numpy_only(fn, a, b, c, h).view(np.uint32)), fn.__name__


def _bits(draw_bytes: bytes, misaligned: bool) -> np.ndarray:
    raw = np.frombuffer(b"\0" * misaligned + draw_bytes, np.uint8)[misaligned:]
    return raw.view(np.float32)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70).flatmap(lambda n: st.lists(
           st.binary(min_size=4 * n, max_size=4 * n), min_size=3, max_size=3)),
       st.floats(0, 1), st.floats(0, 1), st.floats(-1, 1), st.floats(0, 1),
       st.integers(1, 10**6), st.booleans())
def test_adamw_predictions_match_numpys_bit_for_bit(arrays, beta1, beta2, lr, wd, step,
                                                    misaligned) -> None:
    # Random bit patterns: NaNs with distinct payloads meet in one operation, infinities,
    # denormals, negative second moments. Misaligned float32 fall back to numpy.
    a, b, c = (_bits(x, misaligned) for x in arrays)
    h = hint(beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, step=step)
    if predict._scalars(h) is None:
        return  # hints no AdamW step has are ignored before any prediction
    for fn in (predict.predict_second_moment, predict.predict_param):
        got = fn(a, b, c, h).view(np.uint32)
        expected = numpy_only(fn, a, b, c, h).view(np.uint32)
        assert np.array_equal(got, expected), fn.__name__


def test_a_hostile_region_table_is_refused_not_followed() -> None:
    # Sizes that overflow int64 when added must not let a region outside the data through.
    data, out = bytes(16), bytearray(16)
    wrap = lambda x: (x + 2**63) % 2**64 - 2**63  # noqa: E731
    table = np.array([(0, 8, 1), (8, 2**63 - 1, 1), (wrap(8 + 2**63 - 1), 2**63 - 1, 1),
                      (6, 10, 1)], dtype=np.int64)
    for fn in (codecs.native.planes, codecs.native.unplanes):
        with pytest.raises(ValueError, match="tile"):
            fn(data, None, out, table)
    with pytest.raises(ValueError, match="aligned"):  # int64 rows read at an odd address
        codecs.native.planes(data, None, out, memoryview(bytes(25))[1:])


def test_predictions_of_other_dtypes_are_refused() -> None:
    # Equal byte lengths (float64 x n == float32 x 2n) must not pass for float32.
    x = np.linspace(0.1, 1, 8)
    for fn in (predict.predict_second_moment, predict.predict_param):
        with pytest.raises(TypeError, match="float32"):
            fn(x, x, x, hint())
        with pytest.raises(TypeError, match="float32"):
            numpy_only(fn, x, x, x, hint())


def test_a_delta_cannot_decode_into_its_reference() -> None:
    rng = np.random.default_rng(5)
    regions = [codecs.Region(0, 4096, codecs.common_pb2.FLOAT32)]
    cur, ref = rng.bytes(4096), np.frombuffer(rng.bytes(4096), np.uint8).copy()
    payload = codecs.encode_xor(cur, ref, regions)
    with pytest.raises(codecs.CodecError, match="reference"):
        codecs.decode_xor(payload, ref, regions, 4096, out=ref)
