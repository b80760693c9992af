"""`stalwart bench capture`: how long a capture blocks training, against the baselines.

One run, one model state (GPT parameters + AdamW moments): the real Capturer hands the
state to a real daemon every step while training continues; the baselines on the same
state are a plain memory copy (the floor), torch.save and DCP's async_save. Last, the
tiny model trains with and without a capture every step, interleaved, in one process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from stalwart.bench.progress import say


def _model(preset: str, batch: int, seq_len: int | None = None, seed: int = 0):
    """A full GPT on one rank with AdamW, and a function that trains one step."""
    import torch

    from stalwart.client.layers import Stage
    from stalwart_examples.gpt import job

    overrides = {} if seq_len is None else {"seq_len": seq_len}
    torch.manual_seed(seed)
    layers, data = job(preset, global_batch=batch, seed=seed, corpus_bytes=1 << 20,
                       **overrides)
    model = Stage(layers, 0, len(layers) - 1, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    steps = iter(range(1 << 30))

    def step() -> float:
        x, y = data.batch(data.indices(next(steps)))
        loss = layers.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()  # AdamW allocates its moments on the first step
    return model, opt, step


def _state(model, opt) -> dict[str, Any]:
    """Parameters and optimizer moments by snapshot name (live references)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p.detach()
        for key, t in sorted(opt.state[p].items()):
            out[f"optim/{name}/{key}"] = t
    return out


def _state_tensors(state: dict[str, Any]) -> list:
    from stalwart.client.state_layout import StateTensor

    return [StateTensor(name, t) for name, t in state.items()]


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _copy_floor(state: dict[str, Any], repeats: int) -> tuple[float, float]:
    """Bandwidth of one flat copy of the state's bytes into warm memory (bytes/s), floor (s)."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeros touches every page
    seconds = _best(lambda: dst.copy_(src), repeats)
    return nbytes / seconds, seconds


def _torch_save(state: dict[str, Any], folder: Path, repeats: int) -> float:
    import torch

    return median(_best(lambda: torch.save(state, folder / "state.pt"), 1)
                  for _ in range(repeats))


def _dcp_async_stall(state: dict[str, Any], folder: Path, repeats: int) -> tuple[float, float]:
    """Median time async_save blocks the caller, and median time until it is durable (s)."""
    import torch.distributed.checkpoint as dcp

    stalls, totals = [], []
    for i in range(repeats):
        writer = dcp.FileSystemWriter(str(folder / f"dcp-{i}"))
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # "no process group": one process is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            future = dcp.async_save(state, storage_writer=writer, no_dist=True)
        stalls.append(time.perf_counter() - t0)
        future.result()
        totals.append(time.perf_counter() - t0)
        shutil.rmtree(folder / f"dcp-{i}", ignore_errors=True)
    return median(stalls), median(totals)


class _DaemonRank:
    """This process registered as the only rank of a one-daemon job, with a Capturer."""

    def __init__(self, workdir: Path, daemon_settings: dict[str, Any] | None = None
                 ) -> None:
        from stalwart.client.capture import Capturer
        from stalwart.client.daemon_client import DaemonClient
        from stalwart.client.generation import GrpcCaptureTransport
        from stalwart.client.local_cluster import LocalCluster, wait_until
        from stalwart.v1 import common_pb2

        self.cluster = LocalCluster(nodes=1, workdir=workdir,
                                    daemon_settings=daemon_settings or {})
        self.cluster.start_daemons()
        node = self.cluster.daemons[0]
        self.client = DaemonClient(f"unix:{node.socket}")
        layout = common_pb2.ParallelLayout(dp=1, pp=1, tp=1, schedule="1f1b", microbatches=1,
                                           grad_accum=1)
        self.client.register(env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
                             layout=layout)
        self.client.start_heartbeats()
        generation = wait_until(lambda: self.client.status().generation, 60.0,
                                "the daemon's first plan")
        self.client.generation = generation
        self.transport = GrpcCaptureTransport(self.client, common_pb2.RankCoord(rank=0),
                                              layout, generation)
        self.capturer = Capturer(self.transport, token=self.client.token)
        self.step = 0  # step numbers keep rising across phases, as the daemon expects
        self.copy_waits_s: list[float] = []  # blocked in before_update, per optimizer step
        self.registries: dict[tuple[int, int], Any] = {}

    def train(self, model, opt, step: Callable[[], float], steps: int, capture: bool,
              every: int = 1) -> list[float]:
        """Wall time of each training step (capture, every `every` steps, included), s:
        the state and AdamW hints come from a StateRegistry of the model and optimizer
        at every capture, as `stalwart.run()` takes them from a user's training."""
        from stalwart.client.user_state import StateRegistry

        key = (id(model), id(opt))
        if key not in self.registries:
            self.registries[key] = StateRegistry({"model": model, "optimizer": opt})
        registry = self.registries[key]

        def wait_for_copy(*_: Any) -> None:
            # The optimizer is about to overwrite what is being copied.
            self.copy_waits_s.append(self.capturer.before_update())

        hook = opt.register_step_pre_hook(wait_for_copy) if capture else None
        times = []
        try:
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                self.step += 1
                if capture and self.step % every == 0:
                    tensors, extra = registry.capture(self.step)
                    self.capturer.capture(self.step, tensors, extra, registry.adamw_hints())
                times.append(time.perf_counter() - t0)
            if capture:
                self.capturer.before_update()  # the last copy's wait belongs to its step
        finally:
            if hook is not None:
                hook.remove()
        return times

    def fresh_capturer(self) -> None:
        """Close the Capturer and start another (new capture threads, new slots)."""
        from stalwart.client.capture import Capturer

        self.capturer.close()
        self.capturer = Capturer(self.transport, token=self.client.token)

    def wait_committed(self, step: int, timeout_s: float = 300.0) -> None:
        """Until the daemon has committed `step`."""
        from stalwart.client.local_cluster import wait_until
        from stalwart.v1 import rank_pb2

        def committed() -> bool:
            return self.client.call("wait_committed", "WaitCommitted", rank_pb2.
                                    WaitCommittedRequest(step=step, timeout_s=5.0)).committed

        wait_until(committed, timeout_s, f"the commit of step {step}")

    def close(self) -> None:
        try:
            self.capturer.close()
            self.client.close()
        finally:
            self.cluster.close()


