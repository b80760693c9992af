"""Reading a rank's state back (`chain_reader`): from the RAM tier, the disk or erasure
shards, what is kept whole where, the fetch-ahead's bound and failures, and corruption
found and named or read around."""

from __future__ import annotations

from pathlib import Path

import pytest
from snapshot_states import commit_step, state, tensors

from stalwart.core.manifest import build_manifest
from stalwart.core.step_record import split
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.chain_reader import CorruptChunkError
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.selection import Layers
from stalwart.v1 import common_pb2, manifest_pb2

SMALL = dict(chunk_bytes=8192)


def _placed(step: int, store: LocalStore) -> tuple:
    """Rank 0 of `step` encoded, and its record once two holders took shards of chunk 0."""
    prepared = store.encode(step, 0, state(step), tensors())
    placed = manifest_pb2.RankState()
    placed.CopyFrom(prepared.state)
    placed.chunks[0].shards.add(index=0, node="peer-a", location="x.0")
    placed.chunks[0].shards.add(index=1, node="peer-b", location="x.1")
    return prepared, placed


@pytest.mark.parametrize("local_copy", [False, True])
def test_a_chunk_its_shards_keep_is_written_whole_only_with_local_copy(
        tmp_path: Path, local_copy: bool) -> None:
    store = LocalStore(tmp_path, local_copy=local_copy, **SMALL)
    prepared, placed = _placed(1, store)
    record = store.prepare(1, prepared, placed)
    assert record.chunks[0].shards  # the record that names the holders is kept
    assert store.chunk_path(1, 0, 0).exists() == local_copy
    assert all(store.chunk_path(1, 0, i).exists() for i in range(1, len(record.chunks)))
    store.commit(split(build_manifest(job_id=store.job_id, step=1, generation=1,
                                      layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                                      ranks=[record])))
    assert store.read_rank(1, 0) == state(1)  # the RAM tier holds every chunk
    cold = LocalStore(tmp_path, local_copy=local_copy, **SMALL)
    if local_copy:
        assert cold.read_rank(1, 0) == state(1)
    else:  # with memory gone, the chunk comes from its shards
        whole = prepared.payloads[0]
        assert cold.read_rank(1, 0, fetch=lambda c: whole) == state(1)
        with pytest.raises(CorruptChunkError, match="is missing"):  # and nowhere else
            LocalStore(tmp_path, **SMALL).read_rank(1, 0)


def _sharded_everywhere(tmp_path: Path) -> tuple[dict[str, bytes], int]:
    """Step 1 of rank 0 committed with every chunk kept as shards alone; its encoded
    payloads by chunk id, and the chunk count."""
    store = LocalStore(tmp_path, **SMALL)
    prepared = store.encode(1, 0, state(1), tensors())
    placed = manifest_pb2.RankState()
    placed.CopyFrom(prepared.state)
    for c in placed.chunks:
        c.shards.add(index=0, node="peer-a", location=f"{c.chunk_id}.0")
    record = store.prepare(1, prepared, placed)
    store.commit(split(build_manifest(job_id=store.job_id, step=1, generation=1,
                                      layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                                      ranks=[record])))
    assert not list(tmp_path.rglob("*.chunk"))
    return ({c.chunk_id: p for c, p in zip(record.chunks, prepared.payloads, strict=True)},
            len(record.chunks))


def test_a_read_from_shards_fetches_ahead_only_up_to_its_byte_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.daemon.snapshot import chain_reader

    payloads, count = _sharded_everywhere(tmp_path)
    assert count >= 4
    smallest_two = sum(sorted(map(len, payloads.values()))[:2])
    biggest = max(map(len, payloads.values()))
    monkeypatch.setattr(chain_reader, "PREFETCH_BYTES", smallest_two + biggest)
    ahead, at_decode = [], []
    reader = LocalStore(tmp_path, **SMALL)  # cold: no RAM tier, no chunk on disk
    original = reader.reader._decode_rank

    def decode(*args, **kwargs):
        at_decode.append(len(ahead))  # what had been fetched when decoding began
        return original(*args, **kwargs)

    reader.reader._decode_rank = decode

    def fetch(c: manifest_pb2.ChunkRecord) -> bytes:
        ahead.append(c.chunk_id)
        return payloads[c.chunk_id]

    assert reader.read_rank(1, 0, fetch=fetch) == state(1)
    assert 2 <= at_decode[0] < count  # some fetched ahead, not the whole rank
    assert sorted(ahead) == sorted(payloads)  # the rest as it was decoded, each once


