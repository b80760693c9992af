"""Faults of a chaos schedule injected into a running LocalCluster from the outside:
signals to the pids it started, bits flipped in a daemon's stored chunks, a node's
tmpfs filled. Hangs, GPU faults and errors fire inside the rank (STALWART_FAULTS, see
client/launched.py); their time comes back through the rank's fault log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.client.chaos_schedule import Fault, Schedule
from stalwart.client.local_cluster import LocalCluster, Node

__all__ = ["IN_RANK", "REPLAN_S", "Injector", "mount_tmpfs", "unmount"]

IN_RANK = {"hang": "hang", "gpu": "gpu", "error": "error"}  # chaos kind -> STALWART_FAULTS kind
PAUSE_S = 7.0  # a SIGSTOPped daemon's pause: past the 3 s heartbeat timeout of LocalCluster
FREE_AFTER_S = 2.0  # a full disk is freed this long after the plan that follows the kill
KILL_AFTER_FILL = 2  # steps from a filled disk to the kill that makes a rank restore
DISK_BYTES = 64 << 20  # a node's tmpfs for full-disk runs: roomy until filled
REPLAN_S = 3.0  # disk-stays-full runs: the daemons' [snapshot] disk_full_replan_s


@dataclass
class Fired:
    fault: Fault
    time_unix: float
    generation: int  # the job's generation when it fired

    @property
    def disruptive(self) -> bool:
        """It takes a process out of the job (a filled disk only holds commits back)."""
        return self.fault.kind != "full-disk"


@dataclass
class Injector:
    """Fires each fault of `schedule` once its trigger holds; `tick` is called often."""

    cluster: LocalCluster
    schedule: Schedule
    fired: list[Fired] = field(default_factory=list)
    paused: dict[int, float] = field(default_factory=dict)  # node -> SIGCONT at (monotonic)
    stopped: list[int] = field(default_factory=list)  # pids left SIGSTOPped
    ballast: Path | None = None
    _kill_after_fill: tuple[Fault, int] | None = None
    _free_at: float = 0.0

    def tick(self, step: int, generation: int) -> None:
        """`step`: the newest step any rank printed; `generation`: the job's now."""
        for node, at in list(self.paused.items()):
            if time.monotonic() >= at:
                self._signal(self.cluster.daemons[node].proc, signal.SIGCONT)
                del self.paused[node]
        if self._kill_after_fill and step >= self._kill_after_fill[1]:
            fault, at = self._kill_after_fill
            self._kill_after_fill = None
            self._release(at)
            self._signal(self._rank(fault.index), signal.SIGKILL)
            self.fired.append(Fired(Fault("kill-rank", "rank", fault.index, step),
                                    time.time(), generation))
        killed = self.fired[1] if len(self.fired) > 1 else None  # the kill after the fill
        if self.ballast is not None and killed and generation > killed.generation:
            self._free_at = self._free_at or time.monotonic() + FREE_AFTER_S
            if time.monotonic() >= self._free_at:
                self.ballast.unlink(missing_ok=True)  # the restore ran on a full disk
                self.ballast = None
        done = {id(f.fault) for f in self.fired}
        for f in self.schedule.faults:
            if id(f) in done or f.kind in IN_RANK:
                continue
            due = (generation > self.fired[0].generation if f.after == "recovery" and
                   self.fired else f.after != "recovery" and step >= f.step)
            if due:
                if f.after != "recovery":
                    self._release(f.step)
                self._fire(f, step)
                self.fired.append(Fired(f, time.time(), generation))

    def in_rank_fired(self, generation_at: dict[float, int]) -> None:
        """Record the faults the ranks fired themselves, from their fault logs."""
        assert self.cluster.workdir is not None
        for path in self.cluster.workdir.glob("fault-*.json"):
            rec = json.loads(path.read_text())
            f = next(f for f in self.schedule.faults if f.kind in IN_RANK)
            if not any(x.fault is f for x in self.fired):
                gen = max((g for t, g in generation_at.items() if t <= rec["time_unix"]),
                          default=1)
                self.fired.append(Fired(f, rec["time_unix"], gen))

    def hold_steps(self) -> list[int]:
        """The steps whose end every rank waits at until `tick` fires their faults (see
        `_release`): each fault due at a step, and the kill that follows a filled disk."""
        steps = {f.step for f in self.schedule.faults
                 if f.kind not in IN_RANK and f.after != "recovery"}
        steps |= {f.step + KILL_AFTER_FILL for f in self.schedule.faults
                  if f.kind == "full-disk"}
        return sorted(steps)

    def _release(self, step: int) -> None:
        """Let the ranks holding at `step` go on, just before the fault lands: it lands
        while they train the next step, never after a fast job has trained its last."""
        assert self.cluster.workdir is not None
        (self.cluster.workdir / f"release-{step}").touch()

    def release(self) -> None:
        """Resume what is paused (so close() can end it), free the disk, let every
        holding rank go on."""
        for step in self.hold_steps():
            self._release(step)
        for node in self.paused:
            self._signal(self.cluster.daemons[node].proc, signal.SIGCONT)
        self.paused.clear()
        if self.ballast is not None:
            self.ballast.unlink(missing_ok=True)

    # the faults ----------------------------------------------------------------------

    def _fire(self, f: Fault, step: int) -> None:
        if f.kind in ("kill-rank", "double"):
            self._signal(self._rank(f.index), signal.SIGKILL)
        elif f.kind == "kill-spare":
            self._signal([r for r in self.cluster.ranks if r.rank < 0][f.index].proc,
                         signal.SIGKILL)
        elif f.kind == "kill-daemon":
            self._signal(self.cluster.daemons[f.index].proc, signal.SIGKILL)
        elif f.kind in ("kill-node", "kill-coordinator"):
            node = self._coordinator() if f.kind == "kill-coordinator" else \
                self.cluster.daemons[f.index]
            self._signal(node.proc, signal.SIGKILL)
            for r in self.cluster.ranks:
                if r.node is node:
                    self._signal(r.proc, signal.SIGKILL)
        elif f.kind == "stop-rank":
            proc = self._rank(f.index)
            self._signal(proc, signal.SIGSTOP)
            self.stopped.append(proc.pid)
        elif f.kind == "stop-daemon":
            self._signal(self.cluster.daemons[f.index].proc, signal.SIGSTOP)
            self.paused[f.index] = time.monotonic() + PAUSE_S
        elif f.kind == "bitflip":
            own = self._node_of(f.index)
            flip_chunks([own.data_dir, *(n.data_dir for n in self.cluster.daemons
                                         if n is not own)], f.index)
            self._signal(self._rank(f.index), signal.SIGKILL)
        elif f.kind == "full-disk":
            self.ballast = fill(self._node_of(f.index).data_dir)
            # a restore while the disk is full
            self._kill_after_fill = (f, f.step + KILL_AFTER_FILL)
        elif f.kind == "disk-stays-full":  # freed only when the run ends (`release`)
            self.ballast = fill(self.cluster.daemons[f.index].data_dir)
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")

    def _rank(self, rank: int) -> subprocess.Popen[bytes]:
        return next(r.proc for r in self.cluster.ranks if r.rank == rank)

    def _node_of(self, rank: int) -> Node:
        return next(r.node for r in self.cluster.ranks if r.rank == rank)

    def _coordinator(self) -> Node:
        for node in self.cluster.daemons:
            st = node.status(timeout_s=1.0) if node.alive else None
            if st is not None and any(d.coordinator and d.node == st.node for d in st.daemons):
                return node
        return self.cluster.daemons[0]

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)


