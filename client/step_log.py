"""What rank processes print, read as they print it: their `[step] N loss L` lines, and
the last lines of each log for a failure's report.
"""

from __future__ import annotations

import time
from pathlib import Path


class StepLog:
    """Follows the `[step] N loss L` lines rank processes print, as they are printed.

    `losses`: step -> global loss; `seen`: log -> [(step, unix time first read)].
    """

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        self.losses: dict[int, float] = {}
        self.seen: dict[Path, list[tuple[int, float]]] = {}

    def poll(self, paths: list[Path]) -> None:
        now = time.time()
        for path in paths:
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + cut
            for line in chunk[:cut].decode("utf-8", "replace").splitlines():
                fields = line.split()
                if len(fields) != 4 or fields[0] != "[step]" or fields[2] != "loss":
                    continue  # not a step line (or one another write broke into)
                try:
                    step, loss = int(fields[1]), float(fields[3])
                except ValueError:
                    continue
                self.losses[step] = loss
                self.seen.setdefault(path, []).append((step, now))

    def first_seen(self, step: int) -> float | None:
        """When any rank first printed `step` (unix seconds)."""
        times = [t for seen in self.seen.values() for s, t in seen if s == step]
        return min(times) if times else None

    def finished(self, steps: int) -> int:
        """Logs that printed the last step."""
        return sum(any(s == steps for s, _ in seen) for seen in self.seen.values())



def log_tails(logs: list[Path], lines: int = 25) -> list[str]:
    """A header line and the last `lines` lines of each log, for a failure's report."""
    out = []
    for path in logs:
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as e:
            tail = [f"(unreadable: {e})"]
        out += [f"--- {path}", *tail]
    return out
