"""`stalwart bench recovery`: time from SIGKILL of one rank to the first completed training
step after recovery (MTTR), Stalwart (warm spare, in-process rebuild, restore of the last
committed every-step snapshot) against the usual practice (torchrun restarts every rank, which
load the last torch.distributed.checkpoint save), on the same model, layout and machine.

Each Stalwart trial is a fresh local cluster (2 daemons, dp=2 x pp=2, one spare) and one kill;
the baseline is one torchrun job that is killed once per restart round.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any

from stalwart.bench.progress import say, seconds
from stalwart.client.step_log import StepLog

MODEL = "tiny"
TRAIN = {"global_batch": 8, "seed": 0}
LAYOUT = {"dp": 2, "pp": 2, "tp": 1, "schedule": "1f1b", "microbatches": 2}
WORLD = LAYOUT["dp"] * LAYOUT["pp"] * LAYOUT["tp"]
RANKS_PER_NODE = 2
KILL_STEP = 16
"""Stalwart trials kill after this step: by then commits trail training by what they
trail it in steady state (within the first few steps they trail it by less)."""
STEADY_FROM = 8
"""The commit lag is the steady state's: looked at from this step to the kill."""
EXTRA_STEPS = 4
"""Steps trained after the kill step, so the recovered job is seen training on."""
CKPT_EVERY = 10
"""Baseline checkpoint interval (steps): a common choice for DCP saves, which stall training
while they write; each baseline kill lands half an interval after a save, the expected loss."""
TRIAL_TIMEOUT_S = 300.0


DEFINITIONS = {
    "mttr_s": "SIGKILL of one rank -> every role of the job has completed a training step "
              "again (median of trials; each trial one fresh kill)",
    "detect_s": "kill -> first failure event a daemon recorded",
    "plan_s": "-> the last role of the new generation received its plan",
    "rebuild_s": "-> the last role built its process groups and trainer",
    "restore_s": "-> the last role loaded the resume step's state",
    "first_step_s": "-> the last role completed its first step",
    "catch_up_s": "kill -> the step after the killed one completed (redone steps included)",
    "lost_steps": "committed steps discarded by the recovery (worst trial)",
    "redone_steps": "steps trained again: the kill came after steps not yet committed",
    "commit_lag_steps": f"steady state (step {STEADY_FROM} to the kill): newest step trained "
                        "minus newest step committed, median of the benchmark's looks "
                        "(about every 0.1 s)",
    "survivor_stall_s": "a surviving rank's last step before the kill -> its first step "
                        "after it (slowest survivor; step lines as the benchmark read them, "
                        "about 0.1 s apart)",
    "baseline_restart_s": "kill -> torchrun started the first fresh rank process",
    "baseline_import_s": "-> the last rank imported torch and stalwart",
    "baseline_rebuild_s": "-> the last rank joined the process group, built groups and trainer",
    "baseline_restore_s": "-> the last rank loaded the newest complete DCP checkpoint",
    "baseline_lost_steps": f"steps since that checkpoint (saved every {CKPT_EVERY} steps, "
                           f"killed {CKPT_EVERY // 2} steps after a save: the expected loss)",
    "baseline_save_s": "one synchronous DCP save (slowest rank): the stall every interval",
    "torchft_survivor_stall_s": "TorchFT, the same model data parallel over two replica "
                                "groups of one process: the surviving replica's last "
                                "committed step before the kill -> its first after (median)",
    "torchft_replacement_first_step_s": "TorchFT: kill -> the replacement replica (started "
                                        "at once) committed its first step (median)",
}


