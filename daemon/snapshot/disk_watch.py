"""How long this node's disk has refused its ranks' captures, and when that ends them.

A capture that cannot be written here (the disk full, or the local tier over
`[snapshot] disk_quota_bytes`) does not commit, and no later step commits while it
goes on: one node's disk holds back the protection of the whole job. Once the refusals
have lasted `disk_full_replan_s` within one plan, each rank that plan gives this node
is reported STORAGE_FULL: the coordinator gives the roles to spares on other nodes, or
shrinks, and the job commits again. A capture stored ends the spell.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.errors import disk_full
from stalwart.daemon.snapshot.quota import QuotaExceeded
from stalwart.daemon.snapshot.shard_client import ShardTransferError

log = logging.getLogger("stalwart.daemon.snapshot.disk_watch")


def refusal(exc: BaseException | None) -> str | None:
    """Why this node's storage refused a write (full disk, or over quota), or None when
    `exc` is another error."""
    if isinstance(exc, QuotaExceeded) or (isinstance(exc, ShardTransferError) and exc.full):
        return str(exc)
    return disk_full(exc) if exc is not None else None


class DiskWatch:
    """Spells of refused captures, per plan generation; reports their ranks once each."""

    def __init__(self, node: str, replan_s: float, ranks_here: Callable[[int], list[str] | None],
                 report: Callable[[Failure], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`ranks_here(generation)`: the ranks that plan gives this node (None unless it
        is the current plan); `report`: a failure detected here (Registry.report)."""
        self.node, self.replan_s = node, replan_s
        self.ranks_here, self.report, self.clock = ranks_here, report, clock
        self._since: tuple[int, float] | None = None  # (generation, first refusal)
        self._reported = 0  # the newest generation whose ranks were reported

    def refused(self, exc: BaseException, generation: int) -> None:
        """A capture of plan `generation` could not be stored because of `exc`."""
        why = refusal(exc)
        if why is None:
            return
        now = self.clock()
        if self._since is None or self._since[0] != generation:
            self._since = (generation, now)
            log.warning("this node's storage refuses its ranks' captures: %s; no step "
                        "commits until space is freed%s", why,
                        f", or for {self.replan_s:g} s: then its ranks' roles move to "
                        "other nodes" if self.replan_s > 0 else "")
        lasted = now - self._since[1]
        if self.replan_s <= 0 or lasted < self.replan_s or self._reported >= generation:
            return
        self._reported = generation
        for rank_id in self.ranks_here(generation) or []:
            self.report(Failure(
                FailureKind.STORAGE_FULL, rank_id,
                f"the storage of {self.node} has refused its captures for {lasted:.0f} s "
                f"({why}); its role goes to another node", generation=generation,
                reporter=self.node))

    def stored(self) -> None:
        """A capture was stored: the spell, if any, is over."""
        if self._since is not None:
            log.info("this node's storage takes captures again")
            self._since = None
