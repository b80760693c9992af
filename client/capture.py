"""The capture hook: copy a rank's state into a daemon slot off the critical path.

`capture(step, ...)` is called right after `optimizer.step()`. It only records
what to copy and returns; a copier thread fills one of two daemon-owned slots
while the next forward/backward runs, and a sender thread hands the filled slot
to the daemon (phase one of the commit). The training thread blocks only in
`before_update()` — called before the next `optimizer.step()` — and only if the
copy of the previous step is still running, because the optimizer is about to
overwrite the memory being copied. Tensors that change before that (`staged`: module
buffers, which the next forward updates) are copied in `capture` itself, to a staging
copy the copier then reads.

The copier and sender threads may run on CPUs of their own (`cpus`, or
STALWART_CAPTURE_CPUS where the library makes the Capturer): a host that gives its
daemon cores gives the capture's copy those cores too, as a GPU's copy engine takes it
off the training thread, and the hand-over's gRPC threads with it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from stalwart.client.daemon_env import CPUS_ENV
from stalwart.client.record_json import RecordEncoder
from stalwart.client.shm import MappedSlot
from stalwart.client.state_layout import (
    StateTensor,
    byte_view,
    copy_into,
    describe,
    same_layout,
)
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.client.capture")

class CaptureTransport(Protocol):
    """What the capturer needs from the daemon (gRPC in production)."""

    def open_slots(self, nbytes: int) -> list[tuple[str, str]]:
        """Return [(slot_id, fd_socket_path)] of slots holding at least nbytes."""

    def send_capture(self, step: int, slot_id: str, metas: list[common_pb2.TensorMeta],
                     extra: bytes, hints: Sequence[Any] = (), stall_s: float = 0.0,
                     final: bool = False) -> None:
        """Tell the daemon the slot holds `step`; return once it has consumed the slot.
        `stall_s` is how long the previous capture blocked training (for metrics);
        `final` marks the job's last step."""


@dataclass
class CaptureStats:
    stalls_s: list[float] = field(default_factory=list)  # training-thread blocking per step
    copies_s: list[float] = field(default_factory=list)  # background copy time per capture
    bytes_per_capture: int = 0


class _SlotState:
    def __init__(self, mapped: MappedSlot) -> None:
        self.mapped = mapped
        self.buffer = torch.frombuffer(mapped.view, dtype=torch.uint8)
        self.free = threading.Event()
        self.free.set()
        self.pinned = False  # page-locking tried
        self._registered = False  # page-locked by cudaHostRegister
        self._views: list[torch.Tensor] = []
        self._views_of: list[common_pb2.TensorMeta] | None = None

    def pin(self, device: torch.device) -> None:
        """Page-lock the shared mapping so device-to-host copies run by DMA; registered
        from the device the copies run on. Where CUDA refuses (a locked-memory limit, say),
        the copies still land, staged through the driver's own buffers, only slower."""
        with torch.cuda.device(device):
            cudart = torch.cuda.cudart()
            code = cudart.cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
        if code != cudart.cudaError.success:
            log.warning("capture slot %s not page-locked (CUDA error %s): device-to-host "
                        "copies into it are slower", self.mapped.slot_id, code)
        self.pinned = True  # tried once; unregistered at release only if it took
        self._registered = code == cudart.cudaError.success

    def release(self) -> None:
        """Unpin (where pinned) and unmap: a slot is let go of whole, never only unmapped
        while CUDA still counts its pages as locked."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
        self.mapped.close()

    def views(self, metas: list[common_pb2.TensorMeta]) -> list[torch.Tensor]:
        """Each tensor's region of this slot, viewed with its dtype and shape; made once
        per layout (captures of one job keep theirs)."""
        if self._views_of is not metas:
            self._views = [byte_view(self.buffer, m) for m in metas]
            self._views_of = metas
        return self._views


class GrpcThreads:
    """The threads gRPC's core library runs in this process, found by their names.

    They carry every call's socket work, the capture hand-over's included, and start
    where the thread that made them was allowed to run: beside the training thread, on a
    rank pinned to its cores. Left there, they wake several times a capture and preempt
    training; moved to the capture's CPUs, that work runs beside the daemon's instead.
    """

    NAMES = ("event_engine", "grpc_global_tim", "lifeguard")
    """Thread names (as the kernel keeps them, 15 characters at most) of the event-engine
    pool, the timer thread and the pool's lifeguard, as grpcio 1.85 names them; a name
    not listed only leaves that thread where it was."""

    def __init__(self) -> None:
        self._named: dict[int, bool] = {}  # thread id: whether it is one of gRPC's
        self._before: dict[int, set[int]] = {}  # thread id: where it ran before the move

    def ids(self) -> list[int]:
        """gRPC's threads in this process now (none where /proc is not there)."""
        try:
            present = [int(name) for name in os.listdir("/proc/self/task")]
        except OSError:
            return []
        named = {}
        for tid in present:  # a thread's name is read once, when it is first seen
            if tid not in self._named:
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        self._named[tid] = f.read().strip().startswith(self.NAMES)
                except OSError:  # the thread ended meanwhile
                    continue
            named[tid] = self._named[tid]
        self._named = named
        return [tid for tid, grpc_own in named.items() if grpc_own]

    def move_to(self, cpus: frozenset[int]) -> None:
        for tid in self.ids():
            try:
                if tid not in self._before:  # read once: later captures only re-apply
                    self._before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
            except OSError as exc:  # ended meanwhile, or kept out of `cpus`: stays put
                log.debug("gRPC thread %d not moved: %s", tid, exc)

    def move_back(self) -> None:
        """Each moved thread back where it ran before (the capture is over: the rank's
        other gRPC calls, and any of its own, run where the rank does again)."""
        before, self._before = self._before, {}
        for tid, cpus in before.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass  # the thread ended meanwhile