def test_a_failed_fetch_ahead_cancels_the_fetches_not_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from stalwart.daemon.snapshot import chain_reader

    payloads, count = _sharded_everywhere(tmp_path)
    threads = 2
    monkeypatch.setattr(chain_reader, "PREFETCH_THREADS", threads)
    release = threading.Event()  # the slow fetches end once the pool was shut down

    class Pool(chain_reader.ThreadPoolExecutor):
        def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
            super().shutdown(wait=False, cancel_futures=cancel_futures)
            release.set()
            super().shutdown(wait=wait)

    monkeypatch.setattr(chain_reader, "ThreadPoolExecutor", Pool)
    first, calls = next(iter(payloads)), []

    def fetch(c: manifest_pb2.ChunkRecord) -> bytes:
        calls.append(c.chunk_id)
        if c.chunk_id != first:
            assert release.wait(60), "the pool was never shut down"
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        LocalStore(tmp_path, **SMALL).read_rank(1, 0, fetch=fetch)
    # Every fetch but the first waits for the shutdown, so each thread took at most one
    # more after it: none of the others ran.
    assert len(calls) <= threads + 1 < count


def test_flipped_bit_on_disk_is_detected_and_named(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    manifest = commit_step(store, 1)
    target = store.chunk_path(1, 0, 2)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError) as err:
        LocalStore(tmp_path, **SMALL).read_rank(1, 0)
    chunk = manifest.ranks[0].chunks[2].chunk_id
    assert (err.value.step, err.value.rank, err.value.chunk_id, err.value.tier) == \
        (1, 0, chunk, "disk")
    assert f"step 1 rank 0 chunk {chunk} in tier 'disk'" in str(err.value)


def test_corrupt_base_is_named_when_reading_a_later_delta(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, retain=20, **SMALL)
    for step in (1, 2, 3):
        commit_step(store, step)
    target = store.chunk_path(1, 0, 0)
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0x01
    target.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match="step 1 rank 0 chunk s1-r0-c0"):
        LocalStore(tmp_path, **SMALL).read_rank(3, 0)


