"""Specification of GPU health detection: fault injection, and the NVML path on a stand-in."""

from __future__ import annotations

import asyncio
import queue
from types import SimpleNamespace

import pynvml
import pytest

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.recovery.gpu_health import (
    INJECT_ENV,
    GpuHealthMonitor,
    InjectedFault,
    parse_inject,
)

WAIT_S = 30.0  # deadline of every wait: generous for a loaded 2-core machine


def test_injection_specs_parse_and_bad_ones_are_named():
    assert parse_inject("xid:79, ecc:2@1,lost@3") == [
        InjectedFault("xid", 0, 79), InjectedFault("ecc", 1, 2), InjectedFault("lost", 3)]
    with pytest.raises(ValueError, match="'xid:abc'"):
        parse_inject("xid:abc")


async def collect(monitor: GpuHealthMonitor, got: asyncio.Queue, n: int) -> list[Failure]:
    try:
        return [await asyncio.wait_for(got.get(), WAIT_S) for _ in range(n)]
    finally:
        await monitor.stop()


def test_an_injected_fatal_xid_fails_every_rank_on_that_gpu():
    async def scenario():
        got: asyncio.Queue[Failure] = asyncio.Queue()
        mon = GpuHealthMonitor(got.put_nowait, node="n0", inject="xid:79@1",
                               device_ranks=lambda i: {1: ["r4", "r5"]}.get(i, []),
                               generation=lambda: 6)
        assert await mon.start()  # no NVML on this machine: injection alone runs it
        return await collect(mon, got, 2)

    failures = asyncio.run(scenario())
    assert [f.subject for f in failures] == ["r4", "r5"]
    for f in failures:
        assert f.kind is FailureKind.GPU_FAULT and f.details["xid"] == 79
        assert "Xid 79 on GPU 1" in f.evidence and f.reporter == "n0" and f.generation == 6


def test_non_fatal_xids_are_only_logged():
    async def scenario():
        got: asyncio.Queue[Failure] = asyncio.Queue()
        mon = GpuHealthMonitor(got.put_nowait, node="n0", inject="xid:13,xid:48")
        await mon.start()
        failures = await collect(mon, got, 1)
        return failures, got.qsize()

    (failure,), left = asyncio.run(scenario())
    assert failure.details["xid"] == 48 and failure.subject == "gpu0@n0" and left == 0


def test_a_fault_written_to_the_inject_file_at_run_time_is_reported(tmp_path, monkeypatch):
    path = tmp_path / "inject"
    monkeypatch.setenv(INJECT_ENV, str(path))

    async def scenario():
        got: asyncio.Queue[Failure] = asyncio.Queue()
        mon = GpuHealthMonitor(got.put_nowait, node="n2", poll_interval_s=0.05)
        assert await mon.start()
        path.write_text("lost@0\n")
        return await collect(mon, got, 1)

    (failure,) = asyncio.run(scenario())
    assert failure.details["gpu_lost"] and "NVML_ERROR_GPU_IS_LOST" in failure.evidence
    assert not path.exists()


def test_without_nvml_and_without_injection_the_monitor_stays_off(monkeypatch):
    monkeypatch.delenv(INJECT_ENV, raising=False)

    async def scenario():
        mon = GpuHealthMonitor(lambda f: None)
        return await mon.start(), mon.gpus

    assert asyncio.run(scenario()) == (False, 0)


class FakeNvml:
    """The pynvml functions the monitor uses, over two scripted GPUs."""

    NVMLError = pynvml.NVMLError
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.ecc = {0: 5, 1: None}  # GPU 1 has no ECC
        self.lost: set[int] = set()
        self.registered: list[tuple[int, int]] = []
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return SimpleNamespace(index=i)

    def nvmlDeviceGetIndex(self, h):
        return h.index

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlEventSetFree(self, s):
        pass

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return self.nvmlEventTypeXidCriticalError | self.nvmlEventTypeDoubleBitEccError

    def nvmlDeviceRegisterEvents(self, h, mask, s):
        self.registered.append((h.index, mask))

    def nvmlEventSetWait_v2(self, s, timeout_ms):
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None

    def _alive(self, h):
        if h.index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        self._alive(h)
        assert (error_type, counter_type) == (1, 0)
        if self.ecc[h.index] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.ecc[h.index]

    def nvmlDeviceGetMemoryInfo(self, h):
        self._alive(h)


def test_nvml_events_ecc_counters_and_lost_gpus_become_gpu_faults(monkeypatch):
    monkeypatch.delenv(INJECT_ENV, raising=False)
    nv = FakeNvml()

    async def scenario():
        got: asyncio.Queue[Failure] = asyncio.Queue()
        mon = GpuHealthMonitor(got.put_nowait, node="n1", nvml=nv, poll_interval_s=0.05,
                               device_ranks=lambda i: [f"r{i}"])
        assert await mon.start() and mon.gpus == 2
        nv.events.put(SimpleNamespace(device=SimpleNamespace(index=1), eventData=79,
                                      eventType=pynvml.nvmlEventTypeXidCriticalError))
        xid = await asyncio.wait_for(got.get(), WAIT_S)
        nv.ecc[0] = 8  # three new uncorrectable errors since start
        ecc = await asyncio.wait_for(got.get(), WAIT_S)
        nv.lost.add(1)
        lost = await asyncio.wait_for(got.get(), WAIT_S)
        nv.events.put(SimpleNamespace(device=SimpleNamespace(index=0), eventData=94,
                                      eventType=pynvml.nvmlEventTypeXidCriticalError))
        await asyncio.wait_for(got.get(), WAIT_S)  # a later event still arrives...
        left = got.qsize()  # ...and the lost GPU was reported only once
        await mon.stop()
        return xid, ecc, lost, left

    xid, ecc, lost, left = asyncio.run(scenario())
    assert nv.registered == [(0, 10), (1, 10)] and nv.shut
    assert (xid.subject, xid.details["xid"]) == ("r1", 79)
    assert ecc.subject == "r0" and "3 new uncorrectable ECC" in ecc.evidence
    assert lost.subject == "r1" and lost.details["gpu_lost"]
    assert left == 0


