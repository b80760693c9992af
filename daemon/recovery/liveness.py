"""Pure liveness rules: how late a heartbeat may be, and whether a process still runs.

No sockets and no clocks of their own: callers pass the age or the process
identity, so the rules are tested in-process with made-up times.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ALIVE = "alive"
LATE = "late"
DEAD = "dead"


def heartbeat_state(age_s: float, interval_s: float, timeout_s: float) -> str:
    """ALIVE, LATE (a beat is overdue: age > 2 intervals) or DEAD (age > timeout), in seconds."""
    if age_s > timeout_s:
        return DEAD
    if age_s > 2.0 * interval_s:
        return LATE
    return ALIVE


@dataclass(frozen=True)
class ProcessIdentity:
    """A pid plus its start time, so a recycled pid is not mistaken for the original."""

    pid: int
    start_ticks: int  # clock ticks after boot (/proc/<pid>/stat field 22); 0 if unknown


PF_EXITING, PF_DUMPCORE = 0x4, 0x200  # /proc/<pid>/stat field 9: the main thread's flags
SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status SigPnd and ShdPnd


def process_identity(pid: int, proc: Path = Path("/proc")) -> ProcessIdentity | None:
    """The running process `pid`, or None if it is gone, a zombie (exited, not yet
    reaped) or ending: killed (SIGKILL pending), dumping core, or its main thread exiting.
    An ending process runs no more of its code, but its end takes a while: the kernel
    frees its memory first (about 0.1 s per GB here; far longer for a GPU process), and
    only then does the process count as exited."""
    if pid <= 0:
        return None
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return None if proc.is_dir() else _without_proc(pid)
    except OSError:
        return _without_proc(pid)
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X") or int(fields[6]) & (PF_EXITING | PF_DUMPCORE) or \
            _kill_pending(proc / str(pid) / "status"):
        return None
    return ProcessIdentity(pid, int(fields[19]))


def _kill_pending(status: Path) -> bool:
    """Whether a SIGKILL waits for the process (the kernel puts one on every thread of
    a process being killed, until each takes it)."""
    try:
        text = status.read_text()
    except OSError:
        return False  # gone since (the caller finds that next), or no status to read
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigPnd", "ShdPnd") and int(value, 16) & SIGKILL_PENDING:
            return True
    return False


def _without_proc(pid: int) -> ProcessIdentity | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, owned by another user
    return ProcessIdentity(pid, 0)


def process_alive(identity: ProcessIdentity, proc: Path = Path("/proc")) -> bool:
    """True while the process that `identity` names still runs (pid not exited nor reused)."""
    now = process_identity(identity.pid, proc)
    return now is not None and (identity.start_ticks in (0, now.start_ticks))
