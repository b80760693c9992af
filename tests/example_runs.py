"""Run a script written against the public API on a real local cluster (daemons and
rank processes), optionally SIGKILL one rank once it has taken a given step, and read
back what happened: the ranks' results, the plans, and what was committed at the kill."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.client.local_cluster import LocalCluster, wait_until
from stalwart.client.step_log import StepLog
from stalwart.v1 import common_pb2

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    results: list[dict[str, Any]] = field(default_factory=list)
    """Result files of the rank processes that wrote one (spares included)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Step -> job-wide loss, from every rank's log (killed ones included)."""
    committed_at_kill: int | None = None
    """The coordinator's latest committed step when the rank was killed (read just
    before the kill and, while no new plan has come, right after it)."""
    plans: list[Any] = field(default_factory=list)
    """Every plan generation the coordinator showed, in order (resume_step, layout)."""
    exit_codes: list[int | None] = field(default_factory=list)
    logs: str = ""
    workdir: Path | None = None
    """The cluster's folder: node-N/ holds each daemon's data dir (daemons are stopped)."""

    def finished(self) -> list[dict[str, Any]]:
        return [r["result"] for r in self.results if r.get("result")]

    def digest(self) -> str:
        digests = {r["param_digest"] for r in self.finished()}
        assert len(digests) == 1, f"replicas disagree: {digests}\n{self.logs[-4000:]}"
        return digests.pop()


def run_example(tmp_path: Path, script: str, *args: str, nodes: int = 2, world: int = 2,
                spares: int = 0, kill_rank: int | None = None, kill_after_step: int = 3,
                settings: dict[str, Any] | None = None, timeout_s: float = 240.0) -> Run:
    """`python script args` as `world` ranks (+ `spares`) on `nodes` daemons; `script` is
    a path relative to the repository, or a module name (`python -m script args`) when it
    does not end in .py."""
    cluster = LocalCluster(nodes=nodes, workdir=tmp_path / "cluster",
                           daemon_settings=settings or {})
    out = Run(workdir=cluster.workdir)
    follow = StepLog()
    try:
        cluster.start_daemons()
        cluster.launch(None, world, spares, argv=[*_command(script), *args])
        deadline = time.monotonic() + timeout_s
        if kill_rank is not None:
            victim = next(r for r in cluster.ranks if r.rank == kill_rank)

            def reached() -> bool:
                follow.poll([victim.log_path])
                return any(s >= kill_after_step for s, _ in follow.seen.get(victim.log_path, []))

            wait_until(reached, timeout_s, f"rank {kill_rank} to take step {kill_after_step}")
            coordinator = cluster.coordinator()
            before = coordinator.status() if coordinator else None
            os.kill(victim.proc.pid, signal.SIGKILL)
            after = coordinator.status() if coordinator else None
            # Read again after the kill (a step may commit in between), unless the new
            # plan has come meanwhile: then its commits count too, and the look before
            # the kill is the one that says what the kill could lose.
            look = after if after is not None and before is not None and \
                after.generation == before.generation else before
            out.committed_at_kill = look.latest_committed_step if look else None
        seen = [0]  # the newest generation recorded

        def record_plans_until_done() -> bool:
            coordinator = cluster.coordinator()
            status = coordinator.status() if coordinator else None
            if status is not None and status.generation > seen[0]:
                seen[0] = status.generation
                if not status.plan.completed:  # the end of the job, not a re-plan
                    out.plans.append(status.plan)
            return _done(cluster) or not cluster.running()

        wait_until(record_plans_until_done, max(1.0, deadline - time.monotonic()),
                   "every rank with a role to finish", every_s=0.2)
        follow.poll([r.log_path for r in cluster.ranks])
        out.losses = dict(follow.losses)
        out.results = [res for r in cluster.ranks if (res := r.result()) is not None]
        _add_plans_the_ranks_trained_in(out)
        out.exit_codes = [r.proc.poll() for r in cluster.ranks]
        out.logs = "\n".join(f"--- {r.log_path.name}\n{r.log_path.read_text()[-3000:]}"
                             for r in cluster.ranks if r.log_path.exists())
    finally:
        cluster.close()
    return out


def _command(script: str) -> list[str]:
    return [str(REPO / script)] if script.endswith(".py") else ["-m", script]


def _add_plans_the_ranks_trained_in(out: Run) -> None:
    """A plan that lived shorter than one poll (the job ended soon after a re-plan) is
    known from the generations the ranks trained in."""
    seen = {p.generation for p in out.plans}
    for res in out.results:
        for g in res.get("generations", []):
            if g["generation"] not in seen:
                seen.add(g["generation"])
                out.plans.append(common_pb2.Plan(
                    generation=g["generation"], resume_step=g["resume_step"],
                    layout=common_pb2.ParallelLayout(**g["layout"])))
    out.plans.sort(key=lambda p: p.generation)


def _done(cluster: LocalCluster) -> bool:
    """Every rank with a role finished; what still runs is an unused spare."""
    results = [r.result() for r in cluster.ranks]
    finished = [res for res in results if res and res.get("result")]
    running_roles = [r for r in cluster.running() if r.rank >= 0]
    return bool(finished) and not running_roles
