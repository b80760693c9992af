"""Flatten a rank's training state into one byte buffer described by TensorMeta.

Tensors are laid out back to back at 64-byte aligned offsets so that every
dtype view is aligned; the same description lets the daemon delta-encode by
element size and lets restore find each tensor again by name.
"""

from __future__ import annotations

import mmap
import operator
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress

import torch

from stalwart.core.manifest import TENSOR_ALIGN as ALIGN
from stalwart.v1 import common_pb2

_DTYPES: dict[torch.dtype, int] = {
    torch.float32: common_pb2.FLOAT32,
    torch.float16: common_pb2.FLOAT16,
    torch.bfloat16: common_pb2.BFLOAT16,
    torch.float64: common_pb2.FLOAT64,
    torch.int64: common_pb2.INT64,
    torch.int32: common_pb2.INT32,
    torch.int16: common_pb2.INT16,
    torch.int8: common_pb2.INT8,
    torch.uint8: common_pb2.UINT8,
    torch.bool: common_pb2.BOOL,
}
_TORCH: dict[int, torch.dtype] = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a rank's state, with where it sits in the global model."""

    name: str
    tensor: torch.Tensor
    layer: int = -1
    global_shape: tuple[int, ...] | None = None  # None: not a TP shard
    offsets: tuple[int, ...] | None = None
    staged: bool = False
    """Copied at the capture itself, on the training thread, not beside the next step:
    it may change before the next optimizer.step() (a module buffer such as BatchNorm's
    running statistics, which the next forward updates in place)."""


def _place(st: StateTensor) -> tuple[object, ...]:
    return (st.name, st.tensor.dtype, st.tensor.shape, st.layer, st.global_shape, st.offsets)


def same_layout(now: Sequence[StateTensor], last: Sequence[StateTensor]) -> bool:
    """Whether `now` lays out as `last` did (names, dtypes, shapes and places, in order).

    A step's state is mostly the very StateTensors of the last (a StateRegistry keeps
    those of unchanged tensors), and one that is the same object lays out the same: only
    the others are compared field by field, which for every tensor cost a small model's
    training thread tens of microseconds a step. (A tensor resized in place would go
    unnoticed; no optimizer resizes its state.)"""
    if len(now) != len(last):
        return False
    other = compress(range(len(now)), map(operator.is_not, now, last))
    return all(_place(now[i]) == _place(last[i]) for i in other)


def dtype_to_proto(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"cannot snapshot tensors of dtype {dtype}") from None


def proto_to_dtype(code: int) -> torch.dtype:
    try:
        return _TORCH[code]
    except KeyError:
        raise ValueError(f"unknown dtype code {code} in a manifest") from None


def describe(tensors: Sequence[StateTensor]) -> tuple[list[common_pb2.TensorMeta], int]:
    """Assign aligned offsets; return the metadata and the total size in bytes."""
    metas, offset, seen = [], 0, set()
    for st in tensors:
        if st.name in seen:
            raise ValueError(f"state tensor name {st.name!r} appears twice")
        seen.add(st.name)
        t = st.tensor
        nbytes = t.numel() * t.element_size()
        metas.append(common_pb2.TensorMeta(
            name=st.name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape),
            global_shape=list(st.global_shape or t.shape),
            offsets=list(st.offsets or [0] * t.dim()),
            layer=st.layer, nbytes=nbytes, offset=offset))
        offset += -(-nbytes // ALIGN) * ALIGN
    return metas, offset


def byte_view(buffer: torch.Tensor, meta: common_pb2.TensorMeta) -> torch.Tensor:
    """The region of a uint8 buffer that holds one tensor, viewed with its dtype and shape."""
    region = buffer[meta.offset: meta.offset + meta.nbytes]
    return region.view(proto_to_dtype(meta.dtype)).view(tuple(meta.shape))


def copy_into(views: Sequence[torch.Tensor], tensors: Iterable[StateTensor],
              non_blocking: bool = False) -> None:
    """Copy every tensor into its view of a state buffer (`byte_view`s, in order).

    One call for all of them: the GIL is let go once for the whole copy, not once per
    tensor, so a copy on a capture thread does not trade the GIL with the training
    thread a few hundred times a step."""
    sources = [st.tensor for st in tensors]
    if len(sources) != len(views):
        raise ValueError(f"{len(sources)} tensors for {len(views)} views of the buffer")
    if sources:
        with torch.no_grad():
            torch._foreach_copy_(list(views), sources, non_blocking=non_blocking)


def pack_into(buffer: torch.Tensor, tensors: Iterable[StateTensor],
              metas: Sequence[common_pb2.TensorMeta], non_blocking: bool = False) -> None:
    """Copy every tensor into its region of `buffer` (a uint8 CPU tensor)."""
    copy_into([byte_view(buffer, m) for m in metas], tensors, non_blocking)


def unpack(data: bytes | bytearray | memoryview | mmap.mmap,
           metas: Sequence[common_pb2.TensorMeta]) -> dict[str, torch.Tensor]:
    """Tensors by name, each copied straight out of a state buffer into memory of its own
    (bitwise as captured): a restore's buffer (a mapped slot, a bytearray) can be let go
    once this returns, and APIs that want a tensor of their own (set_rng_state) get one."""
    if not len(data):
        return {m.name: byte_view(torch.empty(0, dtype=torch.uint8), m) for m in metas}
    with warnings.catch_warnings():  # a read-only buffer: it is only read, to be cloned
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        buf = torch.frombuffer(data, dtype=torch.uint8)
    return {m.name: byte_view(buf, m).clone() for m in metas}