SUSTAINED_STEPS = 120
"""Steps captured back to back per block: the daemon's slack (two slots and a backlog of
a few captures) fills within them when encoding is slower than a step, so the block's
second half trains at the pace the daemon keeps (a short block would hide it)."""


OVERHEAD_BLOCKS, OVERHEAD_BLOCKS_QUICK = 5, 1
"""Pairs of blocks (plain, captured) per overhead figure: this machine's speed drifts by
several percent between blocks, more than the effect on its good days."""

OWN_CORES_BLOCKS_SMALL = 2
"""Sets of blocks for the own-cores overhead on the `small` model (full runs only): its
steps are about 9x the tiny model's, so each set trains for over a minute."""


def _sustained(rank: _DaemonRank, model, opt, step: Callable[[], float],
               before_block: Callable[[bool], None] = lambda capture: None
               ) -> tuple[list[float], list[float]]:
    """One pair of blocks' step times (s): SUSTAINED_STEPS // 4 steps without capture,
    then SUSTAINED_STEPS with a capture every step, of which the last half count (the
    daemon's backlog drained after the pair)."""
    before_block(False)
    plain = rank.train(model, opt, step, SUSTAINED_STEPS // 4, capture=False)
    before_block(True)
    captured = rank.train(model, opt, step, SUSTAINED_STEPS, capture=True)[SUSTAINED_STEPS // 2:]
    rank.capturer.drain()
    rank.wait_committed(rank.step)
    return plain, captured


def _paired_pct(pairs: list[tuple[list[float], list[float]]]) -> float:
    """Median over blocks of how much slower (%) each block's steps were than those of
    the plain block beside it: a machine whose speed drifts between blocks moves both
    sides of a pair."""
    return round(median(100 * (median(other) / median(plain) - 1) for plain, other in pairs),
                 2)


def _pin(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` onto `cores` (Linux sets affinity per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SPIN = "while True: pass"
_STREAM = """
import sys, numpy as np, zstandard
n, level = int(sys.argv[1]) // 4, int(sys.argv[2])
rng = np.random.default_rng(0)
state = rng.standard_normal(n, dtype=np.float32)
before = state + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
delta = np.empty(n, dtype=np.uint32)
compress = zstandard.ZstdCompressor(level=level).compress
while True:
    np.bitwise_xor(state.view(np.uint32), before.view(np.uint32), out=delta)
    compress(delta)
    np.copyto(before, state)
"""


class _BusyNeighbour:
    """A process busy on `core` with no capture: spinning and touching no memory (what
    any busy process costs the training core: shared caches or a sibling hardware thread
    the virtual topology does not show), or, given `state_bytes`, streaming the daemon's
    kind of work over a state that size without pause (XOR against the last state,
    zstd, copy): what the memory traffic of a delta encode costs it."""

    def __init__(self, core: int, state_bytes: int = 0) -> None:
        import subprocess
        import sys

        from stalwart.daemon.snapshot.codecs import DEFAULT_LEVEL

        self.proc = subprocess.Popen([sys.executable, "-c", _STREAM, str(state_bytes),
                                      str(DEFAULT_LEVEL)] if state_bytes else
                                     [sys.executable, "-c", _SPIN])
        _pin(self.proc.pid, {core})

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _own_cores_overhead(rank: _DaemonRank, model, opt, step: Callable[[], float],
                        blocks: int) -> dict[str, Any]:
    """A model's step overhead with the rank's training thread (one torch thread)
    on one core and its daemon on another, as a deployment that gives the daemon a core
    has it: the capture threads run on the daemon's core (`stalwart run --capture-cpus`)
    in one set of blocks and beside the training thread in the other, interleaved, and
    two more sets train without capture beside a busy neighbour on the daemon's core
    (the machine's floor for any work there, and for a delta encode's memory traffic).
    None where the machine has fewer than two cores to give."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {"overhead_pct": None, "why": f"{len(cores)} core(s): nothing to pin apart"}
    try:
        os.sched_setaffinity(0, set(cores))  # may this process set affinities at all?
    except OSError as exc:
        return {"overhead_pct": None, "why": f"cannot pin threads here: {exc}"}
    daemon = rank.cluster.daemons[0].proc
    assert daemon is not None
    threads = torch.get_num_threads()
    before = {os.getpid(): set(cores), daemon.pid: os.sched_getaffinity(daemon.pid)}
    state = rank.capturer.stats.bytes_per_capture  # the model's, captured before
    assert state > 0, "the own-cores blocks follow captures of the same model"
    torch.set_num_threads(1)
    # Capture threads that start under one torch thread: a copy thread started earlier
    # keeps the OpenMP helper its first copy made, which the pin below would put beside
    # training (a deployment's threads start where --capture-cpus puts them).
    rank.fresh_capturer()
    capturer = rank.capturer
    _pin(daemon.pid, {cores[1]})
    try:
        def place(apart: bool) -> Callable[[bool], None]:
            def before_block(capture: bool) -> None:
                _pin(os.getpid(), {cores[0]})  # the capture threads beside training...
                capturer.cpus = frozenset({cores[1]}) if apart and capture else None
            return before_block  # ...or, `apart`, on the daemon's core

        plain, apart, beside, daemon_cpu_s = [], [], [], []
        neighbours: dict[int, list[tuple[list[float], list[float]]]] = {0: [], state: []}
        for _ in range(blocks):  # interleaved: drift hits every arm
            for arm, out in ((True, apart), (False, beside)):
                cpu_before, captures = _cpu_s(daemon.pid), rank.step
                more_plain, captured = _sustained(rank, model, opt, step, place(arm))
                if arm:  # includes the plain block, when the daemon has nothing to do
                    daemon_cpu_s.append((_cpu_s(daemon.pid) - cpu_before)
                                        / (rank.step - captures - SUSTAINED_STEPS // 4))
                plain += more_plain
                out.append((more_plain, captured))
            for streamed, neighbour in neighbours.items():
                busy = _BusyNeighbour(cores[1], streamed)
                try:
                    neighbour.append((out[-1][0], rank.train(
                        model, opt, step, SUSTAINED_STEPS // 2, capture=False)))
                finally:
                    busy.close()
    finally:
        capturer.cpus = None
        for pid, allowed in before.items():
            _pin(pid, allowed)
        torch.set_num_threads(threads)

    captured = [t for _, block in apart for t in block]
    return {"overhead_pct": _paired_pct(apart), "overhead_pct_capture_threads_on_rank_core":
            _paired_pct(beside), "busy_neighbour_overhead_pct": _paired_pct(neighbours[0]),
            "streaming_neighbour_overhead_pct": _paired_pct(neighbours[state]),
            "overhead_pct_by_block": [_paired_pct([pair]) for pair in apart],
            "daemon_cpu_s_per_capture": round(median(daemon_cpu_s), 6),
            "daemon_core_busy_fraction": round(median(daemon_cpu_s) / median(captured), 3),
            "rank_core": cores[0], "daemon_core": cores[1],
            "torch_threads": 1, "steps_each": len(plain),
            "captured_back_to_back": SUSTAINED_STEPS, "counted_from": SUSTAINED_STEPS // 2,
            "step_s_without_capture": round(median(plain), 6),
            "step_s_with_capture": round(median(captured), 6),
            "step_s_with_capture_threads_on_rank_core":
                round(median(t for _, block in beside for t in block), 6)}


def run(quick: bool) -> dict:
    import torch

    preset, batch, seq = ("tiny", 4, 64) if quick else ("small", 4, 128)
    steps, repeats = (6, 2) if quick else (12, 3)
    folder = Path(tempfile.mkdtemp(prefix="stalwart-bench-capture-"))
    rank = _DaemonRank(folder / "cluster")
    say("daemon up, rank registered")
    try:
        model, opt, step = _model(preset, batch, seq)
        state = _state(model, opt)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        bandwidth, floor_s = _copy_floor(state, repeats + 2)
        save_s = _torch_save(state, folder, repeats)
        dcp_stall_s, dcp_total_s = _dcp_async_stall(state, folder, repeats)

        say(f"baselines done ({nbytes / 1e6:.0f} MB state); capturing {steps} steps")
        rank.train(model, opt, step, 2, capture=False)  # warm-up: first steps run slow
        step_with_s = median(rank.train(model, opt, step, steps, capture=True)[1:])
        stalls = rank.capturer.stats.stalls_s[1:]  # the first opens and pre-faults the slots
        copies = rank.capturer.stats.copies_s[1:]
        waits = rank.copy_waits_s[2:]  # per optimizer step; 0 when the copy was done
        stall_s = median(stalls)
        step_s = median(rank.train(model, opt, step, 3, capture=False))
        # Every 3rd step gives the daemon time to encode between captures (an odd period,
        # so that the capturer's two slots, chosen by step parity, alternate).
        before = len(rank.capturer.stats.stalls_s)
        rank.train(model, opt, step, steps, capture=True, every=3)
        sparse_stalls = rank.capturer.stats.stalls_s[before + 1:]

        say("step overhead on the tiny model")
        tiny_model, tiny_opt, tiny_step = _model("tiny", 4, 64, seed=1)
        rank.train(tiny_model, tiny_opt, tiny_step, 5, capture=False)  # warm-up
        before = len(rank.capturer.stats.stalls_s)
        # Interleaved blocks: drift hits both sides.
        pairs = [_sustained(rank, tiny_model, tiny_opt, tiny_step)
                 for _ in range(OVERHEAD_BLOCKS_QUICK if quick else OVERHEAD_BLOCKS)]
        plain = [t for block, _ in pairs for t in block]
        captured = [t for _, block in pairs for t in block]
        tiny_stalls = rank.capturer.stats.stalls_s[before:]
        tiny_bytes = rank.capturer.stats.bytes_per_capture
        own = _own_cores_overhead(rank, tiny_model, tiny_opt, tiny_step,
                                  OVERHEAD_BLOCKS_QUICK if quick else OVERHEAD_BLOCKS)
        if quick:
            own_small = {"overhead_pct": None, "why": "measured in full runs only (minutes)"}
        else:
            say(f"step overhead with a core each on the {preset} model")
            rank.train(model, opt, step, 2, capture=True)  # its size is what is captured
            own_small = _own_cores_overhead(rank, model, opt, step, OWN_CORES_BLOCKS_SMALL)
    finally:
        rank.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "model": {"preset": preset, "batch": batch, "seq_len": seq,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "state_bytes": nbytes,
        "captures": len(stalls),
        "stall_s": round(stall_s, 6),
        "stall_max_s": round(max(stalls), 6),
        "stall_waiting_for_copy_s": round(median(waits), 6),
        "handoff_s": round(max(0.0, stall_s - median(waits)), 6),
        "stall_s_capture_every_3_steps": round(median(sparse_stalls), 6),
        "step_s_without_capture": round(step_s, 6),
        "step_s_with_capture": round(step_with_s, 6),
        "background_copy_s": round(median(copies), 6),
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "memcpy_floor_s": round(floor_s, 6),
        "torch_save_s": round(save_s, 6),
        "dcp_async_save_stall_s": round(dcp_stall_s, 6),
        "dcp_async_save_total_s": round(dcp_total_s, 6),
        "stall_vs_dcp_async": round(stall_s / dcp_stall_s, 4),
        "stall_vs_torch_save": round(stall_s / save_s, 4),
        "stall_vs_memcpy_floor": round(stall_s / floor_s, 4),
        "tiny": {"state_bytes": tiny_bytes, "steps_each": len(plain),
                 "step_s_without_capture": round(median(plain), 6),
                 "step_s_with_capture": round(median(captured), 6),
                 "stall_s": round(median(tiny_stalls), 6)},
        "step_overhead_pct": _paired_pct(pairs),
        "step_overhead_pct_own_cores": own["overhead_pct"],
        "own_cores": own,
        "step_overhead_pct_own_cores_small": own_small["overhead_pct"],
        "own_cores_small": own_small,
        "torch_threads": torch.get_num_threads(),
        "notes": "stall_s: median time the training thread is blocked per capture "
                 "(capture() call plus the wait before the next optimizer.step()), real "
                 "Capturer -> daemon subprocess, first capture (slot set-up) excluded "
                 "(tiny.stall_s: every capture of the tiny model's captured blocks). "
                 "step_overhead_pct: tiny GPT, capture every step vs none (the state and "
                 "AdamW hints taken by a StateRegistry at each capture, as stalwart.run() "
                 "takes them, and counted in the step), median over "
                 f"{OVERHEAD_BLOCKS} pairs of blocks in one process of each pair's ratio, "
                 f"each captured block {SUSTAINED_STEPS} steps back to back of which "
                 f"the last {SUSTAINED_STEPS // 2} count (the pace once "
                 "the daemon's slack is used up); the daemon's encoding shares the "
                 "machine's cores. "
                 "step_overhead_pct_own_cores: the same with the training thread (one "
                 "torch thread) pinned to one core, and the daemon and the capture's "
                 "copy and hand-over threads to another (stalwart run --capture-cpus); "
                 "step_overhead_pct_own_cores_small: the same on the small model "
                 f"(full runs; {OWN_CORES_BLOCKS_SMALL} sets of blocks), whose step is "
                 "long against the per-capture work of the training thread. "
                 "own_cores.overhead_pct_capture_threads_on_rank_core: the capture "
                 "threads left beside the training thread, blocks interleaved. "
                 "own_cores.busy_neighbour_overhead_pct: no capture, a process spinning "
                 "on the daemon's core instead (this machine's cost of any work there); "
                 "streaming_neighbour_overhead_pct: no capture, a process on the daemon's "
                 "core streaming a delta encode's memory traffic over a state of the "
                 "tiny model's size without pause (XOR against the last state, zstd, "
                 "copy): this machine's cost of the daemon's kind of work there. "
                 "own_cores.daemon_cpu_s_per_capture: the daemon's CPU time over a "
                 "captured block, per capture; daemon_core_busy_fraction: that over the "
                 "captured step time (above 1 the daemon sets the pace). "
                 "handoff_s: the rest (describe the state, hand the slot over). "
                 "stall_waiting_for_copy_s: part of the stall spent before optimizer.step() "
                 "waiting for the copy, which itself waits for a slot the daemon has not "
                 "finished encoding (backpressure when encoding is slower than a step).",
    }
