"""GPU health through NVML: fatal Xid errors, uncorrectable ECC errors, GPUs that are lost.

One thread blocks in nvmlEventSetWait (NVML has no async API) and, between waits,
polls ECC counters and liveness; failures reach the asyncio loop as GPU_FAULT. Without
NVML (no driver) the monitor stays idle. `STALWART_NVML_INJECT` injects faults.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.core.failures import Failure, FailureKind

__all__ = ["FATAL_XIDS", "GpuHealthMonitor", "InjectedFault", "parse_inject", "INJECT_ENV"]

log = logging.getLogger(__name__)

FailureSink = Callable[[Failure], object]  # receives each failure once, on the loop

INJECT_ENV = "STALWART_NVML_INJECT"
"""Faults to inject: "xid:79", "xid:48@1" (device 1), "ecc:2@0", "lost@0", comma separated,
applied at start; or an absolute path whose contents (same syntax) are applied and the
file removed whenever it appears (inject at run time: `echo xid:79 > PATH`)."""

FATAL_XIDS = frozenset({48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140})
"""Xids after which the GPU's state cannot be trusted: double-bit ECC (48), micro-controller
halt (61, 62), row-remap failure (64), NVLink (74), fallen off the bus (79), contained and
uncontained ECC (94, 95), GSP errors (119, 120), unrecovered ECC (140). Application-caused
Xids (13, 31, 43, 45) are logged only: the rank's own error path covers them."""

_SPEC = re.compile(r"^(xid:(?P<xid>\d+)|ecc:(?P<ecc>\d+)|(?P<lost>lost))(@(?P<dev>\d+))?$")


@dataclass(frozen=True)
class InjectedFault:
    kind: str  # "xid" | "ecc" | "lost"
    device: int
    value: int = 0


