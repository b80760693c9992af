"""Entry point of one rank process started by `stalwart demo` (or any launcher).

    python -m stalwart.client.worker SPEC.json RESULT.json

The spec holds the training config, the starting layout and injected faults; the
environment holds the torchrun variables and STALWART_UNIX_SOCKET. Faults are
real: the process SIGKILLs itself (or its node's daemon), or stops answering.
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
from pathlib import Path
from typing import Any

from stalwart.client.agent import AgentConfig, ElasticAgent, JobStopped
from stalwart.client.daemon_client import DaemonClient
from stalwart.client.launch import connect_store
from stalwart.client.model import PRESETS, with_overrides
from stalwart.client.trainer import TrainConfig
from stalwart.client.trainer_program import TrainerProgram
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.client.worker")


def _train_config(spec: dict[str, Any]) -> TrainConfig:
    model = with_overrides(PRESETS[spec["model"]], **spec.get("model_overrides", {}))
    return TrainConfig(model=model, **spec.get("train", {}))


def _layout(spec: dict[str, Any]) -> common_pb2.ParallelLayout:
    lay = spec["layout"]
    return common_pb2.ParallelLayout(
        dp=lay["dp"], pp=lay["pp"], tp=lay["tp"], schedule=lay.get("schedule", "1f1b"),
        microbatches=lay.get("microbatches", 1), grad_accum=lay.get("grad_accum", 1),
        stages=[common_pb2.StageBounds(first_layer=a, last_layer=b)
                for a, b in lay.get("stages", [])])


def _fault_hook(spec: dict[str, Any], rank: int, node: int):
    """on_step callback that injects this process's faults at their step."""
    faults = [f for f in spec.get("faults", [])
              if (f["target"] == "rank" and f["index"] == rank)
              or (f["target"] == "node" and f["index"] == node)
              or (f["target"] == "pids" and rank == 0)]  # rank 0 fires those
    daemon_pid = int(os.environ.get("STALWART_DAEMON_PID", "0"))
    fault_log = os.environ.get("STALWART_FAULT_LOG", "")

    def on_step(step: int, loss: float) -> None:
        print(f"[step] {step} loss {loss!r}", flush=True)  # the demo follows these lines
        for f in faults:
            if f["step"] != step or f.get("fired"):
                continue  # a step redone after a recovery does not fire its fault again
            f["fired"] = True
            target = "node" if f["target"] == "pids" else f["target"]
            print(f"[fault] {f['kind']} {target}:{f['index']} at step {step}",
                  file=sys.stderr, flush=True)
            if fault_log:
                record = {**f, "target": target, "time_unix": time.time(), "pid": os.getpid()}
                path = Path(fault_log) / f"fault-{os.getpid()}.json"
                path.write_text(json.dumps(record))
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
            if f["kind"] == "gpu":
                # An Xid 79 (GPU fell off the bus) on this rank's device, as NVML reports it.
                Path(os.environ["STALWART_NVML_INJECT_FILE"]).write_text(
                    f"xid:79@{os.environ.get('LOCAL_RANK', '0')}")
                threading.Event().wait()  # a rank on a dead GPU makes no more progress
    return on_step


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    rank = int(os.environ.get("RANK", "-1"))
    node = int(os.environ.get("STALWART_NODE_INDEX", "0"))
    spare = rank < 0
    cfg = AgentConfig(spare=spare, collective_timeout_s=spec.get("collective_timeout_s", 10.0),
                      plan_timeout_s=spec.get("plan_timeout_s", 120.0))
    program = TrainerProgram(_train_config(spec), _layout(spec), spec["steps"])
    daemon = DaemonClient()  # $STALWART_UNIX_SOCKET names this node's daemon
    agent = ElasticAgent(program, cfg, daemon, connect_store(),
                         on_step=_fault_hook(spec, rank, node))
    try:
        agent.run()
        code = 0
    except JobStopped as exc:
        print(f"[stopped] {exc}", file=sys.stderr, flush=True)
        code = 3
    finally:
        daemon.close()
    out = dataclasses.asdict(agent.result)
    out["losses"] = {str(k): v for k, v in out["losses"].items()}
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(result_path)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
