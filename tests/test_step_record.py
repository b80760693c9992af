"""Committed steps as small records (core/step_record.py): what a seal covers, what the
coordinator sends per step, and how a rank's chain is found without anyone else's records."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.step_commits import StepCommits
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2


def record_of(rank: int, node: str, step: int = 5, base: int | None = None,
              chunks: int = 3) -> manifest_pb2.RankState:
    state = manifest_pb2.RankState(rank=rank, node=node, total_bytes=4 * chunks,
                                   coord=common_pb2.RankCoord(rank=rank))
    for c in range(chunks):
        codec = manifest_pb2.ZSTD if base is None else manifest_pb2.XOR_DELTA_ZSTD
        chunk = state.chunks.add(chunk_id=f"s{step}-r{rank}-c{c}", offset=4 * c, size=4,
                                 stored_size=3, codec=codec,
                                 base_step=step if base is None else base, k=2, m=1)
        for i in range(3):
            chunk.shards.add(index=i, node=f"n{(rank + c + i) % 5}", location=f"x.{i}",
                             size=2, crc32c=7 * c + i)
    return state


def step_of(step: int, world: int, per_node: int, base: int | None = None
            ) -> tuple[manifest_pb2.StepRecord, list[manifest_pb2.RankState]]:
    states = [record_of(r, f"n{r // per_node}", step, base) for r in range(world)]
    seals = [sr.seal(f"n{n}", states[n * per_node:(n + 1) * per_node])
             for n in range(world // per_node)]
    record = sr.build(job_id="j", step=step, generation=1,
                      layout=common_pb2.ParallelLayout(dp=world, pp=1, tp=1), seals=seals,
                      base_step=step if base is None else base)
    return record, states


def test_a_seal_covers_a_record_but_not_who_holds_its_shards() -> None:
    record, states = step_of(5, 4, 2)
    sr.verify(record)
    sr.check(record, states[:2])
    moved = manifest_pb2.RankState()
    moved.CopyFrom(states[0])
    moved.chunks[1].shards[0].node = "elsewhere"  # a repair moved a shard: still sealed
    sr.check(record, [moved, states[1]])
    for change in (lambda s: setattr(s.chunks[1].shards[0], "crc32c", 99),
                   lambda s: setattr(s.chunks[0], "stored_size", 9),
                   lambda s: setattr(s, "extra", b"{}")):
        forged = manifest_pb2.RankState()
        forged.CopyFrom(states[0])
        change(forged)
        with pytest.raises(mf.ManifestError, match="do not match their seal"):
            sr.check(record, [forged, states[1]])
    with pytest.raises(mf.ManifestError, match="do not match their seal"):
        sr.check(record, states[:1])  # half of a seal's records


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.lists(st.integers(0, 4), max_size=3),
                          st.binary(min_size=32, max_size=32)), min_size=1, max_size=12))
def test_a_record_from_the_seals_bytes_is_the_record_from_their_messages(nodes) -> None:
    # What the coordinator commits from the bytes its prepares came in is, field for
    # field and digest for digest, the record built from the parsed seals.
    seals, first = [], 0
    for i, (count, bases, digest) in enumerate(nodes):
        seals.append(manifest_pb2.RankSeal(node=f"n{i}", ranks=range(first, first + count),
                                           digest=digest, bases=sorted(bases)))
        first += count
    common = {"job_id": "j", "step": 5, "generation": 2, "base_step": 0,
              "layout": common_pb2.ParallelLayout(dp=first, pp=1, tp=1),
              "created_unix_ms": 1234}
    built = sr.build(seals=seals, **common)
    from_bytes = sr.build_from_bytes(
        seals=[s.SerializeToString(deterministic=True) for s in seals], **common)
    assert from_bytes == built
    assert from_bytes.SerializeToString(deterministic=True) == \
        built.SerializeToString(deterministic=True)
    sr.verify(from_bytes)


def test_a_record_must_cover_every_rank_once_and_keep_its_digest() -> None:
    record, _ = step_of(5, 4, 2)
    torn = manifest_pb2.StepRecord()
    torn.CopyFrom(record)
    torn.seals[0].ranks[1] = 3  # rank 1 missing, rank 3 twice
    torn.digest = sr.digest(torn)
    with pytest.raises(mf.ManifestError, match=r"missing \[1\]"):
        sr.verify(torn)
    altered = manifest_pb2.StepRecord()
    altered.CopyFrom(record)
    altered.generation = 9
    with pytest.raises(mf.ManifestError, match="fails its sha256 digest"):
        sr.verify(altered)
    huge = manifest_pb2.StepRecord()
    huge.CopyFrom(record)
    huge.layout.dp = 10**9  # a forged layout: refused without building a billion ranks
    huge.digest = sr.digest(huge)
    with pytest.raises(mf.ManifestError, match="not each of the layout's 1000000000"):
        sr.verify(huge)


def test_a_ranks_chain_names_only_the_steps_its_own_deltas_apply_to() -> None:
    records = {1: step_of(1, 2, 1)[0], 2: step_of(2, 2, 1, base=1)[0],
               3: step_of(3, 2, 1, base=2)[0]}
    assert sr.plan_chain(records, 3, rank=0) == [1, 2, 3]
    assert sr.retained_steps(records, 1) == {1, 2, 3}
    del records[1]
    with pytest.raises(mf.ManifestError, match="needs step 1"):
        sr.plan_chain(records, 3, rank=1)


def test_records_go_to_the_ring_successors_of_their_node() -> None:
    ring = ["n3", "n0", "n2", "n1"]
    assert sr.successors(ring, "n1") == ["n2", "n3", "n0"]
    assert sr.successors(ring, "n3") == ["n0", "n1", "n2"]
    assert sr.successors(["n0"], "n5") == ["n0"]  # a node not (or no longer) in the ring


def test_a_whole_manifest_splits_into_a_record_and_assembles_back() -> None:
    record, states = step_of(4, 6, 3)
    whole = sr.assemble(record, states)
    assert [r.rank for r in whole.ranks] == list(range(6))
    mf.verify_digest(whole)
    again = sr.split(whole)
    assert [(s.node, list(s.ranks), s.digest) for s in again.seals] == \
        [(s.node, list(s.ranks), s.digest) for s in record.seals]
    with pytest.raises(sr.MissingRecords, match=r"ranks \[3, 4, 5\]"):
        sr.assemble(record, states[:3])


class Links:
    """Phase two as the daemons would get it: what the coordinator sends, per node."""

    def __init__(self, nodes: list[str]) -> None:
        self.names = nodes
        self.sent: list[manifest_pb2.StepRecord] = []

    def nodes(self) -> list[str]:
        return self.names

    def holds_seat(self) -> bool:
        return True

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes
                          ) -> None:
        if isinstance(request, bytes):
            request = peer_pb2.CommitStepRequest.FromString(request)
        self.sent.append(request.record)


@pytest.mark.parametrize("record_chunks", [3, 300])
def test_the_commit_each_daemon_gets_grows_with_nodes_never_with_records(
        record_chunks: int) -> None:
    # 64 daemons of 8 ranks: each prepares once per step with the seal of its records;
    # the record every daemon then gets is a few dozen bytes per daemon, however large
    # the records are (they stay with their daemons).
    daemons, per_node = 64, 8
    links = Links([f"n{n}" for n in range(daemons)])
    committed: list[int] = []

    async def finished(step: int) -> None:
        pass

    commits = StepCommits("n0", "j", Metrics(), links,
                          latest_committed=lambda: committed[-1] if committed else None,
                          load_record=None, generation=lambda: 1,
                          committed=lambda g: committed.append(g), finished=finished)
    layout = common_pb2.ParallelLayout(dp=daemons * per_node, pp=1, tp=1)
    record_bytes = 0

    async def prepare_all() -> None:
        nonlocal record_bytes
        for n in range(daemons):
            states = [record_of(r, f"n{n}", chunks=record_chunks)
                      for r in range(n * per_node, (n + 1) * per_node)]
            record_bytes += sum(s.ByteSize() for s in states)
            await commits.prepared(peer_pb2.PrepareStepRequest(
                job_id="j", step=5, generation=1, node=f"n{n}", layout=layout,
                seal=sr.seal(f"n{n}", states)))

    asyncio.run(prepare_all())
    assert len(links.sent) == daemons and len({r.SerializeToString() for r in links.sent}) == 1
    sent = links.sent[0]
    sr.verify(sent)
    assert len(sent.seals) == daemons
    assert sent.ByteSize() < 80 * daemons  # a few dozen bytes per daemon
    assert sent.ByteSize() * 10 < record_bytes  # never the records themselves
