"""`stalwart run`: the per-host launcher, torchrun-compatible where that makes sense.

Started once per host next to that host's daemon, it starts the host's ranks (and
spares) with the torchrun environment, never ends survivors when a sibling dies
(their daemons re-plan the job and they go on in the same processes), forwards
SIGTERM and SIGINT to every process it started, and exits with the job's status and
a one-line reason. There is no MASTER_ADDR: the ranks find the job through their
daemon, and each generation's process groups start from a store a survivor serves.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from stalwart.client.daemon_env import CPUS_ENV, parse_cpus
from stalwart.daemon.config_schema import SOCKET_LOOKUP, daemon_socket

__all__ = ["configure", "run"]

# torchrun flags this launcher refuses, and why (a user switching by one word is told).
REFUSED = {
    "--master-addr": "hosts find the job through their daemons; no host holds the store",
    "--master-port": "hosts find the job through their daemons; no host holds the store",
    "--rdzv-backend": "the daemons (peers, or etcd when configured) are the rendezvous",
    "--rdzv-endpoint": "the daemons (peers, or etcd when configured) are the rendezvous",
    "--rdzv-id": "the job id is the daemons' (STALWART_JOB_ID / [job] in their config)",
    "--rdzv-conf": "the daemons (peers, or etcd when configured) are the rendezvous",
    "--max-restarts": "survivors are never restarted: the job re-plans in-process",
    "--redirects": "each process writes to this launcher's stdout and stderr",
    "--tee": "each process writes to this launcher's stdout and stderr",
}


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
      help="training ranks on this host (default 1)")
    a("--nnodes", type=str, default="1",
      help="hosts that run training ranks (a number; torchrun's MIN:MAX is refused)")
    a("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
      help="this host's index among them (default: $SLURM_NODEID, $JOB_COMPLETION_INDEX "
           "or $GROUP_RANK)")
    a("--spares", type=int, default=0, help="spare ranks to start on this host as well")
    a("--standby", action="store_true",
      help="a standby host: start only spares (--nproc-per-node of them unless --spares)")
    a("--socket", default=None,
      help=f"this host's daemon socket (default: {SOCKET_LOOKUP})")
    a("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    a("--no-python", "--no_python", dest="no_python", action="store_true",
      help="run SCRIPT as a program, not with this Python")
    a("--standalone", action="store_true", help="accepted for torchrun compatibility; "
      "a one-host job needs nothing more")
    a("--capture-cpus", dest="capture_cpus", default="",
      help="CPUs for the ranks' capture threads, e.g. the cores given to this host's "
           "daemon (8-11 or 2,3; default: where each rank runs)")
    a("--monitor-interval", "--monitor_interval", dest="monitor_interval", type=float,
      default=0.2, help="seconds between looks at the processes")
    for flag in REFUSED:  # taken only to say why not
        a(flag, flag[:2] + flag[2:].replace("-", "_"), dest=_dest(flag), nargs="?", const="",
          default=None, help=argparse.SUPPRESS)
    a("script", help="the training script (written against the public API)")
    a("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _dest(flag: str) -> str:
    return "refused_" + flag.lstrip("-").replace("-", "_")


def refused_flag(args: argparse.Namespace) -> str:
    """The reason a torchrun flag given to this launcher is refused, or ""."""
    for flag, why in REFUSED.items():
        if getattr(args, _dest(flag), None) is not None:
            return f"{flag} is not taken: {why}"
    return ""


def _node_rank(args: argparse.Namespace) -> int:
    if args.node_rank is not None:
        return args.node_rank
    for name in ("SLURM_NODEID", "JOB_COMPLETION_INDEX", "GROUP_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _check(args: argparse.Namespace) -> str:
    """The one-line error for bad flags, or ""."""
    if not args.nnodes.isdigit() or int(args.nnodes) < 1:
        return (f"--nnodes {args.nnodes}: give the number of hosts that run training ranks; "
                "a MIN:MAX range is not taken (the job is elastic through its daemons)")
    if args.nproc < 0 or args.spares < 0:
        return "--nproc-per-node and --spares must not be negative"
    if not args.standby and not 0 <= _node_rank(args) < int(args.nnodes):
        return (f"--node-rank {_node_rank(args)} is outside 0..{int(args.nnodes) - 1}; give "
                "each training host its own index (or --standby for a host of spares)")
    try:
        parse_cpus(args.capture_cpus, "--capture-cpus")
    except ValueError as exc:
        return str(exc)
    if not args.module and not args.no_python and not Path(args.script).exists():
        return f"{args.script}: no such file (pass -m for a module name)"
    return ""


def _environments(args: argparse.Namespace, socket: str) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of every process this host starts: ranks, then spares."""
    nnodes, nproc = int(args.nnodes), args.nproc
    world, node = nnodes * nproc, _node_rank(args)
    base = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "STALWART_UNIX_SOCKET": socket,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "PYTHONUNBUFFERED": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        base.pop(name, None)  # no fixed store host
    if args.capture_cpus:
        base[CPUS_ENV] = args.capture_cpus
    out = []
    ranks = 0 if args.standby else nproc
    for local in range(ranks):
        rank = node * nproc + local
        out.append((f"rank{rank}", {**base, "RANK": str(rank), "LOCAL_RANK": str(local),
                                    "GROUP_RANK": str(node), "ROLE_RANK": str(rank)}))
    spares = args.spares or (nproc if args.standby else 0)
    for j in range(spares):
        out.append((f"spare{j}", {**base, "RANK": "-1", "LOCAL_RANK": str(ranks + j),
                                  "GROUP_RANK": str(node)}))
    return out


