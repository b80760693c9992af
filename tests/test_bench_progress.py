"""A benchmark is never silent: it says what it is doing and for how long, then closes
with one line of figures (the real `stalwart bench` command)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def test_a_bench_shows_progress_and_ends_with_a_summary_line(tmp_path: Path) -> None:
    out = tmp_path / "delta.json"
    done = subprocess.run([sys.executable, "-m", "stalwart.cli", "bench", "delta", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    progress = [line for line in lines if re.match(r"\[bench delta +\d+\.\ds\] ", line)]
    assert progress and "tiny: 10 warm-up steps" in progress[0]
    [closing] = [line for line in lines if line.startswith("[bench] delta: done in ")]
    assert "chunk_bytes 4194304" in closing
    assert json.loads(out.read_text())["benchmark"] == "delta"
    assert done.stdout == ""  # figures go to the JSON, progress to stderr
