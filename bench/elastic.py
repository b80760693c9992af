"""Shrinking a 4-stage pipeline onto 3 survivors (no spare): on a real local cluster, the
coordinator's decision time, the state moved, the pause and the speed after the shrink
against the planner's prediction; and the planner alone on a few cases.

Baselines: `layers_moved_naive`, a time-optimal partition computed without regard to what
each survivor holds, survivors placed in rank order; `throughput_ratio` divides the
measured steps/s after the shrink by the measured steps/s before it times the planner's
predicted speed ratio; `throughput_ratio_core_share` also scales the prediction by the
larger share of the host's cores each survivor gets (on one CPU host, ranks share cores).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from stalwart.bench.progress import say, seconds
from stalwart.client.step_log import StepLog
from stalwart.core.decide import Member, PlanState
from stalwart.core.layout import Layout
from stalwart.core.partition import partition
from stalwart.core.shrink import ElasticConfig, plan_shrink

KILL_RANK = 1
# Four blocks of d_model 64 over seq 64, 8 micro-batches of 2: block compute dominates a
# step, and the six profile layers (embedding, blocks, head) split well over four stages,
# worse over three (predicted 0.71x); with 4 micro-batches two stages would win instead.
MODEL = {"d_model": 64, "n_layer": 4, "n_head": 2, "d_ff": 256, "seq_len": 64}
STEPS = {False: (15, 25), True: (8, 12)}  # steps before the kill, steps after it
POLL_S = 0.01


def _layer_bytes(cfg: Any) -> tuple[float, ...]:
    """Bytes a rank receives per layer: fp32 parameters, both AdamW moments, step scalars."""
    from stalwart.client.layers import Stage
    from stalwart_examples.gpt import layers

    spec, out = layers(cfg), []
    for i in range(cfg.num_layers):
        params = list(Stage(spec, i, i).parameters())
        out.append(float(sum(3 * 4 * p.numel() + 4 for p in params)))
    return tuple(out)


def _pipeline(costs: tuple[float, ...], dp: int, pp: int, per_node: int) -> PlanState:
    layout = Layout(dp, pp, 1, stages=partition(list(costs), pp).stages, microbatches=pp)
    members = [Member(f"r{r}", f"n{r // per_node}", layout.coords(r))
               for r in range(layout.world_size)]
    return PlanState(1, layout, tuple(members))


def _planner_case(name: str, costs: tuple[float, ...], layer_bytes: tuple[float, ...],
                  dp: int, pp: int, victim: int, repeats: int) -> dict[str, Any]:
    state = _pipeline(costs, dp, pp, per_node=1)
    config = ElasticConfig(costs=costs, layer_bytes=layer_bytes)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = plan_shrink(state, frozenset({f"r{victim}"}), config)
        times.append(time.perf_counter() - t0)
    lay = result.plan.layout
    return {
        "case": name, "before": {"dp": dp, "pp": pp, "stages": [list(s) for s in
                                                                  state.layout.stages]},
        "killed_rank": victim,
        "after": {"dp": lay.dp, "pp": lay.pp, "stages": [list(s) for s in lay.stages],
                  "microbatches": lay.microbatches, "grad_accum": lay.grad_accum},
        "replan_s": round(statistics.median(times), 6),
        "layers_moved": result.layers_moved, "layers_moved_naive": result.layers_moved_naive,
        "bytes_moved": int(result.bytes_moved), "bytes_moved_naive": int(result.bytes_moved_naive),
        "predicted_speed_ratio": round(result.speed_ratio, 4),
        "receive": {k: list(v) for k, v in result.receive.items()},
    }



def run(quick: bool) -> dict:
    from stalwart_examples.gpt.model import config, layer_costs

    cfg = config("tiny")
    costs = tuple(layer_costs(cfg))
    layer_bytes = _layer_bytes(cfg)
    repeats = 5 if quick else 20
    say(f"planner: a lost stage of 4, each victim, {repeats} repeats")
    cases = [_planner_case("tiny (1,4,1)", costs, layer_bytes, 1, 4, v, repeats)
             for v in range(4)]
    big = config("medium")
    big_costs = tuple(layer_costs(big))
    cases.append(_planner_case("medium (2,4,1)", big_costs, _layer_bytes(big),
                               2, 4, 3, max(1, repeats // 5)))
    say("cluster: a 4-stage pipeline loses a rank and shrinks onto 3")
    cluster = _cluster_run(quick)
    say(f"cluster: re-plan {seconds(cluster.get('replan_s'))}, "
        f"pause {seconds(cluster.get('pause_s'))}")
    keys = ("replan_s", "layers_moved", "layers_moved_naive", "bytes_moved",
            "bytes_moved_naive", "pause_s", "throughput_ratio", "throughput_ratio_core_share",
            "relayout_bytes_fetched", "relayout_bytes_needed", "relayout_bytes_whole_ranks")
    return {**{k: cluster.get(k) for k in keys}, "cluster": cluster,
            "planner_cases": cases}


def _spec(quick: bool) -> dict[str, Any]:
    """The job: (1,4,1) on the planner's balanced partition, one stage's rank killed."""
    before, after = STEPS[quick]
    spec = {"model": "tiny", "model_overrides": MODEL, "train": {"global_batch": 16, "seed": 0},
            "layout": {"dp": 1, "pp": 4, "tp": 1, "schedule": "1f1b", "microbatches": 8},
            "steps": before + after, "collective_timeout_s": 10.0, "flops_costs": True,
            "faults": [{"kind": "kill", "target": "rank", "index": KILL_RANK,
                        "step": before}]}
    costs = list(_profile_config(spec).costs)
    spec["layout"]["stages"] = [list(b) for b in partition(costs, 4).stages]
    return spec


def _cluster_run(quick: bool) -> dict[str, Any]:
    """Train (1,4,1) without a spare, kill one stage's rank, and time the shrink."""
    from stalwart.client.local_cluster import ClusterError, LocalCluster

    spec = _spec(quick)
    steps, clock = spec["steps"], StepLog()
    cluster = LocalCluster(nodes=2, metrics=True, daemon_settings={"elastic": {"shrink": True}})
    cluster.env["STALWART_FAULT_LOG"] = str(cluster.workdir)
    first_plan, roles, next_status, keep = None, 3, 0.0, True
    shrunk = None  # the plan after the kill (the status ends on the completion plan)
    try:
        cluster.start_daemons()
        coord = cluster.coordinator()
        assert coord is not None
        cluster.launch(spec, 4, spares=0, ranks_per_node=2)
        deadline = time.monotonic() + (180 if quick else 360)
        while time.monotonic() < deadline and cluster.running():
            clock.poll([r.log_path for r in cluster.ranks])
            if time.monotonic() >= next_status:  # the plan, at most twice a second
                next_status = time.monotonic() + 0.5
                st = coord.status()
                if st is not None and st.generation == 1 and len(st.plan.assignments) == 4:
                    first_plan = st.plan
                if st is not None and st.generation >= 2 and not st.plan.stop:
                    roles = len([a for a in st.plan.assignments if not a.spare])
                    shrunk = st.plan
            if clock.finished(steps) >= roles:
                break  # every rank with a role in the new plan trained the last step
            time.sleep(POLL_S)
        # Results are written once a rank's last step is committed; give that a moment
        # (a step that some rank's daemon skipped capturing never commits).
        end = time.monotonic() + 10
        while cluster.running() and time.monotonic() < end:
            time.sleep(0.1)
        final = coord.status()
        if final is not None and final.plan.completed and shrunk is not None:
            final.plan.CopyFrom(shrunk)
        scraped = _scrape(coord.metrics_port)
        assert cluster.workdir is not None
        faults = [json.loads(p.read_text()) for p in cluster.workdir.glob("fault-*.json")]
        installed = _plan_installed_unix(coord.log_path)
        error = _incomplete(first_plan, final, faults, installed, clock.finished(steps), roles,
                            steps)
        if error:
            return {"error": f"{error}; logs in {cluster.workdir}"}
        results = [r.result() for r in cluster.ranks]
        # Keep the logs of a last step that did not commit.
        keep = final.latest_committed_step < steps
        out = _figures(spec, clock, first_plan, final, faults[0], installed, results, scraped)
        out.update(_relayout_bytes(cluster))
        return {**out, "logs": str(cluster.workdir)} if keep else out
    except ClusterError as exc:
        return {"error": f"{exc}; logs in {cluster.workdir}"}
    finally:
        cluster.close(keep_workdir=keep)


