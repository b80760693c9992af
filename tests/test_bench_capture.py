"""`stalwart bench capture --quick` runs end to end through a real daemon and reports the
figures the README quotes: the stall beside DCP's, and the step overhead with the rank
and its daemon sharing the cores and with a core each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def test_the_capture_benchmark_reports_the_stall_and_both_overheads(tmp_path: Path) -> None:
    out = tmp_path / "capture.json"
    proc = subprocess.run([sys.executable, "-m", "stalwart.cli", "bench", "capture",
                           "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["captures"] > 0 and figures["stall_s"] > 0
    assert figures["dcp_async_save_stall_s"] > 0 and figures["stall_vs_dcp_async"] > 0
    assert isinstance(figures["step_overhead_pct"], float)
    own = figures["own_cores"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert isinstance(figures["step_overhead_pct_own_cores"], float)
        assert own["rank_core"] != own["daemon_core"] and own["torch_threads"] == 1
        assert isinstance(own["overhead_pct_capture_threads_on_rank_core"], float)
        assert isinstance(own["busy_neighbour_overhead_pct"], float)
        assert isinstance(own["streaming_neighbour_overhead_pct"], float)
        assert 0 < own["daemon_cpu_s_per_capture"] < 10 and own["daemon_core_busy_fraction"] > 0
    else:
        assert figures["step_overhead_pct_own_cores"] is None and own["why"]
    # The small model's own-cores figure takes minutes: full runs only, and said so.
    assert figures["step_overhead_pct_own_cores_small"] is None
    assert figures["own_cores_small"]["why"]
