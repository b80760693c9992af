"""A real etcd server for the tests that need one (Debian etcd-server)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest

from stalwart.client.ports import free_port


def start_etcd(data) -> tuple[str, subprocess.Popen]:
    """A single-member etcd on free loopback ports: (client endpoint host:port, process)."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed: run scripts/install-system-deps.sh (Debian "
                    "etcd-server)")
    client, peer = free_port(), free_port()
    proc = subprocess.Popen([
        binary, "--name", "t", "--data-dir", str(data / "d"),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"t=http://127.0.0.1:{peer}",
    ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30.0
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as r:
                if b'"true"' in r.read():
                    return f"127.0.0.1:{client}", proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("etcd did not become healthy within 30 s")
        try:
            proc.wait(timeout=0.05)  # the pause between probes; also notices an early exit
            pytest.fail(f"etcd exited with code {proc.returncode} while starting")
        except subprocess.TimeoutExpired:
            pass


def stop_etcd(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)  # in case a test froze it
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[str]:
    endpoint, proc = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield endpoint
    stop_etcd(proc)
