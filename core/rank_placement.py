"""Rank placement: which physical device each (dp, pp, tp) rank runs on.

TP groups always stay inside one node (their all-reduces run every layer); among the
placements that do, a cost (by default: fewest PP hops across nodes, then DP groups
spread over the fewest nodes) picks one. `naive_placement` is what a scheduler that
ignores topology does: ranks dealt round-robin over the nodes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from stalwart.core.layout import Layout
from stalwart.core.topology import Topology

__all__ = ["Placement", "default_cost", "min_pp_cross_hops", "naive_placement", "place",
           "validate"]


@dataclass(frozen=True)
class Placement:
    """A layout mapped onto a topology: `devices[rank]` is the rank's global device."""

    layout: Layout
    topology: Topology
    devices: tuple[int, ...]
    strategy: str = "given"

    @functools.cached_property
    def rank_nodes(self) -> tuple[int, ...]:
        """Node of every rank, in rank order."""
        return tuple(self.topology.node_of(d) for d in self.devices)

    def node_of(self, rank: int) -> int:
        return self.rank_nodes[rank]

    def nodes(self, ranks: tuple[int, ...] | list[int]) -> list[int]:
        return [self.rank_nodes[r] for r in ranks]

    def tp_groups_inside_nodes(self) -> bool:
        return all(len(set(self.nodes(g))) == 1 for g in self.layout.groups("tp"))

    def pp_cross_hops(self) -> int:
        """PP neighbour pairs whose two ranks sit on different nodes."""
        return sum(self.node_of(a) != self.node_of(b) for a, b in self.layout.pp_pairs())

    def dp_spread(self) -> int:
        """Sum over DP groups of (nodes the group touches - 1)."""
        return sum(len(set(self.nodes(g))) - 1 for g in self.layout.groups("dp"))


def validate(layout: Layout, topology: Topology) -> None:
    """Raise ValueError, saying what to change, unless the layout fits with TP inside nodes."""
    per_node = topology.devices_per_node
    if layout.tp > per_node:
        raise ValueError(f"tp={layout.tp} does not fit in a node of {per_node} devices; "
                         f"choose tp <= {per_node} so tensor-parallel groups stay on fast links")
    groups_per_node = per_node // layout.tp
    if layout.dp * layout.pp > topology.nodes * groups_per_node:
        raise ValueError(
            f"layout dp={layout.dp} pp={layout.pp} tp={layout.tp} needs {layout.dp * layout.pp} "
            f"TP groups of {layout.tp} devices, but {topology.nodes} nodes x {per_node} devices "
            f"hold only {topology.nodes * groups_per_node}; lower dp or pp, or add nodes")


def naive_placement(layout: Layout, topology: Topology) -> Placement:
    """Rank r on node r % nodes, as a scheduler that ignores topology deals them out."""
    if layout.world_size > topology.devices:
        raise ValueError(f"{layout.world_size} ranks do not fit on {topology.devices} devices")
    n = topology.nodes
    devices = tuple((r % n) * topology.devices_per_node + r // n
                    for r in range(layout.world_size))
    return Placement(layout, topology, devices, "round-robin")


def default_cost(placement: Placement) -> tuple[int, int]:
    """Fewest PP hops across nodes first, then DP groups on the fewest nodes."""
    return placement.pp_cross_hops(), placement.dp_spread()


def place(layout: Layout, topology: Topology,
          cost: Callable[[Placement], object] = default_cost) -> Placement:
    """The cheapest (by `cost`) placement that keeps every TP group inside one node."""
    validate(layout, topology)
    return min(_candidates(layout, topology), key=cost)


def _candidates(layout: Layout, topology: Topology) -> Iterator[Placement]:
    """Placements of whole TP groups into per-node slots, in a few structured orders.

    A unit is one TP group (a (dp, pp) pair); each node has devices_per_node // tp slots.
    Units are ordered pipelines-first (a replica's stages adjacent) or replicas-first
    (a stage's DP replicas adjacent) and filled either densely or aligned, where a run
    (a pipeline, or a stage's replicas) never straddles a node it could avoid.
    """
    slots = topology.devices_per_node // layout.tp
    orders = {
        "pipelines": [[(d, p) for p in range(layout.pp)] for d in range(layout.dp)],
        "replicas": [[(d, p) for d in range(layout.dp)] for p in range(layout.pp)],
    }
    for name, runs in orders.items():
        for aligned in (False, True):
            units = _fill(runs, slots, topology.nodes, aligned)
            if units is not None:
                kind = "aligned" if aligned else "dense"
                yield _to_placement(layout, topology, units, f"{name}-{kind}")


def _fill(runs: list[list[tuple[int, int]]], slots: int, nodes: int,
          aligned: bool) -> dict[tuple[int, int], tuple[int, int]] | None:
    """Map each unit to (node, slot); None when the runs do not fit that way."""
    where: dict[tuple[int, int], tuple[int, int]] = {}
    node, slot = 0, 0
    for run in runs:
        if aligned and slot and (len(run) > slots or slots - slot < len(run)):
            node, slot = node + 1, 0
        for unit in run:
            if slot == slots:
                node, slot = node + 1, 0
            if node >= nodes:
                return None
            where[unit] = (node, slot)
            slot += 1
    return where


def _to_placement(layout: Layout, topology: Topology,
                  units: dict[tuple[int, int], tuple[int, int]], strategy: str) -> Placement:
    devices = [0] * layout.world_size
    for (d, p), (node, slot) in units.items():
        for t in range(layout.tp):
            devices[layout.rank_of(d, p, t)] = (
                node * topology.devices_per_node + slot * layout.tp + t)
    return Placement(layout, topology, tuple(devices), strategy)


def min_pp_cross_hops(layout: Layout, topology: Topology) -> int:
    """Fewest PP node crossings possible: each pipeline spans >= ceil(pp / slots) nodes."""
    slots = topology.devices_per_node // layout.tp
    return layout.dp * layout.tp * (math.ceil(layout.pp / slots) - 1)
