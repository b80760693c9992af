"""AdamW-aware references that make lossless deltas of parameters and second moments tiny.

Given the previous step and this step's first moment, the AdamW update of the second
moment and of the parameter is recomputed here in float32, mirroring torch's
single-tensor AdamW; the codec stores only the XOR against that prediction, which is
mostly zero. A prediction that misses (other optimizer, fused kernel, wrong hint) only
costs compression: decoding recomputes the same prediction and XORs it back out.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from stalwart.daemon.snapshot import codecs
from stalwart.v1 import common_pb2, manifest_pb2


@dataclass(frozen=True)
class _Triple:
    hint: manifest_pb2.AdamWHint
    param: common_pb2.TensorMeta
    exp_avg: common_pb2.TensorMeta
    exp_avg_sq: common_pb2.TensorMeta


def _triples(tensors: Sequence[common_pb2.TensorMeta],
             hints: Sequence[manifest_pb2.AdamWHint]) -> list[_Triple]:
    """Hints whose three tensors exist, are float32 and have equal sizes; others are ignored
    (they would predict nothing useful, and ignoring them keeps decoding well defined)."""
    by_name = {t.name: t for t in tensors}
    out, used = [], set()
    for h in hints:
        names = (h.param, h.exp_avg, h.exp_avg_sq)
        metas = [by_name.get(n) for n in names]
        if all(m is not None and m.dtype == common_pb2.FLOAT32 for m in metas) and \
                len({m.nbytes for m in metas}) == 1 and h.step > 0 and \
                len(set(names)) == 3 and not used & set(names) and _scalars(h) is not None:
            used.update(names)  # a tensor predicted twice would not decode
            out.append(_Triple(h, *metas))
    return out


def _scalars(h: manifest_pb2.AdamWHint) -> tuple[float, float] | None:
    """(step size, sqrt of the second bias correction) in torch's double arithmetic, or
    None for hyperparameters no real AdamW step has (the hint is then ignored)."""
    try:
        bc2_sqrt = (1 - h.beta2 ** h.step) ** 0.5
        step_size = h.lr / (1 - h.beta1 ** h.step)
    except (ZeroDivisionError, OverflowError):
        return None
    if isinstance(bc2_sqrt, complex) or not all(map(math.isfinite, (
            step_size, bc2_sqrt, h.beta1, h.beta2, h.eps, h.weight_decay, h.lr))):
        return None
    return step_size, bc2_sqrt


def _f32(buf: np.ndarray, meta: common_pb2.TensorMeta) -> np.ndarray:
    return buf[meta.offset:meta.offset + meta.nbytes].view(np.float32)


# Both predictions run the same float32 operations in the same order wherever they write
# (a fresh array, or `out` in place) and whichever loops run them (numpy's, or the C of
# `codecs.native`, which returns False for float32 it cannot address aligned): encoder
# and decoder must agree to the bit. `one_nan` (ADAM_PREDICTED_XOR_ZSTD_V2) makes every
# NaN predicted the quiet NaN ONE_NAN; without it (ADAM_PREDICTED_XOR_ZSTD, decode only)
# NaN payloads are those numpy's loops keep, so only numpy's loops may run it.

ONE_NAN = np.uint32(0x7FC00000)


def _require_f32(*arrays: np.ndarray | None) -> None:
    """Predictions are of float32 tensors (`_triples` admits no others); the C loops read
    any bytes as float32, so another dtype is refused here, not reinterpreted."""
    for a in arrays:
        if a is not None and a.dtype != np.float32:
            raise TypeError(f"AdamW predictions take float32 arrays, not {a.dtype}")


def _one_nan(result: np.ndarray) -> np.ndarray:
    result.view(np.uint32)[np.isnan(result)] = ONE_NAN
    return result


def predict_second_moment(v0: np.ndarray, m0: np.ndarray, m1: np.ndarray,
                          h: manifest_pb2.AdamWHint, out: np.ndarray | None = None, *,
                          one_nan: bool = True) -> np.ndarray:
    """exp_avg_sq after the step, from the gradient recovered out of the two first moments:
    v0 * beta2 + ((1 - beta2) * grad) * grad, grad = m0 + (m1 - m0) / (1 - beta1) (m1 is
    lerp(m0, grad, 1 - beta1)). `out` (not an input) receives it."""
    _require_f32(v0, m0, m1, out)
    if one_nan and codecs.native is not None:
        into = np.empty_like(v0) if out is None else out
        if codecs.native.second_moment(v0, m0, m1, into, np.float32(1 - h.beta1),
                                       np.float32(1 - h.beta2), np.float32(h.beta2)):
            return into
    with np.errstate(all="ignore"):
        grad = np.subtract(m1, m0)
        np.divide(grad, np.float32(1 - h.beta1), out=grad)
        np.add(m0, grad, out=grad)
        term = np.multiply(np.float32(1 - h.beta2), grad)
        np.multiply(term, grad, out=term)
        result = np.multiply(v0, np.float32(h.beta2), out=out)
        np.add(result, term, out=result)
    return _one_nan(result) if one_nan else result


def predict_param(p0: np.ndarray, m1: np.ndarray, v1: np.ndarray,
                  h: manifest_pb2.AdamWHint, out: np.ndarray | None = None, *,
                  one_nan: bool = True) -> np.ndarray:
    """The parameter after a torch AdamW step with moments m1, v1 (exact when they are):
    p0 * (1 - lr * wd) + (-step_size) * (m1 / (sqrt(v1) / bc2_sqrt + eps)). `out` (not
    an input) receives it."""
    step_size, bc2_sqrt = _scalars(h)
    _require_f32(p0, m1, v1, out)
    if one_nan and codecs.native is not None:
        into = np.empty_like(p0) if out is None else out
        if codecs.native.param(p0, m1, v1, into, np.float32(bc2_sqrt), np.float32(h.eps),
                               np.float32(-step_size), np.float32(1 - h.lr * h.weight_decay)):
            return into
    with np.errstate(all="ignore"):
        term = np.sqrt(v1)
        np.divide(term, np.float32(bc2_sqrt), out=term)
        np.add(term, np.float32(h.eps), out=term)
        np.divide(m1, term, out=term)
        np.multiply(np.float32(-step_size), term, out=term)
        result = np.multiply(p0, np.float32(1 - h.lr * h.weight_decay), out=out)
        np.add(result, term, out=result)
    return _one_nan(result) if one_nan else result


class Reference:
    """Encoder side: `previous` with hinted params and second moments replaced by their
    predictions from `previous` and `current` (both uint8 buffers of one layout), for
    any byte range. The encoder makes it chunk by chunk, into a chunk-sized scratch of
    the thread encoding the chunk, right before the chunk's XOR reads it: no copy of the
    whole state per capture, and the bytes are still in cache when they are read. The
    predictions are elementwise, so a range gets the bits the whole buffer would."""

    def __init__(self, previous: np.ndarray, current: np.ndarray,
                 tensors: Sequence[common_pb2.TensorMeta],
                 hints: Sequence[manifest_pb2.AdamWHint]) -> None:
        self.previous, self.current = previous, current
        # (where it starts, where it ends, its triple, whether it is the second moment),
        # by offset; empty tensors predict nothing (and, as in chunks.RegionIndex, would
        # share an offset with the next tensor)
        triples = [t for t in _triples(tensors, hints) if t.param.nbytes > 0]
        self._targets = sorted(
            [(m.offset, m.offset + m.nbytes, t, m is t.exp_avg_sq)
             for t in triples for m in (t.exp_avg_sq, t.param)], key=itemgetter(0))
        self._ends = [end for _, end, _, _ in self._targets]

    def piece(self, lo: int, size: int, out: np.ndarray | None = None) -> np.ndarray:
        """Bytes [lo, lo + size) of the reference, in `out` or this thread's scratch
        (valid until the thread's next piece)."""
        out = codecs.scratch(size, np.uint8, "reference") if out is None else out
        np.copyto(out, self.previous[lo:lo + size])
        hi = lo + size
        prev, cur = self.previous, self.current
        for start, end, t, moment in self._targets[bisect.bisect_right(self._ends, lo):]:
            if start >= hi:
                break
            a, b = max(start, lo), min(end, hi)
            # Chunks are cut between elements: the range is whole float32s.
            e = slice((a - start) // 4, (b - start) // 4)
            into = out[a - lo:b - lo].view(np.float32)
            if moment:
                predict_second_moment(_f32(prev, t.exp_avg_sq)[e], _f32(prev, t.exp_avg)[e],
                                      _f32(cur, t.exp_avg)[e], t.hint, out=into)
            else:
                predict_param(_f32(prev, t.param)[e], _f32(cur, t.exp_avg)[e],
                              _f32(cur, t.exp_avg_sq)[e], t.hint, out=into)
        return out


def reference(previous: np.ndarray, current: np.ndarray,
              tensors: Sequence[common_pb2.TensorMeta],
              hints: Sequence[manifest_pb2.AdamWHint]) -> np.ndarray:
    """The whole buffer's `Reference`, in a new array (the encoder makes it by chunks)."""
    return Reference(previous, current, tensors, hints).piece(0, previous.size,
                                                              np.empty_like(previous))


def correct(out: np.ndarray, previous: np.ndarray, tensors: Sequence[common_pb2.TensorMeta],
            hints: Sequence[manifest_pb2.AdamWHint], *, one_nan: bool = True) -> None:
    """Decoder side: `out` holds residual XOR previous everywhere; swap `previous` for the
    prediction in hinted tensors, in place. Second moments first: params need them.
    `one_nan`: False for chunks of ADAM_PREDICTED_XOR_ZSTD, written before V2."""
    triples = _triples(tensors, hints)
    for t in triples:
        v = _f32(out, t.exp_avg_sq)
        predicted = predict_second_moment(
            _f32(previous, t.exp_avg_sq), _f32(previous, t.exp_avg), _f32(out, t.exp_avg), t.hint,
            one_nan=one_nan)
        v.view(np.uint32)[...] ^= _f32(previous, t.exp_avg_sq).view(np.uint32) ^ \
            predicted.view(np.uint32)
    for t in triples:
        p = _f32(out, t.param)
        predicted = predict_param(_f32(previous, t.param), _f32(out, t.exp_avg),
                                  _f32(out, t.exp_avg_sq), t.hint, one_nan=one_nan)
        p.view(np.uint32)[...] ^= _f32(previous, t.param).view(np.uint32) ^ \
            predicted.view(np.uint32)
