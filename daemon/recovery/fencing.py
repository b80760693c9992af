"""Which local processes are proven ranks, and ending them when a new plan leaves them out.

A pid is proven when the kernel vouches that the rank's own process claimed it: its
connection to the ranks' socket at Register (peercred.connected_to), or SO_PEERCRED
on the fd socket when it fetches a slot. Only proven, still-running processes of an
allowed user are ever signalled, and never the daemon itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from stalwart.daemon.recovery.liveness import process_alive, process_identity
from stalwart.daemon.recovery.registry import RankRecord, Registry
from stalwart.daemon.security.peercred import cred_of, inner_pid, refusal

log = logging.getLogger("stalwart.daemon.recovery.fencing")


class RankProcesses:
    """Proven pids of the registry's ranks; `loop` is the registry's event loop."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.loop: asyncio.AbstractEventLoop | None = None

    def owner_pid(self, rank_id: str) -> int | None:
        """The pid of a local rank that proved itself and still runs as an allowed user."""
        record = self.registry.get(rank_id)
        if record is None or record.process is None or not process_alive(record.process):
            return None
        cred = cred_of(record.pid)
        return record.pid if cred is not None and not refusal(cred) else None

    def slot_caller(self, rank_id: str, pid: int) -> str:
        """Why process `pid` (by SO_PEERCRED, on the fd server's thread) may not have a
        slot of `rank_id`, or "". A matching pid proves the rank. A caller in a pid
        namespace this daemon cannot see (pid 0), or in a child namespace where it has
        the rank's pid (a container's), is held to the token and uid only."""
        record = self.registry.get(rank_id)
        if record is None:
            return "that rank is not registered here"
        if pid == 0:
            return ""
        if pid != record.pid:
            if record.process is None and inner_pid(pid) == record.pid:
                return ""  # registered with its pid inside its namespace: unwatched
            return f"process {pid} is not that rank"
        if record.process is None and self.loop is not None:
            self.loop.call_soon_threadsafe(self._prove, rank_id, pid)
        return ""

    def _prove(self, rank_id: str, pid: int) -> None:
        record = self.registry.get(rank_id)
        if record is not None and record.pid == pid and record.process is None:
            record.process = process_identity(pid)

    def fence(self, record: RankRecord) -> None:
        """A rank the new plan left out may still run (hung): end it so it cannot interfere."""
        log.warning("fencing rank left out of the new plan",
                    extra={"rank_id": record.rank_id, "pid": record.pid})
        if self.owner_pid(record.rank_id) in (None, os.getpid()):
            log.error("not ending rank %s: pid %d never proved it is that rank here (remote, "
                      "gone, another user's process or this daemon)", record.rank_id,
                      record.pid)
            return
        try:
            os.kill(record.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.error("cannot end fenced rank %s: %s", record.rank_id, exc)
