"""Recoverability, repaired records and the daemon's storage status, in one process: which
committed steps survive the loss of some nodes (a delta needs its base; the capturing
node's disk counts only where it kept the chunk whole), what a repair may change in a
record, and what `stalwart status` and the shard byte budget report. The same over real
daemons is tests/test_erasure_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core import manifest as mf
from stalwart.core.step_record import split
from stalwart.daemon.snapshot import repair
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.records import RecordHolders
from stalwart.v1 import common_pb2, manifest_pb2

K, M = 2, 2


def _step(step: int, base: int, holders: list[str], node: str = "node-0",
          whole: bool = False) -> manifest_pb2.Manifest:
    """A one-rank manifest whose single chunk has shards 0..3 on `holders` (k=2, m=2),
    kept `whole` on its capturing node's disk too ([snapshot] local_copy)."""
    codec = manifest_pb2.ZSTD if base == step else manifest_pb2.XOR_DELTA_ZSTD
    chunk = manifest_pb2.ChunkRecord(chunk_id=f"s{step}", size=4, stored_size=4, codec=codec,
                                     base_step=base, k=K, m=M, whole_on_node=whole)
    for i, h in enumerate(holders):
        chunk.shards.add(index=i, node=h, location=f"s{step}.{i}", size=2, crc32c=i)
    rank = manifest_pb2.RankState(rank=0, node=node, chunks=[chunk], total_bytes=4,
                                  coord=common_pb2.RankCoord(rank=0))
    return mf.build_manifest(job_id="default", step=step, generation=1,
                             layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1), ranks=[rank])


def test_a_delta_is_recoverable_only_while_its_base_is() -> None:
    found = {1: _step(1, 1, ["a", "b", "c", "d"]), 2: _step(2, 1, ["c", "d", "e", "f"]),
             3: _step(3, 3, ["a", "b", "e", "f"])}
    # Losing a, b, c leaves step 2 three of its own shards but only one of its base's.
    assert repair.recoverable(found, {"a", "b", "c"}, "elsewhere") == [3]
    assert repair.recoverable(found, {"a", "e", "f"}, "elsewhere") == [2, 1]
    assert repair.recoverable(found, {"e", "f"}, "elsewhere") == [3, 2, 1]
    # The capturing node keeps shards only, so it fares as any other node; with a whole
    # copy on its disk (local_copy) it reads that whatever happened to the shards.
    assert repair.recoverable(found, {"a", "b", "c"}, "node-0") == [3]
    whole = {s: _step(s, b, h, whole=True) for s, b, h in
             ((1, 1, ["a", "b", "c", "d"]), (2, 1, ["c", "d", "e", "f"]),
              (3, 3, ["a", "b", "e", "f"]))}
    assert repair.recoverable(whole, {"a", "b", "c"}, "node-0") == [3, 2, 1]


def test_beyond_tolerance_names_the_newest_older_recoverable_step() -> None:
    found = {1: _step(1, 1, ["a", "b", "c", "d"]), 2: _step(2, 2, ["b", "c", "d", "e"])}
    message, newest = repair.beyond_tolerance(2, 0, "why", found, {"b", "c", "d"}, "x", False)
    assert newest is None and "No committed step is recoverable" in message
    message, newest = repair.beyond_tolerance(2, 0, "why", found, {"c", "d", "e"}, "x", True)
    assert newest == 1
    assert "newest step still recoverable (from surviving shards and S3) is 1" in message
    assert "lost: c, d, e" in message


def test_a_repaired_record_replaces_only_shard_holders(tmp_path: Path) -> None:
    # A copy of another daemon's record, then the same record with one shard moved (what
    # a repair sends): it checks against the committed seal. Any other change does not.
    store = LocalStore(tmp_path)
    holders = RecordHolders("node-1", "default", store, None, list, None, lambda: 2)
    old = _step(5, 5, ["a", "b", "c", "d"], node="elsewhere")
    holders.accept(manifest_pb2.RankRecords(job_id="default", step=5, ranks=old.ranks))
    store.commit(split(old), local_node="node-1")
    moved = manifest_pb2.RankState()
    moved.CopyFrom(old.ranks[0])
    moved.chunks[0].shards[2].node = "e"
    holders.accept(manifest_pb2.RankRecords(job_id="default", step=5, ranks=[moved]))
    assert LocalStore(tmp_path).load_manifest(5).ranks[0].chunks[0].shards[2].node == "e"
    other = manifest_pb2.RankState()
    other.CopyFrom(moved)
    other.chunks[0].shards[2].crc32c = 99
    with pytest.raises(mf.ManifestError, match="do not match their seal"):
        holders.accept(manifest_pb2.RankRecords(job_id="default", step=5, ranks=[other]))
    assert LocalStore(tmp_path).load_manifest(5).ranks[0] == moved


