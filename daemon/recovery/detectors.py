"""Daemon-side failure detectors: missed rank heartbeats, exited rank processes, lost peers.

Each runs on the daemon's asyncio loop and hands a typed `Failure` to a callback
(which may be a coroutine function). No torch here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stalwart.core.failures import Failure, FailureKind

__all__ = [
    "FailureSink", "deliver", "RankLiveness", "RankRegistry", "PeerLiveness", "PeerTable",
    "HeartbeatMonitor", "PeerMonitor", "PidWatcher", "exit_evidence",
]

log = logging.getLogger(__name__)

FailureSink = Callable[[Failure], object]
"""Receives each failure once; an awaitable result is scheduled on the loop."""


class RankLiveness(Protocol):
    rank_id: str
    pid: int
    last_heartbeat: float  # time.monotonic() seconds of the last heartbeat


class RankRegistry(Protocol):
    def ranks(self) -> Iterable[RankLiveness]: ...


class PeerLiveness(Protocol):
    node: str
    last_seen: float  # time.monotonic() seconds of the last gossip from this peer


class PeerTable(Protocol):
    def peers(self) -> Iterable[PeerLiveness]: ...


_pending: set[asyncio.Future] = set()


def deliver(sink: FailureSink, failure: Failure) -> None:
    """Log `failure` and hand it to `sink`; call from the event loop's thread."""
    log.warning("failure detected: %s", failure.describe())
    result = sink(failure)
    if inspect.isawaitable(result):
        fut = asyncio.ensure_future(result)
        _pending.add(fut)  # keep a reference until done (the loop holds only weak ones)
        fut.add_done_callback(_pending.discard)


@dataclass
class _Deadline:
    """Reports a subject once when `now - last_seen` passes the timeout; re-arms when it
    is seen again."""

    kind: FailureKind
    timeout_s: float
    on_failure: FailureSink
    clock: Callable[[], float] = time.monotonic
    generation: Callable[[], int] = lambda: 0
    reporter: str = ""
    interval_s: float | None = None

    def __post_init__(self) -> None:
        self._reported: dict[str, float] = {}

    def _entries(self) -> Iterable[tuple[str, float, dict[str, int]]]:
        raise NotImplementedError

    def _evidence(self, late_s: float, extra: dict[str, int]) -> str:
        raise NotImplementedError

    def check(self) -> list[Failure]:
        """Failures due now (each subject once per silence); does not call the sink."""
        now = self.clock()
        found: list[Failure] = []
        present = set()
        for subject, last, extra in self._entries():
            present.add(subject)
            late = now - last
            if late <= self.timeout_s or self._reported.get(subject) == last:
                continue
            self._reported[subject] = last
            found.append(Failure(
                self.kind, subject, self._evidence(late, extra), generation=self.generation(),
                reporter=self.reporter,
                details={"silent_s": round(late, 3), "timeout_s": self.timeout_s, **extra}))
        for gone in set(self._reported) - present:
            del self._reported[gone]
        return found

    async def run(self) -> None:
        """Check every `interval_s` (default a quarter of the timeout) until cancelled."""
        interval = self.interval_s or self.timeout_s / 4
        while True:
            for failure in self.check():
                deliver(self.on_failure, failure)
            await asyncio.sleep(interval)


class HeartbeatMonitor(_Deadline):
    """HEARTBEAT_MISSED for a rank silent longer than `timeout_s` seconds."""

    def __init__(self, registry: RankRegistry, timeout_s: float, on_failure: FailureSink,
                 **kwargs) -> None:
        super().__init__(FailureKind.HEARTBEAT_MISSED, timeout_s, on_failure, **kwargs)
        self.registry = registry

    def _entries(self):
        return ((r.rank_id, r.last_heartbeat, {"pid": r.pid}) for r in self.registry.ranks())

    def _evidence(self, late_s, extra):
        return (f"no heartbeat for {late_s:.1f} s (deadline {self.timeout_s:.1f} s) "
                f"from pid {extra['pid']}")


class PeerMonitor(_Deadline):
    """PEER_LOST for a peer daemon whose gossip stayed away longer than `timeout_s`."""

    def __init__(self, table: PeerTable, timeout_s: float, on_failure: FailureSink,
                 **kwargs) -> None:
        super().__init__(FailureKind.PEER_LOST, timeout_s, on_failure, **kwargs)
        self.table = table

    def _entries(self):
        return ((p.node, p.last_seen, {}) for p in self.table.peers())

    def _evidence(self, late_s, extra):
        return (f"no gossip from peer daemon for {late_s:.1f} s (deadline "
                f"{self.timeout_s:.1f} s): node presumed lost")


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from field 3 (state) on, or None once the pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2:].split()


