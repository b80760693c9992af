"""Checks every RPC's request before a handler acts on it: sizes, counts, ranges, identifiers.

A request that fails a check is refused with INVALID_ARGUMENT and a message
naming the field, its value and the allowed range (who may call is daemon/security/auth.py's
business). Refusals are counted in stalwart_auth_refused_total{reason}.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NoReturn

import grpc

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.core.layout import Layout, unequal_shares_fit
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.shard_store import validate_id
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, rank_pb2

MAX_STEP = 10**12 - 1          # steps are stored as 12 zero-padded digits
MAX_GENERATION = 2**53         # exact in JSON and float; far beyond any real job
MAX_WORLD = 1 << 20            # ranks in a job
MAX_TEXT = 4096                # characters of free text (evidence, messages, hostnames)
MAX_NAME = 256                 # characters of a name or identifier
MAX_TENSORS = 1 << 20          # tensors in one capture
MAX_EXTRA_BYTES = 4 << 20      # JSON side data of a capture (RNG states, data position)
MAX_SLOT_BYTES = 1 << 40       # one shared-memory slot
MAX_LIST = 1 << 16             # entries of any other repeated field (peers, rank ids, labels)
MAX_WAIT_S = 3600.0            # longest a caller may ask the daemon to wait (seconds)
MAX_HURRY_WAIT_S = 60.0        # longest a hurry may hold its answer (the coordinator: 5 s)
MAX_RANKS_PER_NODE = 4096      # registrations one daemon keeps (a GPU node has a handful)
MAX_LIVE_RANKS_PER_NODE = 1024 # live ranks and spares of one node (gossip, prepares)
MAX_PEERS = 4096               # daemons one daemon gossips with
MAX_COLLECTIVES = 64           # distinct collective names counted by link (metric labels)
MAX_FANOUT = MAX_PEERS         # daemons one daemon passes a commit on to
MAX_PREPARE_BYTES = 64 << 10   # one seal in a relayed batch (a seal of 1024 ranks: ~4 KiB)
COLLECTIVE_NAME = re.compile(r"[a-z0-9_]{1,48}")


class InvalidRequest(ValueError):
    """A request field is out of range; str() names the field and what is allowed."""


def _fail(message: str) -> NoReturn:
    raise InvalidRequest(message)


def in_range(value: int | float, low: int | float, high: int | float, what: str) -> None:
    if not low <= value <= high:  # also false for NaN
        _fail(f"{what} must be in [{low}, {high}], got {value}")


def text(value: str, what: str, limit: int = MAX_TEXT) -> None:
    if len(value) > limit:
        _fail(f"{what} is {len(value)} characters, more than the {limit} allowed")


def count(items: Iterable[Any] | Any, what: str, limit: int = MAX_LIST) -> None:
    n = len(items)
    if n > limit:
        _fail(f"{what} has {n} entries, more than the {limit} allowed")


def identifier(value: str, what: str, *, optional: bool = False) -> None:
    """A safe identifier: no path separators beyond '/', no '..', no leading '.' or '-'."""
    if optional and not value:
        return
    try:
        validate_id(value, what)
    except ValueError as e:
        _fail(str(e))


def rank_id(value: str, what: str = "rank_id") -> None:
    """Rank ids are "<node>/<pid>" or "<node>/<pid>.<n>" (see Registry.register)."""
    text(value, what, MAX_NAME)


def process_part(text: str) -> bool:
    """Whether `text`, after a rank id's last slash, is "<pid>" or "<pid>.<n>"."""
    pid, dot, n = text.partition(".")
    return pid.isdigit() and (not dot or n.isdigit())


_LAYOUT_SIZES = ("dp", "pp", "tp", "microbatches", "grad_accum")


