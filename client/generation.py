"""One generation as a rank's program sees it: the plan, the rank's role and process
groups, and the daemon services it needs (capture, restore, the final commit wait), with
the way out when a newer plan arrives (`PlanChanged`)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from stalwart.client.capture import Capturer
from stalwart.client.daemon_client import DaemonClient, DaemonUnavailable
from stalwart.client.daemon_env import capture_cpus
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.pipeline import StepInterrupted
from stalwart.client.state_layout import unpack
from stalwart.client.watchdog import Abandoned, run_unless
from stalwart.v1 import common_pb2, rank_pb2

if TYPE_CHECKING:
    from stalwart.client.agent import AgentResult, ElasticAgent

T = TypeVar("T")
log = logging.getLogger("stalwart.client.generation")

CLOSE_WAIT_S = 60.0
"""Longest a new generation's capturer waits for the abandoned one's to close."""
# How often a rank waiting for its final step to commit looks for a newer plan (seconds).
COMMIT_WAIT_SLICE_S = 0.5


class PlanChanged(Exception):
    """A newer plan arrived while this generation ran: leave it and take the new one."""


class GrpcCaptureTransport:
    """The capturer's view of the daemon: OpenSlot and Capture over the Unix socket."""

    def __init__(self, daemon: DaemonClient, coord: common_pb2.RankCoord,
                 layout: common_pb2.ParallelLayout, generation: int) -> None:
        self.daemon, self.coord, self.layout, self.generation = daemon, coord, layout, generation
        # The metas the daemon holds for this rank (those of its last capture): a capture
        # of the same layout (the Capturer hands over the same list) leaves them out.
        self._named: list[common_pb2.TensorMeta] | None = None

    def open_slots(self, nbytes: int) -> list[tuple[str, str]]:
        reply = self.daemon.call("open_slot", "OpenSlot", rank_pb2.OpenSlotRequest(
            rank_id=self.daemon.rank_id, nbytes=nbytes))
        return [(sid, reply.fd_socket) for sid in (reply.slot_ids or [reply.slot_id])]

    def send_capture(self, step: int, slot_id: str, metas: list[common_pb2.TensorMeta],
                     extra: bytes, hints: Sequence[Any] = (), stall_s: float = 0.0,
                     final: bool = False) -> None:
        same = metas is self._named
        self._named = None  # until the daemon has taken these
        try:
            try:
                self._capture(step, slot_id, metas, extra, hints, stall_s, final, same)
            except DaemonUnavailable as exc:
                if not (same and exc.code is grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                # It holds no tensors for this rank (it forgot them): named in full again.
                self._capture(step, slot_id, metas, extra, hints, stall_s, final, False)
        except DaemonUnavailable as exc:
            # The daemon refuses a capture of an older generation with this code (its one
            # status for a stale generation, daemon/rpc/errors.py).
            if exc.code is grpc.StatusCode.ABORTED:
                raise PlanChanged() from exc
            raise
        self._named = metas

    def _capture(self, step: int, slot_id: str, metas: list[common_pb2.TensorMeta],
                 extra: bytes, hints: Sequence[Any], stall_s: float, final: bool,
                 same: bool) -> None:
        self.daemon.call("capture", "Capture", rank_pb2.CaptureRequest(
            rank_id=self.daemon.rank_id, generation=self.generation, step=step,
            slot_id=slot_id, tensors=() if same else metas, same_tensors=same, extra=extra,
            coord=self.coord, layout=self.layout, adamw=hints, stall_s=stall_s, final=final),
            timeout=120)


Restored = tuple[list[common_pb2.TensorMeta], dict[str, Any], dict[str, Any]]
"""A rank's state at a committed step: its metas, its tensors by name, its extra."""


def fetch_rank(daemon: DaemonClient, step: int, rank: int,
               layers: tuple[int, int] | None = None,
               on_call: Callable[[Any], None] | None = None) -> Restored:
    """Committed `step` as old rank `rank` captured it (with `layers`, of those layers
    alone: `DaemonClient.restore`), each tensor a copy of its own."""
    record, data = daemon.restore(step, rank, layers=layers, on_call=on_call)
    metas = list(record.tensors)
    return metas, unpack(data, metas), json.loads(record.extra.decode())


class RestoreAhead:
    """A restore started as the plan arrives, on a thread of its own, while the rank
    builds its process groups and trainer: the two took turns before, each tens of
    milliseconds of a recovery's critical path. The program's own restore takes it
    when it asks for the same step, rank and layers; otherwise it is cancelled, as it is
    when a newer plan ends the generation first (the daemon then stops streaming it)."""

    def __init__(self, daemon: DaemonClient, step: int, rank: int,
                 layers: tuple[int, int] | None) -> None:
        self.request = (step, rank, layers)
        self.result: Future[Restored] = Future()
        self._lock = threading.Lock()
        self._call: Any = None
        self._cancelled = False

        def started(call: Any) -> None:
            with self._lock:
                self._call = call
                if self._cancelled:
                    call.cancel()

        def fetch() -> None:
            try:
                self.result.set_result(fetch_rank(daemon, step, rank, layers, started))
            except BaseException as exc:  # raised where the program takes it
                self.result.set_exception(exc)

        threading.Thread(target=fetch, name=f"stalwart-restore-ahead-{step}",
                         daemon=True).start()

    def cancel(self) -> None:
        """Not wanted after all: the stream is cancelled if it is still running."""
        with self._lock:
            self._cancelled = True
            if self._call is not None and not self.result.done():
                self._call.cancel()


@dataclass
class Generation:
    """One generation as a program sees it: the plan, this rank's role, its process
    groups, and the daemon services it needs (capture, restore, commit)."""

    plan: common_pb2.Plan
    role: common_pb2.RankAssignment
    dims: ParallelDims
    agent: ElasticAgent
    record: dict[str, Any]
    store: Any = None
    """The store this generation's groups started from (the job's, for programs)."""
    abandoned: bool = False
    """A step of this generation is stuck in a collective: its groups are left alone."""
    ahead: RestoreAhead | None = None
    """The resume step's state, being fetched since the plan came (`RestoreAhead`)."""

    @property
    def daemon(self) -> DaemonClient:
        return self.agent.daemon

    @property
    def result(self) -> AgentResult:
        return self.agent.result

    def newer_plan_waiting(self) -> bool:
        return self.agent.superseded(self.plan.generation)

    def check_plan(self) -> None:
        """Raise PlanChanged when a newer plan is waiting (call at step boundaries)."""
        if self.newer_plan_waiting():
            raise PlanChanged()

    def capturer(self) -> Capturer:
        """This generation's capturer, once an abandoned one's has closed: the daemon may
        hand the new one the same slots, which the old one's last copy must not write into
        any more. Its hand-overs are refused at once (their plan is over), so the wait is
        short; one stuck past CLOSE_WAIT_S is left, and said."""
        closing, self.agent.closing_capturer = self.agent.closing_capturer, None
        if closing is not None:
            closing.join(CLOSE_WAIT_S)
            if closing.is_alive():
                log.warning("the last generation's capturer did not close in %.0f s; its "
                            "slots may be reused while its copy runs", CLOSE_WAIT_S)
        return Capturer(GrpcCaptureTransport(self.daemon, self.role.coord, self.plan.layout,
                                             self.plan.generation), token=self.daemon.token,
                        cpus=capture_cpus())

    def close_capturer(self, capturer: Capturer | None) -> None:
        """End this generation's capturer: its slots unmapped (and unpinned), its threads
        ended. An abandoned generation's copy may still be running into a slot: closed on
        a thread of its own then, which the next generation's `capturer()` waits for."""
        if capturer is None:
            return
        if not self.abandoned:
            _close(capturer)
            return
        closing = threading.Thread(target=_close, args=(capturer,), daemon=True,
                                   name="stalwart-close-capturer")
        closing.start()
        self.agent.closing_capturer = closing

    def run_or_abandon(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` (a step, a collective) on a helper thread; give up on it when a newer
        plan arrives, raising PlanChanged: a collective with a dead or hung peer cannot
        be aborted on gloo, and the new generation must not wait for its timeout."""
        try:
            return run_unless(fn, self.newer_plan_waiting,
                              f"stalwart-{what}-g{self.plan.generation}", self.agent.news)
        except (Abandoned, StepInterrupted):  # the step may have sends in flight: left too
            self.abandoned = True
            raise PlanChanged() from None

    def restore_rank(self, step: int, rank: int, layers: tuple[int, int] | None = None
                     ) -> Restored:
        """Committed `step` as old rank `rank` captured it: metas, tensors by name, extra
        (with `layers`, of those layers alone: `DaemonClient.restore`). The restore
        started ahead is taken, once, where it asked for the same."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.request == (step, rank, layers):
            restored = ahead.result.result()
            self.record["restored_ahead"] = True
            return restored
        if ahead is not None:
            ahead.cancel()
        return fetch_rank(self.daemon, step, rank, layers)

    def report_rebuilt(self, rebuild_s: float, restore_s: float) -> None:
        if self.plan.generation > 1:
            self.daemon.report_phases({"rebuild": rebuild_s, "restore": restore_s})
        self.record.update(rebuild_s=round(rebuild_s, 4), restore_s=round(restore_s, 4))
        self.record["t_trained_from"] = time.monotonic()

    def step_done(self, step: int, loss: float | None, step_time_s: float) -> None:
        """Bookkeeping after step `step` was taken and scheduled for capture."""
        if self.record["first_step_s"] is None:
            self.record["first_step_s"] = round(
                time.monotonic() - self.record.pop("t_trained_from", time.monotonic()), 4)
            self.record["first_step_unix"] = time.time()
        if loss is not None:
            self.result.losses[step] = loss
        self.daemon.report_step(step, step_time_s)
        self.daemon.add_link_bytes(self.agent.links.drain())
        if self.agent.on_step is not None:
            self.agent.on_step(step, loss if loss is not None else float("nan"))

    def committed(self, step: int) -> bool:
        """Whether `step` (or a later one) is committed, as this node's daemon knows now."""
        reply = self.daemon.call("wait_committed", "WaitCommitted",
                                 rank_pb2.WaitCommittedRequest(step=step, timeout_s=1e-6),
                                 timeout=5)
        return bool(reply.committed)

    def wait_committed(self, step: int, timeout_s: float = 120.0) -> None:
        """The last step is durable before this rank reports success. A newer plan ends
        the wait with PlanChanged: a peer was lost before `step` committed, and the rank
        must redo the steps after that plan's resume step (waiting on would time out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_plan()
            left = deadline - time.monotonic()
            wait_s = max(0.01, min(left, COMMIT_WAIT_SLICE_S))
            reply = self.daemon.call("wait_committed", "WaitCommitted",
                                     rank_pb2.WaitCommittedRequest(step=step, timeout_s=wait_s),
                                     timeout=wait_s + 5)
            if reply.committed:
                return
            if left <= COMMIT_WAIT_SLICE_S:
                raise RuntimeError(f"final step {step} was not committed within "
                                   f"{timeout_s:g} s: {reply.message}")


def _close(capturer: Capturer) -> None:
    try:
        capturer.close()
    except Exception as exc:  # the old generation's captures may be refused
        log.debug("capturer closed with: %s", exc)
