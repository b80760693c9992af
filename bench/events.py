"""Timestamped events a benchmark's worker process appends to a JSON-lines file, and
their reading back: how the peer runs in `bench recovery` (torchrun restarting from
DCP, TorchFT) report when each thing happened."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Emit = Callable[..., None]


def emitter(path: Path) -> Emit:
    """`emit(kind, at=None, **fields)`: append one event, timed `at` (Unix seconds) or now."""
    def emit(kind: str, at: float | None = None, **fields: Any) -> None:
        event = {"event": kind, "time_unix": time.time() if at is None else at, **fields}
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")
    return emit


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events in `path`, in the order written (none when it does not exist yet); a
    line still being written (no newline yet) is left for the next read."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]
