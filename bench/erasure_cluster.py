"""Erasure figures from a real training run on a LocalCluster: bytes the daemons store
per protected step (deltas on: every file on every daemon's disk, the k + m shards, any
whole chunk and every copy of the ranks' records) against the state captured, and a
Restore RPC with m daemons killed against one from the capturing daemon's RAM tier.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

# The `small` preset, as #20 measures it; a quick run shortens its sequence only.
SEQ_LEN = {True: 64, False: 128}


def _stored(data_dirs: list[Path]) -> tuple[dict, dict[str, int]]:
    """Every committed step whole (each daemon's records joined), and the bytes on the
    daemons' disks by kind: shards, whole chunks, copies of the records, the rest."""
    from stalwart.daemon.snapshot.local_store import LocalStore
    from stalwart.daemon.snapshot.records import from_disks

    stores = [LocalStore(d, ram_tier_bytes=0) for d in data_dirs]
    fetch = from_disks(stores)
    found = {s: stores[-1].load_manifest(s, fetch) for s in stores[-1].committed_steps()}
    kinds = {"shards": 0, "chunks": 0, "records": 0, "other": 0}
    for d in data_dirs:
        for f in (f for top in ("shards", "snapshots") for f in (d / top).rglob("*")
                  if f.is_file()):
            kind = ("shards" if f.is_relative_to(d / "shards") else "chunks"
                    if f.suffix == ".chunk" else "records" if f.name == "rank.pb" else "other")
            kinds[kind] += f.stat().st_size
    return found, kinds


def _restore_s(address: str, step: int, token: str) -> tuple[float, bytes]:
    import grpc

    from stalwart.v1 import rank_pb2, rank_pb2_grpc

    started = time.perf_counter()
    with grpc.insecure_channel(address) as ch:
        pieces = list(rank_pb2_grpc.RankServiceStub(ch).Restore(
            rank_pb2.RestoreRequest(rank_id="bench", step=step, rank=0), timeout=120,
            metadata=(("stalwart-token", token),)))
    return time.perf_counter() - started, b"".join(p.data for p in pieces[1:])


def cluster_figures(quick: bool, k: int = 4, m: int = 2) -> dict:
    """Train on k + m daemons (one rank on node-0), then measure stored bytes and restores."""
    from stalwart.client.local_cluster import LocalCluster, wait_until

    steps, base_every = 40, 10
    spec = {"model": "small", "model_overrides": {"seq_len": SEQ_LEN[quick]},
            "train": {"global_batch": 4, "corpus_bytes": 65536, "seed": 0},
            "layout": {"dp": 1, "pp": 1, "tp": 1}, "steps": steps, "faults": []}
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-") as tmp:
        cluster = LocalCluster(nodes=k + m, workdir=Path(tmp), daemon_settings={
            "heartbeat_timeout_s": 300.0, "erasure": {"k": k, "m": m},
            "snapshot": {"base_every": base_every, "retain": steps}})
        try:
            cluster.start_daemons()
            cluster.launch(spec, world=1)
            wait_until(lambda: cluster.ranks[0].proc.poll() is not None, 600, "training")
            if cluster.ranks[0].proc.returncode != 0:
                raise RuntimeError(f"training failed; see {cluster.ranks[0].log_path}")
            wait_until(lambda: all((st := n.status()) is not None and
                                   st.latest_committed_step == steps for n in cluster.daemons),
                       60, "the last commit on every daemon")
            found, disk = _stored([n.data_dir for n in cluster.daemons])
            state = sum(r.total_bytes for mf in found.values() for r in mf.ranks)
            encoded = sum(c.stored_size for mf in found.values() for r in mf.ranks
                          for c in r.chunks)
            latest = max(found)
            local_s, want = _restore_s(cluster.daemons[0].address, latest,
                                        cluster.env["STALWART_TOKEN"])
            for node in cluster.daemons[1:1 + m]:  # m holders gone; node-0 keeps its RAM
                node.proc.send_signal(signal.SIGKILL)
                node.proc.wait(10)
            shards_s, got = _restore_s(cluster.daemons[-1].address, latest,
                                       cluster.env["STALWART_TOKEN"])
            if got != want:
                raise RuntimeError("restore from shards is not bitwise equal to the local copy")
        finally:
            cluster.close()
    return {
        "k": k, "m": m, "steps_committed": len(found), "base_every": base_every,
        "state_bytes_per_step": state // len(found),
        "stored_bytes_per_step_ratio": round(sum(disk.values()) / state, 4),
        "records_ratio": round(disk["records"] / state, 4),
        "shards_only_ratio": round(disk["shards"] / state, 4),
        "whole_chunks_ratio": round(disk["chunks"] / state, 4),
        "encoded_ratio": round(encoded / state, 4),
        # What [snapshot] local_copy = true adds: every chunk whole on its own daemon.
        "stored_with_local_copy_ratio": round((sum(disk.values()) + encoded) / state, 4),
        "restore_from_shards_s": round(shards_s, 4), "restore_local_s": round(local_s, 4),
        "restore_nodes_lost": m, "restore_bytes": len(want),
    }