def _wait_status_text(pid: int, code: int | None, sig: int | None) -> tuple[str, dict]:
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else "?"
        return f"pid {pid} killed by signal {sig} ({name})", {"pid": pid, "signal": sig}
    return f"pid {pid} exited with code {code}", {"pid": pid, "exit_code": code}


def exit_evidence(pid: int, pidfd: int | None = None) -> tuple[str, dict]:
    """How `pid` ended, as (evidence text, details); leaves any zombie for its parent."""
    if pidfd is not None:
        try:
            info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None  # not our child; its parent reaps it
        if info is not None:
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            return _wait_status_text(pid, None if killed else info.si_status,
                                     info.si_status if killed else None)
    fields = _proc_stat(pid)
    # A zombie still shows its wait status in field 52 (exit_code) until reaped.
    if fields and fields[0] == "Z" and len(fields) > 49:
        status = int(fields[49])
        if os.WIFSIGNALED(status):
            return _wait_status_text(pid, None, os.WTERMSIG(status))
        return _wait_status_text(pid, os.WEXITSTATUS(status), None)
    return (f"pid {pid} exited (exit status unknown: it was not a child of the daemon and "
            "its parent already reaped it)", {"pid": pid})


class PidWatcher:
    """PROCESS_EXIT the moment a watched rank process ends (SIGKILL included).

    Uses a pidfd per process on the loop (no polling); where pidfd_open is missing
    it polls /proc every `poll_interval_s` seconds. Call from the loop's thread.
    """

    def __init__(self, on_failure: FailureSink, *, generation: Callable[[], int] = lambda: 0,
                 reporter: str = "", poll_interval_s: float = 0.2,
                 use_pidfd: bool = hasattr(os, "pidfd_open")) -> None:
        self.on_failure = on_failure
        self.generation = generation
        self.reporter = reporter
        self.poll_interval_s = poll_interval_s
        self.use_pidfd = use_pidfd
        self._fds: dict[str, tuple[int, int]] = {}  # rank_id -> (pid, pidfd)
        self._polled: dict[str, tuple[int, str]] = {}  # rank_id -> (pid, start time)
        self._poller: asyncio.Task | None = None

    def watch(self, rank_id: str, pid: int) -> None:
        """Start watching `pid` as rank `rank_id` (replacing an earlier pid for it)."""
        self.unwatch(rank_id)
        loop = asyncio.get_running_loop()
        if self.use_pidfd:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._report(rank_id, f"pid {pid} was not running when watching began",
                             {"pid": pid})
                return
            except OSError as exc:  # e.g. ENOSYS in an old kernel or a sandbox
                log.info("pidfd_open unavailable (%s); polling /proc instead", exc)
                self.use_pidfd = False
            else:
                self._fds[rank_id] = (pid, fd)
                loop.add_reader(fd, self._on_readable, rank_id)
                return
        fields = _proc_stat(pid)
        if fields is None:
            self._report(rank_id, f"pid {pid} was not running when watching began",
                         {"pid": pid})
            return
        self._polled[rank_id] = (pid, fields[19])  # field 22: start time, guards pid reuse
        if self._poller is None:
            self._poller = loop.create_task(self._poll())

    def unwatch(self, rank_id: str) -> None:
        """Stop watching a rank (it left cleanly or was replaced)."""
        self._polled.pop(rank_id, None)
        entry = self._fds.pop(rank_id, None)
        if entry is not None:
            asyncio.get_running_loop().remove_reader(entry[1])
            os.close(entry[1])

    def close(self) -> None:
        for rank_id in list(self._fds) + list(self._polled):
            self.unwatch(rank_id)
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    def _on_readable(self, rank_id: str) -> None:
        pid, fd = self._fds[rank_id]
        text, details = exit_evidence(pid, fd)
        self.unwatch(rank_id)
        self._report(rank_id, text, details)

    async def _poll(self) -> None:
        while True:
            for rank_id, (pid, started) in list(self._polled.items()):
                fields = _proc_stat(pid)
                if fields is None or fields[0] in "ZX" or fields[19] != started:
                    text, details = exit_evidence(pid)
                    self._polled.pop(rank_id, None)
                    self._report(rank_id, text, details)
            await asyncio.sleep(self.poll_interval_s)

    def _report(self, rank_id: str, evidence: str, details: dict) -> None:
        deliver(self.on_failure, Failure(
            FailureKind.PROCESS_EXIT, rank_id, evidence, generation=self.generation(),
            reporter=self.reporter, details=details))
