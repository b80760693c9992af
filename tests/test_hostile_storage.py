"""Hostile storage: a full local disk, a full shard disk, an S3 outage during training."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from snapshot_states import commit_step, state

from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.v1 import peer_pb2_grpc, rank_pb2, rank_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
is_root = os.geteuid() == 0


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 3 MiB tmpfs: the local tier fills up after a few steps."""
    if not is_root:
        pytest.skip("mounting a tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="stw-full-", dir="/tmp"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        pytest.skip(f"this container cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
        shutil.rmtree(where, ignore_errors=True)


def test_a_full_local_disk_fails_the_new_step_and_keeps_the_last_committed_one(
        small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(bytes(1 << 20))  # someone else's file that fills the disk
    store = LocalStore(small_disk / "store", base_every=1, retain=1000, chunk_bytes=8192)
    committed, failure = [], None
    for step in range(1, 200):
        try:
            commit_step(store, step, scale=8)
        except OSError as exc:
            failure = exc
            break
        committed.append(step)
    assert failure is not None and failure.errno == errno.ENOSPC, "the disk never filled up"
    assert "No space left on device" in str(failure)
    assert committed, "not even one step fitted on the disk"
    last = committed[-1]
    # The torn step is invisible; the last committed one restores bitwise, also cold.
    assert store.latest_committed() == last
    assert LocalStore(small_disk / "store", chunk_bytes=8192).read_rank(last, 0) == \
        state(last, scale=8)
    # Space comes back: the step that failed commits on a retry.
    filler.unlink()
    commit_step(store, last + 1, scale=8)
    assert store.latest_committed() == last + 1
    assert store.read_rank(last + 1, 0) == state(last + 1, scale=8)


def test_a_full_shard_disk_answers_resource_exhausted_and_keeps_stored_shards(
        small_disk: Path) -> None:
    metrics = Metrics()
    servicer = ShardServicer(small_disk / "shards", metrics)

    async def main() -> tuple[str, str, bytes]:
        server = grpc.aio.server()
        peer_pb2_grpc.add_ShardServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            from stalwart.daemon.snapshot.shard_client import ShardClient, ShardTransferError
            client = ShardClient(f"127.0.0.1:{port}", job_id="default", attempts=1)
            await client.put("c0.0", b"k" * 1000)
            result = "fits"
            for i in range(1, 20):
                try:
                    await client.put(f"c{i}.0", os.urandom(1 << 20))
                except ShardTransferError as exc:
                    result = str(exc)
                    break
            kept = await client.get("c0.0")
            await client.close()
            leftovers = ",".join(p.name for p in (small_disk / "shards").rglob("*.tmp-*"))
            return result, leftovers, kept
        finally:
            await server.stop(0)

    result, leftovers, kept = asyncio.run(main())
    assert "RESOURCE_EXHAUSTED" in result and "free space" in result, result
    assert leftovers == ""
    assert kept == b"k" * 1000


# --- no pickle on any boundary -------------------------------------------------------


def fill(directory: Path) -> Path:
    """Write a file in `directory` until its filesystem has no space left."""
    filler = directory / "filler"
    block = bytes(64 << 10)
    with open(filler, "wb", buffering=0) as f:  # unbuffered: close has nothing left to write
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


DISK_FULL_STEPS = 400


@pytest.mark.multiprocess
def test_a_daemon_whose_local_disk_fills_up_keeps_its_last_committed_step(
        tmp_path: Path) -> None:
    import signal

    from stalwart.client.local_cluster import LocalCluster, wait_until

    if not is_root:
        pytest.skip("mounting a tmpfs needs root")
    cluster = LocalCluster(nodes=1, workdir=tmp_path / "c",
                           daemon_settings={"snapshot": {"base_every": 4, "retain": 3},
                                            "heartbeat_timeout_s": 120.0})
    # The local tier (data_dir/snapshots) on a small disk of its own; logs stay elsewhere.
    tier = tmp_path / "c" / "node-0" / "snapshots"
    tier.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(tier)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"this container cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        cluster.start_daemons()
        node = cluster.daemons[0]
        # Long enough that the rank is still training when space comes back.
        cluster.launch({**OUTAGE_SPEC, "steps": DISK_FULL_STEPS}, world=1)
        rank = cluster.ranks[0]

        def committed() -> int:
            st = node.status()
            return st.latest_committed_step if st is not None else -1

        wait_until(lambda: committed() >= 3, 120, "the first steps to commit")
        rank.proc.send_signal(signal.SIGSTOP)
        filler = fill(tier)
        last = committed()
        rank.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: "No space left on device" in node.log_path.read_text(), 60,
                   "the daemon to log the full disk")
        rank.proc.send_signal(signal.SIGSTOP)
        assert committed() == last, "a step committed although the disk was full"
        trained = max(r.step for r in node.status().ranks)
        assert trained < DISK_FULL_STEPS - 20, "the rank finished before space came back"
        # The newest committed step restores while the disk is full.
        with grpc.insecure_channel(node.address) as ch:
            pieces = list(rank_pb2_grpc.RankServiceStub(ch).Restore(
                rank_pb2.RestoreRequest(rank_id="test", step=0, rank=0), timeout=60,
                metadata=(("stalwart-token", cluster.env["STALWART_TOKEN"]),)))
        assert pieces[0].step >= last and pieces[0].state.total_bytes == sum(
            len(p.data) for p in pieces[1:])
        # Space comes back: training ends and its last step commits.
        filler.unlink()
        rank.proc.send_signal(signal.SIGCONT)
        # Commits resume past the point the disk filled up. (A daemon that falls behind
        # skips captures by design, so not every later step commits.)
        wait_until(lambda: committed() > trained, 120, "commits to resume after space returns")
    finally:
        for r in cluster.ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGCONT)
        cluster.close()
        subprocess.run(["umount", "-l", str(tier)], capture_output=True, timeout=30)