RELAYOUT = re.compile(r"relayout restore: layers \d+-\d+ from old ranks \[([\d, ]*)\] of "
                      r"the step-(\d+) .*: fetched (\d+) bytes for (\d+) needed in ([\d.]+) s")


def _relayout_bytes(cluster: Any) -> dict[str, Any]:
    """What the ranks that took new roles fetched from their daemons (their log lines),
    the bytes their roles hold, and what fetching the old ranks whole would have moved
    (those ranks' records of the step, on the daemons' disks)."""
    from stalwart.core.manifest import ManifestError
    from stalwart.core.step_record import MissingRecords
    from stalwart.daemon.snapshot.local_store import LocalStore
    from stalwart.daemon.snapshot.records import from_disks

    found = [m for r in cluster.ranks if r.log_path.exists()
             for m in RELAYOUT.finditer(r.log_path.read_text(errors="replace"))]
    if not found:
        return {"relayout_ranks": 0}
    stores = [LocalStore(n.data_dir, ram_tier_bytes=0) for n in cluster.daemons]
    fetch = from_disks(stores)
    whole: int | None = 0
    try:
        for m in found:
            step = int(m.group(2))
            for old in (int(x) for x in m.group(1).split(",") if x.strip()):
                whole += stores[0].rank_record(step, old, fetch).total_bytes
    except (OSError, MissingRecords, ManifestError):
        whole = None  # the step was retired by the end of the run (retention)
    return {
        "relayout_ranks": len(found),
        "relayout_bytes_fetched": sum(int(m.group(3)) for m in found),
        "relayout_bytes_needed": sum(int(m.group(4)) for m in found),
        "relayout_bytes_whole_ranks": whole,
        "relayout_restore_s": max(float(m.group(5)) for m in found),
    }


