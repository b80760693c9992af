"""The local tier's disk quota: bytes of snapshots and peers' shards under one limit."""

from __future__ import annotations

import time
from pathlib import Path

from stalwart.daemon.errors import Exhausted


class QuotaExceeded(Exhausted):
    """The local tier would hold more than [snapshot] disk_quota_bytes."""


class DiskQuota:
    """Bytes under the local tier's folders against a quota; re-measured every few
    seconds (a walk of the folders), with the bytes reserved since then added."""

    def __init__(self, roots: list[Path], limit: int, every_s: float = 5.0) -> None:
        self.roots, self.limit, self.every_s = roots, limit, every_s
        self._used, self._at = 0, float("-inf")

    def used(self) -> int:
        if time.monotonic() - self._at > self.every_s:
            self._used = sum(f.stat().st_size for root in self.roots if root.exists()
                             for f in root.rglob("*") if f.is_file())
            self._at = time.monotonic()
        return self._used

    def reserve(self, nbytes: int) -> None:
        """Account for `nbytes` about to be written, or raise QuotaExceeded."""
        if not self.limit:
            return
        used = self.used()
        if used + nbytes > self.limit:
            raise QuotaExceeded(
                f"local tier quota exceeded: {used} bytes used + {nbytes} to write > "
                f"[snapshot] disk_quota_bytes = {self.limit}; nothing is written "
                "(the last committed step stays restorable). Raise the quota or lower "
                "[snapshot] retain.")
        self._used += nbytes
