"""Fixture `run_ranks`: run a top-level function in N gloo-ready processes.

`run_ranks(fn, world_size, *args, timeout=120.0)` calls `fn(ctx, *args)` in each fresh
process, where `ctx` is a `stalwart.client.launch.RankContext` (rank, world_size, and a
client of one shared TCPStore hosted by the test process). It returns the per-rank
results (JSON-serialisable values) or raises `RankFailure` with every rank's traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    from stalwart.client.launch import run_local

    def run(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
        return run_local(fn, world_size, *args, timeout=timeout)

    return run
