"""Files that a crash leaves whole or absent: write to a temp name, rename, and (when
every write is synced) fsync the file and then the folder so the rename itself is durable.

`DiskSync` says when written files reach the disk. Synced on every write, a step counts
as stored only once its files would survive a power loss of every node at once. In the
background, a step counts as stored once its bytes are written on the nodes that keep
them (their page caches survive any process crash, and the loss of up to m nodes costs
nothing), and `sync_filesystem` writes them back every few seconds.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from stalwart.daemon.snapshot.checksum import Buffer


@dataclass(frozen=True)
class DiskSync:
    """`each_write`: fsync every file and folder entry before it counts as written."""

    each_write: bool = True

    def file(self, fd: int) -> None:
        if self.each_write:
            os.fsync(fd)

    def folder(self, path: Path) -> None:
        if self.each_write:
            fsync_dir(path)


EACH_WRITE = DiskSync(each_write=True)
IN_BACKGROUND = DiskSync(each_write=False)


def write_atomic(path: Path, data: Buffer, sync: DiskSync = EACH_WRITE) -> None:
    """Write `data` to `path` so a crash leaves the old file or the whole new one (a
    power loss too, when `sync` syncs each write)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        sync.file(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename, a new file, a removal) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _syncfs() -> ctypes._CFuncPtr | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux: os.sync() writes back every filesystem
        return None


def sync_filesystem(path: Path) -> None:
    """Write back every written file of the filesystem that holds folder `path` and wait
    until it is on the disk (syncfs(2)); OSError when the disk refuses."""
    syncfs = _syncfs()
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
