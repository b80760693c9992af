"""Series the daemon derives for dashboards: stragglers, rank recovery phases, protection.

In-process: the registry with a hand-moved clock, and the pure protection census
over hand-built manifests.
"""

from __future__ import annotations

from stalwart.core.protection import census, chunk_margin
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.registry import Registry
from stalwart.v1 import manifest_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ranks(reg: Registry, n: int) -> list[str]:
    return [reg.register(pid=100 + i, rank=i, world_size=n, local_rank=i, hostname="h",
                         spare=False, device="cpu", watch_pid=False).rank_id for i in range(n)]


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_a_rank_slower_than_its_peers_for_several_windows_is_flagged_and_reported() -> None:
    clock, metrics = Clock(), Metrics()
    reg = Registry("n0", 0.5, 3.0, metrics, clock=clock)
    ids = ranks(reg, 4)
    step = 0
    for _window in range(4):
        reg.check()  # opens the first window; later calls close one
        for _ in range(3):
            step += 1
            for i, rank_id in enumerate(ids):
                reg.heartbeat(rank_id, 1, step, 0.30 if i == 3 else 0.10)
        clock.now += 2.0
    reg.check()
    assert value(metrics, "stalwart_straggler", rank=ids[3]) == 1
    assert [value(metrics, "stalwart_straggler", rank=r) for r in ids[:3]] == [0, 0, 0]
    assert value(metrics, "stalwart_failures_detected_total", kind="straggler") == 1


def test_repeated_heartbeats_of_one_step_count_as_one_sample() -> None:
    clock, metrics = Clock(), Metrics()
    reg = Registry("n0", 0.5, 3.0, metrics, clock=clock)
    ids = ranks(reg, 2)
    for _ in range(5):
        reg.heartbeat(ids[1], 1, 7, 0.9)
    assert reg.stragglers._samples == {ids[1]: [0.9]}


def test_a_ranks_recovery_phases_are_observed_once_per_generation() -> None:
    metrics = Metrics()
    reg = Registry("n0", 0.5, 3.0, metrics, clock=Clock())
    (rank_id,) = ranks(reg, 1)
    for step in (1, 2):
        reg.heartbeat(rank_id, 1, step, 0.1, recovery_phases={"rebuild": 0.2, "restore": 0.4,
                                                             "bogus": 1.0})
    assert value(metrics, "stalwart_recovery_phase_seconds_count", phase="rebuild") == 1
    assert value(metrics, "stalwart_recovery_phase_seconds_sum", phase="restore") == 0.4
    assert value(metrics, "stalwart_recovery_phase_seconds_count", phase="bogus") is None


def chunk(k: int, shards: list[tuple[int, str]]) -> manifest_pb2.ChunkRecord:
    return manifest_pb2.ChunkRecord(
        chunk_id="c", k=k, m=len({i for i, _ in shards}) - k,
        shards=[manifest_pb2.ShardRecord(index=i, node=node) for i, node in shards])


def test_a_chunk_with_2_of_3_shards_on_three_nodes_survives_one_more_loss() -> None:
    c = chunk(2, [(0, "a"), (1, "b"), (2, "c")])
    assert chunk_margin("a", c, {"a", "b", "c"}) == 1
    assert chunk_margin("a", c, {"b", "c"}) == 0  # its home (disk copy) is gone already
    assert chunk_margin("a", c, {"c"}) == -1


def test_parity_on_s3_survives_the_loss_of_every_node() -> None:
    c = chunk(1, [(0, "b"), (1, "s3")])
    assert chunk_margin("a", c, {"a", "b"}) == 2


def test_a_chunk_without_shards_lives_only_on_its_home_disk() -> None:
    assert chunk_margin("a", manifest_pb2.ChunkRecord(chunk_id="c"), {"a", "b"}) == 0


def test_the_home_disk_counts_only_where_it_kept_the_chunk_whole() -> None:
    c = chunk(2, [(0, "b"), (1, "c")])  # no shard on its home, a
    assert chunk_margin("a", c, {"a", "b", "c"}) == 0  # shards only: losing b loses it
    c.whole_on_node = True  # [snapshot] local_copy: a keeps it whole as well
    assert chunk_margin("a", c, {"a", "b", "c"}) == 1


def test_census_counts_shards_on_lost_nodes_as_missing_and_takes_the_worst_chunk() -> None:
    manifest = manifest_pb2.Manifest(step=3, ranks=[
        manifest_pb2.RankState(rank=0, node="a", chunks=[chunk(2, [(0, "a"), (1, "b"),
                                                                   (2, "c")])]),
        manifest_pb2.RankState(rank=1, node="b", chunks=[chunk(1, [(0, "b"), (1, "s3")])]),
    ])
    result = census([manifest], {"a", "b"})
    assert (result.healthy, result.missing, result.margin) == (4, 1, 0)