def test_a_gpu_already_gone_at_start_is_reported_lost_and_the_rest_watched(monkeypatch):
    monkeypatch.delenv(INJECT_ENV, raising=False)
    nv = FakeNvml()
    handle = nv.nvmlDeviceGetHandleByIndex

    def gone_at_start(i):
        if i == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle(i)

    nv.nvmlDeviceGetHandleByIndex = gone_at_start

    async def scenario():
        got: asyncio.Queue[Failure] = asyncio.Queue()
        mon = GpuHealthMonitor(got.put_nowait, node="n1", nvml=nv, poll_interval_s=0.05,
                               device_ranks=lambda i: [f"r{i}"])
        assert await mon.start() and mon.gpus == 2
        lost = await asyncio.wait_for(got.get(), WAIT_S)
        nv.ecc[0] = 6  # GPU 0 is still watched
        ecc = await asyncio.wait_for(got.get(), WAIT_S)
        await mon.stop()
        return lost, ecc

    lost, ecc = asyncio.run(scenario())
    assert lost.subject == "r1" and lost.details["gpu_lost"]
    assert ecc.subject == "r0" and nv.registered == [(0, 10)]


def test_the_gpu_check_reads_nvml_through_the_monitor_and_times_an_xid(monkeypatch):
    # What scripts/gpu_check.sh reports from a real driver, here on the stand-in: every
    # GPU's readings (a reading the driver refuses says so) and an Xid 79 to its failure.
    from stalwart.bench.gpu import _nvml

    monkeypatch.delenv(INJECT_ENV, raising=False)
    figures = _nvml(FakeNvml())
    assert figures["available"] is True and figures["gpus"] == 2
    assert [d["ecc_uncorrected"] for d in figures["devices"]][0] == 5
    assert figures["devices"][1]["ecc_uncorrected"] is None  # GPU 1 has no ECC
    assert str(figures["devices"][0]["name"]).startswith("not readable")  # no such call
    assert figures["xid79_to_failure_s"] > 0
    assert [d["events_registered"] for d in figures["devices"]] == [10, 10]
    assert "Xid 79 on GPU 0" in figures["failure"]


def test_an_xid_fails_the_rank_that_names_that_gpu_by_uuid_index_or_local_rank(monkeypatch):
    """NVML counts a host's GPUs in PCI order; a rank whose CUDA_VISIBLE_DEVICES
    renumbered them names its GPU by UUID, and the daemon matches that, not the index."""
    from stalwart.daemon.job import Job

    monkeypatch.delenv(INJECT_ENV, raising=False)
    nv = FakeNvml()
    nv.nvmlDeviceGetUUID = lambda h: [b"GPU-AAAA", "GPU-bbbb"][h.index]

    def rank(rank_id, device, local_rank, state="alive"):
        return SimpleNamespace(rank_id=rank_id, device=device, local_rank=local_rank,
                               state=state)

    ranks = [rank("by-uuid", "cuda:GPU-bbbb", 0), rank("by-index", "cuda:1", 0),
             rank("by-local-rank", "cuda", 1), rank("elsewhere", "cuda:GPU-aaaa", 1),
             rank("dead", "cuda:GPU-bbbb", 1, "dead"), rank("on-cpu", "cpu", 0)]

    async def scenario():
        mon = GpuHealthMonitor(lambda f: None, nvml=nv, poll_interval_s=0.05)
        assert await mon.start()
        job = SimpleNamespace(gpus=mon, registry=SimpleNamespace(ranks=lambda: ranks))
        on = {i: Job._ranks_on_device(job, i) for i in (0, 1)}
        await mon.stop()
        return mon.uuid(0), mon.uuid(2), on

    uuid0, missing, on = asyncio.run(scenario())
    assert (uuid0, missing) == ("gpu-aaaa", None)
    assert on[1] == ["by-uuid", "by-index", "by-local-rank"]
    assert on[0] == ["elsewhere", "on-cpu"]  # a CPU rank keeps its local rank's match


def test_a_rank_names_its_gpu_by_uuid(monkeypatch):
    import torch

    from stalwart.client.launched import gpu_named

    assert gpu_named("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert gpu_named("cuda") == "cuda"  # nothing to name it by
    props = {0: SimpleNamespace(uuid="1234abcd-0000"), 3: SimpleNamespace(uuid="GPU-9f")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props.__getitem__)
    assert gpu_named("cuda") == "cuda:GPU-1234abcd-0000"
    assert gpu_named("cuda:3") == "cuda:GPU-9f"
