"""Shrinking a 4-stage pipeline onto 3 survivors: what the planner decides and how fast,
how much state moves against re-partitioning from scratch, and (on a local cluster, once
the coordinator and agent carry layout changes) the pause and the speed after the shrink.

Baseline for `layers_moved`: `layers_moved_naive`, a time-optimal partition computed
without regard to what each survivor holds, with survivors placed in rank order.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from stalwart.core.decide import Coord, Layout, Member, PlanState
from stalwart.core.partition import partition
from stalwart.core.shrink import ElasticConfig, plan_shrink

KILL_RANK, KILL_STEP = 1, 8


def _layer_bytes(cfg: Any) -> tuple[float, ...]:
    """Bytes a rank receives per layer: fp32 parameters, both AdamW moments, step scalars."""
    from stalwart.client.model import GPTStage

    out = []
    for i in range(cfg.num_layers):
        params = list(GPTStage(cfg, i, i).parameters())
        out.append(float(sum(3 * 4 * p.numel() + 4 for p in params)))
    return tuple(out)


def _pipeline(costs: tuple[float, ...], dp: int, pp: int, per_node: int) -> PlanState:
    stages = partition(list(costs), pp).stages
    members = [Member(f"r{r}", f"n{r // per_node}", Coord(r, r % dp, r // dp, 0))
               for r in range(dp * pp)]
    return PlanState(1, Layout(dp, pp, 1, stages=stages, microbatches=pp), tuple(members))


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
    from stalwart.client.model import PRESETS, layer_costs

    cfg = PRESETS["tiny"]
    costs = tuple(layer_costs(cfg))
    layer_bytes = _layer_bytes(cfg)
    repeats = 5 if quick else 20
    cases = [_planner_case("tiny (1,4,1)", costs, layer_bytes, 1, 4, v, repeats)
             for v in range(4)]
    big = PRESETS["medium"]
    big_costs = tuple(layer_costs(big))
    cases.append(_planner_case("medium (2,4,1)", big_costs, _layer_bytes(big),
                               2, 4, 3, max(1, repeats // 5)))
    head = cases[KILL_RANK]
    out: dict[str, Any] = {
        "replan_s": head["replan_s"], "layers_moved": head["layers_moved"],
        "layers_moved_naive": head["layers_moved_naive"], "bytes_moved": head["bytes_moved"],
        "bytes_moved_naive": head["bytes_moved_naive"],
        "predicted_speed_ratio": head["predicted_speed_ratio"], "planner_cases": cases,
    }
    out.update(_cluster(quick, head))
    return out


def _cluster(quick: bool, head: dict[str, Any]) -> dict[str, Any]:
    """pause_s and throughput_ratio from a real local cluster, where the job can shrink."""
    missing = _missing_wiring()
    if missing and not os.environ.get("STALWART_BENCH_ELASTIC_CLUSTER"):
        return {"pause_s": None, "throughput_ratio": None,
                "cluster": {"skipped": "the running system cannot shrink a job yet",
                            "missing": missing}}
    return _cluster_run(quick, head)


def _missing_wiring() -> list[str]:
    """What the daemon and agent still lack for a layout change (read from their source:
    the bench must not start a cluster that can only stop)."""
    import inspect

    from stalwart.client import agent
    from stalwart.daemon import job

    missing = []
    if "shrink" not in inspect.getsource(job).lower():
        missing.append("daemon/job.py does not give the Coordinator a shrink_planner "
                       "(stalwart.core.shrink.ElasticPlanner)")
    if "relayout" not in inspect.getsource(agent):
        missing.append("client/agent.py restores only its own old rank's state; a changed "
                       "layout needs stalwart.client.relayout.fetch_and_assemble")
    return missing


def _cluster_run(quick: bool, head: dict[str, Any]) -> dict[str, Any]:
    from stalwart.client.local_cluster import ClusterError, LocalCluster

    steps = 24 if quick else 48
    spec = {"model": "tiny", "model_overrides": {},
            "train": {"global_batch": 8, "seed": 0},
            "layout": {"dp": 1, "pp": 4, "tp": 1, "schedule": "1f1b", "microbatches": 4},
            "steps": steps, "collective_timeout_s": 10.0,
            "faults": [{"kind": "kill", "target": "rank", "index": KILL_RANK,
                        "step": KILL_STEP}]}
    cluster = LocalCluster(nodes=2)
    seen: list[tuple[float, int]] = []  # (unix time first seen, newest step)
    try:
        cluster.start_daemons()
        cluster.launch(spec, 4, spares=0, ranks_per_node=2)
        deadline = time.monotonic() + (240 if quick else 600)
        while cluster.running() and time.monotonic() < deadline:
            step = _newest_step(cluster)
            if step is not None and (not seen or step > seen[-1][1]):
                seen.append((time.time(), step))
            if seen and seen[-1][1] >= steps:
                break
            time.sleep(0.05)
    except ClusterError as exc:
        return {"pause_s": None, "throughput_ratio": None, "cluster": {"error": str(exc)}}
    finally:
        cluster.close()
    return _cluster_figures(seen, steps, head)


def _newest_step(cluster: Any) -> int | None:
    newest = None
    for r in cluster.ranks:
        if not r.log_path.exists():
            continue
        for line in r.log_path.read_text(errors="replace").splitlines()[-5:]:
            if line.startswith("[step] "):
                step = int(line.split()[1])
                newest = step if newest is None else max(newest, step)
    return newest


def _cluster_figures(seen: list[tuple[float, int]], steps: int,
                     head: dict[str, Any]) -> dict[str, Any]:
    before = [(t, s) for t, s in seen if s <= KILL_STEP]
    after = [(t, s) for t, s in seen if s > KILL_STEP]
    if len(before) < 3 or len(after) < 3:
        return {"pause_s": None, "throughput_ratio": None,
                "cluster": {"error": f"too few steps observed around the kill "
                                     f"({len(before)} before, {len(after)} after)",
                            "reached_step": seen[-1][1] if seen else 0, "steps": steps}}
    rate_before = (before[-1][1] - before[1][1]) / (before[-1][0] - before[1][0])
    rate_after = (after[-1][1] - after[1][1]) / (after[-1][0] - after[1][0])
    predicted = rate_before * head["predicted_speed_ratio"]
    return {"pause_s": round(after[0][0] - before[-1][0], 3),
            "throughput_ratio": round(rate_after / predicted, 3),
            "cluster": {"steps_per_s_before": round(rate_before, 3),
                        "steps_per_s_after": round(rate_after, 3),
                        "steps_per_s_predicted_after": round(predicted, 3),
                        "kill": f"rank:{KILL_RANK}@step:{KILL_STEP}", "steps": steps}}
