"""Collective hang watchdog: tells a hung collective from a lost peer, and reports the hang.

Every blocking call of a generation's process groups (collectives, pipeline send and
recv, building the groups) runs through one Watchdog. The groups' own timeout ends a
stuck call (gloo raises then; NCCL's waits return at once, so a wait fails at the
timeout only with TORCH_NCCL_BLOCKING_WAIT=1, else NCCL's watchdog ends the process); an error no
sooner than the deadline is a hang, reported to the daemon as a COLLECTIVE_HANG, an
earlier one is a lost peer. Either way the caller gets a typed GroupFailure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from stalwart.core.failures import Failure, FailureKind

__all__ = ["Abandoned", "CollectiveHangError", "GroupFailure", "Watchdog", "run_unless"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# How often a call left running on its own thread is checked against its give-up
# condition when nothing tells of a change (see run_unless's `news`).
GIVE_UP_POLL_S = 0.05


class GroupFailure(RuntimeError):
    """A collective, or the building of a process group, failed because a peer died or
    left: this generation's groups are unusable. Wait for the coordinator's next plan."""


class CollectiveHangError(GroupFailure):
    """A collective did not finish within its deadline; the hang was reported to the daemon."""


class Abandoned(Exception):
    """`run_unless` gave up on its call: the give-up condition became true first."""


def run_unless(fn: Callable[[], T], give_up: Callable[[], bool], name: str,
               news: threading.Condition | None = None) -> T:
    """`fn()` on a thread of its own (named `name`): its result or its error, or Abandoned
    as soon as `give_up()` is true. A collective or a group build on gloo cannot be
    cancelled, so a left call ends on its thread by its own timeout and is dropped.

    `news` is notified (under its lock) by whatever may make `give_up()` true: the wait
    then ends the moment it does. Without it, `give_up()` is polled every
    GIVE_UP_POLL_S."""
    done: Future[T] = Future()
    wake = news if news is not None else threading.Condition()

    def body() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: B036 - handed to the waiting thread
            done.set_exception(exc)
        with wake:
            wake.notify_all()

    threading.Thread(target=body, name=name, daemon=True).start()
    with wake:
        # Both ends notify under the lock, so neither can slip between a check here
        # and the wait.
        while not done.done():
            if give_up():
                raise Abandoned(name)
            wake.wait(GIVE_UP_POLL_S)
    return done.result()


class Watchdog:
    """The deadline of one generation's blocking distributed calls, and who hears of a hang.

    `deadline_s` must not exceed the process groups' own timeout (seconds): that timeout
    is what ends a stuck call. `on_hang` receives the COLLECTIVE_HANG `Failure` about
    `subject` (this rank) in `generation`, from the thread whose call hung.
    """

    def __init__(self, on_hang: Callable[[Failure], None], *, deadline_s: float,
                 subject: str = "", generation: int = 0) -> None:
        self.on_hang = on_hang
        self.deadline_s = deadline_s
        self.subject = subject
        self.generation = generation

    def run(self, fn: Callable[[], T], op: str, started: float | None = None) -> T:
        """`fn()`, a blocking call named `op`; its errors come out as GroupFailure, or as
        CollectiveHangError (after reporting) when the call failed no sooner than the
        deadline after `started` (a time.monotonic() reading; default: now)."""
        began = time.monotonic() if started is None else started
        try:
            return fn()
        except GroupFailure:
            raise  # a guarded call inside this one: already told apart (and reported)
        except RuntimeError as exc:
            waited = time.monotonic() - began
            if waited < self.deadline_s:
                raise GroupFailure(f"{op} failed after {waited:.1f} s in generation "
                                   f"{self.generation}: {_first_line(exc)}") from exc
            self._report(op, waited)
            raise CollectiveHangError(
                f"{op} did not finish within its {self.deadline_s:g} s deadline in generation "
                f"{self.generation}; the hang was reported, and the next generation's "
                "groups are built from the coordinator's plan") from exc

    def _report(self, op: str, waited: float) -> None:
        failure = Failure(
            FailureKind.COLLECTIVE_HANG, self.subject,
            f"{op} did not finish within {self.deadline_s:.1f} s (waited {waited:.1f} s)",
            generation=self.generation,
            details={"op": op, "deadline_s": self.deadline_s, "waited_s": round(waited, 3)})
        log.error("collective hang: %s", failure.describe())
        self.on_hang(failure)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
