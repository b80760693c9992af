"""What a rank sends over intra-node and inter-node links, by collective.

Counted as the volume the collective's algorithm sends from this rank (ring all-reduce:
2(n-1)/n of the tensor to the ring successor; ring all-gather: n-1 chunks to the
successor; broadcast: the root sends the tensor to each member; point-to-point: the
message), attributed to the link to the receiving member's node. gloo and NCCL pick
their own inner algorithms, but the ring family sends the same volume per rank, so the
figures compare placements and layouts faithfully; they are not bytes read off a socket.
No torch here: the daemon side and the pure tests import it too.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LinkBytes", "link_between"]


def link_between(a: str | int, b: str | int) -> str:
    """ "intra" when both ends are on one node, else "inter"."""
    return "intra" if a == b else "inter"


@dataclass
class LinkBytes:
    """Bytes this rank sent over intra-node and inter-node links, by collective
    (algorithm volume, as the module says)."""

    sent: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, link: str, collective: str, nbytes: float) -> None:
        # Collectives run on the training thread and the DP communication thread.
        with self._lock:
            self.sent[(link, collective)] += nbytes

    def ring_allreduce(self, collective: str, nodes: Sequence[str | int], index: int,
                       nbytes: float) -> None:
        """Member `index` of a ring over `nodes` (each member's node) all-reduced `nbytes`."""
        n = len(nodes)
        if n > 1:
            self.add(link_between(nodes[index], nodes[(index + 1) % n]), collective,
                     2 * (n - 1) / n * nbytes)

    def ring_allgather(self, collective: str, nodes: Sequence[str | int], index: int,
                       chunk_bytes: float) -> None:
        """Member `index` contributed `chunk_bytes` to a ring all-gather over `nodes`."""
        n = len(nodes)
        if n > 1:
            self.add(link_between(nodes[index], nodes[(index + 1) % n]), collective,
                     (n - 1) * chunk_bytes)

    def drain(self) -> dict[tuple[str, str], float]:
        """The counts so far, {(link, collective): bytes}; the counter starts again at 0."""
        with self._lock:
            out, self.sent = dict(self.sent), Counter()
        return out

    def total(self, link: str) -> float:
        """All bytes this rank sent over `link` ("intra" or "inter")."""
        return sum(v for (lk, _), v in self.sent.items() if lk == link)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{collective: {"intra": bytes, "inter": bytes}} for bench output."""
        out: dict[str, dict[str, float]] = {}
        for (link, collective), nbytes in sorted(self.sent.items()):
            out.setdefault(collective, {"intra": 0.0, "inter": 0.0})[link] = nbytes
        return out

    def export(self, counter: Any) -> None:
        """Add the counts to a prometheus Counter labelled (link, collective), then reset."""
        for (link, collective), nbytes in self.drain().items():
            counter.labels(link=link, collective=collective).inc(nbytes)