def run(quick: bool) -> dict[str, Any]:
    trials = 2 if quick else 5  # each side; a Stalwart trial is a fresh cluster (~20-40 s)
    root = Path(tempfile.mkdtemp(prefix="stalwart-bench-recovery-"))
    load_before = os.getloadavg()[0]
    ours = []
    for i in range(trials):
        say(f"Stalwart trial {i + 1}/{trials}: fresh cluster, SIGKILL after step {KILL_STEP}")
        ours.append(_our_trial(i, root / f"ours-{i}"))
        t = ours[-1]
        say(f"Stalwart trial {i + 1}/{trials}: fault to first step {seconds(t.get('mttr_s'))}")
    say(f"baseline: restart-all + checkpoint load, {trials} kills in one run")
    base = _baseline(trials, root / "baseline")
    say("baseline: fault to first step " + ", ".join(seconds(t.get("mttr_s")) for t in base))
    figures = _figures(ours, base, root)
    from stalwart.bench.recovery_torchft import run_torchft

    say(f"TorchFT: the same model data-parallel over 2 replica groups, {trials} kills")
    peer = figures["torchft"] = run_torchft(
        {"model": MODEL, "train": TRAIN, "kill_step": KILL_STEP}, trials, root)
    figures["torchft_survivor_stall_s"] = peer.get("survivor_stall_s")
    figures["torchft_replacement_first_step_s"] = peer.get("replacement_first_step_s")
    if "error" in peer or any("error" in t for t in peer["trials"]):
        say(f"TorchFT had errors; its logs are kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)  # snapshots and checkpoints: ~1 GB; kept on errors
    # Other work on the machine stretches process start-up most: say how busy it was.
    figures["load_average_1m"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    figures["definitions"] = DEFINITIONS
    return figures


# Stalwart -------------------------------------------------------------------------------


@dataclass
class _Watch:
    """What the benchmark sees while a trial runs (wall-clock unix seconds)."""

    failures: dict[tuple[str, int], float] = field(default_factory=dict)
    committed: list[tuple[float, int]] = field(default_factory=list)
    log: StepLog = field(default_factory=StepLog)
    step_times: list[float] = field(default_factory=list)

    def poll(self, cluster: Any) -> None:
        now = time.time()
        for node in cluster.daemons:
            st = node.status(timeout_s=1.0) if node.alive else None
            if st is None:
                continue
            for f in st.recent_failures:
                key = (f.subject, f.kind)
                t = f.time_unix_ms / 1000
                self.failures[key] = min(self.failures.get(key, t), t)
            self.committed.append((now, st.latest_committed_step))
            self.step_times += [r.step_time_s for r in st.ranks if r.step_time_s > 0]
        self.log.poll([r.log_path for r in cluster.ranks])



def _our_trial(index: int, workdir: Path) -> dict[str, Any]:
    """One fresh cluster, one SIGKILL of rank (index % 3) + 1 after KILL_STEP."""
    from stalwart.client.local_cluster import LocalCluster

    victim = 1 + index % (WORLD - 1)
    steps = KILL_STEP + EXTRA_STEPS
    spec = {"model": MODEL, "train": TRAIN, "layout": LAYOUT, "steps": steps,
            "faults": [{"kind": "kill", "target": "rank", "index": victim, "step": KILL_STEP}],
            "collective_timeout_s": 10.0}
    cluster = LocalCluster(nodes=WORLD // RANKS_PER_NODE, workdir=workdir)
    cluster.env["STALWART_FAULT_LOG"] = str(workdir)
    watch = _Watch()
    try:
        cluster.start_daemons()
        cluster.launch(spec, WORLD, spares=1, ranks_per_node=RANKS_PER_NODE)
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while _finished(cluster, steps) < WORLD:
            if time.monotonic() > deadline or not cluster.running():
                raise RuntimeError(f"Stalwart trial {index} did not finish {steps} steps within "
                                   f"{TRIAL_TIMEOUT_S:g} s; logs are in {workdir}")
            watch.poll(cluster)
            time.sleep(0.1)
        watch.poll(cluster)
        results = [res for r in cluster.ranks if (res := r.result())]
    finally:
        for node in cluster.daemons:  # their state is not needed; SIGTERM waits for drains
            cluster.kill_daemon(node)
        cluster.close(keep_workdir=True)
    return _our_recovery(index, victim, workdir, watch, results)


def _finished(cluster: Any, steps: int) -> int:
    """Rank processes that exited after training every step."""
    return sum(1 for r in cluster.ranks if r.proc.poll() == 0
               and str(steps) in (r.result() or {}).get("losses", {}))


def _our_recovery(index: int, victim: int, workdir: Path, watch: _Watch,
                  results: list[dict[str, Any]]) -> dict[str, Any]:
    faults = [json.loads(p.read_text()) for p in workdir.glob("fault-*.json")]
    if len(faults) != 1:
        raise RuntimeError(f"Stalwart trial {index}: expected one fault record in {workdir}, "
                           f"found {len(faults)}")
    fault_t, fault_step = faults[0]["time_unix"], faults[0]["step"]
    # The recovery is over with the first generation in which every role trained a step.
    by_gen: dict[int, list[dict[str, Any]]] = {}
    for res in results:
        for g in res.get("generations", []):
            by_gen.setdefault(g["generation"], []).append(g)
    done = sorted(g for g, recs in by_gen.items() if g > 1 and len(recs) == WORLD
                  and all(r["first_step_unix"] for r in recs))
    if not done:
        raise RuntimeError(f"Stalwart trial {index}: no generation after the kill trained a "
                           f"step on all {WORLD} roles; logs are in {workdir}")
    recs = by_gen[done[0]]
    detected = min((t for t in watch.failures.values() if t >= fault_t - 0.5), default=None)
    if detected is None:
        raise RuntimeError(f"Stalwart trial {index}: no daemon reported the failure")
    # Phase ends are the last rank's: each phase is over when every role is past it.
    planned = max(r["plan_received_unix"] for r in recs)
    rebuilt = max(r["plan_received_unix"] + r["rebuild_s"] for r in recs)
    restored = max(r["plan_received_unix"] + r["rebuild_s"] + r["restore_s"] for r in recs)
    first = max(r["first_step_unix"] for r in recs)
    resume = recs[0]["resume_step"]
    committed_before = max((s for t, s in watch.committed if t <= planned), default=0)
    detected = max(detected, fault_t)
    caught_up = watch.log.first_seen(fault_step + 1)
    lag, stall = _commit_lag(watch, fault_t), _survivor_stall(watch, workdir, victim, fault_t)
    return {"victim_rank": victim, "fault_step": fault_step, "resume_step": resume,
            "generations_used": len([g for g in by_gen if g > 1]),
            "mttr_s": first - fault_t, "detect_s": detected - fault_t,
            "plan_s": planned - detected, "rebuild_s": rebuilt - planned,
            "restore_s": restored - rebuilt, "first_step_s": first - restored,
            "rebuild_by_rank_s": sorted(r["rebuild_s"] for r in recs),
            "restore_by_rank_s": sorted(r["restore_s"] for r in recs),
            "lost_steps": max(0, committed_before - resume),
            "redone_steps": max(0, fault_step - resume),
            "commit_lag_steps": lag, "survivor_stall_s": stall,
            "catch_up_s": caught_up - fault_t if caught_up else None,
            "step_s": median(watch.step_times) if watch.step_times else None,
            "losses": _losses(results)}


def _commit_lag(watch: _Watch, fault_t: float) -> float | None:
    """Median of (newest step trained - newest committed) over the looks before the kill,
    from STEADY_FROM trained steps (before, the pipeline is still filling)."""
    trained = sorted(t_s for seen in watch.log.seen.values() for t_s in seen)
    lags = []
    for t, committed in watch.committed:
        newest = max((step for step, seen_t in trained if seen_t <= t), default=0)
        if STEADY_FROM <= newest and t < fault_t:
            lags.append(newest - committed)
    return median(lags) if lags else None


def _survivor_stall(watch: _Watch, workdir: Path, victim: int, fault_t: float
                    ) -> float | None:
    """Slowest surviving rank: its last step line before the kill -> its first after."""
    stalls = []
    for path, seen in watch.log.seen.items():
        if path.parent != workdir or not path.name.startswith("rank") or \
                path.name == f"rank{victim}.log":
            continue  # the victim, and spares (they were no part of the job before)
        before = [t for _, t in seen if t <= fault_t]
        after = [t for _, t in seen if t > fault_t]
        if before and after:
            stalls.append(min(after) - max(before))
    return max(stalls) if stalls else None


def _losses(results: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for res in results:
        out.update({int(k): v for k, v in res.get("losses", {}).items()})
    return out


# baseline -------------------------------------------------------------------------------


def _baseline(trials: int, workdir: Path) -> list[dict[str, Any]]:
    """One torchrun job; restart round r is killed half an interval after a save."""
    from stalwart.bench.recovery_baseline import run_baseline

    kills = [{"round": r, "rank": 1 + r % (WORLD - 1),
              "step": CKPT_EVERY * (r + 1) + CKPT_EVERY // 2} for r in range(trials)]
    spec = {"model": MODEL, "train": TRAIN, "layout": LAYOUT, "kills": kills,
            "steps": CKPT_EVERY * (trials + 1), "ckpt_every": CKPT_EVERY}
    events = run_baseline(spec, workdir, timeout_s=TRIAL_TIMEOUT_S * trials)
    return [_baseline_recovery(events, k) for k in kills]


def _baseline_recovery(events: list[dict[str, Any]], kill: dict[str, Any]) -> dict[str, Any]:
    fault = next(e for e in events if e["event"] == "fault" and e["round"] == kill["round"])
    after = [e for e in events if e["round"] == kill["round"] + 1]

    def latest(kind: str) -> float:
        return max(e["time_unix"] for e in after if e["event"] == kind)

    restored = next(e["step"] for e in after if e["event"] == "restored")
    first = max(min(e["time_unix"] for e in after if e["event"] == "step" and e["rank"] == r)
                for r in range(WORLD))
    caught = [e["time_unix"] for e in after
              if e["event"] == "step" and e["step"] == kill["step"] + 1]
    t0 = fault["time_unix"]
    spawned = min(e["time_unix"] for e in after if e["event"] == "process_start")
    return {"victim_rank": kill["rank"], "fault_step": kill["step"], "resume_step": restored,
            "mttr_s": first - t0, "restart_s": spawned - t0,
            "import_s": latest("imported") - spawned, "rebuild_s": latest("built")
            - latest("imported"), "restore_s": latest("restored") - latest("built"),
            "first_step_s": first - latest("restored"),
            "lost_steps": kill["step"] - restored, "redone_steps": kill["step"] - restored,
            "catch_up_s": max(caught) - t0 if len(caught) == WORLD else None}


# figures --------------------------------------------------------------------------------


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(median(values), 3) if values else None


def _range(rows: list[dict[str, Any]], key: str) -> list[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return [round(min(values), 3), round(max(values), 3)] if values else []


def _figures(ours: list[dict[str, Any]], base: list[dict[str, Any]],
             root: Path) -> dict[str, Any]:
    base_losses = _baseline_losses(root / "baseline" / "events")
    our_losses: dict[int, float] = {}
    for t in ours:
        our_losses.update(t.pop("losses"))
    common = sorted(set(our_losses) & set(base_losses))
    mttr, base_mttr = _med(ours, "mttr_s"), _med(base, "mttr_s")
    figures = {
        "model": MODEL, "layout": LAYOUT, "global_batch": TRAIN["global_batch"],
        "trials": len(ours),
        "mttr_s": mttr, "mttr_range_s": _range(ours, "mttr_s"),
        **{k: _med(ours, k) for k in ("detect_s", "plan_s", "rebuild_s", "restore_s",
                                      "first_step_s", "catch_up_s", "step_s")},
        "lost_steps": max(t["lost_steps"] for t in ours),
        "redone_steps": _med(ours, "redone_steps"),
        "commit_lag_steps": _med(ours, "commit_lag_steps"),
        "survivor_stall_s": _med(ours, "survivor_stall_s"),
        "baseline": "torchrun --max-restarts (all ranks restarted) + last DCP checkpoint",
        "baseline_ckpt_every_steps": CKPT_EVERY,
        "baseline_mttr_s": base_mttr, "baseline_mttr_range_s": _range(base, "mttr_s"),
        **{f"baseline_{k}": _med(base, k) for k in ("restart_s", "import_s", "rebuild_s",
                                                    "restore_s", "first_step_s",
                                                    "catch_up_s")},
        "baseline_lost_steps": _med(base, "lost_steps"),
        "baseline_save_s": _baseline_save_s(root / "baseline" / "events"),
        "baseline_step_s": _baseline_step_s(root / "baseline" / "events"),
        "mttr_speedup": round(base_mttr / mttr, 2) if mttr and base_mttr else None,
        "same_losses_as_baseline": bool(common) and all(
            our_losses[s] == base_losses[s] for s in common),
        "compared_loss_steps": len(common),
        "trials_ours": [_rounded(t) for t in ours],
        "trials_baseline": [_rounded(t) for t in base],
    }
    return figures


def _baseline_losses(events_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for path in events_dir.glob("rank0-round*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "step":
                out[e["step"]] = e["loss"]
    return out


def _baseline_save_s(events_dir: Path) -> float | None:
    """Median wall time of one DCP save (slowest rank), seconds the baseline's training
    stalls every CKPT_EVERY steps."""
    saves: dict[tuple[str, int], float] = {}
    for path in events_dir.glob("rank*-round*.jsonl"):
        rnd = path.stem.split("-")[1]
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "saved":
                key = (rnd, e["step"])
                saves[key] = max(saves.get(key, 0.0), e["save_s"])
    return round(median(saves.values()), 3) if saves else None


def _baseline_step_s(events_dir: Path) -> float | None:
    """Median time of one training step on rank 0, intervals with a save left out."""
    gaps = []
    for path in events_dir.glob("rank0-round*.jsonl"):
        steps = [json.loads(line) for line in path.read_text().splitlines()]
        steps = [e for e in steps if e["event"] == "step"]
        gaps += [b["time_unix"] - a["time_unix"] for a, b in pairwise(steps)
                 if a["step"] % CKPT_EVERY]
    return round(median(gaps), 3) if gaps else None


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    def r(v: Any) -> Any:
        if isinstance(v, float):
            return round(v, 3)
        return [r(x) for x in v] if isinstance(v, list) else v
    return {k: r(v) for k, v in row.items()}
