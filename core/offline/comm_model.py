"""Analytic communication model: bytes on intra- and inter-node links, and alpha-beta time.

Collectives are costed as the algorithm a library runs: ring all-reduce (each rank sends
2(n-1)/n of the tensor to its ring successor), hierarchical all-reduce, a parameter server
(reduce to one rank, then broadcast), and point-to-point sends. `step_traffic` adds up one
training step of a GPT under a placement, by collective.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.core.costs import GPTShape
from stalwart.core.layout import Layout
from stalwart.core.rank_placement import Placement, place
from stalwart.core.topology import Link, Topology

__all__ = ["Traffic", "TrainingStep", "cross_node_bytes", "hier_allreduce", "hier_allreduce_s",
           "p2p", "place_by_bytes", "ps_sync", "ps_sync_s", "ring_allreduce", "ring_allreduce_s",
           "step_comm_s", "step_traffic"]


@dataclass(frozen=True)
class Traffic:
    """Bytes sent over intra-node and inter-node links (summed over all senders)."""

    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.intra + other.intra, self.inter + other.inter)

    def scaled(self, factor: float) -> Traffic:
        return Traffic(self.intra * factor, self.inter * factor)


def _send(a_node: int, b_node: int, nbytes: float) -> Traffic:
    return Traffic(intra=nbytes) if a_node == b_node else Traffic(inter=nbytes)


def p2p(a_node: int, b_node: int, nbytes: float) -> Traffic:
    """One message of `nbytes` from a rank on `a_node` to a rank on `b_node`."""
    return _send(a_node, b_node, nbytes)


def ring_allreduce(nodes: Sequence[int], nbytes: float) -> Traffic:
    """Ring over the members in the given order; `nodes[i]` is member i's node."""
    n = len(nodes)
    if n < 2:
        return Traffic()
    per_rank = 2 * (n - 1) / n * nbytes
    crossing = sum(nodes[i] != nodes[i - 1] for i in range(n))  # edge (i-1 -> i), wrapping
    return Traffic(intra=(n - crossing) * per_rank, inter=crossing * per_rank)


def _by_node(nodes: Sequence[int]) -> dict[int, int]:
    return dict(Counter(nodes))


def hier_allreduce(nodes: Sequence[int], nbytes: float) -> Traffic:
    """Reduce-scatter inside each node, ring all-reduce of 1/g across nodes, all-gather inside.

    With unequal members per node the 1/g split has no common g: the fallback reduces to
    one leader per node, all-reduces among leaders, and broadcasts inside the node.
    """
    counts = _by_node(nodes)
    k = len(counts)
    sizes = set(counts.values())
    if len(sizes) == 1:
        g = sizes.pop()
        intra = len(nodes) * 2 * (g - 1) / g * nbytes  # reduce-scatter + all-gather
        inter = len(nodes) * (2 * (k - 1) / k * nbytes / g if k > 1 else 0.0)
        return Traffic(intra, inter)
    intra = sum(2 * (c - 1) * nbytes for c in counts.values())
    return Traffic(intra, 2 * (k - 1) * nbytes)


def ps_sync(nodes: Sequence[int], nbytes: float, root: int = 0) -> Traffic:
    """Every member sends its tensor to the root; the root sends the sum back to each."""
    total = Traffic()
    for i, node in enumerate(nodes):
        if i != root:
            total += _send(node, nodes[root], 2 * nbytes)
    return total


def _flows_out(nodes: Sequence[int], edges: Sequence[tuple[int, int]]) -> Counter:
    return Counter(nodes[a] for a, b in edges if nodes[a] != nodes[b])


def _step_s(topo: Topology, nodes: Sequence[int], edges: Sequence[tuple[int, int]],
            nbytes: float) -> float:
    """Seconds for one round in which every edge (a, b) carries `nbytes` concurrently."""
    flows = _flows_out(nodes, edges)
    worst = 0.0
    for a, b in edges:
        if nodes[a] == nodes[b]:
            worst = max(worst, topo.intra.transfer_s(nbytes))
        else:
            bw = topo.inter_flow_bandwidth(flows[nodes[a]])
            worst = max(worst, topo.inter.latency + nbytes / bw)
    return worst


def ring_allreduce_s(topo: Topology, nodes: Sequence[int], nbytes: float) -> float:
    """2(n-1) rounds of nbytes/n along the ring; the slowest edge sets each round."""
    n = len(nodes)
    if n < 2:
        return 0.0
    edges = [(i, (i + 1) % n) for i in range(n)]
    return 2 * (n - 1) * _step_s(topo, nodes, edges, nbytes / n)


def hier_allreduce_s(topo: Topology, nodes: Sequence[int], nbytes: float) -> float:
    """Intra reduce-scatter + inter ring on 1/g (g rings side by side) + intra all-gather."""
    counts = _by_node(nodes)
    k, g = len(counts), max(counts.values())
    if len(set(counts.values())) != 1:
        leaders = list(counts)
        return 2 * (g - 1) * topo.intra.transfer_s(nbytes) + ring_allreduce_s(
            topo, leaders, nbytes)
    intra = 2 * (g - 1) * topo.intra.transfer_s(nbytes / g) if g > 1 else 0.0
    if k < 2:
        return intra
    per_flow = topo.inter_flow_bandwidth(g)  # g rings leave each node at once
    inter = 2 * (k - 1) * (topo.inter.latency + nbytes / g / k / per_flow)
    return intra + inter