def test_status_storage_reports_shards_protection_repair_and_scrub(tmp_path: Path) -> None:
    import asyncio
    import dataclasses

    from stalwart.daemon.config import DaemonConfig
    from stalwart.daemon.metrics import Metrics
    from stalwart.daemon.peers import Peer, PeerChannels
    from stalwart.daemon.recovery.registry import Registry
    from stalwart.daemon.snapshot.path import SnapshotPath

    metrics = Metrics()
    config = dataclasses.replace(DaemonConfig(), node="a")
    path = SnapshotPath(config, Registry("a", 1.0, 5.0, metrics), metrics, tmp_path,
                        lambda: [Peer("a", "127.0.0.1:1", {}), Peer("b", "127.0.0.1:2", {})],
                        PeerChannels(config.tls), send_prepare=None,  # type: ignore[arg-type]
                        is_leader=lambda: True)
    try:
        step = _step(5, 5, ["a", "b", "c", "d"], node="x")
        path.store.keep_records(5, list(step.ranks))  # a copy of x's record
        path.store.commit(split(step), local_node="a")
        status = path.status_storage()
        assert status["shards"] == ("step 5 and its bases: 2 healthy, 2 missing, 0 repairing "
                                    "(records held here)")
        assert status["protection"] == "step 5 survives 0 more daemon losses"
        assert status["repair"].endswith("lost holders: c, d")
        # A repair re-creates the lost holders' shards on a and b and publishes the records
        # with their new holders: the next look counts them, though no step committed.
        repaired = []
        for state in step.ranks:
            moved = manifest_pb2.RankState()
            moved.CopyFrom(state)
            for chunk in moved.chunks:
                for shard in chunk.shards:
                    shard.node = {"c": "a", "d": "b"}.get(shard.node, shard.node)
            repaired.append(moved)
        path.store.keep_records(5, repaired)
        status = path.status_storage()
        assert status["shards"] == ("step 5 and its bases: 4 healthy, 0 missing, 0 repairing "
                                    "(records held here)")
        assert "lost holders" not in status["repair"]
        # A stored shard that fails its checksum and belongs to no kept step: deleted.
        shard = path.scrubber.shard_dir / "default" / "old.0"
        shard.parent.mkdir(parents=True)
        shard.write_bytes(b"xx")
        shard.with_name("old.0.meta.json").write_text(
            '{"size": 2, "crc32c": 1, "step": 9, "generation": 1}')
        assert asyncio.run(path.scrubber.scrub_once()) == ["old.0"]
        assert not shard.exists()
        assert "1 corrupt shards" in path.status_storage()["scrub"]
    finally:
        path.pool.close()


def test_shard_bytes_in_flight_are_bounded_per_daemon_not_per_peer(tmp_path: Path) -> None:
    import asyncio
    import dataclasses

    from stalwart.daemon.config import DaemonConfig
    from stalwart.daemon.metrics import Metrics
    from stalwart.daemon.peers import Peer, PeerChannels
    from stalwart.daemon.recovery.registry import Registry
    from stalwart.daemon.snapshot.holders import SHARD_BYTES_IN_FLIGHT
    from stalwart.daemon.snapshot.path import SnapshotPath

    metrics = Metrics()
    peers = [Peer("b", "127.0.0.1:2", {}), Peer("c", "127.0.0.1:3", {})]
    config = dataclasses.replace(DaemonConfig(), node="a")
    path = SnapshotPath(config, Registry("a", 1.0, 5.0, metrics), metrics, tmp_path,
                        lambda: peers, PeerChannels(config.tls),
                        send_prepare=None,  # type: ignore[arg-type]
                        is_leader=lambda: True)

    async def left_for_c_while_b_holds_three_quarters() -> int:
        to_b, to_c = path.holders.client("b"), path.holders.client("c")
        await to_b.budget.acquire(SHARD_BYTES_IN_FLIGHT // 4 * 3)
        return to_c.budget.available

    try:
        left = asyncio.run(left_for_c_while_b_holds_three_quarters())
    finally:
        path.pool.close()
    assert left == SHARD_BYTES_IN_FLIGHT // 4
