"""`stalwart bench gpu` (what scripts/gpu_check.sh runs on a GPU machine) runs end to end
here at a small size on the CPU: the capture through a real daemon, the restore checked
bitwise, the groups built, aborted and rebuilt; NVML says why it is not there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def test_the_gpu_check_runs_on_the_cpu_and_says_what_it_could_not_read(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "stalwart.cli", "bench", "gpu", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and figures["cuda"] is None
    assert figures["restore_bitwise"] is True and figures["stream_restore_bitwise"] is True
    assert figures["restore_paths"] == ["slot", "stream"]
    assert figures["state_bytes"] == figures["state_bytes_on_device"] > 0
    assert 0 < figures["capture_stall_s"] and 0 < figures["dcp_async_save_stall_s"]
    groups = figures["groups"]
    assert groups["backend"] == "gloo" and groups["generations"] == 4
    assert groups["all_reduce_ok"] is True
    nvml = figures["nvml"]
    assert nvml["available"] is False and "NVML" in nvml["why"]
    assert "[bench gpu" in proc.stderr  # progress lines while it runs
