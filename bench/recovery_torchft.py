"""TorchFT beside Stalwart in `stalwart bench recovery`: the same GPT, data parallel over
two replica groups of one process each, one SIGKILL per trial, and a replacement started
at once (as a scheduler would restart it). Reports how long the surviving replica
stalls and when the replacement commits its first step.

TorchFT's settings are the aggressive ones a user would pick for fast recovery: a
lighthouse that declares a replica dead after HEARTBEAT_TIMEOUT_MS and ticks every
QUORUM_TICK_MS; the workers themselves are `torchft_worker.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

from stalwart.bench.events import read_events
from stalwart.bench.progress import say, seconds
from stalwart.client.local_cluster import ClusterError, wait_until
from stalwart.client.ports import free_port

HEARTBEAT_TIMEOUT_MS = 300
QUORUM_TICK_MS = 50
WORKER_HEARTBEAT_MS = 100
GROUPS = 2
VICTIM = 1
JOINED_STEPS = 3  # steps the replacement commits with the survivor before the trial ends
MAX_STEPS_AFTER_KILL = 2000  # a bound only: the trial ends once the replacement joined


def lighthouse_binary() -> str | None:
    """torchft_lighthouse beside this Python (the wheel installs it), else on PATH."""
    here = Path(sys.executable).parent / "torchft_lighthouse"
    return str(here) if here.exists() else shutil.which("torchft_lighthouse")


def run_torchft(spec: dict[str, Any], trials: int, workdir: Path,
                timeout_s: float = 180.0) -> dict[str, Any]:
    """Trials of one kill each; their figures and medians (or why none could be had)."""
    try:
        import torchft  # noqa: F401  (the workers import it; fail here, in one line)
    except ImportError:
        return {"error": "torchft is not installed: pip install torchft==0.2.0"}
    binary = lighthouse_binary()
    if binary is None:
        return {"error": "torchft_lighthouse not found (it comes with the torchft wheel)"}
    rows = []
    for i in range(trials):
        say(f"TorchFT trial {i + 1}/{trials}: 2 replica groups, SIGKILL after step "
            f"{spec['kill_step']}, replacement started at once")
        try:
            rows.append(_trial(spec, binary, workdir / f"torchft-{i}", timeout_s))
        except Exception as exc:  # a failed peer run must not lose our own figures
            rows.append({"error": f"{type(exc).__name__}: {exc}"})
        row = rows[-1]
        say(f"TorchFT trial {i + 1}/{trials}: survivor stall "
            f"{seconds(row.get('survivor_stall_s'))}, replacement's first step "
            f"{seconds(row.get('replacement_first_step_s'))}")
    good = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {
        "trials": rows, "groups": GROUPS, "processes_per_group": 1,
        "lighthouse_heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
        "lighthouse_quorum_tick_ms": QUORUM_TICK_MS,
        "worker_heartbeat_ms": WORKER_HEARTBEAT_MS,
        "gradient_averaging": "Manager.allreduce per parameter in the bench's own script "
                              "(torchft.ddp's comm hook crashed the survivor on a kill)",
    }
    for key in ("survivor_stall_s", "replacement_first_step_s", "replacement_start_s"):
        values = [r[key] for r in good if r.get(key) is not None]
        out[key] = round(median(values), 4) if values else None
    return out


def _trial(spec: dict[str, Any], binary: str, workdir: Path, timeout_s: float
           ) -> dict[str, Any]:
    events = workdir / "events"
    events.mkdir(parents=True)
    port = free_port()
    stop = workdir / "stop"
    spec = {**spec, "events_dir": str(events), "groups": GROUPS, "victim": VICTIM,
            "lighthouse": f"http://127.0.0.1:{port}", "stop_file": str(stop),
            "max_steps": spec["kill_step"] + MAX_STEPS_AFTER_KILL,
            "torchft": {"timeout_s": 10.0, "quorum_timeout_s": 60.0,
                        "heartbeat_ms": WORKER_HEARTBEAT_MS}}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "RUST_LOG": "warn"}
    procs: list[subprocess.Popen] = []
    logs = []

    def start(args: list[str], name: str, extra: dict[str, str] | None = None) -> None:
        log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                      env={**env, **(extra or {})}, start_new_session=True))

    def worker(group: int, incarnation: int) -> None:
        start([sys.executable, "-m", "stalwart.bench.torchft_worker", str(spec_path),
               str(group)], f"group{group}-{incarnation}",
              {"STALWART_TORCHFT_INCARNATION": str(incarnation)})

    try:
        start([binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
               "--quorum_tick_ms", str(QUORUM_TICK_MS), "--join_timeout_ms", "100",
               "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)], "lighthouse")
        for group in range(GROUPS):
            worker(group, 0)
        fault = wait_until(lambda: _first(events, f"group{VICTIM}-0", "fault"), timeout_s,
                           "the TorchFT victim to reach its kill step")
        worker(VICTIM, 1)  # the replacement, started the moment the victim died
        survivors = [f"group{g}-0" for g in range(GROUPS) if g != VICTIM]
        # The job trains on until the replacement has committed steps in the quorum.
        wait_until(lambda: _joined(events, f"group{VICTIM}-1", JOINED_STEPS), timeout_s,
                   "the TorchFT replacement to commit steps with the survivor")
        stop.touch()
        wait_until(lambda: all(_first(events, name, "done") for name in
                               [*survivors, f"group{VICTIM}-1"]), timeout_s,
                   "the TorchFT survivor and replacement to finish")
    except ClusterError as exc:
        raise RuntimeError(f"{exc}; logs in {workdir}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for log in logs:
            log.close()
    t_kill, killed_at = fault["time_unix"], fault["step"]
    stalls = []
    for name in survivors:
        # By step number: the survivor's step of the kill may land just after the kill.
        steps = [e for e in _events(events, name) if e["event"] == "step" and e["committed"]]
        before = max((e["time_unix"] for e in steps if e["step"] <= killed_at), default=None)
        after = min((e["time_unix"] for e in steps if e["step"] > killed_at), default=None)
        if before is None or after is None:
            raise RuntimeError(f"survivor {name} has no committed step on both sides of "
                               f"the kill; logs in {workdir}")
        stalls.append(after - before)
    new = _events(events, f"group{VICTIM}-1")
    first = min((e["time_unix"] for e in _joined_steps(new)), default=None)
    started = next(e["time_unix"] for e in new if e["event"] == "process_start")
    return {
        "kill_step": fault["step"],
        "survivor_stall_s": round(max(stalls), 4),
        "replacement_first_step_s": None if first is None else round(first - t_kill, 4),
        "replacement_start_s": round(started - t_kill, 4),
        "healed": any(e["event"] == "healed" for e in new),
    }


def _events(folder: Path, name: str) -> list[dict[str, Any]]:
    return read_events(folder / f"{name}.jsonl")


def _joined_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps a replica committed together with every other replica group."""
    return [e for e in events if e["event"] == "step" and e["committed"]
            and e["participants"] == GROUPS]


def _joined(folder: Path, name: str, count: int) -> bool:
    return len(_joined_steps(_events(folder, name))) >= count


def _first(folder: Path, name: str, kind: str) -> dict[str, Any] | None:
    return next((e for e in _events(folder, name) if e["event"] == kind), None)


def _smoke() -> None:  # python -m stalwart.bench.recovery_torchft: one quick trial
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model": "tiny", "train": {"global_batch": 8, "seed": 0}, "kill_step": 6}
        print(json.dumps(run_torchft(spec, 1, Path(tmp)), indent=1))


if __name__ == "__main__":
    _smoke()
