"""The moment a watched rank process ends: a pidfd per process, readable once it exits,
wakes the liveness check at once instead of at its next tick.

Where pidfd_open is unavailable (kernels before 5.3, some sandboxes) nothing is
watched, and the periodic check alone finds the exit (within its 0.1 s tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable

log = logging.getLogger("stalwart.daemon.recovery.exits")


class ExitWatch:
    """Calls `on_exit()` on the event loop as soon as any watched process has ended."""

    def __init__(self, on_exit: Callable[[], object]) -> None:
        self.on_exit = on_exit
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._available = hasattr(os, "pidfd_open")

    @property
    def watched(self) -> set[int]:
        return set(self._fds)

    def follow(self, pids: Iterable[int]) -> None:
        """Watch exactly `pids` (call with the live ranks' pids; cheap when unchanged)."""
        wanted = set(pids)
        for pid in set(self._fds) - wanted:
            self._drop(pid)
        for pid in wanted - set(self._fds):
            self._watch(pid)

    def _watch(self, pid: int) -> None:
        if not self._available:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.on_exit()  # gone already: let the check say so now
            return
        except OSError as exc:  # ENOSYS, EPERM in a sandbox: the periodic check remains
            self._available = False
            log.info("exit watching off (pidfd_open: %s); the liveness tick finds exits", exc)
            return
        self._fds[pid] = fd
        asyncio.get_running_loop().add_reader(fd, self._exited, pid)

    def _exited(self, pid: int) -> None:
        self._drop(pid)
        self.on_exit()

    def _drop(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self._drop(pid)