def _command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-m", args.script, *args.script_args]
    return [sys.executable, args.script, *args.script_args]


def _job_status(socket: str) -> tuple[str, str]:
    """("completed" | "stopped" | "", message) as this host's daemon knows the job."""
    from stalwart.client.daemon_client import DaemonClient

    client = DaemonClient(f"unix:{socket}")
    try:
        plan = client.status().plan
    except Exception as exc:  # the daemon is gone: the processes' codes decide
        return "", str(exc).splitlines()[0]
    finally:
        client.close(leaving=False)
    if plan.stop:
        return ("completed" if plan.completed else "stopped"), plan.stop_message
    return "", ""


def run(args: argparse.Namespace) -> int:
    problem = refused_flag(args) or _check(args)
    if problem:
        print(f"stalwart run: {problem}", file=sys.stderr)
        return 2
    socket = args.socket or daemon_socket()
    if not Path(socket).exists():
        print(f"stalwart run: no daemon socket at {socket}; start `stalwart daemon` on this "
              "host first (or pass --socket)", file=sys.stderr)
        return 2
    procs: dict[str, subprocess.Popen[Any]] = {}
    for name, env in _environments(args, socket):
        procs[name] = subprocess.Popen(_command(args), env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while any(p.poll() is None for p in procs.values()):
            time.sleep(args.monitor_interval)  # a sibling's death ends nobody here
        if any(p.returncode for p in procs.values()) and _job_status(socket) == ("", ""):
            # This host's ranks are gone but the job trains on elsewhere: its outcome,
            # not this host's, is what the launcher reports.
            print("stalwart run: this host's processes have ended; waiting for the job to "
                  "finish on the other hosts", file=sys.stderr, flush=True)
            while _job_status(socket) == ("", ""):
                time.sleep(args.monitor_interval)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _verdict(procs, socket)


def _verdict(procs: dict[str, subprocess.Popen[Any]], socket: str) -> int:
    state, message = _job_status(socket)
    codes = {name: p.returncode for name, p in procs.items()}
    if state == "completed":
        print(f"stalwart run: {message}", file=sys.stderr)
        return 0
    if state == "stopped":
        print(f"stalwart run: the job stopped: {message}", file=sys.stderr)
        return 3
    failed = {n: c for n, c in codes.items() if c}
    if not failed:
        print(f"stalwart run: every process of this host ended cleanly ({len(codes)})",
              file=sys.stderr)
        return 0
    name, code = sorted(failed.items())[0]
    print(f"stalwart run: {name} exited with {code} (see its output above); "
          f"{len(failed)} of {len(codes)} processes failed", file=sys.stderr)
    return code if code > 0 else 1
