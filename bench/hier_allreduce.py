"""Hierarchical all-reduce: reduce-scatter inside each node, all-reduce 1/g of the tensor
across nodes, all-gather inside the node. Built from process groups over a shared store,
so it plugs into the DP layer as `reduce_fn(tensor, group)`, and counts its link bytes.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stalwart.client.link_bytes import LinkBytes

__all__ = ["HierGroups", "LinkBytes", "build_hier_groups", "counting_flat_allreduce",
           "hierarchical_allreduce", "make_reduce_fn", "collective_times", "time_collective"]


@dataclass
class HierGroups:
    """This rank's view of the two-level grouping of a parent group's members."""

    ranks: tuple[int, ...]
    """Global ranks of the parent group, in its order."""
    node_of_rank: tuple[int, ...]
    """Node of each member, aligned with `ranks`."""
    rank: int
    """This process's global rank."""
    intra: Any
    """Process group of the members on this node (None when alone on it)."""
    inter: Any
    """Process group of the members with this local index on every node (uniform case)
    or of one leader per node (uneven case; None on non-leaders)."""
    uniform: bool
    """Every node holds the same number of members."""
    local_index: int
    local_size: int
    nodes: int
    counter: LinkBytes | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


def _pg(store: Any, key: str, members: Sequence[int], rank: int, timeout: datetime.timedelta,
        backend: str) -> Any:
    if len(members) < 2:
        return None
    prefixed = dist.PrefixStore(f"{key}/{'-'.join(map(str, members))}/", store)
    index = list(members).index(rank)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, index, len(members), timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, index, len(members), opts)
    raise ValueError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")


def build_hier_groups(node_of_rank: Sequence[int], *, store: Any, rank: int,
                      ranks: Sequence[int] | None = None, tag: str = "hier",
                      backend: str = "gloo", timeout_s: float = 60.0,
                      counter: LinkBytes | None = None) -> HierGroups:
    """Create this rank's intra-node and inter-node groups; every member must call it.

    `node_of_rank[i]` is the node of the parent group's i-th member, whose global rank is
    `ranks[i]` (default: i). Groups live under `tag` in `store`: use a fresh tag (e.g.
    with the generation in it) whenever membership changes.
    """
    ranks = tuple(range(len(node_of_rank)) if ranks is None else ranks)
    nodes = tuple(node_of_rank)
    if len(ranks) != len(nodes) or rank not in ranks:
        raise ValueError(f"rank {rank} with {len(ranks)} ranks and {len(nodes)} node entries: "
                         "give one node per member and call from a member")
    by_node: dict[int, list[int]] = {}
    for r, n in zip(ranks, nodes, strict=True):
        by_node.setdefault(n, []).append(r)
    mine = by_node[nodes[ranks.index(rank)]]
    local_index = mine.index(rank)
    uniform = len({len(v) for v in by_node.values()}) == 1
    timeout = datetime.timedelta(seconds=timeout_s)
    # Every member creates its intra group before any inter group: no cycle of waits.
    intra = _pg(store, f"{tag}/intra", mine, rank, timeout, backend)
    if uniform:
        inter = _pg(store, f"{tag}/inter", [v[local_index] for v in by_node.values()],
                    rank, timeout, backend)
    elif local_index == 0:
        inter = _pg(store, f"{tag}/leaders", [v[0] for v in by_node.values()], rank,
                    timeout, backend)
    else:
        inter = None
    return HierGroups(ranks, nodes, rank, intra, inter, uniform, local_index, len(mine),
                      len(by_node), counter)


def hierarchical_allreduce(tensor: torch.Tensor, groups: HierGroups) -> None:
    """In-place elementwise sum of `tensor` over every member of `groups`."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    if groups.uniform:
        _uniform(flat, groups)
    else:
        _via_leaders(flat, groups)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def _uniform(flat: torch.Tensor, groups: HierGroups) -> None:
    g, k = groups.local_size, groups.nodes
    chunk = math.ceil(flat.numel() / g)
    padded = flat
    if chunk * g != flat.numel():  # reduce-scatter needs equal pieces
        padded = torch.zeros(chunk * g, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()].copy_(flat)
    piece = padded
    item = flat.element_size()
    if groups.intra is not None:
        piece = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
        groups.intra._reduce_scatter_base(piece, padded).wait()
        _count(groups, "intra", "reduce_scatter", (g - 1) * chunk * item)
    if groups.inter is not None:
        groups.inter.allreduce([piece]).wait()
        _count(groups, "inter", "allreduce", 2 * (k - 1) / k * chunk * item)
    if groups.intra is not None:
        groups.intra._allgather_base(padded, piece).wait()
        _count(groups, "intra", "all_gather", (g - 1) * chunk * item)
    if padded is not flat:
        flat.copy_(padded[:flat.numel()])


def _via_leaders(flat: torch.Tensor, groups: HierGroups) -> None:
    """Uneven nodes: reduce to the node's first member, all-reduce among leaders, broadcast."""
    nbytes = flat.numel() * flat.element_size()
    if groups.intra is not None:
        groups.intra.reduce([flat], _root0(dist.ReduceOptions())).wait()
        if groups.local_index != 0:
            _count(groups, "intra", "reduce", nbytes)
    if groups.inter is not None:
        groups.inter.allreduce([flat]).wait()
        _count(groups, "inter", "allreduce", 2 * (groups.nodes - 1) / groups.nodes * nbytes)
    if groups.intra is not None:
        groups.intra.broadcast([flat], _root0(dist.BroadcastOptions())).wait()
        if groups.local_index == 0:
            _count(groups, "intra", "broadcast", (groups.local_size - 1) * nbytes)


def _root0(opts: Any) -> Any:
    opts.rootRank = 0
    return opts


def _count(groups: HierGroups, link: str, collective: str, nbytes: float) -> None:
    if groups.counter is not None:
        groups.counter.add(link, f"hier_{collective}", nbytes)


def counting_flat_allreduce(tensor: torch.Tensor, pg: Any, node_of_rank: Sequence[int],
                            index: int, counter: LinkBytes) -> None:
    """Plain all-reduce over `pg`, recording the ring bytes this member sends to its successor.

    `node_of_rank` lists the node of each member in `pg` order; `index` is ours.
    """
    pg.allreduce([tensor]).wait()
    counter.ring_allreduce("flat_allreduce", node_of_rank, index,
                           tensor.numel() * tensor.element_size())


def make_reduce_fn(groups: HierGroups) -> Callable[[torch.Tensor, Any], None]:
    """A DP-layer `reduce_fn(tensor, group)` that sums through `groups` instead of `group`.

    `groups` must have been built over the same members as the DP group it replaces.
    """

    def reduce_fn(tensor: torch.Tensor, group: Any) -> None:
        size = group.size() if callable(getattr(group, "size", None)) else groups.size
        if size != groups.size:
            raise ValueError(f"the DP group has {size} members but the hierarchical groups "
                             f"were built for {groups.size}; rebuild them for this group")
        hierarchical_allreduce(tensor, groups)

    return reduce_fn


def collective_times(fn: Callable[[], None], barrier: Callable[[], None], repeats: int,
                     warmup: int = 1) -> list[float]:
    """Seconds of `fn()` in each of `repeats` runs, each started after `barrier()`."""
    for _ in range(warmup):
        fn()  # connections, buffers
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_collective(fn: Callable[[], None], barrier: Callable[[], None], repeats: int,
                    warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeats` runs, each started after `barrier()`."""
    times = sorted(collective_times(fn, barrier, repeats, warmup))
    return times[len(times) // 2]