def _plan_installed_unix(log_path: Path | None) -> float | None:
    """When the coordinator installed the shrunk plan (its JSON log line), unix seconds."""
    from datetime import datetime

    for line in log_path.read_text().splitlines() if log_path else ():
        if '"new plan installed"' in line:
            ts = json.loads(line)["ts"]
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    return None


def _incomplete(first_plan: Any, final: Any, faults: list, installed: float | None,
                finished: int, roles: int, steps: int) -> str:
    """Why the run cannot give figures, or ''."""
    if first_plan is None:
        return "the coordinator never showed the first plan"
    if final is None or final.generation < 2 or installed is None:
        return "no new plan after the kill"
    if final.plan.stop:
        return f"the job stopped instead of shrinking: {final.plan.stop_message}"
    if len(faults) != 1:
        return f"expected one fault record, found {len(faults)}"
    if finished < roles:
        return f"only {finished} of the new plan's {roles} ranks trained to step {steps}"
    return ""


def _scrape(port: int) -> dict[str, float]:
    """The coordinator's /metrics as {series with labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _step_times(clock: StepLog, since: float, until: float) -> dict[int, float]:
    """step -> when every rank that printed it in (since, until] had printed it."""
    out: dict[int, float] = {}
    for seen in clock.seen.values():
        for step, t in seen:
            if since < t <= until:
                out[step] = max(out.get(step, 0.0), t)
    return out


def _rate(times: dict[int, float], skip: int) -> tuple[float, int]:
    """Steps/s over the steps after the first `skip` (warm-up), and the steps counted."""
    steps = sorted(times)[skip:]
    if len(steps) < 3:
        raise ValueError(f"too few steps to time ({len(steps)})")
    return (steps[-1] - steps[0]) / (times[steps[-1]] - times[steps[0]]), len(steps)


def _figures(spec: dict[str, Any], clock: StepLog, first_plan: Any, final: Any,
             fault: dict[str, Any], installed: float, results: list,
             scraped: dict[str, float]) -> dict[str, Any]:
    # The old pipeline is stuck from the kill on: every step line after the plan's
    # installation is the new generation's.
    before = _step_times(clock, 0.0, installed)
    after = _step_times(clock, installed, float("inf"))
    rate_before, n_before = _rate(before, 2)
    rate_after, n_after = _rate(after, 2)
    # The planner on the same plan and profile the coordinator had (no memory cap).
    state = PlanState.from_proto(first_plan)
    victim = next(m.rank_id for m in state.members if m.coord.rank == KILL_RANK)
    config = _profile_config(spec)
    t0 = time.perf_counter()
    again = plan_shrink(state, frozenset({victim}), config)
    planner_s = time.perf_counter() - t0
    predicted = rate_before * again.speed_ratio
    # Ranks on one CPU host share its cores: each of the 4 gets cores/4 before the kill and
    # each of the 3 survivors cores/3 after. The planner's device speeds do not know that.
    new = PlanState.from_proto(final.plan)
    cores = len(os.sched_getaffinity(0))
    core_gain = min(1.0, cores / len(new.members)) / min(1.0, cores / len(state.members))
    moved = re.search(r"(\d+) layers moved", final.plan.reason)
    gen2 = [g for r in results if r for g in r.get("generations", []) if g["generation"] == 2]
    plan_sum = 'stalwart_recovery_phase_seconds_sum{phase="plan"}'
    return {
        "replan_s": round(scraped[plan_sum], 4) if plan_sum in scraped else None,
        "layers_moved": int(moved[1]) if moved else again.layers_moved,
        "layers_moved_naive": again.layers_moved_naive,
        "bytes_moved": int(again.bytes_moved), "bytes_moved_naive": int(again.bytes_moved_naive),
        "pause_s": round(min(after.values()) - max(before.values()), 3),
        "throughput_ratio": round(rate_after / predicted, 3),
        "throughput_ratio_core_share": round(rate_after / (predicted * core_gain), 3),
        "core_share_gain": round(core_gain, 4), "cores": cores,
        "steps_per_s_before": round(rate_before, 3), "steps_per_s_after": round(rate_after, 3),
        "steps_per_s_predicted_after": round(predicted, 3),
        "predicted_speed_ratio": round(again.speed_ratio, 4),
        "measured_speed_ratio": round(rate_after / rate_before, 4),
        "steps_timed": {"before": n_before, "after": n_after},
        "planner_s": round(planner_s, 6),
        "planner_matches_coordinator": again.plan.layout.stages == new.layout.stages,
        "plan_before": {"pp": state.layout.pp, "stages": [list(s) for s in state.layout.stages]},
        "plan_after": {"pp": new.layout.pp, "stages": [list(s) for s in new.layout.stages],
                       "grad_accum": new.layout.grad_accum},
        "reason": final.plan.reason, "resume_step": final.plan.resume_step,
        "fault_to_first_step_s": round(min(after.values()) - fault["time_unix"], 3),
        "detect_plan_s": round(installed - fault["time_unix"], 3),
        # From the survivors' results, written only once their last step committed.
        "rebuild_s": max((g["rebuild_s"] for g in gen2), default=None),
        "restore_s": max((g["restore_s"] for g in gen2), default=None),
        "last_step_committed": final.latest_committed_step >= spec["steps"],
        "latest_committed_step": final.latest_committed_step,
        "kill": f"rank:{KILL_RANK}@step:{fault['step']}", "steps": spec["steps"],
        "model": MODEL, "layer_costs": list(config.costs),
    }


def _profile_config(spec: dict[str, Any]) -> ElasticConfig:
    """The ElasticConfig the coordinator builds from the ranks' layer profile."""
    from stalwart.client.trainer import TrainConfig
    from stalwart.client.trainer_program import TrainerProgram
    from stalwart.v1 import common_pb2
    from stalwart_examples.gpt import job

    lay, train = spec["layout"], spec["train"]
    layers, data = job(spec["model"], global_batch=train["global_batch"], seed=train["seed"],
                       flops_costs=True, **spec["model_overrides"])
    p = TrainerProgram(layers, data, TrainConfig(seed=train["seed"]), common_pb2.ParallelLayout(
        dp=lay["dp"], pp=lay["pp"], tp=lay["tp"], microbatches=lay["microbatches"]),
        spec["steps"]).profile()
    return ElasticConfig(costs=tuple(p.costs), layer_bytes=tuple(p.state_bytes) or None)
