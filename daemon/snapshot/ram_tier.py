"""The RAM tier of the local store: encoded chunk payloads kept in memory, bounded in bytes.

Everything here is also on disk or in erasure shards, so eviction never loses data
(a restore then reads the disk, or k shards): it drops the oldest
payloads first, sparing those that restoring the newest steps needs until nothing else is left.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

Key = tuple[int, int, int]  # (step, rank, chunk index)


class RamTier:
    """Payloads by (step, rank, chunk index), oldest first, at most `budget` bytes."""

    def __init__(self, budget: int, protected: Callable[[set[int]], set[int]]) -> None:
        """`protected(steps)` names which of `steps` to spare while others can go."""
        self.budget = budget
        self._protected = protected
        self._items: OrderedDict[Key, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.RLock()

    @property
    def used(self) -> int:
        """Bytes held."""
        return self._used

    def get(self, key: Key) -> bytes | None:
        return self._items.get(key)

    def put(self, key: Key, payload: bytes) -> None:
        with self._lock:
            if len(payload) > self.budget or key in self._items:
                return
            self._items[key] = payload
            self._used += len(payload)
            if self._used > self.budget:
                self._evict()

    def drop(self, key: Key) -> None:
        with self._lock:
            self._used -= len(self._items.pop(key, b""))

    def drop_steps(self, steps: Iterable[int]) -> None:
        """Forget every payload of these steps."""
        gone = set(steps)
        with self._lock:
            for key in [k for k in self._items if k[0] in gone]:
                self.drop(key)

    def steps(self) -> set[int]:
        return {k[0] for k in list(self._items)}

    def _evict(self) -> None:
        spare = self._protected(self.steps())
        for keep_protected in (True, False):
            for key in list(self._items)[:-1]:  # never the payload just put
                if self._used <= self.budget:
                    return
                if not (keep_protected and key[0] in spare):
                    self.drop(key)
