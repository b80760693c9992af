"""SIGTERM or SIGINT to a running `stalwart demo` ends its whole tree: the daemons it
started, the ranks and the spares; nothing is left running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import processes_naming

from stalwart.client.local_cluster import wait_until

pytestmark = pytest.mark.multiprocess

MICRO = '{"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}'


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_demo_ends_every_process_it_started(tmp_path: Path, sig) -> None:
    workdir = tmp_path / "wd"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart.cli", "demo", "--workdir", str(workdir),
         "--model-overrides", MICRO, "--steps", "400", "--no-faults"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = time.monotonic()
        for line in proc.stdout:
            if "launched" in line or time.monotonic() - started > 120:
                break
        wait_until(lambda: len(processes_naming(workdir)) >= 7, 60,
                   "two daemons, four ranks and a spare to run")
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
        wait_until(lambda: not processes_naming(workdir), 30, "every process to end")
    finally:
        if proc.poll() is None:
            proc.kill()
