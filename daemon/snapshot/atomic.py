"""Files that a crash leaves whole or absent: write to a temp name, fsync, rename, and
fsync the folder so the rename itself is durable."""

from __future__ import annotations

import os
from pathlib import Path

from stalwart.daemon.snapshot.checksum import Buffer


def write_atomic(path: Path, data: Buffer) -> None:
    """Write `data` to `path` so a crash leaves the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
