"""Seeded fault schedules for the chaos campaign (pure logic, no processes).

A schedule is a layout (parallel degrees, spares, nodes) and the faults to inject into
one run of it. Only schedules the job is expected to survive are generated: after every
fault of a schedule, the live ranks and spares that still have a live daemon can run
some layout with the same TP degree (the planner keeps TP and may span nodes), and at
most one daemon is lost (erasure coding keeps every committed step through one).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KINDS", "NOT_COVERED", "Fault", "Layout", "Schedule", "feasible", "generate",
           "placement"]

MAX_PROCESSES = 8  # ranks + spares of one run: bounds a run's time on a small machine

# kind -> what it does (the table and --help use these lines)
KINDS: dict[str, str] = {
    "kill-rank": "SIGKILL a training rank",
    "kill-spare": "SIGKILL an idle spare",
    "kill-daemon": "SIGKILL a daemon alone (its ranks keep running)",
    "kill-node": "SIGKILL a node: its daemon, ranks and spares",
    "kill-coordinator": "SIGKILL the node whose daemon coordinates",
    "hang": "a rank stops answering (alive, heartbeating)",
    "gpu": "an NVML Xid 79 on a rank's GPU",
    "stop-rank": "SIGSTOP a training rank, left stopped",
    "stop-daemon": "SIGSTOP a daemon past the heartbeat timeout, then SIGCONT",
    "double": "SIGKILL a rank, then another while the job recovers",
    "bitflip": "flip a bit in a rank's stored chunks, then SIGKILL it",
    "full-disk": "fill a node's disk (tmpfs), SIGKILL a rank there, free the disk",
}
NOT_COVERED = {"s3-outage": "no S3 server in the campaign's clusters (the remote tier is "
                            "the peers' shards); tests/test_s3_tier.py covers S3 outages"}

_NODE_KINDS = {"kill-daemon", "kill-node", "kill-coordinator", "stop-daemon"}
_RANK_KINDS = {"kill-rank", "hang", "gpu", "stop-rank", "bitflip", "full-disk"}


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    spares: int
    nodes: int
    ranks_per_node: int

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def key(self) -> tuple[int, int, int]:
        """What a failure-free run's numbers depend on: the degrees, not the placement
        (gloo's sums do not depend on which node a rank runs on), nor the spares."""
        return (self.dp, self.pp, self.tp)

    def __str__(self) -> str:
        return (f"dp{self.dp}pp{self.pp}tp{self.tp} s{self.spares} "
                f"n{self.nodes}x{self.ranks_per_node}")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str  # "rank" (a training RANK), "spare" (j-th spare) or "node"
    index: int
    step: int  # injected once any rank printed this step
    after: str = ""  # "recovery": instead when the job installs the next plan


@dataclass(frozen=True)
class Schedule:
    kind: str
    layout: Layout
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "layout": asdict(self.layout),
                "faults": [asdict(f) for f in self.faults]}


def placement(layout: Layout) -> tuple[list[int], list[int]]:
    """Node of each training rank and of each spare, as LocalCluster.launch places them."""
    n, per = layout.nodes, layout.ranks_per_node
    ranks = [min(r // per, n - 1) for r in range(layout.world)]
    spares = [n - 1 - (j % n) for j in range(layout.spares)]
    return ranks, spares


def _lost(layout: Layout, faults: tuple[Fault, ...]) -> tuple[set[int], set[int], set[int]]:
    """(training ranks, spares, nodes) the faults take out of the job."""
    ranks, spares = placement(layout)
    lost_r: set[int] = set()
    lost_s: set[int] = set()
    lost_n: set[int] = set()
    for f in faults:
        if f.target == "rank":
            lost_r.add(f.index)
        elif f.target == "spare":
            lost_s.add(f.index)
        else:  # a daemon lost (or paused past its timeout) takes its node's ranks along
            lost_n.add(f.index)
            lost_r |= {r for r, n in enumerate(ranks) if n == f.index}
            lost_s |= {j for j, n in enumerate(spares) if n == f.index}
    return lost_r, lost_s, lost_n


def feasible(s: Schedule) -> bool:
    """The job is expected to survive `s` (see the module docstring)."""
    lay = s.layout
    if (lay.world + lay.spares > MAX_PROCESSES or lay.nodes * lay.ranks_per_node < lay.world
            or lay.ranks_per_node % lay.tp):
        return False
    ranks, spares = placement(lay)
    if len({(f.target, f.index) for f in s.faults}) < len(s.faults):
        return False  # two faults on one process or node are one fault
    for f in s.faults:
        if f.target == "rank" and not 0 <= f.index < lay.world:
            return False
        if f.target == "spare" and not 0 <= f.index < lay.spares:
            return False
        if f.target == "node" and (not 0 <= f.index < lay.nodes or f.index not in
                                   set(ranks) | set(spares)):
            return False  # a fault on an empty node tests nothing
    lost_r, lost_s, lost_n = _lost(lay, s.faults)
    survivors = lay.world - len(lost_r) + lay.spares - len(lost_s)
    return len(lost_n) <= 1 and survivors >= lay.tp and bool(lost_r | lost_s)


def _layout(rng: random.Random) -> Layout:
    dp, pp, tp = rng.choice((1, 2)), rng.choice((1, 2)), rng.choice((1, 2))
    nodes, spares = rng.randint(2, 4), rng.randint(0, 2)
    world = dp * pp * tp
    per = tp * -(-world // (tp * nodes))  # fewest per node that hold the world, TP whole
    return Layout(dp, pp, tp, spares, nodes, per)


def _faults(kind: str, lay: Layout, rng: random.Random, steps: int) -> tuple[Fault, ...]:
    step = rng.randint(3, max(3, steps // 2))
    ranks, spares = placement(lay)
    rank = rng.randrange(lay.world)
    if kind in _RANK_KINDS:
        return (Fault(kind, "rank", rank, step),)
    if kind == "kill-spare":
        return (Fault(kind, "spare", rng.randrange(max(1, lay.spares)), step),)
    if kind == "double":
        other = rng.choice([r for r in range(lay.world) if r != rank] or [rank])
        return (Fault("kill-rank", "rank", rank, step),
                Fault("kill-rank", "rank", other, step, after="recovery"))
    if kind == "kill-coordinator":
        return (Fault(kind, "node", 0, step),)  # the default rule: node-0 coordinates
    hosts = sorted(set(ranks))  # daemons with training ranks, so the fault costs a rank
    return (Fault(kind, "node", rng.choice(hosts), step),)


def generate(seed: int, runs: int, *, kinds: list[str] | None = None,
             steps: int = 12) -> list[Schedule]:
    """`runs` feasible schedules; kinds taken in turn from a seeded order (every kind
    appears once `runs` >= len(kinds)), layout and victims drawn until feasible."""
    rng = random.Random(seed)
    order = list(kinds or KINDS)
    rng.shuffle(order)
    out: list[Schedule] = []
    for i in range(runs):
        kind = order[i % len(order)]
        for _ in range(1000):
            lay = _layout(rng)
            s = Schedule(kind, lay, _faults(kind, lay, rng, steps))
            if feasible(s):
                out.append(s)
                break
        else:
            raise ValueError(f"no feasible schedule of kind {kind!r} in 1000 draws")
    return out
