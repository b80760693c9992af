"""A restore of some layers of a rank's state (what a rank needs after a re-plan moved
layers to it): the tensors of those layers and of no layer, bitwise as a whole restore
gives them, read from fewer chunks, along base/delta chains with AdamW-predicted deltas."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stalwart.core.manifest import build_manifest
from stalwart.core.step_record import split
from stalwart.daemon.snapshot import selection
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.predict import predict_param, predict_second_moment
from stalwart.daemon.snapshot.selection import Layers
from stalwart.v1 import common_pb2, manifest_pb2

LAYERS, N = 6, 300  # float32 elements per parameter: a chunk of 1 KiB splits them
HINT = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _metas() -> list[common_pb2.TensorMeta]:
    """Parameters first, then their moments, then an RNG state: a layout that puts a
    parameter's moments in other chunks than the parameter, as the trainer's does."""
    names = ([(f"model/l{i}.w", i) for i in range(LAYERS)]
             + [(f"optim/l{i}.w/{m}", i) for i in range(LAYERS)
                for m in ("exp_avg", "exp_avg_sq")])
    metas, at = [], 0
    for name, layer in names:
        metas.append(common_pb2.TensorMeta(name=name, dtype=common_pb2.FLOAT32, shape=[N],
                                           layer=layer, nbytes=4 * N, offset=at))
        at += 4 * N
    metas.append(common_pb2.TensorMeta(name="rng/torch", dtype=common_pb2.UINT8, shape=[40],
                                       layer=-1, nbytes=40, offset=at))
    return metas


def _f32(buf: np.ndarray, meta: common_pb2.TensorMeta) -> np.ndarray:
    return buf[meta.offset:meta.offset + meta.nbytes].view(np.float32)


def _train(store: LocalStore, steps: int) -> dict[int, bytes]:
    """Commit `steps` AdamW steps whose predictions hit exactly; the states by step."""
    metas = _metas()
    by = {m.name: m for m in metas}
    rng = np.random.default_rng(0)
    buf = np.zeros(metas[-1].offset + metas[-1].nbytes, dtype=np.uint8)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    for i in range(LAYERS):  # finite starting values
        for name in (f"model/l{i}.w", f"optim/l{i}.w/exp_avg"):
            _f32(buf, by[name])[:] = rng.standard_normal(N)
        _f32(buf, by[f"optim/l{i}.w/exp_avg_sq"])[:] = rng.random(N)
    out = {}
    for step in range(1, steps + 1):
        prev, hints = buf.copy(), []
        for i in range(LAYERS):
            p, m, v = f"model/l{i}.w", f"optim/l{i}.w/exp_avg", f"optim/l{i}.w/exp_avg_sq"
            h = manifest_pb2.AdamWHint(param=p, exp_avg=m, exp_avg_sq=v, step=step, **HINT)
            _f32(buf, by[m])[:] += np.float32(0.01) * rng.standard_normal(N).astype(np.float32)
            _f32(buf, by[v])[:] = predict_second_moment(_f32(prev, by[v]), _f32(prev, by[m]),
                                                        _f32(buf, by[m]), h)
            _f32(buf, by[p])[:] = predict_param(_f32(prev, by[p]), _f32(buf, by[m]),
                                                _f32(buf, by[v]), h)
            hints.append(h)
        buf[-40:] = rng.integers(0, 256, 40, dtype=np.uint8)
        prepared = store.encode(step, 0, buf.tobytes(), metas, adamw=hints)
        record = store.prepare(step, prepared)
        store.commit(split(build_manifest(
            job_id=store.job_id, step=step, generation=1,
            layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1), ranks=[record])))
        out[step] = buf.tobytes()
    return out


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, dict[int, bytes]]:
    store = LocalStore(tmp_path, base_every=4, retain=20, chunk_bytes=1024)
    states = _train(store, 7)
    codecs = {c.codec for s in store.committed_steps()
              for c in store.rank_record(s, 0).chunks}
    assert manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2 in codecs  # the predicted path is covered
    return tmp_path, states


def test_a_layer_range_whose_first_is_after_its_last_is_refused() -> None:
    with pytest.raises(ValueError, match="the first is after the last"):
        Layers(4, 2)


@pytest.mark.parametrize(("first", "last"), [(0, 0), (2, 3), (5, 5), (0, 5)])
def test_a_layer_range_restores_its_tensors_bitwise_from_fewer_chunks(
        trained, first: int, last: int) -> None:
    folder, states = trained
    for step in (5, 7):  # a base, and the end of a chain of deltas
        whole_reads = _reads(folder, lambda store, s=step: store.read_rank(s, 0))
        part_reads = _reads(folder, lambda store, s=step: store.read_layers(
            s, 0, Layers(first, last)))
        record, data = LocalStore(folder, chunk_bytes=1024).read_layers(step, 0,
                                                                      Layers(first, last))
        whole = np.frombuffer(states[step], dtype=np.uint8)
        want = [m for m in _metas() if m.layer < 0 or first <= m.layer <= last]
        assert [t.name for t in record.tensors] == [m.name for m in want]
        assert record.total_bytes == len(data) >= sum(m.nbytes for m in want)
        for got, meta in zip(record.tensors, want, strict=True):
            assert data[got.offset:got.offset + got.nbytes] == \
                whole[meta.offset:meta.offset + meta.nbytes].tobytes(), meta.name
        assert not record.chunks
        if (first, last) == (0, LAYERS - 1):
            assert part_reads == whole_reads
        else:  # the chunks of the other layers are never read, in any step of the chain
            assert part_reads < whole_reads
            assert len(part_reads) / len(whole_reads) < (last - first + 2) / LAYERS


def _reads(folder: Path, read) -> set[str]:
    """Chunks `read(store)` reads on a cold store (every one from disk)."""
    store = LocalStore(folder, chunk_bytes=1024)
    seen: set[str] = set()
    original = store.reader._read_or_fetch

    def counted(step, rank, index, chunk, fetch):
        seen.add(chunk.chunk_id)
        return original(step, rank, index, chunk, fetch)

    store.reader._read_or_fetch = counted
    read(store)
    return seen


def test_the_closure_takes_in_a_parameters_moments_and_its_chunk_mates() -> None:
    metas = _metas()
    state = manifest_pb2.RankState(tensors=metas, total_bytes=metas[-1].offset + 40)
    # Two chunks: [0, 2 params + a bit) and the rest.
    state.chunks.add(offset=0, size=4 * N * 2 + 4)
    state.chunks.add(offset=4 * N * 2 + 4, size=state.total_bytes - (4 * N * 2 + 4))
    state.adamw.add(param="model/l0.w", exp_avg="optim/l0.w/exp_avg",
                    exp_avg_sq="optim/l0.w/exp_avg_sq")
    got = selection.closure([state], {"model/l0.w"})
    # l0.w's chunk holds l1.w and a bit of l2.w, whose chunk holds everything else.
    assert got == {m.name for m in metas}
    lone = manifest_pb2.RankState(tensors=metas, total_bytes=state.total_bytes)
    at = 0
    for m in metas:  # one chunk per tensor, no hints: nothing is dragged in
        lone.chunks.add(offset=at, size=m.nbytes)
        at += m.nbytes
    assert selection.closure([lone], {"model/l3.w"}) == {"model/l3.w"}
    assert selection.chunk_positions(lone, {"model/l3.w"}) == [3]
