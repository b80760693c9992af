"""A peer whose traffic is dropped (iptables DROP inside its network namespace) is read
around within the shard reader's deadline: four daemons, each in its own namespace on an
emulated switch (bench.netns_cluster), one rank process attached over its Unix socket.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench.netns_cluster import emulated_cluster, netns_unavailable
from stalwart.client.local_cluster import LocalCluster, Node, wait_until
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.v1 import operator_pb2, operator_pb2_grpc, rank_pb2, rank_pb2_grpc

pytestmark = pytest.mark.multiprocess

STEPS = 5
READ_DEADLINE_S = 10.0  # ShardReader's default deadline for one chunk
SPEC = {"model": "tiny",
        "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16},
        "train": {"global_batch": 4, "corpus_bytes": 65536, "seed": 0},
        "layout": {"dp": 1, "pp": 1, "tp": 1}, "steps": STEPS, "faults": []}


def _why_not() -> str | None:
    if (reason := netns_unavailable()) is not None:
        return reason
    return None if shutil.which("iptables") else "iptables is not installed"


TOKEN = "netns-job-token"  # the daemons of one job share it (peers authenticate)


def _status(node: Node) -> operator_pb2.StatusReply | None:
    try:
        with grpc.insecure_channel(f"unix:{node.socket}") as ch:
            return operator_pb2_grpc.OperatorServiceStub(ch).Status(
                operator_pb2.StatusRequest(), timeout=2.0)
    except grpc.RpcError:
        return None


def _restore(node: Node, step: int, timeout_s: float) -> bytes:
    with grpc.insecure_channel(f"unix:{node.socket}") as ch:
        pieces = list(rank_pb2_grpc.RankServiceStub(ch).Restore(
            rank_pb2.RestoreRequest(rank_id="test", step=step, rank=0), timeout=timeout_s,
            metadata=(("stalwart-token", TOKEN),)))
    return b"".join(p.data for p in pieces[1:])


def _config(name: str, address: str, data_dir: Path, peers: list[str]) -> str:
    top = {"node": name, "listen": address, "data_dir": str(data_dir),
           "unix_socket": str(data_dir / "daemon.sock"), "metrics_port": 0,
           "log_format": "json", "peers": peers, "heartbeat_interval_s": 0.5, "token": TOKEN,
           "heartbeat_timeout_s": 300.0}
    lines = [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    return "\n".join([*lines, "[erasure]", "k = 2", "m = 2",
                      "[snapshot]", "base_every = 3", "retain = 5"]) + "\n"


@pytest.mark.skipif(_why_not() is not None, reason=f"needs root, ip netns, tc and iptables: "
                                                   f"{_why_not()}")
def test_peer_with_dropped_traffic_is_read_around_within_the_deadline(tmp_path: Path) -> None:
    with emulated_cluster(4, rate_mbit=1000) as nets:
        addresses = [f"{n.addr}:7070" for n in nets]
        cluster = LocalCluster(nodes=4, workdir=tmp_path, env={"STALWART_TOKEN": TOKEN})
        try:
            for i, net in enumerate(nets):
                node = Node(f"node-{i}", i, addresses[i], tmp_path / f"node-{i}")
                node.data_dir.mkdir()
                config = node.data_dir / "stalwart.toml"
                config.write_text(_config(node.name, addresses[i], node.data_dir,
                                          [a for a in addresses if a != addresses[i]]))
                with open(node.data_dir / "daemon.log", "ab") as log:
                    node.proc = subprocess.Popen(
                        ["ip", "netns", "exec", net.netns, sys.executable, "-m",
                         "stalwart.cli", "daemon", "--config", str(config)],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                        env=dict(os.environ))
                cluster.daemons.append(node)
            wait_until(lambda: all((st := _status(n)) is not None and
                                   sum(d.state == "up" for d in st.daemons) >= 3
                                   for n in cluster.daemons), 60,
                       "the namespaced daemons to see each other")
            cluster.launch(SPEC, world=1)
            wait_until(lambda: cluster.ranks[0].proc.poll() is not None, 150,
                       "the rank to finish training")
            assert cluster.ranks[0].proc.returncode == 0
            wait_until(lambda: all((st := _status(n)) is not None and
                                   st.latest_committed_step == STEPS
                                   for n in cluster.daemons), 30, "the last commit everywhere")
            reference = _restore(cluster.daemons[0], STEPS, 30.0)  # node-0's own disk copy

            # Block the holder of a data shard: the reader asks for data shards first.
            # node-0 captured rank 0 and keeps its record.
            record = LocalStore(cluster.daemons[0].data_dir, ram_tier_bytes=0).held_record(
                STEPS, 0)
            chunk = record.chunks[0]
            blocked = next(int(rec.node.split("-")[1]) for rec in sorted(
                chunk.shards, key=lambda r: r.index) if rec.node not in ("node-0", "node-3"))
            reader = cluster.daemons[3]
            for chain in ("INPUT", "OUTPUT"):
                subprocess.run(["ip", "netns", "exec", nets[blocked].netns, "iptables", "-A",
                                chain, "-j", "DROP"], check=True)
            # The RPC's own deadline is the bound: hedging must beat the reader's deadline.
            assert _restore(reader, STEPS, timeout_s=READ_DEADLINE_S + 5.0) == reference
        finally:
            cluster.close()
