"""Spawn N local rank processes with a torchrun-compatible environment and collect
their results. The parent hosts the job's TCPStore, so the store outlives any rank;
every wait has a deadline and a failed rank brings the others down with its traceback.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RankContext", "RankFailure", "connect_store", "run_local"]

HOST = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What a rank function receives besides its own arguments."""

    rank: int
    """Global rank of this process, 0-based."""
    world_size: int
    """Number of rank processes in the job."""
    store: Any
    """Client of the job's shared torch.distributed.TCPStore (hosted by the launcher)."""
    master_port: int
    """TCP port of that store on 127.0.0.1."""


class RankFailure(RuntimeError):
    """One or more ranks failed or missed their deadline; the message holds every rank's
    story, `summary` the first failure in one line."""

    def __init__(self, message: str, summary: str = "") -> None:
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]


def connect_store(timeout_s: float = 60.0):
    """Connect to the store named by MASTER_ADDR/MASTER_PORT (as torchrun sets them)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
               out_dir: str, env: dict[str, str]) -> None:
    """Child entry point: set the torchrun variables, run fn, write JSON result or traceback."""
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=HOST, MASTER_PORT=str(port))
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        import torch

        # One intra-op thread by default: multi-threaded CPU kernels may sum in a varying
        # order, and bitwise-repeatable runs matter more here than speed.
        torch.set_num_threads(int(os.environ.get("STALWART_THREADS_PER_RANK", "1")))
        ctx = RankContext(rank=rank, world_size=world_size, store=connect_store(),
                          master_port=port)
        record = {"ok": True, "result": fn(ctx, *args)}
    except BaseException:  # noqa: B036 - report every failure, including SystemExit
        record = {"ok": False, "error": traceback.format_exc()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    if not record["ok"]:
        sys.exit(1)  # a non-zero exit starts the launcher's grace period for the others


def run_local(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              grace: float = 5.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run top-level `fn(ctx, *args)` in `world_size` fresh processes; return per-rank results.

    Results must be JSON-serialisable (they travel as JSON files, never pickled back).
    `timeout` (seconds) bounds the whole run; after the first rank fails the others get
    `grace` seconds to finish before they are killed. Raises RankFailure naming every rank.
    """
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, None, True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="stalwart-ranks-") as out_dir:
        procs = [ctx.Process(target=_rank_main, name=f"rank{r}", daemon=True,
                             args=(fn, r, world_size, store.port, args, out_dir, env or {}))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            timed_out = _wait(procs, timeout, grace)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join(5.0)
        records = [_read(Path(out_dir) / f"rank{r}.json") for r in range(world_size)]
    del store
    failures = [(r, rec, p.exitcode) for r, (rec, p) in enumerate(zip(records, procs, strict=True))
                if rec is None or not rec["ok"]]
    if failures or timed_out:
        raise RankFailure(_describe(failures, timeout if timed_out else None),
                          _summary(failures, timeout if timed_out else None))
    return [rec["result"] for rec in records]


def _wait(procs: list, timeout: float, grace: float) -> bool:
    """Poll until all exit; returns True when the overall deadline passed first."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if now >= deadline:
            return True
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, now + grace)
        for p in procs:
            if p.is_alive():
                p.join(0.05)
                break
    return False


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _summary(failures: list, timeout: float | None) -> str:
    """The first failed rank's exception line (the last line of its traceback)."""
    if timeout is not None:
        return f"{len(failures)} rank(s) still ran after {timeout:.0f} s and were killed"
    rank, rec, code = failures[0]
    if rec is None:
        return f"rank {rank} exited with code {code} without a result (killed or crashed)"
    last = [line for line in rec["error"].strip().splitlines() if line.strip()][-1:]
    others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    return f"rank {rank} failed: {last[0].strip() if last else 'no message'}{others}"


def _describe(failures: list, timeout: float | None) -> str:
    head = (f"ranks still running after {timeout:.0f} s were killed; "
            if timeout is not None else "")
    lines = [f"{head}{len(failures)} rank(s) failed:"]
    for rank, rec, code in failures:
        if rec is None:
            lines.append(f"--- rank {rank}: no result (exit code {code}; killed or crashed)")
        else:
            lines.append(f"--- rank {rank}:\n{rec['error']}")
    return "\n".join(lines)