def test_corrupt_ram_copy_is_read_around_from_disk(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    commit_step(store, 1)
    commit_step(store, 2)  # step 1 is no longer held decoded: its chunks are read
    key = (1, 0, 0)
    good = store.ram.get(key)
    store.ram.drop(key)
    store.ram.put(key, b"\x00" * len(good))
    assert store.read_rank(1, 0) == state(1)


def _forget_chunks(store: LocalStore, steps: range) -> None:
    """Every encoded chunk of `steps` gone from the RAM tier and the disk."""
    for step in steps:
        for index in range(len(store.rank_record(step, 0).chunks)):
            store.ram.drop((step, 0, index))
            store.chunk_path(step, 0, index).unlink()


def test_the_newest_committed_capture_restores_without_reading_a_chunk(
        tmp_path: Path) -> None:
    """What a restore after a failure asks for, the rank's newest committed step, comes
    from the decoded buffer its daemon keeps as the next delta's reference: no chunk of
    the chain is read or decoded. An older step still needs its chain."""
    store = LocalStore(tmp_path, **SMALL)
    for step in (1, 2, 3):
        commit_step(store, step)
    whole = LocalStore(tmp_path, **SMALL).read_layers(3, 0, Layers(0, 0))  # from the chain
    _forget_chunks(store, range(1, 4))
    assert store.read_rank(3, 0) == state(3)
    assert store.read_layers(3, 0, Layers(0, 0)) == whole
    with pytest.raises(CorruptChunkError, match="is missing"):
        store.read_rank(2, 0)


def test_a_held_buffer_that_fails_its_checksums_is_read_around_from_the_chain(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    for step in (1, 2):
        commit_step(store, step, owned=True)
    held = store.decoded(2, 0)
    assert held is not None
    held[len(held) // 2] ^= 0x10  # a bit flipped in the daemon's memory
    assert store.read_rank(2, 0) == state(2)
    _forget_chunks(store, range(1, 3))
    with pytest.raises(CorruptChunkError, match="is missing"):  # it was not used
        store.read_rank(2, 0)


def _layered() -> list[common_pb2.TensorMeta]:
    """The synthetic state's tensors on two layers, "step" and "rng" on none."""
    metas = tensors()
    for meta in metas:
        meta.layer = {"w": 0, "b": 0, "exp_avg": 1}.get(meta.name, -1)
        if meta.layer >= 0:
            meta.name = f"model/{meta.name}"
    return metas


def _two_daemons(tmp_path: Path, steps: range) -> tuple[LocalStore, LocalStore]:
    """Daemon a captured rank 0's steps and committed them; daemon b committed the same
    steps holding none of rank 0's records or chunks (a spare's daemon on another node)."""
    a = LocalStore(tmp_path / "a", **SMALL)
    b = LocalStore(tmp_path / "b", metrics=Metrics(), **SMALL)
    for step in steps:
        prepared = a.encode(step, 0, state(step), _layered(), node="a")
        record = split(build_manifest(job_id=a.job_id, step=step, generation=1,
                                      layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                                      ranks=[a.prepare(step, prepared)]))
        a.commit(record)
        b.commit(record, local_node="b")
    return a, b


def test_a_step_held_by_the_daemon_that_captured_it_restores_elsewhere_from_it(
        tmp_path: Path) -> None:
    # A spare on daemon b replaces rank 0, whose daemon a lives: b reads the newest
    # committed step decoded from a (the chunks a read wants, not the chain), checked
    # against the record's CRC32Cs; b holds no chunk and has no shards to fetch.
    a, b = _two_daemons(tmp_path, range(1, 4))
    asked: list[tuple[str, int, int, list[int]]] = []

    def fetch_records(record, seal):
        return [a.rank_record(record.step, r) for r in seal.ranks]

    def fetch_held(node, step, rank, positions):
        asked.append((node, step, rank, list(positions)))
        regions = a.reader.held_regions(step, rank, positions)
        return None if regions is None else b"".join(regions)

    assert b.read_rank(3, 0, fetch_records=fetch_records, fetch_held=fetch_held) == state(3)
    assert asked == [("a", 3, 0, [])]
    part = b.read_layers(3, 0, Layers(1, 1), fetch_records=fetch_records,
                         fetch_held=fetch_held)
    assert part == a.read_layers(3, 0, Layers(1, 1))
    assert {t.name for t in part[0].tensors} == {"model/exp_avg", "step", "rng"}
    chunks = len(a.rank_record(3, 0).chunks)
    assert 0 < len(asked[1][3]) < chunks  # only the chunks that hold layer 0's tensors
    with pytest.raises(CorruptChunkError, match="is missing"):  # not held: the chain
        b.read_rank(2, 0, fetch_records=fetch_records, fetch_held=fetch_held)


def test_a_held_copy_that_fails_its_checksums_on_the_way_is_read_around(
        tmp_path: Path) -> None:
    a, b = _two_daemons(tmp_path, range(1, 3))

    def fetch_records(record, seal):
        return [a.rank_record(record.step, r) for r in seal.ranks]

    def flipped(node, step, rank, positions):
        data = bytearray(b"".join(a.reader.held_regions(step, rank, positions)))
        data[len(data) // 3] ^= 0x04  # a bit flipped between the daemons
        return bytes(data)

    with pytest.raises(CorruptChunkError, match="is missing"):  # the copy was not used
        b.read_rank(2, 0, fetch_records=fetch_records, fetch_held=flipped)
    assert b.metrics.scrub_errors.labels(tier="peer")._value.get() == 1  # noqa: SLF001
    for step in (1, 2):  # with the chain's chunks at hand, b reads them instead
        for index in range(len(a.rank_record(step, 0).chunks)):
            target = b.chunk_path(step, 0, index)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(a.chunk_path(step, 0, index).read_bytes())
    assert b.read_rank(2, 0, fetch_records=fetch_records, fetch_held=flipped) == state(2)