# --- S3 goes away during training ---------------------------------------------------

OUTAGE_STEPS = 300  # long enough that training goes on after S3 returns
OUTAGE_SPEC = {"model": "tiny",
               "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
                                   "seq_len": 16},
               "train": {"global_batch": 4, "corpus_bytes": 65536, "seed": 0},
               "layout": {"dp": 1, "pp": 1, "tp": 1}, "steps": OUTAGE_STEPS, "faults": []}


@pytest.mark.multiprocess
def test_s3_outage_during_training_loses_no_committed_step_and_catches_up(
        tmp_path: Path, s3_server, s3_location) -> None:
    import signal

    from stalwart.client.local_cluster import LocalCluster, wait_until

    s3 = {"endpoint": s3_location.endpoint, "bucket": s3_location.bucket,
          "prefix": s3_location.prefix, "region": s3_location.region}
    cluster = LocalCluster(
        nodes=2, workdir=tmp_path / "c", metrics=True,
        # A rank held with SIGSTOP must not be declared dead meanwhile: long liveness window.
        daemon_settings={"s3": s3, "erasure": {"k": 1, "m": 1, "parity_to": "both"},
                         "snapshot": {"base_every": 4, "retain": 400},
                         "heartbeat_timeout_s": 120.0},
        env={"AWS_ACCESS_KEY_ID": s3_location.access_key,
             "AWS_SECRET_ACCESS_KEY": s3_location.secret_key})
    node0, node1 = None, None
    try:
        cluster.start_daemons()
        node0, node1 = cluster.daemons
        cluster.launch(OUTAGE_SPEC, world=1)
        rank = cluster.ranks[0]

        def committed(node) -> int:
            st = node.status()
            return st.latest_committed_step if st is not None else -1

        wait_until(lambda: committed(node0) >= 3, 120, "the first steps to commit with S3 up")
        rank.proc.send_signal(signal.SIGSTOP)  # hold training while S3 goes away
        s3_server.stop()
        try:
            before = committed(node0)
            rank.proc.send_signal(signal.SIGCONT)
            # Train on through the outage: captures keep being accepted.
            wait_until(lambda: (st := node0.status()) is not None and any(
                r.step >= before + 4 for r in st.ranks), 120, "training to go on without S3")
            rank.proc.send_signal(signal.SIGSTOP)
            # Stay down past the S3 tier's retries, so a step really fails to reach S3.
            wait_until(lambda: s3_failures(node0.metrics_port) >= 6, 60,
                       "the daemon to exhaust its S3 retries")
            during = committed(node0)
            assert during >= before, "a committed step was lost while S3 was down"
            trained = max(r.step for r in node0.status().ranks)
            assert trained < OUTAGE_STEPS - 20, "the rank finished before S3 came back"
            # Every step committed before the outage restores from either daemon, S3 down.
            for step in range(1, before + 1):
                for node in (node0, node1):
                    assert restored_bytes(node.address, step, cluster.env["STALWART_TOKEN"]) > 0
        finally:
            s3_server.start()
            rank.proc.send_signal(signal.SIGCONT)
        # Commits resume past the outage on both daemons (a daemon that falls behind skips
        # captures by design, so not every later step commits)...
        wait_until(lambda: min(committed(node0), committed(node1)) > trained, 120,
                   "commits to resume after S3 returns")
        # ...and the remote tier caught up: a step committed after the outage is on S3.
        newest = committed(node0)

        def on_s3() -> bool:
            listing = s3_server.client().list_objects_v2(
                Bucket=s3_location.bucket, Prefix=f"{s3_location.prefix}/default/manifests/")
            return any(int(o["Key"].rsplit("/", 1)[1].split(".")[0]) >= newest
                       for o in listing.get("Contents", []))

        wait_until(on_s3, 30, f"a manifest of step {newest} or later on S3")
    finally:
        if s3_server.proc is None:
            s3_server.start()
        cluster.close()


def restored_bytes(address: str, step: int, token: str) -> int:
    """Size of rank 0's state at `step` as a daemon's Restore RPC returns it (checked)."""
    with grpc.insecure_channel(address) as ch:
        pieces = list(rank_pb2_grpc.RankServiceStub(ch).Restore(
            rank_pb2.RestoreRequest(rank_id="test", step=step, rank=0), timeout=60,
            metadata=(("stalwart-token", token),)))
    size = sum(len(p.data) for p in pieces[1:])
    assert size == pieces[0].state.total_bytes
    return size


def s3_failures(metrics_port: int) -> float:
    """Sum of stalwart_s3_errors_total on a daemon's /metrics."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stalwart_s3_errors_total{"))
