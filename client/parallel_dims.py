"""Who talks to whom: the process groups of one generation over the job's (dp, pp, tp)
layout (`core.layout`). A generation's groups live under their own store prefix, so a
later generation can be built in the same process after `destroy()`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stalwart.client.link_bytes import LinkBytes, link_between
from stalwart.client.watchdog import Abandoned, GroupFailure, Watchdog, run_unless
from stalwart.core.layout import Coord, Layout

__all__ = ["Group", "ParallelDims", "Sending"]

log = logging.getLogger("stalwart.client.parallel_dims")

T = TypeVar("T")


@dataclass
class Group:
    """One process group as this rank sees it: the members' global ranks and our index."""

    name: str
    ranks: tuple[int, ...]
    index: int
    pg: Any = field(repr=False)
    nodes: tuple[str, ...] = ()
    """Node of each member, aligned with `ranks` (empty: unknown, nothing is counted)."""
    links: LinkBytes | None = field(default=None, repr=False)
    """Where this rank's sends are counted, by link and collective."""
    watchdog: Watchdog | None = field(default=None, repr=False)
    """Guards every wait (None: errors come out of torch as they are)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _counting(self) -> LinkBytes | None:
        return self.links if self.links is not None and len(self.nodes) == self.size else None

    def run(self, fn: Callable[[], T], op: str, started: float | None = None) -> T:
        """`fn()`, a blocking call named `op` on this group that started at `started` (a
        time.monotonic() reading; default: now), under the watchdog."""
        if self.watchdog is None:
            return fn()
        return self.watchdog.run(fn, f"{self.name} {op}", started)

    def wait(self, work: Any, op: str, started: float | None = None) -> None:
        """Wait for `work`, the handle of `op` on this group, as `run` does."""
        self.run(work.wait, op, started)

    def start_and_wait(self, start: Callable[[], Any], op: str) -> None:
        """Start `op` with `start()` (which returns its handle) and wait for it, both under
        the watchdog: gloo raises at the start already when a peer's connection is gone."""
        self.run(lambda: start().wait(), op)

    def count_allreduce(self, nbytes: float) -> None:
        """Count an all-reduce of `nbytes` over this group (ring volume)."""
        if (links := self._counting()) is not None:
            links.ring_allreduce(f"{self.name}_allreduce", self.nodes, self.index, nbytes)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        """In-place all-reduce; a no-op in a group of one."""
        if self.size > 1:
            self.start_and_wait(
                lambda: dist.all_reduce(tensor, op=op, group=self.pg, async_op=True),
                "all_reduce")
            self.count_allreduce(tensor.numel() * tensor.element_size())

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor (same shape), in group order."""
        if self.size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in self.ranks]
        self.start_and_wait(lambda: self.pg.allgather([out], [tensor.contiguous()]),
                            "all_gather")
        if (links := self._counting()) is not None:
            links.ring_allgather(f"{self.name}_allgather", self.nodes, self.index,
                                 tensor.numel() * tensor.element_size())
        return out

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """In-place broadcast from group index `root`."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            self.start_and_wait(lambda: self.pg.broadcast([tensor], opts),
                                f"broadcast from {root}")
            if self.index == root and (links := self._counting()) is not None:
                for i, node in enumerate(self.nodes):
                    if i != root:
                        links.add(link_between(self.nodes[root], node),
                                  f"{self.name}_broadcast",
                                  tensor.numel() * tensor.element_size())

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Sending:
        """Start sending to group index `dst`; returns the handle to wait on."""
        started = time.monotonic()
        work = self.run(lambda: self.pg.send([tensor.contiguous()], dst, tag),
                        f"send to {dst}", started)
        if (links := self._counting()) is not None:
            links.add(link_between(self.nodes[self.index], self.nodes[dst]),
                      f"{self.name}_send", tensor.numel() * tensor.element_size())
        return Sending(self, work, f"send to {dst}", started)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        """Receive into `tensor` from group index `src` (blocks until it arrived)."""
        self.start_and_wait(lambda: self.pg.recv([tensor], src, tag), f"recv from {src}")

    def barrier(self) -> None:
        if self.size > 1:
            self.start_and_wait(self.pg.barrier, "barrier")


@dataclass
class Sending:
    """A send in flight; its deadline counts from when it started."""

    group: Group
    work: Any
    op: str
    started: float

    def wait(self) -> None:
        self.group.wait(self.work, self.op, self.started)