def parse_inject(spec: str) -> list[InjectedFault]:
    """Parse an injection spec (see INJECT_ENV); raises ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(f"{INJECT_ENV}: cannot parse {part!r}; expected xid:N[@DEV], "
                             "ecc:COUNT[@DEV] or lost[@DEV]")
        dev = int(m["dev"] or 0)
        if m["xid"]:
            faults.append(InjectedFault("xid", dev, int(m["xid"])))
        elif m["ecc"]:
            faults.append(InjectedFault("ecc", dev, int(m["ecc"])))
        else:
            faults.append(InjectedFault("lost", dev))
    return faults


class GpuHealthMonitor:
    """Watches every GPU of this node and reports GPU_FAULT for the ranks using it.

    `device_ranks(index)` names the rank_ids on a GPU; with none, the subject is
    "gpu<index>@<node>". `nvml` defaults to the `pynvml` module (nvidia-ml-py); tests
    pass a stand-in with the same functions. `poll_interval_s`: ECC/liveness polls.
    """

    def __init__(self, on_failure: FailureSink, *, node: str = "",
                 device_ranks: Callable[[int], Iterable[str]] | None = None,
                 generation: Callable[[], int] = lambda: 0, nvml: Any = None,
                 fatal_xids: frozenset[int] = FATAL_XIDS, poll_interval_s: float = 2.0,
                 inject: str | None = None) -> None:
        self.on_failure = on_failure
        self.node = node
        self.device_ranks = device_ranks
        self.generation = generation
        self.fatal_xids = fatal_xids
        self.poll_interval_s = poll_interval_s
        self._nvml = nvml
        spec = os.environ.get(INJECT_ENV, "") if inject is None else inject
        self._inject_path = Path(spec) if spec.startswith("/") else None
        self._inject_now = [] if self._inject_path else parse_inject(spec)
        self._handles: list[Any] = []
        self._uuids: list[str | None] = []  # each GPU's NVML UUID ("GPU-..."), by index
        # By GPU index: the NVML event types registered for it, or why none were.
        self.events: dict[int, int | str] = {}
        self._ecc_seen: dict[int, int] = {}
        self._lost: set[int] = set()
        self._event_set: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def gpus(self) -> int:
        """GPUs under watch (0 when NVML is unavailable)."""
        return len(self._handles)

    def uuid(self, index: int) -> str | None:
        """GPU `index`'s UUID as NVML gives it ("GPU-...", lower case), where known: how
        a rank names its GPU whatever CUDA_VISIBLE_DEVICES renumbered (NVML counts every
        GPU of the host in PCI order)."""
        return self._uuids[index] if 0 <= index < len(self._uuids) else None

    async def start(self) -> bool:
        """Open NVML and start watching; False when there is neither NVML nor injection."""
        self._loop = asyncio.get_running_loop()
        have_nvml = await asyncio.to_thread(self._open)
        if not have_nvml and not (self._inject_path or self._inject_now):
            return False
        self._thread = threading.Thread(target=self._run, name="stalwart-nvml", daemon=True)
        self._thread.start()
        return True

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        if self._handles:
            nv = self._nvml
            if self._event_set is not None:
                nv.nvmlEventSetFree(self._event_set)
            nv.nvmlShutdown()

    def inject(self, spec: str) -> None:
        """Apply faults now, through the same handlers as real NVML events."""
        self._apply(parse_inject(spec))

    def _apply(self, faults: list[InjectedFault]) -> None:
        for fault in faults:
            if fault.kind == "xid":
                self._on_xid(fault.device, fault.value)
            elif fault.kind == "ecc":
                self._on_ecc(fault.device, self._ecc_seen.get(fault.device, 0) + fault.value)
            else:
                self._on_lost(fault.device)

    def _open(self) -> bool:
        try:
            if self._nvml is None:
                import pynvml
                self._nvml = pynvml
            nv = self._nvml
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:  # ImportError, or NVMLError without a driver
            log.info("GPU health monitoring off: NVML unavailable (%s)", exc)
            self._nvml = None
            return False
        # A GPU that is already gone (or refused) must not keep the daemon from starting:
        # it is reported lost once the monitor runs, and the others are watched.
        self._handles = []
        for index in range(count):
            try:
                self._handles.append(nv.nvmlDeviceGetHandleByIndex(index))
            except nv.NVMLError as exc:
                log.warning("GPU %d: no NVML handle (%s); reported lost", index, exc)
                self._handles.append(None)
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("no NVML event set (%s); polling ECC and liveness only", exc)
            self._event_set = None
        self._uuids = [_uuid_of(nv, h) for h in self._handles]
        wanted = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                if self._event_set is not None:
                    supported = nv.nvmlDeviceGetSupportedEventTypes(handle)
                    nv.nvmlDeviceRegisterEvents(handle, wanted & supported, self._event_set)
                    self.events[index] = wanted & supported
            except nv.NVMLError as exc:
                self.events[index] = str(exc)
                log.warning("GPU %d: no NVML events (%s); polling ECC and liveness only",
                            index, exc)
            try:
                self._ecc_seen[index] = self._ecc_count(handle) or 0
            except nv.NVMLError:
                self._ecc_seen[index] = 0  # the first poll reports a GPU that is gone
        log.info("watching %d GPU(s) through NVML", len(self._handles))
        return True

    def _run(self) -> None:
        self._apply(self._inject_now)
        for index, handle in enumerate(self._handles):
            if handle is None:
                self._on_lost(index)
        while not self._stop.is_set():
            if self._handles and self._event_set is not None:
                self._wait_event()
            else:
                self._stop.wait(self.poll_interval_s)
            self._poll()

    def _wait_event(self) -> None:
        nv = self._nvml
        try:
            event = nv.nvmlEventSetWait_v2(self._event_set, int(self.poll_interval_s * 1000))
        except nv.NVMLError_Timeout:
            return
        except nv.NVMLError_GpuIsLost:
            return  # the poll below tells which GPU
        except nv.NVMLError as exc:
            log.warning("waiting for NVML events failed (%s); retrying", exc)
            self._stop.wait(self.poll_interval_s)
            return
        index = self._index_of(event.device)
        if event.eventType & nv.nvmlEventTypeXidCriticalError:
            self._on_xid(index, int(event.eventData))
        if event.eventType & nv.nvmlEventTypeDoubleBitEccError:
            self._on_ecc(index, self._ecc_seen.get(index, 0) + 1)

    def _poll(self) -> None:
        if self._inject_path is not None and self._inject_path.exists():
            spec = self._inject_path.read_text().strip()
            self._inject_path.unlink(missing_ok=True)
            self.inject(spec)
        nv = self._nvml
        for index, handle in enumerate(self._handles):
            if index in self._lost:  # a GPU without a handle was reported lost at start
                continue
            try:
                count = self._ecc_count(handle)
                nv.nvmlDeviceGetMemoryInfo(handle)  # any call fails on a GPU that is gone
            except nv.NVMLError_GpuIsLost:
                self._on_lost(index)
                continue
            except nv.NVMLError as exc:
                log.warning("GPU %d: NVML poll failed (%s)", index, exc)
                continue
            if count is not None and count > self._ecc_seen.get(index, 0):
                self._on_ecc(index, count)

    def _ecc_count(self, handle: Any) -> int | None:
        nv = self._nvml
        try:
            return int(nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        except nv.NVMLError_NotSupported:
            return None

    def _index_of(self, handle: Any) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            return -1

    def _on_xid(self, index: int, xid: int) -> None:
        if xid not in self.fatal_xids:
            log.warning("GPU %d: Xid %d (not fatal for training; logged only)", index, xid)
            return
        self._report(index, f"Xid {xid} on GPU {index}", {"xid": xid})

    def _on_ecc(self, index: int, total: int) -> None:
        """`total`: the GPU's volatile count of uncorrectable ECC errors now."""
        new = total - self._ecc_seen.get(index, 0)
        if new <= 0:
            return
        self._ecc_seen[index] = total
        self._report(index, f"{new} new uncorrectable ECC error(s) on GPU {index} "
                            f"(volatile total {total})", {"ecc_uncorrected": total})

    def _on_lost(self, index: int) -> None:
        if index in self._lost:
            return
        self._lost.add(index)
        self._report(index, f"GPU {index} is lost (NVML_ERROR_GPU_IS_LOST): it fell off the "
                            "bus or stopped answering", {"gpu_lost": True})

    def _report(self, index: int, evidence: str, details: dict) -> None:
        subjects = list(self.device_ranks(index)) if self.device_ranks else []
        for subject in subjects or [f"gpu{index}@{self.node}"]:
            failure = Failure(FailureKind.GPU_FAULT, subject, evidence,
                              generation=self.generation(), reporter=self.node,
                              details={"gpu": index, **details})
            if self._loop is None:
                raise RuntimeError("GpuHealthMonitor.start() must run before faults arrive")
            self._loop.call_soon_threadsafe(self._deliver, failure)

    def _deliver(self, failure: Failure) -> None:
        """On the event loop's thread: log the fault and hand it on."""
        log.warning("failure detected: %s", failure.describe())
        self.on_failure(failure)


def _uuid_of(nv: Any, handle: Any) -> str | None:
    if handle is None:
        return None
    try:
        uuid = nv.nvmlDeviceGetUUID(handle)
    except Exception:  # NVMLError, or a stand-in without the call: matched by index then
        return None
    return (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).lower()
