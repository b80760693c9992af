"""One daemon per data directory: an exclusive lock held for the daemon's life.

The lock is `flock` on `daemon.lock` in the data directory, so the kernel drops it when
the process dies (kill -9 included) and a restarted daemon takes it again at once. The
file keeps the holder's pid for the refusal message; it is never removed, since
removing a lock file lets two processes lock two different files of one name.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "daemon.lock"


class DataDirBusy(RuntimeError):
    """Another live process holds the data directory."""


class DataDirLock:
    """Held from `acquire()` to `release()`; `held` says whether this process has it."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise DataDirBusy naming the holder's pid."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DataDirBusy(f"another daemon (pid {holder}) serves {self.path.parent}") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None