def _layout(layout: common_pb2.ParallelLayout, what: str = "layout") -> None:
    # Every prepare carries one: the common case is a few comparisons, and only a
    # layout out of bounds pays for naming its field.
    dp, pp, tp = layout.dp, layout.pp, layout.tp
    sizes = (dp, pp, tp, layout.microbatches, layout.grad_accum)
    if min(sizes) < 0 or max(sizes) > MAX_WORLD:
        for name, value in zip(_LAYOUT_SIZES, sizes, strict=True):
            in_range(value, 0, MAX_WORLD, f"{what}.{name}")
    if dp * pp * tp > MAX_WORLD:
        _fail(f"{what} {dp}x{pp}x{tp} has more than {MAX_WORLD} ranks")
    # Unequal shares: what core.layout.Layout checks, before any rank builds on it (0
    # in a degree or micro-batches field reads as 1 there).
    if (total := layout.microbatch_total) and not unequal_shares_fit(
            max(dp, 1), max(pp, 1), layout.microbatches or 1, layout.grad_accum, total):
        _fail(f"{what}.microbatch_total {total} does not fit dp={dp} pp={pp} "
              f"microbatches={layout.microbatches} grad_accum={layout.grad_accum}")
    if len(layout.stages) > MAX_LIST or len(layout.schedule) > MAX_NAME:
        count(layout.stages, f"{what}.stages")
        text(layout.schedule, f"{what}.schedule", MAX_NAME)


def _plan(plan: common_pb2.Plan) -> None:
    in_range(plan.generation, 0, MAX_GENERATION, "plan.generation")
    in_range(plan.resume_step, 0, MAX_STEP, "plan.resume_step")
    _layout(plan.layout, "plan.layout")
    count(plan.assignments, "plan.assignments", MAX_WORLD)
    for a in plan.assignments:
        rank_id(a.rank_id, "plan.assignments.rank_id")
        text(a.node, "plan.assignments.node", MAX_NAME)
    text(plan.reason, "plan.reason")
    text(plan.stop_message, "plan.stop_message")
    in_range(plan.commit_fanout, 0, MAX_FANOUT, "plan.commit_fanout")
    if len(plan.commit_key) not in (0, 32):
        _fail(f"plan.commit_key is 32 bytes (Ed25519), not {len(plan.commit_key)}")


def known_enum(message: Any, name: str) -> None:
    """Proto3 keeps enum numbers this build does not know; refuse them here."""
    value = getattr(message, name)
    known = message.DESCRIPTOR.fields_by_name[name].enum_type.values_by_number
    if value not in known:
        _fail(f"{name} {value} is unknown; this daemon knows "
              + ", ".join(f"{v.name}={n}" for n, v in sorted(known.items())))


def _failure(event: common_pb2.FailureEvent) -> None:
    known_enum(event, "kind")
    in_range(event.generation, 0, MAX_GENERATION, "generation")
    text(event.subject, "subject", MAX_NAME)
    text(event.evidence, "evidence")
    text(event.reporter, "reporter", MAX_NAME)


def manifest_ids(state: manifest_pb2.RankState, what: str) -> None:
    """Chunk ids and shard locations end up in file paths and S3 keys: keep them safe."""
    count(state.chunks, f"{what}.chunks", MAX_TENSORS)
    for chunk in state.chunks:
        identifier(chunk.chunk_id, f"{what} chunk_id")
        count(chunk.shards, f"{what} chunk {chunk.chunk_id} shards", 1024)
        for shard in chunk.shards:
            identifier(shard.location, f"{what} shard location", optional=True)
            text(shard.node, f"{what} shard node", MAX_NAME)


def _seal(seal: manifest_pb2.RankSeal, what: str) -> None:
    if len(seal.node) > MAX_NAME or len(seal.ranks) > MAX_WORLD or len(seal.bases) > MAX_TENSORS:
        text(seal.node, f"{what}.node", MAX_NAME)
        count(seal.ranks, f"{what}.ranks", MAX_WORLD)
        count(seal.bases, f"{what}.bases", MAX_TENSORS)
    if len(seal.digest) != 32:
        _fail(f"{what}.digest has {len(seal.digest)} bytes; a seal is one sha256 (32 bytes)")


def step_record(r: manifest_pb2.StepRecord) -> None:
    text(r.job_id, "record.job_id", MAX_NAME)
    in_range(r.step, 0, MAX_STEP, "record.step")
    in_range(r.generation, 0, MAX_GENERATION, "record.generation")
    _layout(r.layout, "record.layout")
    count(r.seals, "record.seals", MAX_WORLD)
    if not r.seals:
        _fail(f"the record of step {r.step} has no seals; a committed step holds every rank")
    for seal in r.seals:
        _seal(seal, "record seal")
    try:
        sr.verify(r)  # every rank of the layout once, digest intact
    except mf.ManifestError as e:
        _fail(f"inconsistent record: {e}")


