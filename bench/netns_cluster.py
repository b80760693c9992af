"""Emulated multi-node cluster on one machine: one network namespace per node, all joined
to a bridge inside a "switch" namespace, each node's link rate-limited by `tc tbf` in both
directions. Addresses (10.77.0.0/24) exist only inside these namespaces; nothing leaves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NetnsNode", "emulated_cluster", "netns_unavailable", "run_workers"]

STORE_PORT = 29777


@dataclass(frozen=True)
class NetnsNode:
    """One emulated node: its namespace, its network interface and address."""

    netns: str
    ifname: str
    addr: str


def netns_unavailable() -> str | None:
    """None when network namespaces and tc can be used here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"stwc-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if subprocess.run(["tc", "-V"], capture_output=True).returncode != 0:
        return "tc is not installed"
    return None


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def _limit(netns: str, ifname: str, rate_mbit: int) -> None:
    # latency bounds the queue; generous so TCP sees delay, not drops
    _sh("tc", "-n", netns, "qdisc", "add", "dev", ifname, "root", "tbf", "rate",
        f"{rate_mbit}mbit", "burst", "256kb", "latency", "200ms")


@contextmanager
def emulated_cluster(nodes: int, rate_mbit: int) -> Iterator[list[NetnsNode]]:
    """Create the namespaces, bridge and limits; always remove them on exit."""
    if not 1 <= nodes <= 250:
        raise ValueError(f"an emulated cluster has 1..250 nodes, not {nodes}")
    _remove_stale()
    tag = str(os.getpid())  # interface names stay within 15 characters
    switch = f"stwc-{tag}-sw"
    made = [switch]
    try:
        _sh("ip", "netns", "add", switch)
        _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", "br0", "up")
        out = []
        for i in range(nodes):
            node = NetnsNode(f"stwc-{tag}-{i}", f"stw{tag}n{i}", f"10.77.0.{i + 1}")
            port = f"stw{tag}s{i}"
            _sh("ip", "netns", "add", node.netns)
            made.append(node.netns)
            _sh("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name",
                node.ifname, "netns", node.netns)
            _sh("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _sh("ip", "-n", node.netns, "link", "set", "lo", "up")
            _sh("ip", "-n", node.netns, "link", "set", node.ifname, "up")
            _limit(node.netns, node.ifname, rate_mbit)  # the node's upload
            _limit(switch, port, rate_mbit)  # and its download
            out.append(node)
        yield out
    finally:
        for name in made:  # removing a namespace removes its veth ends and the bridge
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _remove_stale() -> None:
    """Delete namespaces left by an earlier run that was killed before it could clean up."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(r"stwc-(\d+)-(sw|\d+)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_workers(cluster: list[NetnsNode], node_of_rank: list[int], module: str,
                args: list[str], timeout_s: float) -> list[dict]:
    """Run `python -m module --rank R --store ADDR:PORT --out F ARGS` per rank in its node.

    Rank 0 hosts the store. Each worker writes one JSON object to F; the list is returned
    in rank order. A failed or late worker raises with the tail of its stderr.
    """
    procs: list[subprocess.Popen] = []
    logs = []
    with tempfile.TemporaryDirectory(prefix="stalwart-netns-") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(len(node_of_rank))]
        try:
            for r, n in enumerate(node_of_rank):
                node = cluster[n]
                env = {**os.environ, "GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1"}
                logs.append((Path(tmp) / f"rank{r}.err").open("w"))
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", node.netns, sys.executable, "-m", module,
                     "--rank", str(r), "--store", f"{cluster[node_of_rank[0]].addr}:{STORE_PORT}",
                     "--out", str(outs[r]), *args],
                    env=env, stdout=subprocess.DEVNULL, stderr=logs[-1]))
            _wait_all(procs, Path(tmp), time.monotonic() + timeout_s)
            return [json.loads(p.read_text()) for p in outs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
            for f in logs:
                f.close()


def _wait_all(procs: list[subprocess.Popen], logs: Path, deadline: float) -> None:
    """Poll until every worker exits; the first failure or the deadline raises."""
    while True:
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0):
                tail = (logs / f"rank{r}.err").read_text()[-3000:]
                raise RuntimeError(f"worker rank {r} exited with {p.returncode}:\n{tail}")
        if all(p.returncode == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not finish before the deadline; the namespaces "
                               "are removed, rerun to retry")
        time.sleep(0.05)