class Capturer:
    """Double-buffered, asynchronous capture of one rank's state."""

    def __init__(self, transport: CaptureTransport, token: str = "",
                 cpus: frozenset[int] | None = None) -> None:
        self.transport = transport
        self.token = token
        # Where the copier and sender threads run (None: wherever the rank's threads
        # do). Applied as each job starts, so it holds even if the rank is re-pinned.
        self.cpus = cpus
        self.stats = CaptureStats()
        self._slots: list[_SlotState] = []
        self._size = 0
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="stalwart-copy")
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="stalwart-send")
        self._copied: Future[None] | None = None
        self._sent: list[Future[None]] = []
        self._stream = None  # CUDA side stream, created on first CUDA capture
        self._next_slot = 0
        # The last layout described: (the StateTensors it was described from, metas,
        # bytes). A step's state keeps its names, dtypes and shapes, so its metas (and
        # each slot's views of them) are made once, not every step.
        self._described: tuple[list[StateTensor], list[common_pb2.TensorMeta], int] | None = None
        self._records = RecordEncoder()
        self._opening: Future[None] | None = None  # slots being opened ahead (`open_ahead`)
        self._grpc_threads = GrpcThreads()
        # Where `staged` tensors are copied at the capture: (their dtypes, shapes and
        # devices, the copies), kept while the state keeps its layout.
        self._staging: tuple[tuple[Any, ...], list[torch.Tensor]] = ((), [])

    def open_ahead(self, tensors: Sequence[StateTensor]) -> None:
        """Open and map the slots that captures of `tensors` need, in the background.

        Call it once the state is whole (after a restore): the first capture then finds
        its slots ready instead of waiting for the daemon to make them, which on a busy
        node takes tens of milliseconds, on the step that ends a recovery. A failure is
        left for that capture, which opens the slots itself and reports what went wrong.
        """
        if self._opening is None and not self._slots:
            self._opening = self._copier.submit(self._open_for, list(tensors))

    def _open_for(self, tensors: list[StateTensor]) -> None:
        self._pin()
        self._open(self._describe(tensors)[1], populate=True)

    def _await_opening(self) -> None:
        opening, self._opening = self._opening, None
        if opening is None:
            return
        try:
            opening.result()
        except Exception as exc:  # the capture opens them itself and raises what it meets
            log.debug("slots opened ahead failed (%s); the capture opens them", exc)

    def _open(self, nbytes: int, populate: bool = False) -> None:
        """Map `nbytes` slots in place of the current ones; `populate`: fault their pages
        in now (off the training thread), not in the first copy."""
        for s in self._slots:
            s.release()
        self._slots = []
        slots = [_SlotState(MappedSlot.attach(path, slot_id, self.token))
                 for slot_id, path in self.transport.open_slots(nbytes)]
        if populate:
            for s in slots:
                s.mapped.populate()
        self._slots, self._size = slots, min(s.mapped.size for s in slots)

    def capture(self, step: int, tensors: Sequence[StateTensor], extra: dict,
                hints: Sequence[Any] = (), final: bool = False) -> None:
        """Schedule a snapshot of `tensors` (and the small JSON-able `extra`) for step.

        `hints` (stalwart.v1 AdamWHint) describe the optimizer update; they only make
        the daemon's deltas smaller. `final` marks the job's last step. Slots still
        being opened (`open_ahead`, or a state that outgrew its slots) are waited for
        by the copy, not here: the training thread waits, if at all, in the next
        `before_update`.
        """
        started = time.perf_counter()
        self.before_update()
        for f in [f for f in self._sent if f.done()]:
            self._sent.remove(f)
            f.result()  # surface a failed hand-over at the next capture
        metas, nbytes = self._describe(tensors)
        self.stats.bytes_per_capture = nbytes
        payload = self._records.encode(extra)
        on_cuda = any(t.tensor.is_cuda for t in tensors)
        tensors = self._stage(tensors)
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            # The side stream must see the optimizer's writes (and the staging copies,
            # made on the current stream) before copying them.
            self._stream.wait_stream(torch.cuda.current_stream())
        self._copied = self._copier.submit(self._copy_then_send, step, nbytes, list(tensors),
                                           metas, payload, on_cuda, list(hints), final)
        self.stats.stalls_s.append(time.perf_counter() - started)

    def _stage(self, tensors: Sequence[StateTensor]) -> Sequence[StateTensor]:
        """`tensors` with each `staged` one's values copied now, in one call, into a
        staging tensor of its own (reused from capture to capture: the last copy has read
        it by now, `before_update`); the rest stay live references."""
        staged = [i for i, st in enumerate(tensors) if st.staged]
        if not staged:
            return tensors
        sources = [tensors[i].tensor for i in staged]
        key = tuple((t.dtype, t.shape, t.device) for t in sources)
        if self._staging[0] != key:
            self._staging = (key, [torch.empty(t.shape, dtype=t.dtype, device=t.device)
                                   for t in sources])
        copies = self._staging[1]
        with torch.no_grad():
            torch._foreach_copy_(copies, sources)
        out = list(tensors)
        for i, copy in zip(staged, copies, strict=True):
            out[i] = replace(tensors[i], tensor=copy)
        return out

    def _describe(self, tensors: Sequence[StateTensor]
                  ) -> tuple[list[common_pb2.TensorMeta], int]:
        if self._described is None or not same_layout(tensors, self._described[0]):
            self._described = (list(tensors), *describe(tensors))
        else:  # today's tensors kept, not the first ones (those may be gone since)
            self._described = (list(tensors), *self._described[1:])
        return self._described[1], self._described[2]

    def _slot_for(self, nbytes: int, on_cuda: bool) -> _SlotState:
        """On the copy thread: the next slot, round robin (not step parity: captures every
        k steps must not share one), its slots opened first where there are none yet (an
        opening ahead failed) or the state outgrew them."""
        if not self._slots or self._size < nbytes:
            for f in list(self._sent):  # the daemon is done with the slots being replaced
                f.result()
            self._open(nbytes)
        slot = self._slots[self._next_slot % len(self._slots)]
        self._next_slot += 1
        if on_cuda and not slot.pinned:
            slot.pin(self._stream.device)
        return slot

    def _copy_then_send(self, step: int, nbytes: int, tensors: list[StateTensor],
                        metas: list[common_pb2.TensorMeta], extra: bytes, on_cuda: bool,
                        hints: list[Any], final: bool) -> None:
        self._pin()
        slot = self._slot_for(nbytes, on_cuda)
        if not slot.free.wait(timeout=600):
            raise TimeoutError(f"daemon did not consume slot {slot.mapped.slot_id} in 600 s")
        slot.free.clear()
        t0 = time.perf_counter()
        if on_cuda:
            with torch.cuda.stream(self._stream):
                copy_into(slot.views(metas), tensors, non_blocking=True)
            self._stream.synchronize()
        else:
            copy_into(slot.views(metas), tensors)
        self.stats.copies_s.append(time.perf_counter() - t0)
        self._sent.append(self._sender.submit(self._send, step, slot, metas, extra, hints,
                                              final))

    def _send(self, step: int, slot: _SlotState, metas: list[common_pb2.TensorMeta],
              extra: bytes, hints: list[Any], final: bool) -> None:
        self._pin(with_grpc=True)
        try:
            stall = self.stats.stalls_s[-2] if len(self.stats.stalls_s) > 1 else 0.0
            self.transport.send_capture(step, slot.mapped.slot_id, metas, extra, hints, stall,
                                        final)
        finally:
            slot.free.set()

    def _pin(self, with_grpc: bool = False) -> None:
        """This capture thread onto `cpus`, and `with_grpc` (the hand-over thread, the
        one that calls the daemon) gRPC's own threads too: syscalls of microseconds."""
        cpus = self.cpus
        if cpus is None:
            return
        try:
            os.sched_setaffinity(0, cpus)
            if with_grpc:
                self._grpc_threads.move_to(cpus)
        except OSError as exc:  # outside this process's cpuset: it only costs speed
            self.cpus = None
            log.warning("capture threads stay where the rank runs: cannot move them to "
                        "CPUs %s (%s); give %s CPUs this process may use (taskset -p)",
                        ",".join(map(str, sorted(cpus))), exc, CPUS_ENV)

    def before_update(self) -> float:
        """Block until the last copy is done; returns seconds blocked. Call before step()."""
        if self._copied is None:
            return 0.0
        t0 = time.perf_counter()
        copied, self._copied = self._copied, None
        copied.result()  # re-raises a copy failure in the training thread, once
        waited = time.perf_counter() - t0
        if self.stats.stalls_s:
            self.stats.stalls_s[-1] += waited
        return waited

    def drain(self) -> None:
        """Wait until every scheduled capture has reached the daemon (raises its errors)."""
        self.before_update()
        sent, self._sent = self._sent, []
        for f in sent:
            f.result()

    def close(self) -> None:
        try:
            self._await_opening()
            self.drain()
        finally:
            self._copier.shutdown(wait=True)
            self._sender.shutdown(wait=True)
            self._grpc_threads.move_back()
            for s in self._slots:
                s.release()
            self._slots = []
            self._described = None  # its state's tensors are not kept alive by a closed capturer
