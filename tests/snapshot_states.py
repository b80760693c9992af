"""Synthetic rank states for snapshot tests: deterministic per (step, rank), torch-free.

Each state mixes fp32 "parameters" that drift a little per step, bf16 bit patterns,
an int64 counter and an odd-sized byte blob, packed with 8-byte alignment.
"""

from __future__ import annotations

import numpy as np

from stalwart.core.manifest import build_manifest
from stalwart.core.step_record import split
from stalwart.v1 import common_pb2

SPECS = [("w", common_pb2.FLOAT32, (64, 96)), ("b", common_pb2.BFLOAT16, (333,)),
         ("step", common_pb2.INT64, (1,)), ("exp_avg", common_pb2.FLOAT32, (5000,)),
         ("rng", common_pb2.UINT8, (77,))]
NP = {common_pb2.FLOAT32: np.float32, common_pb2.BFLOAT16: np.uint16,
      common_pb2.INT64: np.int64, common_pb2.UINT8: np.uint8}


def tensors(scale: int = 1) -> list[common_pb2.TensorMeta]:
    out, offset = [], 0
    for name, dtype, shape in SPECS:
        shape = (shape[0] * scale, *shape[1:])
        nbytes = int(np.prod(shape)) * np.dtype(NP[dtype]).itemsize
        out.append(common_pb2.TensorMeta(name=name, dtype=dtype, shape=shape, nbytes=nbytes,
                                         offset=offset, layer=-1))
        offset += -(-nbytes // 8) * 8
    return out


def state(step: int, rank: int = 0, scale: int = 1) -> bytes:
    """The buffer of (step, rank): a random start plus `step` small deterministic updates."""
    metas = tensors(scale)
    buf = np.zeros(metas[-1].offset + metas[-1].nbytes, dtype=np.uint8)
    for t in metas:
        rng = np.random.default_rng([rank, len(t.name)])
        n = int(np.prod(t.shape))
        if t.dtype == common_pb2.FLOAT32:
            v = rng.standard_normal(n).astype(np.float32)
            drift = np.random.default_rng([rank, step]).standard_normal(n).astype(np.float32)
            v = v + np.float32(1e-3) * step * drift
        elif t.dtype == common_pb2.INT64:
            v = np.full(n, step, dtype=np.int64)
        else:
            v = rng.integers(0, 256, n * np.dtype(NP[t.dtype]).itemsize, dtype=np.uint8)
            v[: step % 50] ^= 0xFF
        buf[t.offset:t.offset + t.nbytes] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    return buf.tobytes()


def commit_step(store, step: int, world: int = 1, scale: int = 1, owned: bool = False):
    """Encode, prepare and commit `step` for ranks 0..world-1; returns the manifest.
    `owned`: hand the states over as a capture slot's bytes are (the store copies them
    into buffers of its own, writable), not as immutable bytes."""
    layout = common_pb2.ParallelLayout(dp=world, pp=1, tp=1)
    ranks = []
    for rank in range(world):
        coord = common_pb2.RankCoord(rank=rank, dp=rank)
        data = state(step, rank, scale)
        prepared = store.encode(step, rank, bytearray(data) if owned else data,
                                tensors(scale), coord=coord)
        ranks.append(store.prepare(step, prepared))
    manifest = build_manifest(job_id=store.job_id, step=step, generation=1, layout=layout,
                              ranks=ranks)
    store.commit(split(manifest))
    return manifest