def _records(r: manifest_pb2.RankRecords) -> None:
    text(r.job_id, "job_id", MAX_NAME)
    in_range(r.step, 1, MAX_STEP, "step")
    count(r.ranks, "ranks", MAX_LIVE_RANKS_PER_NODE)
    for state in r.ranks:
        in_range(state.rank, 0, MAX_WORLD - 1, "rank")
        text(state.node, "node", MAX_NAME)
        manifest_ids(state, f"rank {state.rank}")


def _get_records(r: peer_pb2.GetRecordsRequest) -> None:
    text(r.job_id, "job_id", MAX_NAME)
    in_range(r.step, 1, MAX_STEP, "step")
    count(r.ranks, "ranks", MAX_LIVE_RANKS_PER_NODE)
    if not r.ranks:
        _fail("GetRecords names no rank")


def request(message: Any) -> None:
    """Raise InvalidRequest unless every field of `message` is within its limits."""
    check = _CHECKS.get(type(message))
    if check is not None:
        check(message)


def _register(r: rank_pb2.RegisterRequest) -> None:
    text(r.job_id, "job_id", MAX_NAME)
    in_range(r.pid, 1, 2**31 - 1, "pid")
    in_range(r.rank, -1, MAX_WORLD, "rank")
    in_range(r.world_size, 0, MAX_WORLD, "world_size")
    in_range(r.local_rank, 0, MAX_WORLD, "local_rank")
    text(r.hostname, "hostname", MAX_NAME)
    text(r.device, "device", MAX_NAME)
    text(r.instance, "instance", MAX_NAME)
    _layout(r.layout)
    _layout_of_world(r.layout, r.world_size, r.rank)


def _layout_of_world(layout: common_pb2.ParallelLayout, world_size: int, rank: int) -> None:
    """A rank of the job (not a spare) names a layout of exactly its world's ranks: the
    first plan is made of it."""
    if rank < 0 or world_size == 0:
        return
    if rank >= world_size:
        _fail(f"rank {rank} is outside a world of {world_size} ranks")
    try:
        ranks = Layout.from_proto(layout, world_size=world_size).world_size
    except ValueError:  # a degree derived as 0: pp x tp alone exceed the world
        ranks = 0
    if ranks != world_size:
        _fail(f"the layout's degrees (dp={layout.dp or 'unset'} pp={layout.pp or 1} "
              f"tp={layout.tp or 1}) do not make a world of {world_size} ranks "
              "(WORLD_SIZE); make dp x pp x tp equal it")


def _heartbeat(r: rank_pb2.HeartbeatRequest) -> None:
    rank_id(r.rank_id)
    # Phase names become metric labels: bound their number and length.
    phases = getattr(r, "recovery_phase_s", {})
    count(phases, "recovery_phase_s", 16)
    for name, seconds in phases.items():
        text(name, "recovery phase name", 64)
        in_range(seconds, 0.0, 1e9, f"recovery_phase_s[{name!r}]")
    in_range(r.generation, 0, MAX_GENERATION, "generation")
    in_range(r.step, 0, MAX_STEP, "step")
    in_range(r.step_time_s, 0.0, 1e9, "step_time_s")
    in_range(r.finished_at, 0, MAX_STEP, "finished_at")
    text(r.raised, "raised")
    # Collective names become metric labels too.
    count(r.link_bytes, "link_bytes", MAX_COLLECTIVES)
    for sent in r.link_bytes:
        if sent.link not in ("intra", "inter"):
            _fail(f"link_bytes.link must be 'intra' or 'inter', got {sent.link[:64]!r}")
        if not COLLECTIVE_NAME.fullmatch(sent.collective):
            _fail(f"link_bytes.collective must be 1-48 of [a-z0-9_], got "
                  f"{sent.collective[:64]!r}")
        in_range(sent.bytes, 0.0, 1e18, f"link_bytes[{sent.collective}].bytes")


def _open_slot(r: rank_pb2.OpenSlotRequest) -> None:
    rank_id(r.rank_id)
    in_range(r.nbytes, 1, MAX_SLOT_BYTES, "nbytes")