def ps_sync_s(link: Link, n: int, nbytes: float) -> float:
    """n-1 tensors into the root over its one link, then n-1 copies back out."""
    if n < 2:
        return 0.0
    return 2 * (link.latency + (n - 1) * nbytes / link.bandwidth)


@dataclass(frozen=True, kw_only=True)
class TrainingStep:
    """One training step of a GPT: its shape and how the batch and numbers travel."""

    shape: GPTShape
    """The model (and micro-batch size in sequences), as the planner describes it."""
    micro_batches: int = 8
    """Micro-batches per step and DP replica."""
    act_bytes: int = 2
    """Bytes per activation element (bf16)."""
    grad_bytes: int = 4
    """Bytes per gradient element (fp32 reduction)."""

    def stage_layers(self, pp: int, stage: int) -> int:
        """Blocks of one stage when the blocks are split evenly."""
        base, extra = divmod(self.shape.n_layers, pp)
        return base + (stage < extra)

    def stage_params(self, pp: int, stage: int) -> int:
        """Parameters of one stage: its blocks, the embedding first, the LM head last."""
        h = self.shape.d_model
        params = self.stage_layers(pp, stage) * self.shape.block_params()
        if stage == 0:
            params += (self.shape.vocab + self.shape.seq) * h
        if stage == pp - 1:
            params += self.shape.vocab * h + 2 * h  # untied head and final norm
        return params

    @property
    def activation_bytes(self) -> int:
        """Bytes of one micro-batch's hidden states at a layer boundary."""
        return self.shape.micro_batch * self.shape.seq * self.shape.d_model * self.act_bytes


def step_traffic(placement: Placement, step: TrainingStep,
                 dp_algorithm: str = "ring") -> dict[str, Traffic]:
    """Bytes of one training step by collective: tp_allreduce, pp_sendrecv, dp_allreduce.

    TP: 2 all-reduces of the hidden states per layer forward and 2 backward (Megatron MLP
    and attention), per micro-batch. PP: each TP rank sends its copy of the boundary
    activation forward and its gradient back, per micro-batch. DP: one all-reduce of the
    rank's gradient shard (`dp_algorithm` "ring" in dp order, or "hier").
    """
    layout = placement.layout
    out: dict[str, Traffic] = {}
    tp = Traffic()
    for group in layout.groups("tp"):
        stage = layout.coords(group[0]).pp
        calls = 4 * step.stage_layers(layout.pp, stage) * step.micro_batches
        tp += ring_allreduce(placement.nodes(group), step.activation_bytes).scaled(calls)
    out["tp_allreduce"] = tp
    pairs = layout.pp_pairs()
    crossing = sum(placement.node_of(a) != placement.node_of(b) for a, b in pairs)
    out["pp_sendrecv"] = Traffic(intra=float(len(pairs) - crossing), inter=float(crossing)).scaled(
        2 * step.micro_batches * step.activation_bytes)
    reduce = {"ring": ring_allreduce, "hier": hier_allreduce}[dp_algorithm]
    dp = Traffic()
    for group in layout.groups("dp"):
        stage = layout.coords(group[0]).pp
        grad = step.stage_params(layout.pp, stage) / layout.tp * step.grad_bytes
        dp += reduce(placement.nodes(group), grad)
    out["dp_allreduce"] = dp
    return out


def step_comm_s(placement: Placement, step: TrainingStep, dp_algorithm: str = "ring") -> float:
    """Seconds of communication on the slowest rank's path per step, without overlap.

    The sum of the worst TP group's all-reduces, one PP boundary's sends per micro-batch
    (both ways), and the worst DP group's gradient all-reduce.
    """
    layout, topo = placement.layout, placement.topology
    tp_s = max(4 * step.stage_layers(layout.pp, layout.coords(g[0]).pp)
               * step.micro_batches
               * ring_allreduce_s(topo, placement.nodes(g), step.activation_bytes)
               for g in layout.groups("tp"))
    pp_s = max((2 * step.micro_batches
                * topo.link(placement.devices[a], placement.devices[b])
                .transfer_s(step.activation_bytes)
                for a, b in layout.pp_pairs()), default=0.0)
    allreduce = {"ring": ring_allreduce_s, "hier": hier_allreduce_s}[dp_algorithm]
    dp_s = max(allreduce(topo, placement.nodes(g),
                         step.stage_params(layout.pp, layout.coords(g[0]).pp)
                         / layout.tp * step.grad_bytes)
               for g in layout.groups("dp"))
    return tp_s + pp_s + dp_s


def cross_node_bytes(placement: Placement, step: TrainingStep,
                     dp_algorithm: str = "ring") -> float:
    """Bytes of one training step that cross a node boundary, all collectives together."""
    return sum(t.inter for t in step_traffic(placement, step, dp_algorithm).values())


def place_by_bytes(layout: Layout, topology: Topology, step: TrainingStep,
                   dp_algorithm: str = "hier") -> Placement:
    """The TP-inside-node placement that sends the fewest bytes of `step` across nodes."""
    return place(layout, topology, cost=lambda p: cross_node_bytes(p, step, dp_algorithm))
