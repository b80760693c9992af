"""Keeps the protection series current: shards by state and the protection margin.

Re-counts the newest committed step (and the bases it needs) whenever the step or
the set of live daemons changes, so a lost peer shows at once as missing shards
and a smaller margin. Each daemon counts the records it holds (its own ranks' and
the copies it keeps): the job's margin is the smallest any daemon reports. The
daemon's status shows the same count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.core.protection import Census, census
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.local_store import LocalStore

log = logging.getLogger("stalwart.daemon.snapshot.protection")


class ProtectionWatch:
    """Call `update()` periodically from the daemon's event loop."""

    def __init__(self, store: LocalStore, live_nodes: Callable[[], list[str]],
                 metrics: Metrics) -> None:
        self.store, self.live_nodes, self.metrics = store, live_nodes, metrics
        self._seen: tuple[int | None, frozenset[str], int] | None = None
        self.last: Census | None = None
        self.step: int | None = None  # the step `last` counts

    def update(self) -> Census | None:
        """Recount if the newest committed step, the records held (a repair gives them
        new holders) or the live daemons changed."""
        latest = self.store.latest_committed()
        live = frozenset(self.live_nodes())
        seen = (latest, live, self.store.changes)
        if seen == self._seen:
            return self.last
        if latest is None:
            self._seen = seen
            self.last = self.step = None
            return None
        try:
            chain = sr.plan_chain(self.store.committed_records(), latest)
            held = [self.store.held_manifest(s) for s in chain]
        except (FileNotFoundError, KeyError, mf.ManifestError):
            return self.last  # a step was discarded or retired meanwhile: next tick
        self.last, self.step = census(held, set(live)), latest
        self._seen = seen
        self.metrics.shards.labels("healthy").set(self.last.healthy)
        self.metrics.shards.labels("missing").set(self.last.missing)
        self.metrics.protection_margin.set(self.last.margin)
        return self.last
