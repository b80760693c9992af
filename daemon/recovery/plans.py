"""A new plan arriving at this daemon: install it, drop what it supersedes, fence the
local ranks it leaves out, and hand it again to a daemon that comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from stalwart.core.generation import StaleGeneration
from stalwart.daemon.recovery.fencing import RankProcesses
from stalwart.daemon.recovery.liveness import process_alive
from stalwart.daemon.recovery.registry import LEFT, Registry
from stalwart.v1 import common_pb2

log = logging.getLogger("stalwart.daemon.recovery.plans")

RESEND_PATIENCE_S = 60.0  # how long the leader keeps handing a returning daemon the plan


class Plans:
    """Installs plans on this daemon and re-sends the current one to returning peers."""

    def __init__(self, registry: Registry, processes: RankProcesses,
                 discard_after: Callable[[int, int], list[int]], is_leader: Callable[[], bool],
                 heartbeat_interval_s: float) -> None:
        self.registry, self.processes, self.discard_after = registry, processes, discard_after
        self.is_leader, self.interval_s = is_leader, heartbeat_interval_s
        # Set by the job once its links exist: sends a plan to one daemon.
        self.send: Callable[[str, common_pb2.Plan], Awaitable[None]] | None = None

    def adopt(self, plan: common_pb2.Plan) -> common_pb2.Ack:
        """Install a plan here and end local ranks it left out (fencing)."""
        previous = self.registry.current_plan()
        try:
            self.registry.install_plan(plan)
        except StaleGeneration as exc:
            return common_pb2.Ack(accepted=False, message=str(exc))
        if previous.assignments:
            # The new generation re-captures the steps after resume_step: what the old one
            # prepared for them must not become a delta base.
            dropped = self.discard_after(plan.resume_step, plan.generation)
            if dropped:
                log.warning("discarded committed steps past the resume point",
                            extra={"steps": dropped, "resume_step": plan.resume_step})
        if plan.stop:
            # The ranks a stop lost end; the others wait for the plan that resumes the
            # job (or leave on their own after their wait, or at completion).
            left_out = set(plan.lost)
        else:
            kept = {a.rank_id for a in plan.assignments}
            left_out = {a.rank_id for a in previous.assignments
                        if not a.spare and a.rank_id not in kept}
        for rank_id in sorted(left_out):
            record = self.registry.get(rank_id)
            if record is not None and record.state != LEFT and (record.state != "dead" or (
                    record.process is not None and process_alive(record.process))):
                self.processes.fence(record)  # a rank declared dead may still run (hung)
        return common_pb2.Ack(accepted=True)

    def on_peer_up(self, node: str) -> None:
        """A daemon that was lost answers again (a pause, a partition that healed): the
        leader hands it the current plan, so it stops acting on the old generation (and
        fences its ranks the plan left out)."""
        if not self.is_leader() or self.send is None:
            return
        plan = self.registry.current_plan()
        if not plan.assignments and not plan.stop:
            return  # no plan yet
        send = self.send

        async def resend() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + RESEND_PATIENCE_S
            while True:
                try:
                    await send(node, self.registry.current_plan())
                    return
                except (grpc.aio.AioRpcError, LookupError) as exc:
                    # Its channel may still be reconnecting, or the daemon, just started,
                    # may not have confirmed who leads yet (it refuses a plan until then).
                    if loop.time() > deadline:
                        log.warning("current plan not re-sent",
                                    extra={"node": node, "error": str(exc)})
                        return
                    await asyncio.sleep(self.interval_s)
        asyncio.get_running_loop().create_task(resend())
