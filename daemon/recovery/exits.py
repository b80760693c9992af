"""The moment a watched rank process ends: pidfds, readable once what they name has
exited, wake the liveness check at once instead of at its next tick.

A killed process counts as exited only once the kernel has freed its memory (about
0.1 s per GB here, seconds for a process holding a GPU), but its threads are gone long
before: every thread but the last leaves within a millisecond, and the last frees the
memory. So besides the process, a few of its threads are watched, each through a
thread pidfd (Linux 6.9+). A thread that ends wakes the check, which declares the rank
dead if the process is ending (`liveness.process_identity`: killed, dumping core, or
its main thread exiting), and otherwise finds it running: a thread that finished its
work ends nothing.

Where pidfd_open is unavailable (kernels before 5.3, some sandboxes) nothing is
watched, and the periodic check alone finds the exit (within its 0.1 s tick); where
thread pidfds are (kernels before 6.9), the process alone is watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("stalwart.daemon.recovery.exits")

THREADS_WATCHED = 4
"""Threads watched per process: all of them but the last to go leave at once, so any
two would do; a few more cover threads that are slow to leave (one in a driver call)."""
PIDFD_THREAD = os.O_EXCL  # pidfd_open flag: the thread, not its process (Linux 6.9+)


class ExitWatch:
    """Calls `on_exit()` on the event loop as soon as any watched process has ended, or
    one of its watched threads has."""

    def __init__(self, on_exit: Callable[[], object], proc: Path = Path("/proc")) -> None:
        self.on_exit = on_exit
        self.proc = proc
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._threads: dict[int, dict[int, int]] = {}  # pid -> tid -> thread pidfd
        self._available = hasattr(os, "pidfd_open")
        self._threads_available = self._available

    @property
    def watched(self) -> set[int]:
        return set(self._fds)

    def threads_watched(self, pid: int) -> set[int]:
        return set(self._threads.get(pid, {}))

    def follow(self, pids: Iterable[int]) -> None:
        """Watch exactly `pids` (call with the live ranks' pids, every tick: cheap when
        unchanged, and it replaces the watched threads that ended)."""
        wanted = set(pids)
        for pid in set(self._fds) - wanted:
            self._drop(pid)
        for pid in wanted - set(self._fds):
            self._watch(pid)
        for pid in wanted & set(self._fds):
            if len(self._threads.get(pid, ())) < THREADS_WATCHED:
                self._watch_threads(pid)

    def _watch(self, pid: int) -> None:
        if not self._available:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.on_exit()  # gone already: let the check say so now
            return
        except OSError as exc:  # ENOSYS, EPERM in a sandbox: the periodic check remains
            self._available = self._threads_available = False
            log.info("exit watching off (pidfd_open: %s); the liveness tick finds exits", exc)
            return
        self._fds[pid] = fd
        asyncio.get_running_loop().add_reader(fd, self._exited, pid)
        self._watch_threads(pid)

    def _watch_threads(self, pid: int) -> None:
        if not self._threads_available:
            return
        watched = self._threads.setdefault(pid, {})
        try:
            tids = sorted(int(t) for t in os.listdir(self.proc / str(pid) / "task"))
        except (OSError, ValueError):
            return  # gone (its process pidfd says so), or no /proc to read
        for tid in tids:
            if len(watched) >= THREADS_WATCHED:
                return
            if tid in watched:
                continue
            try:
                fd = os.pidfd_open(tid, PIDFD_THREAD)
            except ProcessLookupError:
                continue  # that thread is gone already
            except OSError as exc:  # EINVAL before Linux 6.9: the process alone is watched
                self._threads_available = False
                log.info("thread exit watching off (pidfd_open of a thread: %s); a killed "
                         "rank is seen once its memory is freed", exc)
                return
            watched[tid] = fd
            asyncio.get_running_loop().add_reader(fd, self._thread_exited, pid, tid)

    def _exited(self, pid: int) -> None:
        self._drop(pid)
        self.on_exit()

    def _thread_exited(self, pid: int, tid: int) -> None:
        self._close(self._threads.get(pid, {}).pop(tid, None))
        self.on_exit()

    def _drop(self, pid: int) -> None:
        self._close(self._fds.pop(pid, None))
        for fd in self._threads.pop(pid, {}).values():
            self._close(fd)

    @staticmethod
    def _close(fd: int | None) -> None:
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self._drop(pid)
