"""What every launched rank process shares, whichever entry shape it trains: the
agent wired to the node's daemon and the job's store from the launcher's environment,
the step lines launchers follow, the result file they read, and injected faults.

Faults (STALWART_FAULTS, a JSON list set by `stalwart demo` and the chaos tests) are
real: at the given step (and, for one marked "committed", once that step is committed)
the process SIGKILLs itself (or its node's daemon first), stops answering while it
heartbeats, reports an NVML Xid on its GPU and stops, or raises an exception from its
training (a bug in the user's code).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from stalwart.client.agent import AgentConfig, ElasticAgent, Program
from stalwart.client.daemon_client import DaemonClient
from stalwart.v1 import rank_pb2

__all__ = ["gpu_named", "launched_agent", "run_rank"]

log = logging.getLogger("stalwart.client.launched")

# The entry (run() or run_layers()) this process has trained under, if any: a process
# is one rank of one job.
_entered: str | None = None


class Finished(Protocol):
    steps: int  # the step the rank's training loop ended at, the job's length


R = TypeVar("R", bound=Finished)


def gpu_named(device: str) -> str:
    """`device` as this rank tells its daemon: a GPU by its UUID ("cuda:GPU-..."), which
    the daemon's NVML monitor matches whatever CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER
    renumbered (an Xid then fails the rank on that GPU); anything else as it is."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device
    index = torch.device(device).index
    try:
        uuid = str(torch.cuda.get_device_properties(
            torch.cuda.current_device() if index is None else index).uuid)
    except (AttributeError, RuntimeError) as exc:  # an older torch, a device gone
        log.warning("GPU not named by UUID (%s): the daemon takes it to be the local "
                    "rank's", exc)
        return device
    return f"cuda:{uuid if uuid.lower().startswith('gpu-') else 'GPU-' + uuid}"


def check_device(device: str, who: str) -> None:
    """ValueError, before anything starts, for a device this process cannot train on."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{who}: device={device!r} is not a torch device ({exc}); use "
                         "'cpu' or 'cuda'") from None
    if kind == "cpu":
        return
    if kind != "cuda":
        raise ValueError(f"{who}: device={device!r}; Stalwart trains on 'cpu' or 'cuda' "
                         "(with NCCL between ranks)")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"{who}: device={device!r}, but torch sees no CUDA device (torch "
                         f"{torch.__version__}, {build}); run on a GPU host or use "
                         "device='cpu'")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"{who}: device={device!r}, but this process sees "
                         f"{torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def check_collective_timeout(seconds: float, who: str) -> None:
    """ValueError, before anything starts, for a collective deadline that is no deadline."""
    if not (isinstance(seconds, int | float) and 0 < seconds < float("inf")):
        raise ValueError(f"{who}: collective_timeout_s={seconds!r}; give the seconds a "
                         "collective may wait before it counts as a hang (more than 0)")


def launched_agent(program: Program, *, device: str, collective_timeout_s: float,
                   who: str) -> tuple[ElasticAgent, DaemonClient]:
    """The agent of this launched rank process (RANK < 0 or unset: a spare)."""
    from stalwart.client.launch import connect_store

    env = os.environ
    if "STALWART_UNIX_SOCKET" not in env:
        raise RuntimeError(f"{who} needs a Stalwart launcher: start the script with "
                           "`stalwart demo`, or from stalwart.client.local_cluster in tests, "
                           "next to a `stalwart daemon`; STALWART_UNIX_SOCKET is not set")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed's default process group is initialized; remove "
            "init_process_group() from the script: Stalwart builds each generation's "
            "process groups itself and rebuilds them after a failure (in run()'s loop, "
            "read ctx.dp_rank and ctx.dp_size, and pass group=ctx.dp_group)")
    global _entered
    if _entered is not None:
        # The job's daemons know this rank as done: a second registration would end at
        # once, without training (the job completed) or hold a role twice.
        raise RuntimeError(
            f"{who}: this process already trained under {_entered}; a protected process "
            "is one rank of one job. Train every phase inside one training function "
            "(choose the phase by ctx.step), or run the next phase as a job of its own")
    _entered = who
    rank = int(env.get("RANK", "-1"))
    cfg = AgentConfig(spare=rank < 0, collective_timeout_s=collective_timeout_s,
                      plan_timeout_s=float(env.get("STALWART_PLAN_TIMEOUT_S", "120")),
                      resume_wait_s=float(env.get("STALWART_RESUME_WAIT_S", "1800")),
                      device=gpu_named(device),
                      backend="nccl" if device.startswith("cuda") else "gloo")
    daemon = DaemonClient()  # $STALWART_UNIX_SOCKET names this node's daemon
    hooks = [h for h in (_print_step if env.get("STALWART_STEP_LOG") else None,
                         _fault_hook(rank, daemon)) if h is not None]

    def on_step(step: int, loss: float) -> None:
        for hook in hooks:
            hook(step, loss)

    # Generations start from a store a survivor serves (the plan names it); a launcher's
    # fixed store (MASTER_ADDR) is used only by plans that name none.
    store = connect_store() if "MASTER_ADDR" in env else None
    agent = ElasticAgent(program, cfg, daemon, store, on_step=on_step)
    return agent, daemon


def _print_step(step: int, loss: float) -> None:
    # Launchers follow these lines. One write with its newline: print() writes the end
    # separately, and unbuffered, a warning from another thread could land in between.
    sys.stdout.write(f"[step] {step} loss {loss!r}\n")
    sys.stdout.flush()


def run_rank(agent: ElasticAgent, daemon: DaemonClient, result: Callable[[], R | None],
             as_json: Callable[[R], dict[str, Any]]) -> R | None:
    """Train this rank (`agent.run()`) and make its `result()`; either way its result
    file is written and its daemon client closed. Only a rank whose training returned
    tells its daemon it leaves cleanly: one that raised is a failed rank, and its daemon
    sees it so when the process exits, at once, so its role goes to a spare or the
    survivors re-plan. Told it left cleanly, the daemon would leave its peers waiting for
    it until their collectives time out. A rank with a result also says the step its
    loop ended at: a job launched again after its last step committed trains nothing, so
    no commit ends it, and the coordinator ends it when a rank of its plan says so."""
    out: R | None = None
    returned, raised = False, ""
    try:
        agent.run()
        returned = True
        out = result()
    except BaseException as exc:
        raised = f"{type(exc).__name__}: {exc}".splitlines()[0]  # what the exit report names
        raise
    finally:
        try:
            write_result(agent, None if out is None else as_json(out))
        finally:
            daemon.close(leaving=returned, raised=raised,
                         finished_at=0 if out is None else out.steps)
    return out


def write_result(agent: ElasticAgent, result: dict[str, Any] | None) -> None:
    """Where a launcher asks for it (STALWART_RESULT_FILE), this rank's story as JSON."""
    path = os.environ.get("STALWART_RESULT_FILE")
    if not path:
        return
    out = dataclasses.asdict(agent.result)
    out["losses"] = {str(k): v for k, v in out["losses"].items()}
    out["result"] = result
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)