def _capture(r: rank_pb2.CaptureRequest) -> None:
    rank_id(r.rank_id)
    in_range(r.generation, 0, MAX_GENERATION, "generation")
    in_range(r.step, 0, MAX_STEP, "step")
    text(r.slot_id, "slot_id", MAX_NAME)
    count(r.tensors, "tensors", MAX_TENSORS)
    count(r.adamw, "adamw", MAX_TENSORS)
    if len(r.extra) > MAX_EXTRA_BYTES:
        _fail(f"extra is {len(r.extra)} bytes, more than the {MAX_EXTRA_BYTES} allowed")
    for t in r.tensors:
        text(t.name, "tensor name", MAX_NAME)
        in_range(t.nbytes, 0, MAX_SLOT_BYTES, f"tensor {t.name!r} nbytes")
        in_range(t.offset, 0, MAX_SLOT_BYTES, f"tensor {t.name!r} offset")
        count(t.shape, f"tensor {t.name!r} shape", 64)
        if any(d < 0 for d in t.shape):
            _fail(f"tensor {t.name!r} has a negative dimension in shape {list(t.shape)}")
    in_range(r.coord.rank, 0, MAX_WORLD, "coord.rank")
    _layout(r.layout)
    in_range(r.stall_s, 0.0, 1e9, "stall_s")


def _commit_step(r: peer_pb2.CommitStepRequest) -> None:
    step_record(r.record)
    in_range(r.fanout, 0, MAX_FANOUT, "fanout")
    if len(r.signature) not in (0, 64):
        _fail(f"a commit signature is 64 bytes (Ed25519), not {len(r.signature)}")


def _wait_committed(r: rank_pb2.WaitCommittedRequest) -> None:
    in_range(r.step, 0, MAX_STEP, "step")
    in_range(r.timeout_s, 0.0, MAX_WAIT_S, "timeout_s")


def _restore(r: rank_pb2.RestoreRequest) -> None:
    rank_id(r.rank_id)
    in_range(r.step, 0, MAX_STEP, "step")
    in_range(r.rank, 0, MAX_WORLD, "rank")
    if r.HasField("layers") and r.layers.first > r.layers.last:
        raise InvalidRequest(f"layers {r.layers.first}-{r.layers.last}: the first layer is "
                             "after the last")


def _watch_plan(r: rank_pb2.WatchPlanRequest) -> None:
    rank_id(r.rank_id)
    in_range(r.known_generation, 0, MAX_GENERATION, "known_generation")


def _peer_info(r: peer_pb2.PeerInfo) -> None:
    text(r.node, "node", MAX_NAME)
    text(r.address, "address", MAX_NAME)
    host, sep, port = r.address.rpartition(":")
    if r.address and (not sep or not host or not port.isdigit() or int(port) > 65535):
        _fail(f"address must be HOST:PORT, got {r.address!r}")
    count(r.labels, "labels", 16)
    for k, v in r.labels.items():
        text(k, "label name", MAX_NAME)
        text(v, f"label {k}", MAX_NAME)
    in_range(r.generation, 0, MAX_GENERATION, "generation")
    in_range(r.latest_committed, 0, MAX_STEP, "latest_committed")
    count(r.rank_ids, "rank_ids", MAX_LIVE_RANKS_PER_NODE)
    if len(r.view) > 32:
        _fail(f"view is a digest of at most 32 bytes, not {len(r.view)}")
    for rid in r.rank_ids:
        rank_id(rid, "rank_ids")


def _announce(r: peer_pb2.RankAnnouncement) -> None:
    text(r.node, "node", MAX_NAME)
    rank_id(r.rank_id)
    # The coordinator keys ranks by id: an id must name its daemon, "<node>/<pid>".
    node, _, pid = r.rank_id.rpartition("/")
    if not r.node or node != r.node or not process_part(pid):
        _fail(f"rank_id {r.rank_id!r} must be '<node>/<pid>' (or '<node>/<pid>.<n>') of the "
              f"announcing node {r.node!r}")
    in_range(r.rank, -1, MAX_WORLD, "rank")
    in_range(r.world_size, 0, MAX_WORLD, "world_size")
    _layout(r.layout)
    _layout_of_world(r.layout, r.world_size, r.rank)
    in_range(r.generation, 0, MAX_GENERATION, "generation")
    in_range(r.finished_at, 0, MAX_STEP, "finished_at")


