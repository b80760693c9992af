"""Collective hang watchdog: a deadline around collectives and pipeline send/recv.

One thread per process watches every guarded call. When a deadline passes it
reports a COLLECTIVE_HANG failure through a callback (the daemon's
ReportFailure RPC) and aborts the process group so the rank can rebuild.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.core.failures import Failure, FailureKind

__all__ = ["CollectiveHangError", "Watchdog", "abort_group"]

log = logging.getLogger(__name__)


class CollectiveHangError(RuntimeError):
    """A guarded collective passed its deadline; its process group is no longer usable."""


def abort_group(group: Any) -> None:
    """Abort `group` (None = every group) so a call stuck in it returns with an error.

    NCCL: the communicator is aborted and the blocked call returns at once. Gloo has no
    abort for an operation already running: on torch 2.13 `abort()` and destroying the
    group both block until the stuck operation ends (measured), so nothing is done here;
    the call returns when the group's own timeout fires or a peer's connection closes
    (fence the hung rank by ending its process). Prefer `Watchdog.wait` on async work.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        log.warning("%s groups cannot be aborted while a call is stuck in them; it returns "
                    "at the group's timeout or when the hung peer's process ends", backend)
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(group)
    else:
        (group or dist.group.WORLD).abort()


@dataclass
class _Watch:
    op: str
    group: Any
    deadline_s: float
    started: float
    due: float
    fired: bool = False


class _Guard(contextlib.ContextDecorator):
    def __init__(self, dog: Watchdog, op: str, group: Any, deadline_s: float | None) -> None:
        self._dog, self._op, self._group, self._deadline_s = dog, op, group, deadline_s
        self._token: int | None = None

    def __enter__(self) -> _Guard:
        self._token = self._dog._arm(self._op, self._group, self._deadline_s)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self._token is not None
        watch = self._dog._disarm(self._token)
        if watch.fired:
            raise CollectiveHangError(self._dog._message(watch)) from exc
        return False


class Watchdog:
    """Deadlines for blocking distributed calls, watched by a single thread.

    `on_hang` receives a COLLECTIVE_HANG `Failure` (called from the watchdog thread;
    keep it short). With `abort` set (default `abort_group`), the call's process group is
    aborted after reporting. `generation` may be a callable returning the current one.
    """

    def __init__(self, on_hang: Callable[[Failure], None], *, deadline_s: float = 60.0,
                 subject: str = "", reporter: str = "",
                 generation: int | Callable[[], int] = 0,
                 abort: Callable[[Any], None] | None = abort_group) -> None:
        self.on_hang = on_hang
        self.deadline_s = deadline_s
        self.subject = subject
        self.reporter = reporter
        self._generation = generation
        self._abort = abort
        self._cond = threading.Condition()
        self._watches: dict[int, _Watch] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def generation(self) -> int:
        gen = self._generation
        return gen() if callable(gen) else gen

    def guard(self, op: str, group: Any = None, deadline_s: float | None = None) -> _Guard:
        """Context manager / decorator: `op` must finish within `deadline_s` seconds.

        On exit after the deadline fired it raises CollectiveHangError (chained to the
        call's own error, if any).
        """
        return _Guard(self, op, group, deadline_s)

    def wait(self, work: Any, op: str, group: Any = None,
             deadline_s: float | None = None) -> None:
        """Wait for async work (`async_op=True` result) within the deadline.

        Unblocks even on gloo: the wait itself times out, then the hang is reported,
        the group aborted, and CollectiveHangError raised.
        """
        limit = self.deadline_s if deadline_s is None else deadline_s
        token = self._arm(op, group, limit, watched=False)
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as exc:
            watch = self._disarm(token)
            if not watch.fired:
                self._fire(watch)
            raise CollectiveHangError(self._message(watch)) from exc
        watch = self._disarm(token)
        if watch.fired:
            raise CollectiveHangError(self._message(watch))

    def close(self) -> None:
        """Stop the watchdog thread; pending watches are dropped without firing."""
        with self._cond:
            self._closed = True
            self._watches.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _arm(self, op: str, group: Any, deadline_s: float | None, watched: bool = True) -> int:
        limit = self.deadline_s if deadline_s is None else deadline_s
        now = time.monotonic()
        # `wait` enforces its own deadline; the thread then only needs a late backstop.
        due = now + limit if watched else now + 2 * limit + 1.0
        with self._cond:
            if self._closed:
                raise RuntimeError("the watchdog was closed; create a new one for new groups")
            token = next(self._tokens)
            self._watches[token] = _Watch(op, group, limit, now, due)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="stalwart-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return token

    def _disarm(self, token: int) -> _Watch:
        with self._cond:
            return self._watches.pop(token)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [w for w in self._watches.values() if not w.fired and w.due <= now]
                for w in due:
                    w.fired = True  # under the lock, so _disarm sees it
                if not due:
                    pending = [w.due for w in self._watches.values() if not w.fired]
                    self._cond.wait(timeout=min(pending) - now if pending else None)
                    continue
            for w in due:
                self._fire(w, already_marked=True)

    def _fire(self, watch: _Watch, already_marked: bool = False) -> None:
        if not already_marked:
            with self._cond:
                watch.fired = True
        waited = time.monotonic() - watch.started
        failure = Failure(
            FailureKind.COLLECTIVE_HANG, self.subject,
            f"{watch.op} did not finish within {watch.deadline_s:.1f} s "
            f"(waited {waited:.1f} s)",
            generation=self.generation, reporter=self.reporter,
            details={"op": watch.op, "deadline_s": watch.deadline_s,
                     "waited_s": round(waited, 3)})
        log.error("collective hang: %s", failure.describe())
        try:
            self.on_hang(failure)
        except Exception:  # a broken reporter must not stop the abort below
            log.exception("reporting the hang of %s failed", watch.op)
        if self._abort is not None:
            try:
                self._abort(watch.group)
            except Exception:
                log.exception("aborting the process group of %s failed", watch.op)

    def _message(self, watch: _Watch) -> str:
        return (f"{watch.op} passed its {watch.deadline_s:.1f} s deadline in generation "
                f"{self.generation}; the hang was reported and the process group "
                f"{'aborted' if self._abort else 'left as is'}. Rebuild the groups for the "
                "next generation (the coordinator publishes its plan).")
