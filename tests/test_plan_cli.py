"""`stalwart plan` run as a real subprocess: tables on stdout, JSON for programs, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def stalwart(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart.cli", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def test_partition_writes_inclusive_stages_and_the_bottleneck(tmp_path: Path):
    out = tmp_path / "p.json"
    done = stalwart("partition", "--costs", "1,3,3,3,3,3,3,3,3,9", "--stages", "4",
                    "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["stages"] == [[0, 2], [3, 5], [6, 8], [9, 9]]
    assert result["bottleneck"] == 9.0
    assert "bottleneck 9" in done.stdout and "stage" in done.stdout


def test_partition_with_speeds_divides_each_stage_cost_by_its_speed(tmp_path: Path):
    out = tmp_path / "p.json"
    done = stalwart("partition", "--costs", "2,2,2,2,2,2", "--stages", "2", "--speeds", "1,2",
                    "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["stages"] == [[0, 1], [2, 5]]
    assert result["bottleneck"] == 4.0


def test_partition_reports_layers_moved_from_a_previous_split(tmp_path: Path):
    out = tmp_path / "p.json"
    done = stalwart("partition", "--costs", "1,1,1,1", "--stages", "2",
                    "--previous", "0-1,2-3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["layers_moved"] == 0


def test_partition_memory_shortfall_is_an_error_in_bytes():
    done = stalwart("partition", "--costs", "1,1,1", "--stages", "2", "--mem", "5,5,5",
                    "--mem-cap", "6")
    assert done.returncode == 2
    assert "short by 4 bytes" in done.stderr


def test_partition_more_stages_than_layers_is_an_error():
    done = stalwart("partition", "--costs", "1,2", "--stages", "3")
    assert done.returncode == 2
    assert "cannot split 2 layers into 3 stages" in done.stderr


def test_advise_prints_a_table_and_writes_the_plan(tmp_path: Path):
    out = tmp_path / "a.json"
    done = stalwart("advise", "--params", "7e9", "--gpus-per-node", "8", "--nodes", "4",
                    "--gpu-mem", "80", "--intra-bw", "3600", "--inter-bw", "400",
                    "--global-batch", "256", "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    best = result["best"]
    assert best["dp"] * best["tp"] * best["pp"] == 32
    assert best["step_time_s"] > 0 and best["memory_bytes"] < 80e9
    assert "classic rule" in done.stdout and "layout" in done.stdout


def test_advise_defaults_to_h100_nodes_and_says_what_it_assumed(tmp_path: Path):
    explicit, default = tmp_path / "explicit.json", tmp_path / "default.json"
    done = stalwart("advise", "--params", "7e9", "--nodes", "32", "--json", str(default))
    assert done.returncode == 0, done.stderr
    assert ("32 x 8 GPUs, 80 GB, 3600 Gb/s inside a node / 400 Gb/s between nodes per GPU"
            in done.stdout)
    same = stalwart("advise", "--params", "7e9", "--nodes", "32", "--gpus-per-node", "8",
                    "--gpu-mem", "80", "--intra-bw", "3600", "--inter-bw", "400",
                    "--json", str(explicit))
    assert same.returncode == 0
    assert json.loads(default.read_text())["best"] == json.loads(explicit.read_text())["best"]
    # The README's 7B / 200 Gb/s row, and its comparison with the classic rule, printed.
    slow = stalwart("advise", "--params", "7e9", "--nodes", "32", "--inter-bw", "200")
    assert slow.stdout.splitlines()[3].startswith("dp32 tp2 pp4")
    assert "(+29%)" in slow.stdout and "classic rule" in slow.stdout
