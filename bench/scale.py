"""Re-planning at scale: decide, partition, rank placement and shard placement after a
node is lost from jobs of 1,024, 4,096 and 16,384 GPUs (the coordinator's real code).

Each job is dp x pp 16 x tp 8 on nodes of 8 GPUs with 80 equal layers. A node is lost;
with a spare node the plan replaces it, without one the elastic planner shrinks onto
the survivors (the slower path, and the one `replan_s` reports). Rank placement lays the
new layout onto the nodes; shard placement is the repair plan for the shards the lost
node held (2,048 chunks of k=4, m=2 spread over the job's nodes) and the cost of placing
one chunk, which every daemon pays for every chunk of every step.

The per-step commit is simulated with N daemons over real gRPC against the real
coordinator code (`bench/scale_commit.py`), N from 8 to 2,048 (256 in a quick run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from stalwart.bench import progress, scale_commit
from stalwart.core.decide import Member, PlanDecision, PlanState, decide
from stalwart.core.failures import Failure, FailureKind
from stalwart.core.layout import Layout
from stalwart.core.placement import Node, place_chunk, repair_plan
from stalwart.core.rank_placement import place
from stalwart.core.shrink import ElasticConfig, ElasticPlanner
from stalwart.core.topology import Topology
from stalwart.daemon.config_schema import default
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.membership import Membership
from stalwart.v1 import peer_pb2

GPUS = (1024, 4096, 16384)
PER_NODE, TP, PP, LAYERS = 8, 8, 16, 80
LOST = "node-3"
CHUNKS = 2048  # chunks whose shards the repair plan re-places
COORDINATOR_CPU_GOAL_S = 0.050  # per committed step at 2,048 daemons (issue #17)
GOAL_DAEMONS = 2048


def run(quick: bool) -> dict[str, Any]:
    repeats = 1 if quick else 3
    points = []
    for gpus in GPUS:
        progress.say(f"{gpus} GPUs: replace, shrink, rank and shard placement")
        points.append(_point(gpus, repeats))
    sizes = (8, 64, 256) if quick else (8, 64, 256, 1024, 2048)
    commit = scale_commit.points(sizes, steps=5 if quick else 10)
    return {
        "model": {"layers": LAYERS, "tp": TP, "pp": PP, "gpus_per_node": PER_NODE,
                  "lost": "one node (8 GPUs)", "k": 4, "m": 2},
        "replan": points,
        "replan_s": {str(p["gpus"]): p["replan_s"] for p in points},
        **commit,
        "gossip": [_gossip(n) for n in sizes],
        "per_step_costs": {
            "coordinator": "about commit_fanout columns of seals in, as messages on the "
                           "step streams its children hold open, each seal checked against "
                           "its daemon's seat in the plan by its bytes and its tag (about "
                           "1.5 microseconds of Python per daemon, O(daemons), never "
                           "O(ranks)); one record of O(daemons) seals parsed from their "
                           "bytes in one call, signed once and sent on commit_fanout "
                           "streams to daemons that pass it on.",
            "daemon": "verifies the step record (sha256 over O(daemons) bytes, every rank "
                      "once, counted in C), its own seal and the coordinator's signature; "
                      "passes the record on to at most commit_fanout children and its "
                      "subtree's seals up in one column; copies its ranks' records to m "
                      "holders: O(its own ranks)."},
        "defects": _defects(commit),
    }


def _defects(commit: dict[str, Any]) -> list[str]:
    """What on the per-step path misses its goal, with the figures that say so."""
    top = commit["points"][-1]
    cpu, daemons = top["coordinator_cpu_s_per_step"], top["daemons"]
    if daemons < GOAL_DAEMONS or cpu <= COORDINATOR_CPU_GOAL_S:
        return []
    seals = commit["seal_check_us_per_daemon"] * daemons / 1e6
    on_loop = top["coordinator_loop_cpu_s_per_step"]
    others = top["coordinator_other_threads_cpu_s_per_step"]
    return [f"coordinator: {cpu:.3f} s of CPU per step at {daemons:,} daemons against a "
            f"goal of {COORDINATOR_CPU_GOAL_S:.3f} s. {on_loop:.3f} s of it on the event "
            f"loop's thread, where checking each daemon's seal ("
            f"{commit['seal_check_us_per_daemon']:.1f} us) takes {seals:.3f} s, and the "
            "step's bookkeeping and gRPC's work per message the rest (about 2 x "
            "commit_fanout messages a step on step streams: columns in, the "
            f"step's commit of {top['step_record_bytes']:,} bytes out to commit_fanout "
            f"daemons); {others:.3f} s on its other threads (gRPC's sockets and HTTP/2). "
            "O(daemons), never O(ranks)"]


def _gossip(daemons: int) -> dict[str, Any]:
    """One heartbeat interval of gossip for one daemon among `daemons`, measured on the
    real membership tables (the daemon's default `gossip_fanout`): the calls it makes,
    as many made to it on average, and the bytes of both with the replies of daemons that
    see the job alike; beside them the full mesh with full replies this replaced."""
    def info(i: int) -> peer_pb2.PeerInfo:
        return peer_pb2.PeerInfo(
            node=f"node-{i:04d}", address=f"10.0.{i // 256}.{i % 256}:7070",
            labels={"rack": f"rack-{i // 16}"}, generation=3, latest_committed=1234,
            time_unix_ms=int(time.time() * 1000),
            rank_ids=[f"node-{i:04d}/{4000 + r}" for r in range(PER_NODE)])

    tables = [Membership(f"node-{i:04d}", info(i).address, 1.0, 5.0, Metrics(), lambda f: f,
                         fanout=default("gossip_fanout")) for i in (0, 1)]
    for i in range(daemons):
        for j, table in enumerate(tables):
            if i != j:
                table.observe(info(i))
    call = info(1)  # node-0001 calls node-0000, both seeing the job alike
    call.view = tables[1].view()
    converged = tables[0].to_proto(info(0), "node-0000", call.view).ByteSize()
    full = tables[0].to_proto(info(0), "node-0000", b"").ByteSize()
    calls = 2 * len(tables[0].targets())  # out, and as many in
    mesh = 2 * (daemons - 1)
    return {"daemons": daemons, "calls_per_daemon_per_interval": calls,
            "bytes_per_daemon_per_interval": calls * (call.ByteSize() + converged),
            "full_mesh_calls_per_daemon_per_interval": mesh,
            "full_mesh_bytes_per_daemon_per_interval": mesh * (call.ByteSize() + full)}


def _point(gpus: int, repeats: int) -> dict[str, Any]:
    nodes = gpus // PER_NODE
    fail = [Failure(FailureKind.PEER_LOST, LOST, "bench: node lost", generation=1)]
    planner = ElasticPlanner(ElasticConfig(costs=(1.0,) * LAYERS))
    with_spare, without = _state(gpus, spare_nodes=1), _state(gpus, spare_nodes=0)
    replace_s, replaced = _median(repeats, lambda: decide(with_spare, fail, 100))
    shrink_s, shrunk = _median(repeats, lambda: decide(without, fail, 100,
                                                       shrink_planner=planner))
    assert isinstance(replaced, PlanDecision) and replaced.kind == "replace", replaced
    assert isinstance(shrunk, PlanDecision) and shrunk.kind == "shrink", shrunk
    lay = shrunk.plan.layout
    topology = Topology(nodes=nodes - 1, devices_per_node=PER_NODE)
    placement_s, _ = _median(repeats, lambda: place(lay, topology))
    live = [Node(f"node-{i}", {"rack": f"rack-{i // 16}"}) for i in range(nodes)]
    per_chunk_s, placements = _median(repeats, lambda: [
        place_chunk(f"100/{c % 8}/c{c}", 4, 2, live) for c in range(CHUNKS)])
    survivors = [n for n in live if n.name != LOST]
    repair_s, plan = _median(repeats, lambda: repair_plan(placements, {LOST}, survivors))
    result = planner.last
    return {
        "gpus": gpus, "nodes": nodes,
        "replace_s": round(replace_s, 4),
        "shrink_s": round(shrink_s, 4),
        "shrink_to": f"dp={lay.dp} pp={lay.pp} tp={lay.tp}",
        "layers_moved": result.layers_moved if result else None,
        "layers_moved_naive": result.layers_moved_naive if result else None,
        "rank_placement_s": round(placement_s, 4),
        "shard_place_us_per_chunk": round(per_chunk_s / CHUNKS * 1e6, 1),
        "shard_repair_plan_s": round(repair_s, 4),
        "shards_repaired": len(plan.tasks),
        "replan_s": round(shrink_s + placement_s + repair_s, 4),
    }


def _state(gpus: int, spare_nodes: int) -> PlanState:
    lay = Layout(dp=gpus // (TP * PP), pp=PP, tp=TP, microbatches=2 * PP)
    members = tuple(Member(f"rank-{r}", f"node-{r // PER_NODE}", lay.coords(r))
                    for r in range(gpus))
    first = gpus // PER_NODE
    spares = tuple(Member(f"spare-{i}", f"node-{first + i // PER_NODE}")
                   for i in range(spare_nodes * PER_NODE))
    return PlanState(generation=1, layout=lay, members=members, spares=spares)


def _median(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out
