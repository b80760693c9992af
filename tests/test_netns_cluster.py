"""The emulated cluster of the comm benchmark: namespaces appear, talk, and always go away."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stalwart.bench.netns_cluster import emulated_cluster, netns_unavailable

WHY_NOT = netns_unavailable()
SERVER = """import socket, sys
s = socket.create_server((sys.argv[1], 29778)); s.settimeout(20)
c, _ = s.accept(); print(c.recv(5).decode())"""
CLIENT = """import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        socket.create_connection((sys.argv[1], 29778), timeout=2).sendall(b"hello"); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)"""


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


@pytest.mark.netns
@pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces unavailable: {WHY_NOT}")
def test_emulated_nodes_reach_each_other_and_are_removed_even_after_an_error() -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"), emulated_cluster(2, 400) as nodes:
        ours = {n.netns for n in nodes}
        assert ours <= _namespaces()
        server = subprocess.Popen(["ip", "netns", "exec", nodes[1].netns, sys.executable,
                                   "-c", SERVER, nodes[1].addr], stdout=subprocess.PIPE,
                                  text=True)
        client = subprocess.run(["ip", "netns", "exec", nodes[0].netns, sys.executable, "-c",
                                 CLIENT, nodes[1].addr], capture_output=True, text=True,
                                timeout=30)
        assert client.returncode == 0, client.stderr
        assert server.communicate(timeout=30)[0].strip() == "hello"
        qdisc = subprocess.run(["tc", "-n", nodes[1].netns, "qdisc", "show", "dev",
                                nodes[1].ifname], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "400Mbit" in qdisc
        raise RuntimeError("boom")
    # None of ours is left, and nothing new; those a killed run left behind (before) may
    # be gone too: a cluster sweeps namespaces whose process has died.
    after = _namespaces()
    assert not ours & after and after <= before
