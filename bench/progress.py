"""Progress lines of a running benchmark, on stderr: what it is doing now and how long
it has run, so a bench that takes minutes is never silent (stdout stays free)."""

from __future__ import annotations

import sys
import time

_started = time.monotonic()
_name = "bench"


def begin(name: str) -> None:
    """A benchmark starts: later lines count from now and carry its name."""
    global _started, _name
    _started, _name = time.monotonic(), name


def say(text: str) -> None:
    print(f"[bench {_name} {time.monotonic() - _started:6.1f}s] {text}", file=sys.stderr,
          flush=True)


def elapsed_s() -> float:
    return time.monotonic() - _started


def seconds(value: float | None) -> str:
    """A duration for a progress line ("-" when not measured)."""
    return "-" if value is None else f"{value:.2f} s"
