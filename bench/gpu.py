"""`stalwart bench gpu`: what only a GPU machine can show, in one run (see
scripts/gpu_check.sh, which installs the repo there and runs this).

- capture: how long a capture of CUDA-resident state (parameters and AdamW moments,
  at least 1 GB) blocks training, through the real Capturer and a real daemon, against
  DCP `async_save` with pinned-memory staging on the same state in the same loop;
- restore: the committed state back into CUDA tensors through the daemon, bitwise;
- nvml: the daemon's GPU monitor on the real driver (GPUs, ECC counters) and the time
  from an Xid 79 handed to it to the failure it reports;
- nccl: this rank's groups built, aborted in-process, and built again as the next
  generation would, with an all-reduce on each.

Without CUDA it runs on the CPU at a small size (gloo groups, no NVML): a smoke run
that proves the script, not a figure to quote.
"""

from __future__ import annotations

import asyncio
import inspect
import mmap
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from stalwart.bench.progress import say

XID_WAIT_S = 30.0


def _model(device: str, width: int, layers: int, batch: int):
    """An MLP with AdamW on `device`, and one training step (synchronised, so its time
    is the step's)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # AdamW allocates its moments on the first step
    return model, opt, step


def _stalls(opt: Any, step: Callable[[], None], start: Callable[[], Callable[[], None]],
            settle: Callable[[], None], repeats: int) -> tuple[list[float], list[float]]:
    """Per save: seconds training was blocked (the call that starts it, plus the wait
    before the next optimizer step may overwrite what it copies), and the step time of
    the step the save overlapped. `settle` waits, untimed, until the save is done."""
    stalls, steps = [], []
    pending: list[Callable[[], None]] = []

    def before_update(*_: Any) -> None:
        if pending:
            t0 = time.perf_counter()
            pending.pop()()
            stalls[-1] += time.perf_counter() - t0

    hook = opt.register_step_pre_hook(before_update)
    try:
        for _ in range(repeats):
            step()
            t0 = time.perf_counter()
            pending.append(start())
            stalls.append(time.perf_counter() - t0)
            step()  # the copy overlaps this step's forward and backward
            steps.append(time.perf_counter() - t0)
            settle()
    finally:
        hook.remove()
    return stalls, steps


def _dcp(state: dict[str, Any], folder: Path, cuda: bool) -> tuple[Callable, Callable, str]:
    """DCP async_save of `state`: (start, settle, how it staged)."""
    import torch.distributed.checkpoint as dcp

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                              use_async_staging=True,
                                              use_non_blocking_copy=cuda))
        how = f"DefaultStager(pinned={cuda}, async staging)"
    except (ImportError, TypeError):  # an older torch: staging inside the call
        stager, how = None, "default (staged inside the call)"
    saves: list[Any] = []
    # "no process group": one process is the point. Its save threads warn too, so the
    # filter is the process's, not a catch_warnings block's.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def start() -> Callable[[], None]:
        writer = dcp.FileSystemWriter(str(folder / f"dcp-{len(saves)}"))
        kwargs = {"async_stager": stager} if stager is not None else {}
        if "no_dist" in inspect.signature(dcp.async_save).parameters:  # torch >= 2.8
            kwargs["no_dist"] = True
        reply = dcp.async_save(state, storage_writer=writer, **kwargs)
        saves.append(reply)
        staged = getattr(reply, "staging_completion", None)
        return (lambda: staged.result()) if staged is not None else (lambda: None)

    def settle() -> None:
        reply = saves[-1]
        getattr(reply, "upload_completion", reply).result()
        shutil.rmtree(folder / f"dcp-{len(saves) - 1}", ignore_errors=True)

    return start, settle, how


def _capture_and_restore(device: str, width: int, layers: int, batch: int, repeats: int,
                         folder: Path) -> dict[str, Any]:
    import torch

    from stalwart.bench.capture import _DaemonRank, _state, _state_tensors
    from stalwart.client.state_layout import unpack

    model, opt, step = _model(device, width, layers, batch)
    state = _state(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    on_device = sum(t.numel() * t.element_size() for t in state.values() if t.device.type
                    == device)
    say(f"{nbytes / 1e9:.2f} GB of state ({on_device / 1e9:.2f} GB on {device}); "
        "starting a daemon")
    rank = _DaemonRank(folder / "cluster")
    try:
        step_s = median(_timed(step) for _ in range(repeats + 1))
        tensors = _state_tensors(state)

        def capture() -> Callable[[], None]:
            rank.step += 1
            rank.capturer.capture(rank.step, tensors, {"step": rank.step})
            return lambda: rank.capturer.before_update()

        _stalls(opt, step, capture, rank.capturer.drain, 1)  # slots opened and pinned
        say("capturing")
        ours, ours_steps = _stalls(opt, step, capture, rank.capturer.drain, repeats)
        say("DCP async_save on the same state")
        start, settle, how = _dcp(state, folder, device == "cuda")
        _stalls(opt, step, start, settle, 1)  # its first save sets up its buffers
        theirs, theirs_steps = _stalls(opt, step, start, settle, repeats)

        say("restoring the committed state into fresh tensors")
        capture()()
        rank.capturer.drain()
        last = rank.step
        rank.wait_committed(last)

        def restore(into_slot: bool) -> tuple[float, float, bool]:
            t0 = time.perf_counter()
            record, data = rank.client.restore(last, 0, into_slot=into_slot)
            fetched_s = time.perf_counter() - t0
            paths.add("slot" if isinstance(data, mmap.mmap) else "stream")
            restored = {name: t.to(state[name].device, non_blocking=True)
                        for name, t in unpack(data, record.tensors).items()}
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            return seconds, fetched_s, sorted(restored) == sorted(state) and all(
                torch.equal(restored[name], t) for name, t in state.items())

        # Alternated, best of each: the daemon's page cache is warm for both.
        paths: set[str] = set()
        runs = [restore(into_slot) for _ in range(2) for into_slot in (True, False)]
        restore_s, fetched_s, _ = min(runs[0::2])
        stream_s, stream_fetched_s, _ = min(runs[1::2])
        bitwise = all(ok for _, _, ok in runs[0::2])
        stream_bitwise = all(ok for _, _, ok in runs[1::2])
    finally:
        rank.close()
    return {
        "state_bytes": nbytes, "state_bytes_on_device": on_device,
        "model": {"width": width, "layers": layers, "batch": batch,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "step_s": round(step_s, 6),
        "capture_stall_s": round(median(ours), 6),
        "capture_stall_max_s": round(max(ours), 6),
        "step_s_with_capture": round(median(ours_steps), 6),
        "dcp_async_save_stall_s": round(median(theirs), 6),
        "dcp_step_s_with_save": round(median(theirs_steps), 6),
        "dcp_staging": how,
        "capture_stall_vs_dcp": round(median(ours) / median(theirs), 4),
        "restore_s": round(restore_s, 6),
        "restore_fetch_s": round(fetched_s, 6),
        "restore_gbps": round(nbytes / restore_s / 1e9, 3),
        "restore_bitwise": bitwise,
        "stream_restore_s": round(stream_s, 6),
        "stream_restore_fetch_s": round(stream_fetched_s, 6),
        "stream_restore_bitwise": stream_bitwise,
        "restore_speedup_vs_stream": round(stream_s / restore_s, 2),
        "restore_paths": sorted(paths),  # ["slot", "stream"]: the slot path was taken
    }


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _nvml(nvml: Any = None) -> dict[str, Any]:
    """The daemon's GpuHealthMonitor on this machine's driver (`nvml`: pynvml, or a
    stand-in in tests)."""
    from stalwart.daemon.recovery.gpu_health import GpuHealthMonitor

    async def main() -> dict[str, Any]:
        failed = asyncio.Event()
        seen: list[Any] = []

        def on_failure(failure: Any) -> None:
            seen.append(failure)
            failed.set()

        monitor = GpuHealthMonitor(on_failure, node="gpu-check", nvml=nvml,
                                   device_ranks=lambda i: [f"gpu-check/{i}"])
        if not await monitor.start():
            return {"available": False, "why": "NVML unavailable (no driver or no pynvml)"}
        try:
            nv = monitor._nvml
            handles = monitor._handles
            readings = [{
                "name": _maybe(lambda h=h: _text(nv.nvmlDeviceGetName(h))),
                "memory_total_bytes": _maybe(lambda h=h: int(nv.nvmlDeviceGetMemoryInfo(h)
                                                             .total)),
                "temperature_c": _maybe(lambda h=h: nv.nvmlDeviceGetTemperature(
                    h, nv.NVML_TEMPERATURE_GPU)),
                "power_w": _maybe(lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000),
                "ecc_uncorrected": _maybe(lambda h=h: monitor._ecc_count(h)),
                "uuid": monitor.uuid(i),
                # the Xid and ECC event types the monitor waits on (a mask), or why none
                "events_registered": monitor.events.get(i, "no NVML event set"),
            } for i, h in enumerate(handles)]
            t0 = time.perf_counter()
            monitor.inject("xid:79@0")  # through the handlers real NVML events reach
            await asyncio.wait_for(failed.wait(), XID_WAIT_S)
            xid_s = time.perf_counter() - t0
        finally:
            await monitor.stop()
        return {"available": True, "gpus": len(handles), "devices": readings,
                "xid79_to_failure_s": round(xid_s, 6),
                "failure": seen[0].describe() if seen else ""}

    return asyncio.run(main())


def _maybe(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:  # NVMLError_NotSupported and friends: say which
        return f"not readable: {exc}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _groups(device: str, repeats: int) -> dict[str, Any]:
    """Generation 1's groups, an all-reduce, an in-process abort, generation 2's groups."""
    import torch
    import torch.distributed as dist

    from stalwart.client.parallel_dims import ParallelDims

    backend = "nccl" if device == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    builds, aborts, reduces = [], [], []
    ok = True
    for generation in range(1, repeats + 2):
        t0 = time.perf_counter()
        dims = ParallelDims().build(store, 0, generation, backend=backend, timeout_s=60.0)
        builds.append(time.perf_counter() - t0)
        x = torch.full((1 << 20,), float(generation), device=device)
        t0 = time.perf_counter()
        # On the backend itself: Group.all_reduce skips a group of one, and NCCL makes
        # its communicator only at the first collective, which the abort must then end.
        dims.world.pg.allreduce([x]).wait()
        if device == "cuda":
            torch.cuda.synchronize()
        reduces.append(time.perf_counter() - t0)
        ok = ok and bool((x == generation).all())
        t0 = time.perf_counter()
        dims.abort()
        aborts.append(time.perf_counter() - t0)
    return {"backend": backend, "generations": len(builds), "all_reduce_ok": ok,
            "build_s": round(median(builds[1:]), 6), "first_build_s": round(builds[0], 6),
            "abort_s": round(median(aborts), 6), "all_reduce_s": round(median(reduces), 6)}


def run(quick: bool) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # 4096^2 fp32 weights with two AdamW moments: 201 MB of state a layer.
    width, layers, batch = ((4096, 6, 4096) if cuda else (1024, 4, 64)) if not quick else \
        ((4096, 2, 1024) if cuda else (512, 2, 16))
    repeats = 3 if quick else 5
    say(f"device {device}" + (f" ({torch.cuda.get_device_name()})" if cuda else
                              ": no CUDA, a smoke run at a small size"))
    folder = Path(tempfile.mkdtemp(prefix="stalwart-bench-gpu-"))
    try:
        figures = {"device": device, "torch": torch.__version__,
                   "cuda": torch.version.cuda if cuda else None,
                   **_capture_and_restore(device, width, layers, batch, repeats, folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    say("NVML through the daemon's GPU monitor")
    figures["nvml"] = _nvml()
    say(f"process groups ({'NCCL' if cuda else 'gloo'}): build, abort, rebuild")
    figures["groups"] = _groups(device, repeats)
    figures["notes"] = (
        "capture_stall_s: median seconds training is blocked per capture (the capture "
        "call plus the wait before the next optimizer.step), Capturer -> daemon "
        "subprocess; dcp_async_save_stall_s: the same for DCP async_save on the same "
        "state in the same loop (staging as dcp_staging says). restore_s: the committed "
        "step from the daemon back into tensors on the state's devices, through a "
        "shared-memory slot the daemon fills; stream_restore_s: the same over the gRPC "
        "stream (1 MiB pieces), in the same run. groups: one "
        "rank (one GPU allows no more under NCCL), abort through ParallelDims.abort().")
    return figures