def _prepare(r: peer_pb2.PrepareStepRequest) -> None:
    # The coordinator checks one per daemon per step: fields read once each.
    text(r.job_id, "job_id", MAX_NAME)
    in_range(r.step, 0, MAX_STEP, "step")
    in_range(r.generation, 0, MAX_GENERATION, "generation")
    node, seal = r.node, r.seal
    text(node, "node", MAX_NAME)
    relayed_seal(seal)
    if seal.node != node:
        _fail(f"the seal is of node {seal.node!r}, but the prepare is from node "
              f"{node!r}; a daemon prepares only its own ranks")
    _layout(r.layout)


def relayed_seal(seal: manifest_pb2.RankSeal) -> None:
    """A prepare's seal, direct or from the commit tree: some ranks of one node."""
    _seal(seal, "seal")
    ranks = seal.ranks
    if not ranks:
        _fail(f"the seal of node {seal.node!r} covers no rank")
    if len(ranks) > MAX_LIVE_RANKS_PER_NODE:
        count(ranks, "seal.ranks", MAX_LIVE_RANKS_PER_NODE)
    if any(b <= a for a, b in zip(ranks, ranks[1:], strict=False)):
        _fail(f"the seal of node {seal.node!r} lists ranks {list(ranks)[:8]}: each rank "
              "once, in increasing order")


def _batch(r: peer_pb2.PrepareBatch) -> None:
    text(r.job_id, "job_id", MAX_NAME)
    count(r.columns, "columns", MAX_PEERS)
    seals = 0
    for c in r.columns:
        in_range(c.step, 0, MAX_STEP, "columns.step")
        in_range(c.generation, 0, MAX_GENERATION, "columns.generation")
        _layout(c.layout, "columns.layout")
        n = len(c.seals)
        if not n:
            _fail(f"a column of step {c.step} holds no seal")
        seals += n
        if len(c.tags) != commit_tree.TAG_BYTES * n:
            _fail(f"a column of {n} seals has {len(c.tags)} bytes of tags, not "
                  f"{commit_tree.TAG_BYTES} per seal")
        if (largest := max(map(len, c.seals))) > MAX_PREPARE_BYTES:
            _fail(f"a relayed seal is {largest} bytes; at most {MAX_PREPARE_BYTES}")
    if seals > MAX_PEERS:
        _fail(f"a batch of {seals} relayed seals; at most {MAX_PEERS}")


def _hurry(r: peer_pb2.HurryStepRequest) -> None:
    text(r.job_id, "job_id", MAX_NAME)
    in_range(r.step, 1, MAX_STEP, "step")
    in_range(r.generation, 0, MAX_GENERATION, "generation")
    in_range(r.wait_s, 0.0, MAX_HURRY_WAIT_S, "wait_s")


def _get_record(r: peer_pb2.GetStepRecordRequest) -> None:
    text(r.job_id, "job_id", MAX_NAME)
    in_range(r.step, 1, MAX_STEP, "step")


_CHECKS: dict[type, Any] = {
    rank_pb2.RegisterRequest: _register,
    rank_pb2.HeartbeatRequest: _heartbeat,
    rank_pb2.OpenSlotRequest: _open_slot,
    rank_pb2.CaptureRequest: _capture,
    rank_pb2.WaitCommittedRequest: _wait_committed,
    rank_pb2.RestoreRequest: _restore,
    rank_pb2.WatchPlanRequest: _watch_plan,
    common_pb2.FailureEvent: _failure,
    common_pb2.Plan: _plan,
    peer_pb2.PeerInfo: _peer_info,
    peer_pb2.RankAnnouncement: _announce,
    peer_pb2.PrepareStepRequest: _prepare,
    peer_pb2.CommitStepRequest: _commit_step,
    peer_pb2.GetStepRecordRequest: _get_record,
    peer_pb2.PrepareBatch: _batch,
    peer_pb2.HurryStepRequest: _hurry,
    manifest_pb2.RankRecords: _records,
    peer_pb2.GetRecordsRequest: _get_records,
}


async def admit(context: grpc.aio.ServicerContext, metrics: Any, message: Any) -> None:
    """Abort the call with INVALID_ARGUMENT unless `message` is within limits."""
    try:
        request(message)
    except InvalidRequest as e:
        metrics.auth_refused.labels("invalid").inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
