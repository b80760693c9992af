"""One run of a chaos schedule on a LocalCluster: launch the GPT example, inject the
faults as the ranks' step lines reach them, follow the coordinator's plans, and judge
the outcome against a failure-free baseline of the same layout. Every run is bounded
by a deadline and ends every process it started.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.client.chaos_faults import (
    IN_RANK,
    REPLAN_S,
    Injector,
    job_state,
    mount_tmpfs,
    unmount,
)
from stalwart.client.chaos_schedule import Schedule, Setup
from stalwart.client.local_cluster import ClusterError, LocalCluster, Node
from stalwart.client.step_log import StepLog
from stalwart.core.layout import Layout

__all__ = ["TOLERANCE", "Outcome", "judge", "run_job"]

MICRO = {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}
TOLERANCE = 1e-4  # relative, per step's loss, when the layout changed (other sums)
STOP_WAIT_S = 20.0
# A bitflip's victim is restored from the decoded copy its daemon holds in RAM, which
# never reads the flipped files: the daemons' scrub finds them, every SCRUB_S in such a
# run, and the evidence waits for it at most SCRUB_WAIT_S after the job.
SCRUB_S, SCRUB_WAIT_S = 1.0, 30.0


@dataclass
class Outcome:
    completed: bool = False
    losses: dict[int, float] = field(default_factory=dict)
    digest: str | None = None
    lost_steps: int = 0
    fault_to_first_step_s: float | None = None
    plans: list[dict[str, Any]] = field(default_factory=list)
    final_layout: tuple[int, int, int] | None = None
    ended_layout: tuple[int, int, int] | None = None  # of the completion plan
    elapsed_s: float = 0.0
    error: str = ""
    workdir: str = ""
    evidence: dict[str, int] = field(default_factory=dict)
    """What shows the fault's mechanism ran: victims ended, corrupt bytes caught."""


def _spec(lay: Layout, steps: int, in_rank: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "tiny", "model_overrides": MICRO,
            "train": {"global_batch": 8, "seed": 0},
            "layout": {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "schedule": "1f1b",
                       "microbatches": lay.pp},
            "steps": steps, "faults": in_rank, "flops_costs": True,
            "collective_timeout_s": 4.0}


def run_job(schedule: Schedule, *, steps: int, timeout_s: float, workdir: Path) -> Outcome:
    """Run `schedule` (no faults: a baseline) and observe it; never raises for the job."""
    run, out, t0 = schedule.setup, Outcome(), time.monotonic()
    settings: dict[str, Any] = {"elastic": {"shrink": True}}
    if schedule.kind == "disk-stays-full":
        settings["snapshot"] = {"disk_full_replan_s": REPLAN_S}
    cluster = LocalCluster(nodes=run.nodes, workdir=workdir, daemon_settings=settings,
                           metrics=schedule.kind == "bitflip")
    cluster.env["STALWART_FAULT_LOG"] = str(workdir)
    if schedule.kind == "bitflip":
        cluster.env["STALWART_SCRUB_INTERVAL_S"] = str(SCRUB_S)
    in_rank = [{"kind": IN_RANK[f.kind], "target": "rank", "index": f.index, "step": f.step}
               for f in schedule.faults if f.kind in IN_RANK]
    injector = Injector(cluster, schedule)
    # Every rank waits at the end of a fault's step until the fault is fired: however
    # late this process sees the step, the fault lands in the step after it.
    in_rank += [{"kind": "hold", "target": "all", "index": -1, "step": s}
                for s in injector.hold_steps()]
    mounted: list[Path] = []
    try:
        for f in schedule.faults:
            if f.kind in ("full-disk", "disk-stays-full"):
                node = f.index if f.target == "node" else _node_of_rank(run, f.index)
                path = workdir / f"node-{node}"
                if (why := mount_tmpfs(path)) is not None:
                    raise ClusterError(f"full-disk needs a tmpfs on {path}: {why}")
                mounted.append(path)
        cluster.start_daemons()
        cluster.launch(_spec(run.layout, steps, in_rank), run.world, run.spares,
                       run.ranks_per_node)
        _watch(cluster, injector, out, steps, time.monotonic() + timeout_s)
    except ClusterError as exc:
        out.error = str(exc)
    except Exception as exc:  # the harness's own fault: this run fails, the campaign goes on
        (workdir / "harness-error.txt").write_text(traceback.format_exc())
        out.error = (f"the harness failed: {type(exc).__name__}: {exc} (traceback in "
                     f"{workdir / 'harness-error.txt'})")
    finally:
        injector.release()
        cluster.close(keep_workdir=True)
        for path in mounted:
            if not out.completed:  # keep the failed node's logs: the tmpfs goes with it
                shutil.copytree(path, path.with_name(path.name + "-tmpfs"), dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("ballast", "*.sock"))
            unmount(path)
    out.elapsed_s = round(time.monotonic() - t0, 2)
    out.workdir = str(workdir)
    return out


