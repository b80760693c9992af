"""Manifest logic: digest, structural validation, restore chains and retention sets."""

from __future__ import annotations

import pytest

from stalwart.core import manifest as mf
from stalwart.v1 import common_pb2, manifest_pb2

F32 = common_pb2.FLOAT32


def rank_state(rank: int, step: int, base_step: int, coord=None) -> manifest_pb2.RankState:
    codec = manifest_pb2.ZSTD if base_step == step else manifest_pb2.XOR_DELTA_ZSTD
    tensors = [common_pb2.TensorMeta(name="w", dtype=F32, shape=[4, 8], nbytes=128, offset=0),
               common_pb2.TensorMeta(name="b", dtype=F32, shape=[8], nbytes=32, offset=128)]
    chunks = [manifest_pb2.ChunkRecord(chunk_id=f"s{step}-r{rank}-c{i}", offset=off, size=80,
                                       codec=codec, base_step=base_step)
              for i, off in enumerate((0, 80))]
    return manifest_pb2.RankState(rank=rank, coord=coord or common_pb2.RankCoord(rank=rank),
                                  tensors=tensors, chunks=chunks, total_bytes=160)


def manifest(step: int, base_step: int | None = None, dp: int = 2, pp: int = 1,
             tp: int = 1) -> manifest_pb2.Manifest:
    base_step = step if base_step is None else base_step
    coords = [(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
    ranks = [rank_state(i, step, base_step, common_pb2.RankCoord(rank=i, dp=d, pp=p, tp=t))
             for i, (d, p, t) in enumerate(coords)]
    return mf.build_manifest(job_id="j", step=step, generation=1,
                             layout=common_pb2.ParallelLayout(dp=dp, pp=pp, tp=tp), ranks=ranks,
                             created_unix_ms=1)


def test_a_built_manifest_is_valid_and_its_digest_verifies() -> None:
    m = manifest(3, dp=1, pp=2, tp=2)
    mf.validate(m)
    mf.verify_digest(m)
    assert len(m.digest) == 32 and m.base_step == 3


def test_any_change_after_sealing_fails_the_digest() -> None:
    m = manifest(3)
    m.ranks[1].chunks[0].crc32c ^= 1
    with pytest.raises(mf.ManifestError, match="step 3 fails its sha256"):
        mf.verify_digest(m)


def test_digest_ignores_the_digest_field_and_is_stable_across_serialisation() -> None:
    m = manifest(4)
    again = manifest_pb2.Manifest.FromString(m.SerializeToString())
    assert mf.digest(again) == m.digest == mf.digest(m)


def test_base_step_defaults_to_the_oldest_base_named_by_a_chunk() -> None:
    assert manifest(7, base_step=5).base_step == 5


@pytest.mark.parametrize("breakage, message", [
    (lambda m: m.ranks.pop(), "missing \\[1\\]"),
    (lambda m: setattr(m.ranks[1].coord, "dp", 0), "share a"),
    (lambda m: setattr(m.ranks[0].coord, "tp", 3), "outside the layout"),
    (lambda m: setattr(m.ranks[0].chunks[1], "offset", 90), "gap or overlap"),
    (lambda m: setattr(m.ranks[0], "total_bytes", 200), "cover 160 of 200"),
    (lambda m: setattr(m.ranks[0].tensors[1], "offset", 100), "overlap"),
    (lambda m: setattr(m.ranks[0].tensors[0], "nbytes", 100), "needs 128"),
    (lambda m: setattr(m.ranks[0].chunks[0], "codec", 0), "no codec"),
    (lambda m: setattr(m.ranks[0].chunks[0], "base_step", 2), "base chunk"),
    (lambda m: setattr(m, "format_version", 9), "upgrade"),
])
def test_validate_names_structural_problems(breakage, message) -> None:
    m = manifest(3)
    breakage(m)
    with pytest.raises(mf.ManifestError, match=message):
        mf.validate(m)


def test_a_delta_must_apply_to_an_earlier_step() -> None:
    with pytest.raises(mf.ManifestError, match="not an earlier one"):
        mf.validate(manifest(3, base_step=4))


def test_plan_chain_follows_deltas_back_to_the_base() -> None:
    ms = {1: manifest(1), 2: manifest(2, 1), 3: manifest(3, 2), 4: manifest(4), 5: manifest(5, 4)}
    assert mf.plan_chain(ms, 3) == [1, 2, 3]
    assert mf.plan_chain(ms, 4) == [4]
    assert mf.plan_chain(ms, 5) == [4, 5]


def test_plan_chain_names_the_missing_link() -> None:
    ms = {1: manifest(1), 3: manifest(3, 2)}
    with pytest.raises(mf.ManifestError, match="needs step 2"):
        mf.plan_chain(ms, 3)


def test_retained_steps_keep_the_newest_and_their_bases() -> None:
    ms = {1: manifest(1), 2: manifest(2, 1), 3: manifest(3, 1), 4: manifest(4),
          5: manifest(5, 4), 6: manifest(6, 5)}
    assert mf.retained_steps(ms, 1) == {4, 5, 6}
    assert mf.retained_steps(ms, 3) == {4, 5, 6}
    assert mf.retained_steps(ms, 4) == {1, 3, 4, 5, 6}
    assert mf.retained_steps(ms, 0) == set()


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(mf.ManifestError, match="unknown dtype 99"):
        mf.element_size(99)