def _fault_hook(rank: int, daemon: DaemonClient) -> Callable[[int, float], None] | None:
    """on_step callback that injects this process's faults at their step."""
    spec = os.environ.get("STALWART_FAULTS")
    if not spec:
        return None
    node = int(os.environ.get("STALWART_NODE_INDEX", "0"))
    faults = [f for f in json.loads(spec)
              if f["target"] == "all" or (f["target"] == "rank" and f["index"] == rank)
              or (f["target"] == "node" and f["index"] == node)
              or (f["target"] == "pids" and rank == 0)]  # rank 0 fires those
    if not faults:
        return None
    daemon_pid = int(os.environ.get("STALWART_DAEMON_PID", "0"))
    fault_log = os.environ.get("STALWART_FAULT_LOG", "")

    def on_step(step: int, loss: float) -> None:
        for f in faults:
            if f["step"] != step or f.get("fired"):
                continue  # a step redone after a recovery does not fire its fault again
            f["fired"] = True
            if f.get("committed"):
                _until_committed(daemon, step)
            if f["kind"] == "hold":
                if fault_log:
                    _hold(Path(fault_log) / f"release-{step}")
                continue
            target = "node" if f["target"] == "pids" else f["target"]
            print(f"[fault] {f['kind']} {target}:{f['index']} at step {step}",
                  file=sys.stderr, flush=True)
            if fault_log:
                record = {**f, "target": target, "time_unix": time.time(), "pid": os.getpid()}
                (Path(fault_log) / f"fault-{os.getpid()}.json").write_text(json.dumps(record))
            if f["target"] == "pids":  # a whole node, from outside it (see demo --kill)
                pids = json.loads(Path(f["pids_file"]).read_text())
                for pid in sorted(pids, key=lambda p: p == os.getpid()):  # this one last
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                continue
            if f["kind"] == "kill" and f["target"] == "node" and daemon_pid:
                os.kill(daemon_pid, signal.SIGKILL)
            if f["kind"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f["kind"] == "hang":
                threading.Event().wait()  # alive, heartbeating, never answering
            if f["kind"] == "error":  # what a bug in the training code does
                raise InjectedError(f"injected fault: rank {rank} raised at step {step}")
            if f["kind"] == "gpu":
                # An Xid 79 (GPU fell off the bus) on this rank's device, as NVML reports it.
                Path(os.environ["STALWART_NVML_INJECT_FILE"]).write_text(
                    f"xid:79@{os.environ.get('LOCAL_RANK', '0')}")
                threading.Event().wait()  # a rank on a dead GPU makes no more progress
    return on_step


class InjectedError(RuntimeError):
    """The "error" fault: the rank's training raises, as a bug in its code would."""


HOLD_S = 60.0  # a hold's longest wait: a launcher that never releases it is gone
COMMIT_WAIT_S = 60.0  # a "committed" fault's longest wait for its step's commit


def _until_committed(daemon: DaemonClient, step: int) -> None:
    """Wait until `step` is committed (this rank's capture of it is already on its way);
    past COMMIT_WAIT_S the fault fires anyway, and says so."""
    deadline = time.monotonic() + COMMIT_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        wait_s = min(left, 5.0)
        reply = daemon.call("wait for a commit", "WaitCommitted",
                            rank_pb2.WaitCommittedRequest(step=step, timeout_s=wait_s),
                            timeout=wait_s + 5)
        if reply.committed:
            return
    print(f"[fault] step {step} was not committed within {COMMIT_WAIT_S:g} s; firing anyway",
          file=sys.stderr, flush=True)


def _hold(release: Path) -> None:
    """Wait at this step's end until the launcher releases it (it creates `release`):
    an outside fault due at this step lands before the job is past it, however slowly
    the launcher follows the step lines."""
    deadline = time.monotonic() + HOLD_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
