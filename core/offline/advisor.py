"""Parallel-strategy advisor: pick (dp, tp, pp, micro-batches, schedule, recomputation)
for a GPT on a cluster by predicting step time and memory per GPU.

The cost model, and what it assumes (stated once here, reported with every plan):
- Compute: analytic FLOPs at `efficiency` x peak; stages balanced by the partitioner.
- Placement: tp varies fastest, then pp, then dp, so TP stays inside a node, PP hops
  cross a node only when tp * pp > GPUs per node, and DP rings cross nodes when the
  job spans more than one node. Bandwidths are per GPU and per direction.
- TP (Megatron style, with sequence parallelism): 4 all-reduces of b*s*h 16-bit values
  per block per micro-batch (6 with full recomputation), not overlapped.
- PP: one activation send forward and one gradient send backward per micro-batch per
  stage boundary, each TP rank sending its 1/tp slice; not overlapped.
- DP: ring all-reduce of the 16-bit gradients, 2(d-1)/d of the bytes per GPU, started
  with the last micro-batch's backward pass (bucketed, as DDP does) and hidden behind it;
  only the rest shows. The optimizer state is sharded over DP (ZeRO-1), which moves the
  same bytes as an all-reduce.
- Memory: 2+2 bytes/param for 16-bit weights and gradients, 12/dp for the fp32 master
  copy and Adam moments; activations for the micro-batches in flight (1F1B: p - stage,
  GPipe: all of a flush); 10% of the GPU kept free for the runtime and fragmentation.
- Not modelled: message latency, optimizer-step time, kernel efficiency changing
  with shape.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from stalwart.core.costs import RECOMPUTE, CostProfile, GPTShape, gpt_profile, shape_for_params
from stalwart.core.partition import in_flight, partition

__all__ = ["Cluster", "Plan", "advise", "classic_rule", "compare_with_classic"]

BITS = 8
USABLE_MEMORY = 0.9
# Plans within this fraction of the best step time count as equally good.
TIE = 0.02


@dataclass(frozen=True)
class Cluster:
    """The machines a job runs on."""

    gpus_per_node: int
    nodes: int
    gpu_mem_bytes: float
    intra_gbps: float
    """NVLink-class bandwidth inside a node, Gb/s per GPU per direction."""
    inter_gbps: float
    """Network bandwidth between nodes, Gb/s per GPU per direction."""
    gpu_flops: float = 989e12
    """Peak dense 16-bit FLOP/s of one GPU (H100 SXM by default)."""
    efficiency: float = 0.5
    """Fraction of peak that the matrix multiplies reach."""

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Plan:
    """One candidate layout with its predicted cost."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per pipeline flush."""
    accumulation: int
    """Flushes (pp > 1) or micro-steps (pp = 1) per optimizer step."""
    schedule: str
    recompute: str
    step_time_s: float = math.inf
    time_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: float = 0.0
    memory_detail: dict[str, float] = field(default_factory=dict)
    stages: list[tuple[int, int]] = field(default_factory=list)
    fits: bool = True
    reason: str = ""

    @property
    def layout(self) -> str:
        return f"dp{self.dp} tp{self.tp} pp{self.pp}"

    def to_json(self) -> dict:
        out = asdict(self)
        out["stages"] = [list(s) for s in self.stages]
        return out


def advise(params: float | None, cluster: Cluster, global_batch: int = 1024,
           shape: GPTShape | None = None, runner_ups: int = 4) -> dict:
    """Best plan, runner-ups with why each loses, and the assumptions, as JSON-ready dict.

    params: model parameters (used to derive a GPT shape when `shape` is None).
    global_batch: sequences per optimizer step.
    """
    if shape is None:
        if not params or params <= 0:
            raise ValueError("give the model size (params > 0) or its shape")
        shape = shape_for_params(params)
    shape = GPTShape(**{**asdict(shape), "micro_batch": 1})
    plans = [_evaluate(c, shape, cluster) for c in _candidates(shape, cluster, global_batch)]
    feasible = sorted((p for p in plans if p.fits), key=lambda p: p.step_time_s)
    if not feasible:
        closest = min(plans, key=lambda p: p.memory_bytes)
        raise ValueError(f"no layout fits {cluster.gpu_mem_bytes / 1e9:.0f} GB GPUs: the "
                         f"smallest needs {closest.memory_bytes / 1e9:.1f} GB per GPU "
                         f"({closest.layout}, recompute {closest.recompute}); add GPUs or "
                         f"use GPUs with more memory")
    best = feasible[0]
    best.reason = "fastest predicted step that fits"
    seen = {(best.dp, best.tp, best.pp)}
    ups = []
    for p in feasible[1:]:
        if (p.dp, p.tp, p.pp) in seen:
            continue
        seen.add((p.dp, p.tp, p.pp))
        p.reason = _why_slower(p, best)
        ups.append(p)
        if len(ups) == runner_ups:
            break
    rejected = []
    for key in sorted({(p.dp, p.tp, p.pp) for p in plans} - {(p.dp, p.tp, p.pp)
                                                            for p in feasible}):
        smallest = min((p for p in plans if (p.dp, p.tp, p.pp) == key),
                       key=lambda p: p.memory_bytes)
        rejected.append(smallest)
    return {"model": {"params": shape.params(), **asdict(shape)},
            "cluster": asdict(cluster), "global_batch": global_batch,
            "best": best.to_json(), "runner_ups": [p.to_json() for p in ups],
            "rejected": [p.to_json() for p in rejected],
            "classic": compare_with_classic(shape.params(), cluster, best, plans),
            "assumptions": __doc__.split("assumes (stated once here, reported with every "
                                         "plan):\n")[1].strip()}


