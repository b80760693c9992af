"""Seeded fault schedules for the chaos campaign (pure logic, no processes).

A schedule is a setup (the job's layout, spares, nodes) and the faults to inject into
one run of it. A node fault may hit a node that runs no rank or spare: its daemon alone,
holding shards and records. Only schedules the job is expected to survive are generated: after every
fault of a schedule, the live ranks and spares that still have a live daemon can run
some layout with the same TP degree (the planner keeps TP and may span nodes), and at
most one daemon is lost (erasure coding keeps every committed step through one).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.core.layout import Layout

__all__ = ["KINDS", "NOT_COVERED", "Fault", "Schedule", "Setup", "feasible", "generate",
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
    "error": "a rank's training raises an exception (a bug in its code)",
    "stop-rank": "SIGSTOP a training rank, left stopped",
    "stop-daemon": "SIGSTOP a daemon past the heartbeat timeout, then SIGCONT",
    "double": "SIGKILL a rank, then another while the job recovers",
    "bitflip": "flip a bit in a rank's stored chunks, then SIGKILL it",
    "full-disk": "fill a node's disk (tmpfs), SIGKILL a rank there, free the disk",
    "disk-stays-full": "fill the disk (tmpfs) of a node with ranks and leave it full: "
                       "its ranks' roles move to other nodes",
}
NOT_COVERED = {"s3-outage": "no S3 server in the campaign's clusters (the remote tier is "
                            "the peers' shards); tests/test_s3_tier.py covers S3 outages"}

_NODE_KINDS = {"kill-daemon", "kill-node", "kill-coordinator", "stop-daemon"}
_RANK_KINDS = {"kill-rank", "hang", "gpu", "error", "stop-rank", "bitflip", "full-disk"}


@dataclass(frozen=True)
class Setup:
    """The processes of one run: the job's layout, its spares, and the nodes they run on."""

    layout: Layout
    spares: int
    nodes: int
    ranks_per_node: int

    @property
    def world(self) -> int:
        return self.layout.world_size

    def to_json(self) -> dict[str, int]:
        lay = self.layout
        return {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "spares": self.spares,
                "nodes": self.nodes, "ranks_per_node": self.ranks_per_node}

    @classmethod
    def from_json(cls, row: dict[str, int]) -> Setup:
        return cls(Layout(row["dp"], row["pp"], row["tp"]), row["spares"], row["nodes"],
                   row["ranks_per_node"])

    def __str__(self) -> str:
        lay = self.layout
        return (f"dp{lay.dp}pp{lay.pp}tp{lay.tp} s{self.spares} "
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
    setup: Setup
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "setup": self.setup.to_json(),
                "faults": [asdict(f) for f in self.faults]}


def placement(setup: Setup) -> tuple[list[int], list[int]]:
    """Node of each training rank and of each spare, as LocalCluster.launch places them."""
    n, per = setup.nodes, setup.ranks_per_node
    ranks = [min(r // per, n - 1) for r in range(setup.world)]
    spares = [n - 1 - (j % n) for j in range(setup.spares)]
    return ranks, spares


def _lost(setup: Setup, faults: tuple[Fault, ...]) -> tuple[set[int], set[int], set[int]]:
    """(training ranks, spares, nodes) the faults take out of the job."""
    ranks, spares = placement(setup)
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
    run, tp = s.setup, s.setup.layout.tp
    if (run.world + run.spares > MAX_PROCESSES or run.nodes * run.ranks_per_node < run.world
            or run.ranks_per_node % tp):
        return False
    ranks, spares = placement(run)
    if len({(f.target, f.index) for f in s.faults}) < len(s.faults):
        return False  # two faults on one process or node are one fault
    for f in s.faults:
        if f.target == "rank" and not 0 <= f.index < run.world:
            return False
        if f.target == "spare" and not 0 <= f.index < run.spares:
            return False
        if f.target == "node" and not 0 <= f.index < run.nodes:
            return False
    if any(f.kind == "disk-stays-full" and (f.index == 0 or run.nodes < 3)
           for f in s.faults):
        # node-0 coordinates (the default rule), and a coordinator whose own disk stays
        # full commits nothing; of 2 nodes, the other has no peer left to keep copies of
        # its ranks' records, so it commits nothing either. Limitations the README
        # states, not schedules to survive.
        return False
    lost_r, lost_s, lost_n = _lost(run, s.faults)
    survivors = run.world - len(lost_r) + run.spares - len(lost_s)
    return len(lost_n) <= 1 and survivors >= tp and bool(lost_r | lost_s | lost_n)


def _setup(rng: random.Random) -> Setup:
    layout = Layout(rng.choice((1, 2)), rng.choice((1, 2)), rng.choice((1, 2)))
    nodes, spares = rng.randint(2, 4), rng.randint(0, 2)
    # The fewest ranks per node that hold the world, each TP group on one node.
    per = layout.tp * -(-layout.world_size // (layout.tp * nodes))
    return Setup(layout, spares, nodes, per)


def _faults(kind: str, run: Setup, rng: random.Random, steps: int) -> tuple[Fault, ...]:
    step = rng.randint(3, max(3, steps // 2))
    ranks, spares = placement(run)
    rank = rng.randrange(run.world)
    if kind in _RANK_KINDS:
        return (Fault(kind, "rank", rank, step),)
    if kind == "kill-spare":
        return (Fault(kind, "spare", rng.randrange(max(1, run.spares)), step),)
    if kind == "double":
        other = rng.choice([r for r in range(run.world) if r != rank] or [rank])
        return (Fault("kill-rank", "rank", rank, step),
                Fault("kill-rank", "rank", other, step, after="recovery"))
    if kind == "kill-coordinator":
        return (Fault(kind, "node", 0, step),)  # the default rule: node-0 coordinates
    if kind == "disk-stays-full":  # a node whose captures are refused: one with ranks
        return (Fault(kind, "node", rng.choice(sorted(set(ranks) - {0}) or [0]), step),)
    # Any node: one with ranks or spares loses them too, one with neither only its
    # daemon, which holds shards and records (the job must go on without a re-plan).
    return (Fault(kind, "node", rng.randrange(run.nodes), step),)


def generate(seed: int, runs: int, *, kinds: list[str] | None = None,
             steps: int = 12) -> list[Schedule]:
    """`runs` feasible schedules; kinds taken in turn from a seeded order (every kind
    appears once `runs` >= len(kinds)), setup and victims drawn until feasible."""
    rng = random.Random(seed)
    order = list(kinds or KINDS)
    rng.shuffle(order)
    out: list[Schedule] = []
    for i in range(runs):
        kind = order[i % len(order)]
        for _ in range(1000):
            run = _setup(rng)
            s = Schedule(kind, run, _faults(kind, run, rng, steps))
            if feasible(s):
                out.append(s)
                break
        else:
            raise ValueError(f"no feasible schedule of kind {kind!r} in 1000 draws")
    return out
