"""When stored files reach the disk (`[snapshot] disk_sync`): each write fsynced before it
counts as stored, or written back by the daemon every disk_sync_every_s.

Whether a file's pages are still unwritten is read from the kernel (cachestat(2))."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from fixtures_daemon import DaemonFactory, wait_for
from snapshot_states import commit_step, state

from stalwart.daemon.snapshot.atomic import EACH_WRITE, IN_BACKGROUND, sync_filesystem
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.shard_store import ShardStore

CACHESTAT = 451  # x86_64 and arm64 syscall number, Linux 6.5+
MB = 1 << 20


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def unwritten_pages(path: Path) -> int:
    """Pages of `path` in memory that are not yet on its disk (dirty or being written)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = _Stat()
        if libc.syscall(CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0):
            err = ctypes.get_errno()
            pytest.skip(f"cachestat(2) unavailable ({os.strerror(err)}): nothing here can "
                        "tell a written page from an unwritten one")
        return stat.nr_dirty + stat.nr_writeback
    finally:
        os.close(fd)


def write_unsynced(path: Path, nbytes: int = 8 * MB) -> None:
    path.write_bytes(os.urandom(nbytes))
    if unwritten_pages(path) == 0:
        pytest.skip(f"{path.parent} keeps no unwritten pages (a memory filesystem?): "
                    "there is nothing to write back")


def test_each_write_is_on_disk_when_put_returns_and_the_write_back_takes_the_rest(
        tmp_path: Path) -> None:
    write_unsynced(tmp_path / "probe")
    synced, background = ShardStore(tmp_path / "a", EACH_WRITE), \
        ShardStore(tmp_path / "b", IN_BACKGROUND)
    for store in (synced, background):
        store.put("job", "s1-r0-c0.0", os.urandom(4 * MB), {"step": 1})
    assert unwritten_pages(synced.path("job", "s1-r0-c0.0")) == 0
    sync_filesystem(tmp_path)
    assert unwritten_pages(background.path("job", "s1-r0-c0.0")) == 0


def test_sync_filesystem_names_a_folder_it_cannot_open(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="missing"):
        sync_filesystem(tmp_path / "missing")


def test_a_daemon_writing_back_in_the_background_does_so_within_its_interval(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a", settings={"snapshot": {"disk_sync": "background",
                                                         "disk_sync_every_s": 0.2}})
    probe = d.data_dir / "probe"
    write_unsynced(probe)
    # The kernel's own write-back takes pages dirty for 30 s (dirty_expire_centisecs):
    # within this deadline only the daemon's write-back cleans them.
    wait_for(lambda: unwritten_pages(probe) == 0, 20.0, "the daemon to write the file back")


def test_records_a_power_loss_tore_are_set_aside_and_the_store_reads_on(
        tmp_path: Path) -> None:
    # Written in the background, a record renamed into place may come back empty or cut
    # short after a power loss: the restarted store sets it aside instead of failing on it.
    store = LocalStore(tmp_path, base_every=4, retain=20, sync=IN_BACKGROUND, chunk_bytes=8192)
    for step in range(1, 5):
        commit_step(store, step, world=2)
    manifests = tmp_path / "snapshots" / "default" / "manifests"
    step4, step3 = sorted(manifests.glob("*.step"))[-1], sorted(manifests.glob("*.step"))[-2]
    step4.write_bytes(b"")  # never written back
    step3.write_bytes(step3.read_bytes()[:40])  # written back in part
    rank_record = next((tmp_path / "snapshots" / "default" / "steps").glob("*2/r1/rank.pb"))
    rank_record.write_bytes(b"\xff" * 7)
    fresh = LocalStore(tmp_path, retain=20, sync=IN_BACKGROUND, chunk_bytes=8192)
    assert fresh.committed_steps() == [1, 2]
    assert sorted(p.name for p in manifests.iterdir()) == [
        "000000000001.step", "000000000002.step", f"{step3.name}.torn", f"{step4.name}.torn"]
    assert fresh.held_record(2, 1) is None and fresh.held_record(2, 0) is not None
    assert fresh.read_rank(1, 1) == state(1, 1)
    commit_step(fresh, 5, world=2)  # commits and retention go on
    assert fresh.latest_committed() == 5


def test_shards_whose_sidecar_a_power_loss_tore_are_scrubbed_and_retired(
        tmp_path: Path) -> None:
    store = ShardStore(tmp_path, IN_BACKGROUND)
    for step in (1, 2):
        store.put("job", f"s{step}-r0-c0.0", os.urandom(4096), {"step": step, "crc32c": 0})
    torn = store.path("job", "s2-r0-c0.0")
    torn.with_name(torn.name + ".meta.json").write_text("")
    assert "job/s2-r0-c0.0" in store.scrub()
    deleted, kept = store.delete("job", [], below_step=2)
    assert deleted == 2 and kept == [] and not torn.exists()


def test_with_each_write_synced_a_committed_steps_files_are_on_disk_at_commit(
        tmp_path: Path) -> None:
    write_unsynced(tmp_path / "probe")
    store = LocalStore(tmp_path, sync=EACH_WRITE, chunk_bytes=8192)
    commit_step(store, 1, world=2)
    files = [p for p in (tmp_path / "snapshots").rglob("*") if p.is_file()]
    assert files and all(unwritten_pages(p) == 0 for p in files)


def test_retention_keeps_the_newest_step_on_disk_until_a_newer_one_is_written_back(
        tmp_path: Path) -> None:
    # Newer steps may not have reached the disk: retiring the last one that has would
    # leave a power loss nothing to read.
    synced = LocalStore(tmp_path / "synced", base_every=2, retain=1, chunk_bytes=8192)
    background = LocalStore(tmp_path / "bg", base_every=2, retain=1, sync=IN_BACKGROUND,
                            chunk_bytes=8192)
    for step in range(1, 11):
        commit_step(synced, step)
        commit_step(background, step)
        if step == 3:
            background.written_back(3)
    assert 3 not in synced.committed_steps()  # plain retention has retired it
    assert 3 in background.committed_steps() and 1 not in background.committed_steps()
    assert LocalStore(tmp_path / "bg", chunk_bytes=8192).read_rank(3, 0) == state(3)
    background.written_back(10)
    commit_step(background, 11)
    assert 3 not in background.committed_steps()
