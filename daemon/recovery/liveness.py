"""Pure liveness rules: how late a heartbeat may be, and whether a process still runs.

No sockets and no clocks of their own: callers pass the age or the process
identity, so the rules are tested in-process with made-up times.
"""

from __future__ import annotations

import os
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


def process_identity(pid: int, proc: Path = Path("/proc")) -> ProcessIdentity | None:
    """The running process `pid`, or None if it is gone or a zombie (exited, not yet reaped)."""
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
    if fields[0] in ("Z", "X"):
        return None
    return ProcessIdentity(pid, int(fields[19]))


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
