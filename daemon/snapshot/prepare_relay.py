"""Phase one up the commit tree: this daemon's prepares and those of the daemons below
it go to its parent (or the coordinator) in one batch per step.

A batch for a step leaves as soon as it holds this daemon's prepare and those of every
daemon below it in the prepare tree, or LINGER_S after its first prepare arrived, and
a late prepare goes up on its own when it comes. Waiting costs the commit nothing: a
step commits only once every daemon's prepare is in, so the batch waits for what the
step waits for anyway. LINGER_S bounds it for a prepare that took another way (its
daemon could not reach this one and sent it to the coordinator). A parent that cannot
be reached is skipped: the batch goes to the coordinator directly. A batch holds one
column per step, generation, layout and final flag (`SealColumn`): each daemon's seal
and its tag, made by that daemon with the key the coordinator gave it (see
commit_tree.py). This daemon appends columns that arrive to its own; it passes tags
on, it cannot make them for others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from stalwart.daemon.background import Background
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.peers import PeerLost
from stalwart.daemon.snapshot import commit_tree
from stalwart.v1 import common_pb2, peer_pb2

log = logging.getLogger("stalwart.daemon.snapshot.prepare_relay")

LINGER_S = 0.25  # longest a prepare waits here for those of the daemons below
KEEP_STEPS = 64  # steps whose arrivals are counted (older ones are forgotten)

# (the node to send to, None for the coordinator; the batch) -> done, or raises
SendBatch = Callable[[str | None, peer_pb2.PrepareBatch], Awaitable[object]]


@dataclass
class _Step:
    # (generation, final, layout's bytes) -> the column of the seals waiting here
    waiting: dict[tuple[int, bool, bytes], peer_pb2.SealColumn] = field(default_factory=dict)
    seen: int = 0  # prepares that arrived for the step (waiting or gone up)
    timer: asyncio.TimerHandle | None = None


class PrepareRelay:
    """This daemon's place in the prepare tree of the current plan."""

    def __init__(self, node: str, job_id: str, plan: Callable[[], common_pb2.Plan],
                 send: SendBatch, metrics: Metrics | None = None) -> None:
        self.node, self.job_id, self.plan, self.send = node, job_id, plan, send
        self.metrics = metrics
        # The key the coordinator gave this daemon: (that coordinator, key).
        self.key: tuple[str, bytes] | None = None
        self._steps: dict[int, _Step] = {}
        self._tree: tuple[tuple[int, str], list[str]] = ((-1, ""), [])
        self._sending = Background()
        self._told: tuple[int, str] = (-1, "")  # the tree last logged

    def _nodes(self, plan: common_pb2.Plan) -> list[str]:
        """The prepare tree's daemons, derived once per plan."""
        if self._tree[0] != (plan.generation, plan.coordinator):
            self._tree = ((plan.generation, plan.coordinator), commit_tree.prepare_nodes(plan))
        return self._tree[1]

    def usable(self, coordinator: str) -> bool:
        """Whether this daemon's prepares go up the tree to `coordinator`: it holds that
        coordinator's key, and that coordinator's plan makes a tree deeper than one hop."""
        plan = self.plan()
        return (self.key is not None and self.key[0] == coordinator == plan.coordinator
                and plan.commit_fanout > 0
                and len(self._nodes(plan)) > plan.commit_fanout)

    def own(self, req: peer_pb2.PrepareStepRequest) -> None:
        """This daemon's prepare, tagged with its key, into the step's batch."""
        assert self.key is not None, "usable() first"
        plan = self.plan()
        if self._told != (plan.generation, plan.coordinator):
            self._told = (plan.generation, plan.coordinator)
            nodes = self._nodes(plan)
            log.info("prepares go up the commit tree", extra={
                "generation": plan.generation,
                "parent": commit_tree.parent(nodes, self.node, plan.commit_fanout)
                or f"{plan.coordinator} (the coordinator)",
                "below": commit_tree.below(nodes, self.node, plan.commit_fanout)})
        self.add([commit_tree.column(self.job_id, self.key[1], req)])

    def relay(self, columns: list[peer_pb2.SealColumn]) -> None:
        """Prepares of the daemons below this one, on their way up."""
        if self.metrics is not None:
            self.metrics.commit_tree.labels("up").inc(sum(len(c.seals) for c in columns))
        self.add(columns)

    def add(self, columns: list[peer_pb2.SealColumn]) -> None:
        """Prepares of this daemon or of the daemons below it into their steps' batches."""
        plan = self.plan()
        nodes = self._nodes(plan)
        expected = 1 + commit_tree.below(nodes, self.node, plan.commit_fanout)
        for c in columns:
            step = self._steps.get(c.step)
            if step is None:
                step = self._steps[c.step] = _Step()
                for old in [s for s in self._steps if s + KEEP_STEPS < c.step]:
                    self._flush(old)
                    del self._steps[old]
            key = (c.generation, c.final, c.layout.SerializeToString(deterministic=True))
            if (have := step.waiting.get(key)) is None:
                have = step.waiting[key] = peer_pb2.SealColumn()
                have.CopyFrom(c)
            else:
                commit_tree.append(have, c)
            step.seen += len(c.seals)
            if step.seen >= expected:
                self._flush(c.step)
            elif step.timer is None:
                step.timer = asyncio.get_running_loop().call_later(
                    LINGER_S, self._flush, c.step)

    def _flush(self, number: int) -> None:
        step = self._steps.get(number)
        if step is None:
            return
        if step.timer is not None:
            step.timer.cancel()
            step.timer = None
        if not step.waiting:
            return
        batch = peer_pb2.PrepareBatch(job_id=self.job_id, columns=list(step.waiting.values()))
        step.waiting = {}
        self._sending.start(self._up(number, batch))

    async def _up(self, number: int, batch: peer_pb2.PrepareBatch) -> None:
        plan = self.plan()
        above = commit_tree.parent(self._nodes(plan), self.node, plan.commit_fanout)
        for target in ([above, None] if above is not None else [None]):
            try:
                await self.send(target, batch)
                return
            except (grpc.aio.AioRpcError, LookupError, PeerLost) as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("prepares not passed up" + (
                    "; sending them to the coordinator directly" if target else ""),
                    extra={"to": target or "the coordinator", "step": number,
                           "prepares": sum(len(c.seals) for c in batch.columns),
                           "error": detail})