def _candidates(shape: GPTShape, cluster: Cluster, global_batch: int) -> list[Plan]:
    n_layers = shape.n_layers + 2
    out = []
    for tp in _divisors(cluster.gpus_per_node):  # TP never leaves a node
        if shape.n_heads % tp:
            continue
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            if pp > n_layers or global_batch % dp:
                continue
            m = global_batch // dp
            for recompute in RECOMPUTE:
                if pp == 1:
                    out.append(Plan(dp, tp, 1, 1, 1, m, "none", recompute))
                    continue
                if m >= pp:
                    out.append(Plan(dp, tp, pp, 1, m, 1, "1f1b", recompute))
                out.append(Plan(dp, tp, pp, 1, m, 1, "gpipe", recompute))
    return out


@functools.lru_cache(maxsize=8)
def _profile(shape: GPTShape) -> CostProfile:
    return gpt_profile(shape)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ring_s(nbytes: float, ranks: int, gbps: float) -> float:
    """Ring all-reduce time: each GPU sends and receives 2(d-1)/d of the bytes."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (gbps * 1e9 / BITS)


def _evaluate(plan: Plan, shape: GPTShape, cluster: Cluster) -> Plan:
    dp, tp, pp = plan.dp, plan.tp, plan.pp
    profile = _profile(shape)
    rate = cluster.gpu_flops * cluster.efficiency
    token_bytes = shape.seq * shape.d_model * 2  # one micro-batch of 16-bit activations
    allreduces = 6 if plan.recompute == "full" else 4
    tp_msg = _ring_s(token_bytes, tp, cluster.intra_gbps)
    # Per-layer seconds per micro-batch on one GPU: compute split over TP, plus TP comm.
    seconds = [x.flops(plan.recompute) / tp / rate
               + (allreduces * tp_msg if x.kind == "block" else 2 * tp_msg)
               for x in profile.layers]
    static = [x.params / tp * (4 + 12 / dp) for x in profile.layers]
    act = [x.act_bytes[plan.recompute] / tp for x in profile.layers]
    if plan.recompute == "full":
        # Recomputing a block needs that block's full activations for a moment.
        working = max(x.act_bytes["none"] for x in profile.layers) / tp
    else:
        working = 0.0
    usable = cluster.gpu_mem_bytes * USABLE_MEMORY - working
    flights = in_flight("1f1b", pp, plan.micro_batches) if plan.schedule == "1f1b" else None
    try:
        if plan.schedule == "gpipe":
            # Largest flush whose activations fit; the rest of the batch is accumulated.
            bounds = partition(seconds, pp).stages
            total = plan.micro_batches * plan.accumulation
            plan.micro_batches = _largest_flush(bounds, static, act, usable, total)
            plan.accumulation = total // plan.micro_batches
            flights = [plan.micro_batches] * pp
        cut = partition(seconds, pp, mem=static, act=act, mem_cap=usable,
                        schedule="1f1b" if plan.schedule != "gpipe" else "gpipe",
                        micro_batches=plan.micro_batches if pp > 1 else 1)
    except ValueError:
        flights = flights or [plan.micro_batches if pp > 1 else 1] * pp
        bounds = partition(seconds, pp).stages
        need = [sum(static[a:b + 1]) + f * sum(act[a:b + 1])
                for (a, b), f in zip(bounds, flights, strict=True)]
        plan.memory_bytes = max(need) + working
        plan.fits = False
        plan.reason = (f"does not fit: needs {plan.memory_bytes / 1e9:.1f} GB per GPU, "
                       f"{usable / 1e9 + working / 1e9:.1f} GB usable")
        return plan
    plan.stages = list(cut.stages)
    j = max(range(pp), key=lambda s: cut.stage_memory[s])
    a, b = cut.stages[j]
    plan.memory_detail = {"weights_grads_optimizer": sum(static[a:b + 1]),
                          "activations": cut.stage_memory[j] - sum(static[a:b + 1]) + working}
    plan.memory_bytes = cut.stage_memory[j] + working

    stage_s = cut.bottleneck
    pp_link = cluster.intra_gbps if tp * pp <= cluster.gpus_per_node else cluster.inter_gbps
    pp_s = 2 * token_bytes / tp / (pp_link * 1e9 / BITS) if pp > 1 else 0.0
    comm_share = sum((allreduces * tp_msg if x.kind == "block" else 2 * tp_msg)
                     for x in profile.layers[a:b + 1])
    per_mb = stage_s + pp_s
    m, flushes = plan.micro_batches if pp > 1 else 1, plan.accumulation
    pipeline_s = flushes * (m + pp - 1) * per_mb
    grads = sum(x.params for x in profile.layers[a:b + 1]) / tp * 2
    spans_nodes = cluster.nodes > 1 and dp * tp * pp > cluster.gpus_per_node
    dp_link = cluster.inter_gbps if spans_nodes else cluster.intra_gbps
    dp_s = _ring_s(grads, dp, dp_link)
    hidden = stage_s * 2 / 3  # the backward pass of the last micro-batch
    plan.time_s = {"compute": flushes * m * (stage_s - comm_share),
                   "tp_comm": flushes * m * comm_share,
                   "pp_comm": flushes * m * pp_s,
                   "bubble": flushes * (pp - 1) * per_mb,
                   "dp_allreduce": dp_s,
                   "dp_exposed": max(0.0, dp_s - hidden)}
    plan.step_time_s = pipeline_s + plan.time_s["dp_exposed"]
    return plan


def _largest_flush(bounds: list[tuple[int, int]], static: list[float], act: list[float],
                   usable: float, m: int) -> int:
    room = min((usable - sum(static[a:b + 1])) / max(sum(act[a:b + 1]), 1e-9)
               for a, b in bounds)
    best = 1
    for f in _divisors(m):
        if f <= room:
            best = f
    return best


def _why_slower(plan: Plan, best: Plan) -> str:
    delta = plan.step_time_s - best.step_time_s
    parts = []
    for key, label in (("bubble", "pipeline bubble"), ("tp_comm", "TP all-reduces"),
                       ("pp_comm", "PP sends"), ("dp_exposed", "exposed DP all-reduce"),
                       ("compute", "compute")):
        diff = plan.time_s.get(key, 0.0) - best.time_s.get(key, 0.0)
        if diff > 0.05 * delta:
            parts.append((diff, f"{label} +{diff:.2f} s"))
    parts.sort(reverse=True)
    text = ", ".join(t for _, t in parts[:2]) or "small differences everywhere"
    if plan.recompute != "none" and plan.time_s.get("compute", 0) > best.time_s.get("compute", 0):
        text += f" ({plan.recompute} recomputation)"
    return f"{delta:+.2f} s/step ({delta / best.step_time_s:+.0%}): {text}"


def classic_rule(params: float, inter_gbps: float) -> dict:
    """What the rule of thumb says: <10B DP + accumulation, 10-100B DP + TP, >100B 3D;
    links under 200 Gb/s favour PP over DP across nodes."""
    if params < 10e9:
        rule, kinds = "under 10B: data parallel with gradient accumulation", {"dp"}
    elif params <= 100e9:
        rule, kinds = "10B-100B: data parallel + tensor parallel inside a node", {"dp", "tp"}
    else:
        rule, kinds = "over 100B: 3D (data, tensor and pipeline parallel)", {"dp", "tp", "pp"}
    if inter_gbps < 200:
        rule += "; links under 200 Gb/s: pipeline across nodes instead of more DP"
        kinds |= {"pp"}
    return {"rule": rule, "uses": sorted(kinds)}


def compare_with_classic(params: float, cluster: Cluster, best: Plan,
                         plans: list[Plan]) -> dict:
    """The classic rule beside the model's choice: the fastest plan that follows the rule,
    and what the model's choice saves over it (or why the rule's layout cannot run)."""
    rule = classic_rule(params, cluster.inter_gbps)
    wanted = set(rule["uses"])
    used = _axes(best)
    out = {**rule, "model_uses": sorted(used), "agrees": used == wanted}
    followers = sorted((p for p in plans if p.fits and _axes(p) == wanted),
                       key=lambda p: p.step_time_s)
    if followers:
        follower = followers[0]
        out["rule_plan"] = follower.to_json()
        if follower.step_time_s <= best.step_time_s * (1 + TIE):
            # Within the model's precision the rule's layout is as good: no disagreement.
            out["agrees"] = True
        if not out["agrees"]:
            out["rule_plan"]["reason"] = _why_slower(follower, best)
            out["differences"] = [f"the rule's best layout ({follower.layout}, "
                                  f"{follower.recompute} recomputation) loses "
                                  + _why_slower(follower, best)]
    else:
        smallest = min((p for p in plans if _axes(p) == wanted), key=lambda p: p.memory_bytes,
                       default=None)
        what = (f"its smallest layout ({smallest.layout}) needs "
                f"{smallest.memory_bytes / 1e9:.1f} GB per GPU" if smallest
                else "no such layout exists on this cluster")
        out["differences"] = [f"no layout that follows the rule fits: {what}"]
    out.setdefault("differences", [])
    return out


def _axes(plan: Plan) -> set[str]:
    return {k for k, v in (("dp", plan.dp), ("tp", plan.tp), ("pp", plan.pp)) if v > 1}