class ParallelDims:
    """The process groups of one generation over a `Layout` (whose product of degrees is the
    world size); the layout says who shares a group with whom."""

    def __init__(self, layout: Layout | None = None, *, world_size: int | None = None) -> None:
        layout = layout or Layout()
        if world_size is not None and layout.world_size != world_size:
            raise ValueError(
                f"dp*pp*tp = {layout.dp}*{layout.pp}*{layout.tp} = {layout.world_size} but the "
                f"world has {world_size} ranks; choose degrees whose product is {world_size}")
        self.layout = layout
        self.generation: int | None = None
        self.rank: int | None = None
        self.groups: dict[str, Group] = {}

    def build(self, store: Any, rank: int, generation: int, *, backend: str = "gloo",
              timeout_s: float = 60.0, node_of: Mapping[int, str] | None = None,
              links: LinkBytes | None = None, watchdog: Watchdog | None = None,
              superseded: Callable[[], bool] | None = None,
              news: threading.Condition | None = None) -> ParallelDims:
        """Create this rank's dp, pp, tp and world groups for `generation`.

        Every member of a group must call this with the same generation; groups live under
        the store prefix ``gen{generation}/`` so a new generation never meets an old one.
        With `node_of` (global rank -> node) and `links`, every collective this rank runs
        through the groups counts its bytes by link (see client/link_bytes.py). With a
        `watchdog` (its deadline at most `timeout_s`), building the groups and every wait
        on them raise GroupFailure when a peer is lost, CollectiveHangError when it hung.
        With `superseded` (true once a newer plan exists), building a group is left as soon
        as it is true, with GroupFailure: a peer that died part-way through this build can
        hold a group's rendezvous past its timeout, and the members of the newer
        generation must not time out waiting for this rank meanwhile. `news` is notified
        when `superseded` may have become true (`run_unless`).
        """
        if self.groups:
            raise RuntimeError(f"generation {self.generation} is still built; destroy() first")
        gen_store = dist.PrefixStore(f"gen{generation}/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        for axis in ("dp", "pp", "tp", "world"):
            ranks = (tuple(range(self.layout.world_size)) if axis == "world"
                     else self.layout.group(rank, axis))
            key = f"{axis}/{'-'.join(map(str, ranks))}/"
            make = partial(_make_pg, backend, dist.PrefixStore(key, gen_store),
                           ranks.index(rank), len(ranks), timeout)
            if superseded is not None:
                make = partial(_unless_superseded, make, superseded, news,
                               f"building the {axis} group of generation {generation}")
            pg = make() if watchdog is None else watchdog.run(make, f"building the {axis} group")
            nodes = tuple(node_of[r] for r in ranks) if node_of and all(
                r in node_of for r in ranks) else ()
            self.groups[axis] = Group(axis, ranks, ranks.index(rank), pg, nodes, links, watchdog)
        self.generation, self.rank = generation, rank
        return self

    def group(self, axis: str) -> Group:
        if axis not in self.groups:
            raise RuntimeError("process groups are not built; call build(store, rank, gen)")
        return self.groups[axis]

    @property
    def dp_group(self) -> Group:
        return self.group("dp")

    @property
    def pp_group(self) -> Group:
        return self.group("pp")

    @property
    def tp_group(self) -> Group:
        return self.group("tp")

    @property
    def world(self) -> Group:
        return self.group("world")

    @property
    def my(self) -> Coord:
        """This rank's grid position."""
        if self.rank is None:
            raise RuntimeError("process groups are not built; call build(store, rank, gen)")
        return self.layout.coords(self.rank)

    def destroy(self) -> None:
        """Drop this generation's groups; their threads and sockets close with them."""
        self._end("shutdown")

    def abort(self) -> None:
        """Drop this generation's groups without waiting for what is in flight on them:
        NCCL ends its communicators at once, where a shutdown would wait for a collective
        stuck on a lost peer (gloo has no such abort: see ElasticAgent's abandoning)."""
        self._end("abort")

    def _end(self, how: str) -> None:
        groups = list(self.groups.values())
        self.groups.clear()
        self.generation = None
        # NCCL communicators aborted one after another can deadlock on each other's
        # kernels; inside one NCCL group call they end together (as torch's own
        # _abort_process_group does).
        nccl = next((g.pg for g in groups if how == "abort"
                     and callable(getattr(g.pg, "_group_start", None))), None)
        if nccl is not None:
            nccl._group_start()
        try:
            self._end_each(groups, how)
        finally:
            if nccl is not None:
                nccl._group_end()

    @staticmethod
    def _end_each(groups: list[Group], how: str) -> None:
        for g in groups:
            # torch before 2.7 has the NCCL backend's abort and shutdown private only.
            end = next((f for name in (how, f"_{how}", "shutdown", "_shutdown")
                        if (f := getattr(g.pg, name, None)) is not None), None)
            if end is None:
                log.warning("the %s group (%s) has no %s; left to the garbage collector",
                            g.name, type(g.pg).__name__, how)
                continue
            if how == "shutdown":
                end()
                continue
            try:
                end()
            except Exception as exc:  # torn down already (a watchdog, a lost peer)
                log.warning("%s of the %s group failed: %s", how, g.name, exc)


def _unless_superseded(make: Callable[[], Any], superseded: Callable[[], bool],
                       news: threading.Condition | None, what: str) -> Any:
    """`make()`, left with GroupFailure once `superseded()` (`run_unless`)."""
    try:
        return run_unless(make, superseded, "stalwart-group-build", news)
    except Abandoned:
        raise GroupFailure(f"{what} was left: a newer plan superseded it") from None


def _make_pg(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        # TORCH_NCCL_ASYNC_ERROR_HANDLING stays torch's (3: a collective that times out
        # ends the process, which recovers as a lost rank). Mode 2 would keep the process,
        # but NCCL's waits return before the collective ends, so the rank would go on with
        # a timed-out all-reduce's partial sums and could capture a step built on them.
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