def flip_chunks(data_dirs: list[Path], rank: int) -> list[Path]:
    """Flip one bit in the middle of the first data shard of every chunk of `rank` on
    every daemon (the one a shard reader asks for first; a parity shard would never be
    read), and of every chunk kept whole on its own daemon's disk (chunks without shards,
    or [snapshot] local_copy), so a restore must read around them."""
    paths = [p for d in data_dirs for p in d.glob(f"shards/*/s*-r{rank}-c*.0")]
    paths += data_dirs[0].glob(f"snapshots/*/steps/*/r{rank}/c*.chunk")
    flipped = []
    for path in sorted(paths):
        with contextlib.suppress(FileNotFoundError), open(path, "r+b") as f:
            data = bytearray(f.read())
            if not data:
                continue
            data[len(data) // 2] ^= 0x10
            f.seek(0)
            f.write(data)
            flipped.append(path)
    return flipped


def fill(data_dir: Path) -> Path:
    """Take every free byte of the filesystem holding `data_dir`; returns the ballast."""
    ballast = data_dir / "ballast"
    st = os.statvfs(data_dir)
    # Unbuffered: a buffered file would hold the bytes the full disk refused and raise
    # ENOSPC again when closed, outside the suppress (it ended a chaos campaign once).
    with open(ballast, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
        with contextlib.suppress(OSError):  # the last blocks, in case fallocate fell short
            while True:
                f.write(b"\0" * (1 << 20))
    return ballast


def mount_tmpfs(path: Path, size_bytes: int = DISK_BYTES) -> str | None:
    """Mount a tmpfs of `size_bytes` on `path`; None on success, else why not (needs root)."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(path)], capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or "mount failed")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def job_state(statuses: list[Any]) -> tuple[int, int, Any]:
    """(generation, latest committed step, plan) of the coordinator among `statuses`."""
    for st in statuses:
        if st is not None and any(d.coordinator and d.node == st.node for d in st.daemons):
            return st.generation, st.latest_committed_step, st.plan
    return 0, 0, None