def _node_of_rank(run: Setup, rank: int) -> int:
    return min(rank // run.ranks_per_node, run.nodes - 1)


def _watch(cluster: LocalCluster, injector: Injector, out: Outcome, steps: int,
           deadline: float) -> None:
    follow = StepLog()
    generation_at: dict[float, int] = {}
    committed_at: list[tuple[float, int]] = []
    seen_gen, stopped_at = 0, None
    roles = sum(r.rank >= 0 for r in cluster.ranks)
    while time.monotonic() < deadline and cluster.running():
        follow.poll([r.log_path for r in cluster.ranks])
        statuses = [n.status(timeout_s=1.0) for n in cluster.daemons
                    if n.alive and n.index not in injector.paused]
        gen, committed, plan = job_state(statuses)
        now = time.time()
        if gen:
            committed_at.append((now, committed))
        if gen > seen_gen and plan.completed:
            seen_gen = gen  # the job trained its last step: not a re-plan, but its layout
            lay = plan.layout  # is the one the job ended in (a re-plan may be outrun)
            out.ended_layout = (lay.dp, lay.pp, max(1, lay.tp))
        elif gen > seen_gen:
            seen_gen = gen
            generation_at[now] = gen
            lay = plan.layout
            out.plans.append({"generation": gen, "time_unix": now, "reason": plan.reason,
                              "resume_step": plan.resume_step, "stop": plan.stop,
                              "layout": (lay.dp, lay.pp, max(1, lay.tp))})
            if plan.stop:
                stopped_at = time.monotonic()
            elif lay.dp:
                roles = Layout.from_proto(lay).world_size
        injector.tick(max(follow.losses, default=0), seen_gen)
        if _finished(cluster, steps) >= roles:
            break
        if stopped_at is not None and time.monotonic() - stopped_at > STOP_WAIT_S:
            break
        time.sleep(0.1)
    else:
        if time.monotonic() >= deadline:
            out.error = "the run passed its deadline"
    follow.poll([r.log_path for r in cluster.ranks])
    injector.in_rank_fired(generation_at)
    _conclude(cluster, injector, out, follow, committed_at, steps)


def _finished(cluster: LocalCluster, steps: int) -> int:
    """Rank processes that ended after training every step (whatever their exit status:
    see `dirty_exits`); ranks and spares left out of the last plan may still wait."""
    done = 0
    for r in cluster.ranks:
        if r.proc.poll() is not None and (res := r.result()) and res.get("result"):
            done += str(steps) in (res.get("losses") or {})
    return done


def _conclude(cluster: LocalCluster, injector: Injector, out: Outcome, follow: StepLog,
              committed_at: list[tuple[float, int]], steps: int) -> None:
    results = [res for r in cluster.ranks if (res := r.result()) is not None]
    finished = [res for res in results if res.get("result")]
    out.losses = dict(follow.losses)
    for res in finished:
        out.losses.update({int(k): v for k, v in res["losses"].items()})
    # Done: every step trained, and the ranks that finished agree on the parameters.
    digests = {res["result"]["param_digest"] for res in finished}
    out.completed = sorted(out.losses) == list(range(1, steps + 1)) and len(digests) == 1
    out.digest = digests.pop() if out.completed else None
    if out.plans:
        out.final_layout = out.plans[-1]["layout"]
    if out.ended_layout is not None and out.ended_layout != out.final_layout:
        out.final_layout = out.ended_layout
    out.evidence = _evidence(cluster, injector)
    fired = sorted(injector.fired, key=lambda f: f.time_unix)
    for f in fired:
        before = [c for t, c in committed_at if t <= f.time_unix]
        plan = next((p for p in out.plans if p["time_unix"] > f.time_unix
                     and p["generation"] > f.generation), None)
        if plan is not None and before:
            out.lost_steps += max(0, before[-1] - plan["resume_step"])
    first = next((f for f in fired if f.disruptive), None)
    if first is None:
        return
    t_fault = first.time_unix
    last = out.plans[-1]["generation"] if out.plans else 0
    firsts = [g["first_step_unix"] for res in finished for g in res.get("generations", [])
              if g["generation"] == last and g.get("first_step_unix")]
    if last > first.generation and firsts:
        out.fault_to_first_step_s = round(max(firsts) - t_fault, 3)
    else:  # no re-plan (a spare lost, say): the next step any rank printed
        later = [t for seen in follow.seen.values() for _, t in seen if t > t_fault]
        out.fault_to_first_step_s = round(min(later) - t_fault, 3) if later else None


def _evidence(cluster: LocalCluster, injector: Injector) -> dict[str, int]:
    victims = [r for f in injector.fired if f.fault.target == "rank" for r in cluster.ranks
               if r.rank == f.fault.index]
    # Ranks that trained to the end and then exited with an error or a signal.
    dirty = [r for r in cluster.ranks if r.proc.poll() not in (None, 0)
             and (r.result() or {}).get("result")]

    def failures() -> int:
        return sum(_checksum_failures(n) for n in cluster.daemons
                   if cluster.metrics and n.alive)

    caught = failures()
    if any(f.fault.kind == "bitflip" for f in injector.fired):
        deadline = time.monotonic() + SCRUB_WAIT_S
        while caught == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            caught = failures()
    return {"victims_ended": sum(r.proc.poll() is not None for r in victims),
            "dirty_exits": len(dirty),
            "victims": len(victims),
            "checksum_failures": caught}


def _checksum_failures(node: Node) -> int:
    """Chunks and shards the daemon read (or scrubbed) and found failing their CRC32C."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics",
                                    timeout=2.0) as reply:
            text = reply.read().decode()
    except OSError:
        return 0
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("stalwart_scrub_errors_total{"))


def judge(out: Outcome, baseline: Outcome, layout: Layout) -> bool:
    """Equal to the baseline: bitwise when the layout held, else every loss within
    TOLERANCE relative."""
    if not out.completed or not baseline.completed:
        return False
    if out.final_layout in (None, (layout.dp, layout.pp, layout.tp)):
        return out.digest is not None and out.digest == baseline.digest
    return all(abs(out.losses[s] - b) <= TOLERANCE * abs(b)
               for s, b in baseline.losses.items())


def remove(out: Outcome) -> None:
    """Delete a run's folder (kept only for runs that failed)."""
    if out.workdir:
        shutil.rmtree(out.workdir, ignore_errors=True)


def to_json(schedule: Schedule, out: Outcome, equal: bool) -> dict[str, Any]:
    return {**schedule.to_json(), "recovered": out.completed, "lost_steps": out.lost_steps,
            "equal": equal, "fault_to_first_step_s": out.fault_to_first_step_s,
            "plans": [p["reason"] for p in out.plans[1:]], "elapsed_s": out.elapsed_s,
            "evidence": out.evidence, "error": out.error,
            **({"workdir": out.workdir} if not equal else {})}


def dumps(runs: list[dict[str, Any]]) -> str:
    return json.dumps({"runs": runs}, indent=2) + "\n"
