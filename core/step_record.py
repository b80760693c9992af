"""Committed steps as small records: seals of each prepare, the records kept apart.

A step's `StepRecord` names, per prepare, the daemon that captured which ranks and the
sha256 of their records (`RankSeal`). It is what the coordinator sends every daemon:
a few bytes per prepare, whatever the records weigh. The records (`RankState`: tensors,
chunks, shards) stay with the daemon that captured them and are copied to its ring
successors; whoever needs a rank's record fetches it and checks it against its seal.

The seal leaves shard holder names out, so a repair that moves shards re-writes the
records without touching the committed step. Pure logic (no I/O), shared by the
daemons and the tools that read committed steps.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence

from stalwart.core import manifest as mf
from stalwart.core import wire
from stalwart.core.layout import Layout
from stalwart.v1 import common_pb2, manifest_pb2

FORMAT_VERSION = 2


class MissingRecords(LookupError):
    """Records a step's seals name are not held here (fetch them from their holders)."""

    def __init__(self, step: int, ranks: Sequence[int]) -> None:
        self.step, self.ranks = step, list(ranks)
        super().__init__(f"step {step}: the records of ranks {self.ranks[:8]} are not held "
                         "here; they live on the daemon that captured them and its ring "
                         "successors")


def seal_digest(states: Iterable[manifest_pb2.RankState]) -> bytes:
    """sha256 over the records in rank order, each without its shard holder names."""
    h = hashlib.sha256()
    for state in sorted(states, key=lambda s: s.rank):
        bare = manifest_pb2.RankState()
        bare.CopyFrom(state)
        for chunk in bare.chunks:
            for shard in chunk.shards:
                shard.ClearField("node")
        data = bare.SerializeToString(deterministic=True)
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.digest()


def seal(node: str, states: Sequence[manifest_pb2.RankState]) -> manifest_pb2.RankSeal:
    """The seal a daemon sends in its prepare for the records it made durable."""
    bases = sorted({c.base_step for s in states for c in s.chunks
                    if c.codec not in mf.BASE_CODECS})
    return manifest_pb2.RankSeal(node=node, ranks=sorted(s.rank for s in states),
                                 digest=seal_digest(states), bases=bases)


def digest(record: manifest_pb2.StepRecord) -> bytes:
    """sha256 over the record without its digest field (a record not yet sealed is
    hashed as it is, without a copy)."""
    bare = record
    if record.digest:
        bare = manifest_pb2.StepRecord()
        bare.CopyFrom(record)
        bare.ClearField("digest")
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).digest()


def build(*, job_id: str, step: int, generation: int, layout: common_pb2.ParallelLayout,
          seals: Iterable[manifest_pb2.RankSeal], base_step: int,
          created_unix_ms: int | None = None) -> manifest_pb2.StepRecord:
    """The sealed record of a step whose every rank prepared."""
    record = manifest_pb2.StepRecord(
        format_version=FORMAT_VERSION, job_id=job_id, step=step, generation=generation,
        layout=layout, seals=sorted(seals, key=lambda s: s.ranks[0] if s.ranks else -1),
        base_step=base_step,
        created_unix_ms=int(time.time() * 1000) if created_unix_ms is None
        else created_unix_ms)
    record.digest = digest(record)
    return record


SEALS_FIELD = wire.tag(manifest_pb2.StepRecord.DESCRIPTOR, "seals")


def holding(seals: Sequence[bytes]) -> manifest_pb2.StepRecord:
    """A record of nothing but `seals` (each a RankSeal's bytes), parsed in one call."""
    return manifest_pb2.StepRecord.FromString(b"".join(wire.delimited(SEALS_FIELD, seals)))


def build_from_bytes(*, job_id: str, step: int, generation: int, layout: common_pb2.ParallelLayout,
             seals: Sequence[bytes], base_step: int,
             created_unix_ms: int | None = None) -> manifest_pb2.StepRecord:
    """`build` from the seals' bytes, already in rank order: the coordinator holds its
    prepares' seals as the bytes their daemons sent, so the record is parsed from them
    in one call instead of copied from one message per seal. The digest is taken over
    the parsed record, so it is the one `verify` computes whatever the seals' bytes."""
    record = holding(seals)
    record.format_version, record.job_id = FORMAT_VERSION, job_id
    record.step, record.generation, record.base_step = step, generation, base_step
    record.layout.CopyFrom(layout)
    record.created_unix_ms = (int(time.time() * 1000) if created_unix_ms is None
                              else created_unix_ms)
    record.digest = digest(record)
    return record


