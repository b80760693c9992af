"""Which registrations a daemon takes: the right job, a real pid, room for one more, and
a pid the caller proves is its own before the daemon will ever watch or fence it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.errors import Exhausted, Invalid, Refused
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.registry import Registry
from stalwart.daemon.rpc.validate import MAX_LIVE_RANKS_PER_NODE, MAX_RANKS_PER_NODE
from stalwart.daemon.security.peercred import (
    connected_pids,
    connected_to,
    cred_of,
    inner_pid,
    refusal,
)
from stalwart.v1 import rank_pb2


class RankAdmission:
    """The checks on a RegisterRequest, past authentication."""

    def __init__(self, config: DaemonConfig, registry: Registry, metrics: Metrics) -> None:
        self.node, self.job_id = config.node, config.job_id
        self.registry, self.metrics = registry, metrics
        self.unix_socket = str(Path(config.unix_socket).resolve())

    async def admit(self, request: rank_pb2.RegisterRequest, local: bool) -> bool:
        """Raise Refused, Invalid or Exhausted for a registration this daemon does not
        take; else whether the rank's pid may be watched (and fenced)."""
        if request.job_id and request.job_id != self.job_id:
            self.metrics.auth_refused.labels("job").inc()
            raise Refused(f"rank belongs to job {request.job_id!r} but daemon {self.node} "
                          f"serves job {self.job_id!r}; use that job's daemon or fix "
                          "STALWART_JOB_ID")
        if request.pid <= 0:
            raise Invalid(f"pid must be the rank's process id (> 0), got {request.pid}")
        ranks = self.registry.ranks()
        alive = sum(r.state != "dead" for r in ranks)
        if len(ranks) >= MAX_RANKS_PER_NODE or alive >= MAX_LIVE_RANKS_PER_NODE:
            raise Exhausted(f"daemon {self.node} already holds {len(ranks)} registrations "
                            f"({alive} live); stop stray ranks or run another daemon")
        return await self._own_pid(request.pid, local)

    async def _own_pid(self, pid: int, local: bool) -> bool:
        """Whether the daemon may watch (and fence) `pid`: a local rank registers its own
        process, which must hold a connection to this socket and run as a user allowed
        here; a pid claimed by anyone else is refused. Ranks whose pid the daemon cannot
        see (another pid namespace, or TCP) register unwatched: heartbeats only, never
        fenced, and never in place of a watched rank."""
        if local:
            cred = cred_of(pid)
            why = "" if cred is None else refusal(cred)
            # /proc and socket-table walks: off the event loop, which serves everyone else.
            if cred is not None and not why and await asyncio.to_thread(
                    connected_to, pid, self.unix_socket):
                return True
            if await asyncio.to_thread(self._claims_anothers_pid, pid):
                self.metrics.auth_refused.labels("pid").inc()
                raise Refused(f"pid {pid} is not a process connected to {self.unix_socket}"
                              + (f" ({why})" if why else "")
                              + "; a rank registers its own pid (os.getpid())")
        existing = self.registry.live_with_pid(pid)
        if existing is not None and existing.process is not None:
            self.metrics.auth_refused.labels("pid").inc()
            raise Refused(f"pid {pid} is a watched local rank of {self.node}; another caller "
                          "cannot register as it")
        return False

    def _claims_anothers_pid(self, pid: int) -> bool:
        """True unless some connected process could be the caller with `pid` as its own:
        one in a child pid namespace where it has that pid, or one this daemon cannot see
        at all (when it sees no caller)."""
        callers = connected_pids(self.unix_socket)
        return bool(callers) and not any(p != pid and inner_pid(p) == pid for p in callers)
