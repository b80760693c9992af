"""With capture CPUs given, the hand-over's gRPC threads leave the training thread's
cores too, while the capture runs. A real daemon over gRPC; this process is its
registered rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from stalwart.bench.capture import _DaemonRank
from stalwart.client.capture import GrpcThreads
from stalwart.client.state_layout import StateTensor

pytestmark = pytest.mark.multiprocess


def test_the_hand_overs_grpc_threads_run_on_the_capture_cpus(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("this machine gives the process one CPU: nothing to pin apart")
    own = frozenset({allowed[-1]})
    rank = _DaemonRank(tmp_path / "cluster")
    try:
        grpc_threads = GrpcThreads().ids()
        assert grpc_threads, "the daemon client's channel runs gRPC threads of its own"
        assert all(os.sched_getaffinity(tid) == set(allowed) for tid in grpc_threads)
        rank.capturer.cpus = own
        state = [StateTensor("model/w", torch.randn(64, 64))]
        for step in range(1, 4):
            rank.capturer.capture(step, state, {"step": step})
        rank.capturer.drain()
        moved = GrpcThreads().ids()
        assert set(grpc_threads) <= set(moved)
        assert {tid: os.sched_getaffinity(tid) for tid in moved} == {tid: own for tid in moved}
        assert os.sched_getaffinity(0) == set(allowed)  # the training thread stays
        rank.wait_committed(3)
        rank.capturer.close()  # the capture is over: gRPC's threads go back
        assert all(os.sched_getaffinity(tid) == set(allowed) for tid in GrpcThreads().ids())
    finally:
        rank.close()