def verify(record: manifest_pb2.StepRecord) -> None:
    """ManifestError unless the record is well formed and its digest matches."""
    step = record.step
    if record.format_version != FORMAT_VERSION:
        raise mf.ManifestError(f"step {step}: record format {record.format_version}, this "
                               f"build reads {FORMAT_VERSION}; upgrade stalwart")
    if record.digest != digest(record):
        raise mf.ManifestError(f"the record of step {step} fails its sha256 digest: it was "
                               "altered or torn after commit; restore an older step")
    world = Layout.from_proto(record.layout).world_size
    # One pass over the seals (every daemon checks every step's record: 2,048 seals at
    # 2,048 nodes): their ranks gathered, digest sizes and newest base noted; a failure
    # then looks again only to name its culprit.
    ranks: list[int] = []
    gather = ranks.extend
    sized, newest = True, -1
    for s in record.seals:
        gather(s.ranks)
        if len(s.digest) != 32:
            sized = False
        if bases := s.bases:
            newest = max(newest, max(bases))
    # Count first: a forged layout may claim billions of ranks (no huge range built).
    if len(ranks) != world or sorted(ranks) != list(range(world)):
        missing = sorted(set(range(min(world, len(ranks) + 1))) - set(ranks))
        raise mf.ManifestError(f"step {step}: its seals cover {len(ranks)} ranks, not each of "
                               f"the layout's {world} once (missing {missing[:16]}, duplicates "
                               "possible); a step commits only with every rank")
    if not sized:
        s = next(s for s in record.seals if len(s.digest) != 32)
        raise mf.ManifestError(f"step {step}: the seal of ranks {list(s.ranks)[:8]} has "
                               "no sha256")
    if newest >= step:
        s = next(s for s in record.seals if any(b >= step for b in s.bases))
        raise mf.ManifestError(f"step {step}: ranks {list(s.ranks)[:8]} apply to a step "
                               f"not before it ({list(s.bases)})")


def seal_of(record: manifest_pb2.StepRecord, rank: int) -> manifest_pb2.RankSeal:
    """The seal that covers `rank` (KeyError when none does)."""
    for s in record.seals:
        if rank in s.ranks:
            return s
    raise KeyError(f"step {record.step} has no rank {rank} (layout of "
                   f"{Layout.from_proto(record.layout).world_size} ranks)")


def check(record: manifest_pb2.StepRecord, states: Sequence[manifest_pb2.RankState]) -> None:
    """ManifestError unless `states` are exactly the records one seal of `record` names."""
    if not states:
        raise mf.ManifestError(f"step {record.step}: no records to check")
    ranks = sorted(s.rank for s in states)
    owner = seal_of(record, ranks[0])
    if list(owner.ranks) != ranks or seal_digest(states) != owner.digest:
        raise mf.ManifestError(f"step {record.step}: the records of ranks {ranks[:8]} do not "
                               f"match their seal (from {owner.node}); a holder's copy is "
                               "corrupt or from another commit: fetch it from another holder")
    for state in states:
        mf.validate_rank(record.step, state)


def referenced_steps(record: manifest_pb2.StepRecord) -> set[int]:
    return {b for s in record.seals for b in s.bases}


def plan_chain(records: Mapping[int, manifest_pb2.StepRecord], step: int,
               rank: int | None = None) -> list[int]:
    """Steps to decode, oldest base first, to restore `step` (of `rank` only, whose
    chain stays on one daemon, or of every rank). ManifestError names a missing link."""
    return mf.walk_chain(step, records, lambda s: seal_of(records[s], rank).bases
                         if rank is not None else referenced_steps(records[s]))


def retained_steps(records: Mapping[int, manifest_pb2.StepRecord], keep: int) -> set[int]:
    """The newest `keep` committed steps plus every step their chains need."""
    kept: set[int] = set()
    for s in sorted(records)[-keep:] if keep > 0 else []:
        kept.update(plan_chain(records, s))
    return kept


def nodes(record: manifest_pb2.StepRecord) -> list[str]:
    """The daemons that captured the step, sorted: the ring record holders follow."""
    return sorted({s.node for s in record.seals})


def successors(ring: Sequence[str], node: str) -> list[str]:
    """The other daemons of `ring` in ring order after `node` (where its records go)."""
    names = sorted(set(ring) | {node})
    at = names.index(node)
    return names[at + 1:] + names[:at]


def assemble(record: manifest_pb2.StepRecord, states: Iterable[manifest_pb2.RankState]
             ) -> manifest_pb2.Manifest:
    """The whole step as one Manifest (every rank's record), for the tools that walk it
    whole: an export, a test. Records are checked against their seals."""
    by_rank = {s.rank: s for s in states}
    missing = [r for s in record.seals for r in s.ranks if r not in by_rank]
    if missing:
        raise MissingRecords(record.step, missing)
    for s in record.seals:
        check(record, [by_rank[r] for r in s.ranks])
    manifest = manifest_pb2.Manifest(
        format_version=mf.FORMAT_VERSION, job_id=record.job_id, step=record.step,
        generation=record.generation, layout=record.layout,
        ranks=[by_rank[r] for r in sorted(by_rank)], base_step=record.base_step,
        created_unix_ms=record.created_unix_ms)
    return mf.seal(manifest)


def split(manifest: manifest_pb2.Manifest) -> manifest_pb2.StepRecord:
    """The record of a whole manifest, one seal per capturing node (importing a
    checkpoint, building a step in a test)."""
    by_node: dict[str, list[manifest_pb2.RankState]] = {}
    for r in manifest.ranks:
        by_node.setdefault(r.node, []).append(r)
    return build(job_id=manifest.job_id, step=manifest.step, generation=manifest.generation,
                 layout=manifest.layout, base_step=manifest.base_step,
                 seals=[seal(n, rs) for n, rs in by_node.items()],
                 created_unix_ms=manifest.created_unix_ms)
