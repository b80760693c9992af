"""`stalwart bench scale`: re-planning figures for 1k, 4k and 16k GPUs, as the issue keys them."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_scale_reports_replan_seconds_per_gpu_count(tmp_path):
    out = tmp_path / "scale.json"
    subprocess.run([sys.executable, "-m", "stalwart.cli", "bench", "scale", "--quick",
                    "--json", str(out)], check=True, timeout=600)
    figures = json.loads(out.read_text())
    assert set(figures["replan_s"]) == {"1024", "4096", "16384"}
    for point in figures["replan"]:
        assert point["replan_s"] == figures["replan_s"][str(point["gpus"])] > 0
        assert point["replan_s"] >= point["shrink_s"] > 0
        # A node of 8 is lost: the shrink keeps tp and the 8-GPU groups of the survivors.
        assert point["shrink_to"].endswith("tp=8")
        assert 0 < point["layers_moved"] < point["layers_moved_naive"]
        assert point["shards_repaired"] > 0
