"""`stalwart chaos`: a seeded campaign of fault schedules over layouts, each run checked
for 0 committed steps lost and the failure-free result (bitwise when spares kept the
layout, losses within 1e-4 relative when it changed). Prints a line per run, then a
table of fault kind x layout, and per kind the median time from fault to first step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from stalwart.client.chaos_faults import mount_tmpfs, unmount
from stalwart.client.chaos_run import Outcome, dumps, judge, remove, run_job, to_json
from stalwart.client.chaos_schedule import KINDS, NOT_COVERED, Schedule, Setup, generate
from stalwart.core.layout import Layout


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--runs", type=int, default=12, help="faulted runs (each with a cached baseline)")
    a("--seed", type=int, default=1, help="the same seed generates the same schedules")
    a("--json", dest="json_path", type=Path, default=None,
      help='write {"runs": [...]} here, one object per run')
    a("--quick", action="store_true", help="8 steps per run instead of 12")
    a("--kinds", default="", help=f"comma-separated subset of: {', '.join(KINDS)}")
    a("--timeout", type=float, default=240.0, help="seconds per run")
    a("--workdir", type=Path, default=None, help="runs' folders here (failed ones are kept)")


def tmpfs_available() -> str | None:
    """None when this process may mount a tmpfs (full-disk runs), else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    with tempfile.TemporaryDirectory(prefix="stalwart-tmpfs-") as d:
        why = mount_tmpfs(Path(d), 1 << 20)
        if why is None:
            unmount(Path(d))
        return why


def run(args: argparse.Namespace) -> int:
    kinds = [k for k in args.kinds.split(",") if k] or list(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"stalwart chaos: unknown kind(s) {unknown}; choose from {list(KINDS)}",
              file=sys.stderr)
        return 2
    if "full-disk" in kinds and (why := tmpfs_available()) is not None:
        print(f"stalwart chaos: full-disk left out: {why}", file=sys.stderr)
        kinds.remove("full-disk")
    steps = 8 if args.quick else 12
    schedules = generate(args.seed, args.runs, kinds=kinds, steps=steps)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="stalwart-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    for kind, why in NOT_COVERED.items():
        print(f"not covered: {kind}: {why}")
    print(f"stalwart chaos: {len(schedules)} runs, seed {args.seed}, {steps} steps each; "
          f"folders under {root}", flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        rows = campaign(schedules, steps=steps, timeout_s=args.timeout, root=root)
    except KeyboardInterrupt:
        print("stalwart chaos: interrupted; every process of the current run was ended",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(table(rows))
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(dumps(rows))
        print(f"runs written to {args.json_path}")
    bad = [r for r in rows if not (r["recovered"] and r["equal"] and r["lost_steps"] == 0)]
    return 1 if bad else 0


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds each run's finally


def campaign(schedules: list[Schedule], *, steps: int, timeout_s: float,
             root: Path) -> list[dict[str, Any]]:
    """Run each schedule after its layout's baseline (one per layout); a line per run."""
    baselines: dict[Layout, Outcome] = {}
    rows = []
    for i, s in enumerate(schedules):
        # A failure-free run's numbers depend on the layout alone: gloo's sums do not
        # depend on which node a rank runs on, nor on the spares.
        key = s.setup.layout
        if key not in baselines:
            quiet = dataclasses.replace(s.setup, spares=0)
            baselines[key] = run_job(Schedule("baseline", quiet), steps=steps,
                                     timeout_s=timeout_s, workdir=root / f"base-{i}")
            if baselines[key].completed:
                remove(baselines[key])
        out = run_job(s, steps=steps, timeout_s=timeout_s, workdir=root / f"run-{i}")
        equal = judge(out, baselines[key], s.setup.layout)
        if not baselines[key].completed and not out.error:
            # Judged against nothing: say so, or the run reads as unequal to it.
            out.error = (f"the failure-free run of this layout did not complete "
                         f"({baselines[key].error or 'see ' + str(root / 'base-*')})")
        if equal and out.completed:
            remove(out)
        row = to_json(s, out, equal)
        rows.append(row)
        t = row["fault_to_first_step_s"]
        print(f"[chaos {i + 1}/{len(schedules)}] {s.kind:16} {s.setup!s:18} "
              f"recovered={_yn(out.completed)} equal={_yn(equal)} lost={out.lost_steps} "
              f"first step {t if t is not None else '-'} s ({out.elapsed_s} s)"
              + (f" -- {out.error}" if out.error else ""), flush=True)
    return rows


def _yn(ok: bool) -> str:
    return "yes" if ok else "NO"


def table(rows: list[dict[str, Any]]) -> str:
    """Fault kind x layout (recovered / equal / seconds to first step), then per kind."""
    lines = ["", f"{'fault kind':16}  {'layout':18}  recovered  equal  first step (s)"]
    for r in sorted(rows, key=lambda r: (r["kind"], str(_setup(r)))):
        t = r["fault_to_first_step_s"]
        lines.append(f"{r['kind']:16}  {_setup(r)!s:18}  {_yn(r['recovered']):9}  "
                     f"{_yn(r['equal']):5}  {t if t is not None else '-'}")
    lines += ["", "| fault kind | runs | layouts | recovered | equal | lost steps | "
              "s to first step: median (max) |", "|---|---|---|---|---|---|---|"]
    for kind in sorted({r["kind"] for r in rows}):
        of = [r for r in rows if r["kind"] == kind]
        times = [r["fault_to_first_step_s"] for r in of
                 if r["recovered"] and r["fault_to_first_step_s"]]
        med = f"{statistics.median(times):.2f} ({max(times):.2f})" if times else "-"
        lines.append(f"| {kind} | {len(of)} | {len({str(_setup(r)) for r in of})} | "
                     f"{sum(r['recovered'] for r in of)} | {sum(r['equal'] for r in of)} | "
                     f"{sum(r['lost_steps'] for r in of)} | {med} |")
    return "\n".join(lines)


def _setup(row: dict[str, Any]) -> Setup:
    return Setup.from_json(row["setup"])


__all__ = ["campaign", "configure", "run", "table", "tmpfs_available"]
