"""AdamW-predicted deltas: lossless whatever the hints say, and much smaller when right."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.daemon.snapshot import codecs, predict
from stalwart.daemon.snapshot.chunks import RegionIndex, decode_rank, encode_rank
from stalwart.v1 import common_pb2, manifest_pb2

F32 = common_pb2.FLOAT32


def layout(n: int) -> list[common_pb2.TensorMeta]:
    names = ["w", "w/exp_avg", "w/exp_avg_sq", "other"]
    return [common_pb2.TensorMeta(name=name, dtype=F32, shape=[n], nbytes=4 * n, offset=4 * n * i)
            for i, name in enumerate(names)]


def hint(**kw) -> manifest_pb2.AdamWHint:
    base = dict(param="w", exp_avg="w/exp_avg", exp_avg_sq="w/exp_avg_sq", lr=1e-3,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)
    return manifest_pb2.AdamWHint(**{**base, **kw})


def round_trip(prev: bytes, cur: bytes, metas, hints) -> tuple[bytes, int]:
    encoded = encode_rank(2, 0, cur, metas, chunk_bytes=1024, reference=prev,
                          reference_step=1, adamw=hints)
    record = manifest_pb2.RankState(tensors=metas, chunks=encoded.chunks,
                                    total_bytes=len(cur), adamw=hints)
    out = decode_rank(record, encoded.payloads, {1: np.frombuffer(prev, np.uint8)})
    return out.tobytes(), encoded.stored_bytes


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(
           st.binary(min_size=16 * n, max_size=16 * n),
           st.binary(min_size=16 * n, max_size=16 * n))),
       st.floats(-1, 1), st.floats(0, 1), st.floats(0, 1), st.integers(1, 10**6))
def test_any_bits_and_any_hint_round_trip_exactly(bufs, lr, beta1, beta2, step) -> None:
    prev, cur = bufs  # random bit patterns: NaNs, infinities, denormals all occur
    metas = layout(len(prev) // 16)
    hints = [hint(lr=lr, beta1=beta1, beta2=beta2, step=step)]
    assert round_trip(prev, cur, metas, hints)[0] == cur


def test_hints_naming_missing_or_repeated_tensors_are_ignored() -> None:
    rng = np.random.default_rng(0)
    metas = layout(64)
    prev, cur = rng.bytes(1024), rng.bytes(1024)
    hints = [hint(param="nope"), hint(exp_avg_sq="w"), hint(), hint()]
    assert round_trip(prev, cur, metas, hints)[0] == cur


def test_real_torch_adamw_states_shrink_several_times_over_plain_xor() -> None:
    torch = pytest.importorskip("torch", reason="the accuracy check needs torch's AdamW")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4096) * 0.02)
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.1, foreach=False)
    metas = layout(4096)

    def step_and_capture() -> bytes:
        w.grad = torch.randn(4096) * 0.01
        opt.step()
        s = opt.state[w]
        parts = [w.detach(), s["exp_avg"], s["exp_avg_sq"], torch.zeros(4096)]
        return b"".join(t.numpy().tobytes() for t in parts)

    for _ in range(3):
        prev = step_and_capture()
    cur = step_and_capture()
    step = int(opt.state[w]["step"])
    decoded, predicted = round_trip(prev, cur, metas, [hint(step=step)])
    assert decoded == cur
    _, plain = round_trip(prev, cur, metas, [])
    assert predicted < plain / 2


def test_chunks_written_before_one_nan_still_decode() -> None:
    # ADAM_PREDICTED_XOR_ZSTD (5) predicted NaNs with numpy's payloads; a step stored by
    # an older daemon decodes with that prediction, not V2's one NaN.
    rng = np.random.default_rng(3)
    n = 256
    metas = layout(n)
    prev = rng.integers(0, 2**32, 4 * n, dtype=np.uint64).astype(np.uint32)
    prev[::7] = 0x7FC00000 | rng.integers(1, 2**22, prev[::7].size).astype(np.uint32)
    cur = prev ^ np.where(np.arange(4 * n) % 5 == 0, 0x7F812345, 0).astype(np.uint32)
    prev_u8, cur_u8 = prev.view(np.uint8), cur.view(np.uint8)
    h = hint()
    old_ref = prev_u8.copy()  # what the older daemon XORed against
    f32 = {m.name: slice(m.offset, m.offset + m.nbytes) for m in metas}
    as_f32 = lambda buf, name: buf[f32[name]].view(np.float32)  # noqa: E731
    predict.predict_second_moment(as_f32(prev_u8, "w/exp_avg_sq"), as_f32(prev_u8, "w/exp_avg"),
                                  as_f32(cur_u8, "w/exp_avg"), h, one_nan=False,
                                  out=as_f32(old_ref, "w/exp_avg_sq"))
    predict.predict_param(as_f32(prev_u8, "w"), as_f32(cur_u8, "w/exp_avg"),
                          as_f32(cur_u8, "w/exp_avg_sq"), h, one_nan=False,
                          out=as_f32(old_ref, "w"))
    assert not np.array_equal(old_ref, predict.reference(prev_u8, cur_u8, metas, [h])), \
        "the case must tell the two predictions apart"
    encoded = encode_rank(2, 0, cur_u8, metas, chunk_bytes=1024, reference=prev_u8,
                          reference_step=1, adamw=[h])
    payloads = []
    for c in encoded.chunks:
        regions = RegionIndex(metas).regions(c.offset, c.size)
        payloads.append(codecs.encode_xor(cur_u8[c.offset:c.offset + c.size],
                                          old_ref[c.offset:c.offset + c.size], regions))
        c.codec = manifest_pb2.ADAM_PREDICTED_XOR_ZSTD
    record = manifest_pb2.RankState(tensors=metas, chunks=encoded.chunks,
                                    total_bytes=cur_u8.size, adamw=[h])
    assert decode_rank(record, payloads, {1: prev_u8}).tobytes() == cur_u8.tobytes()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 200), st.data())
def test_a_range_of_the_reference_has_the_bits_of_the_whole_ones(n, data) -> None:
    """The encoder predicts chunk by chunk, chunks cut anywhere between elements: each
    range must equal the same range of the reference made over the whole buffer."""
    rng = np.random.default_rng(n)
    metas = layout(n)
    prev = rng.standard_normal(4 * n, dtype=np.float32).view(np.uint8)
    cur = rng.standard_normal(4 * n, dtype=np.float32).view(np.uint8)
    cur[::97] = 0xFF  # NaNs among them
    whole = predict.reference(prev, cur, metas, [hint()])
    assert not np.array_equal(whole, prev)  # the prediction replaced something
    ref = predict.Reference(prev, cur, metas, [hint()])
    lo = 4 * data.draw(st.integers(0, 4 * n - 1))
    hi = 4 * data.draw(st.integers(lo // 4 + 1, 4 * n))
    assert ref.piece(lo, hi - lo).tobytes() == whole[lo:hi].tobytes()


def test_an_empty_hinted_tensor_at_the_offset_of_the_next_does_not_hide_it() -> None:
    """describe() gives an empty tensor the offset of the tensor after it: a chunk that
    starts there must still predict that tensor (a weight-decay split of parameter
    groups orders an empty parameter's hint after its neighbour's)."""
    rng = np.random.default_rng(5)
    n = 64
    metas = layout(n)
    metas += [common_pb2.TensorMeta(name=name, dtype=F32, shape=[0], nbytes=0, offset=0)
              for name in ("z", "z/exp_avg", "z/exp_avg_sq")]
    prev = rng.standard_normal(16 * n, dtype=np.float32).view(np.uint8).tobytes()
    cur = rng.standard_normal(16 * n, dtype=np.float32).view(np.uint8).tobytes()
    hints = [hint(), hint(param="z", exp_avg="z/exp_avg", exp_avg_sq="z/exp_avg_sq")]
    whole = predict.reference(np.frombuffer(prev, np.uint8), np.frombuffer(cur, np.uint8),
                              metas, hints)
    assert not np.array_equal(whole[:4 * n], np.frombuffer(prev, np.uint8)[:4 * n])
    assert round_trip(prev, cur, metas, hints)[0] == cur
