"""Manifests of committed steps: build, seal with a digest, validate, plan restore chains.

Pure logic over stalwart.v1 messages (no I/O), shared by the daemon that commits
steps and the client that restores them.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Container, Iterable, Mapping

from stalwart.v1 import common_pb2, manifest_pb2

FORMAT_VERSION = 1
TENSOR_ALIGN = 64  # bytes: where each tensor of a state buffer starts

# Bytes per element of each wire dtype; the byte-plane shuffle uses it too.
DTYPE_SIZE: dict[int, int] = {
    common_pb2.FLOAT32: 4,
    common_pb2.FLOAT16: 2,
    common_pb2.BFLOAT16: 2,
    common_pb2.FLOAT64: 8,
    common_pb2.INT64: 8,
    common_pb2.INT32: 4,
    common_pb2.INT16: 2,
    common_pb2.INT8: 1,
    common_pb2.UINT8: 1,
    common_pb2.BOOL: 1,
}

# Codecs whose chunk stands alone; every other codec applies to its base_step.
BASE_CODECS = frozenset({manifest_pb2.RAW, manifest_pb2.ZSTD})
# Codecs whose hinted tensors decode against an AdamW prediction (RankState.adamw).
PREDICTED_CODECS = frozenset({manifest_pb2.ADAM_PREDICTED_XOR_ZSTD,
                              manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2})


class ManifestError(ValueError):
    """A manifest is malformed, inconsistent or fails its digest."""



def whole_on_node(chunk: manifest_pb2.ChunkRecord) -> bool:
    """Whether the disk of the daemon that captured `chunk` keeps it whole: a chunk
    without shards always, one with shards when that daemon kept a local copy."""
    return chunk.whole_on_node or not chunk.shards

def element_size(dtype: int) -> int:
    """Bytes per element of a stalwart.v1 DType value."""
    try:
        return DTYPE_SIZE[dtype]
    except KeyError:
        raise ManifestError(f"unknown dtype {dtype}: this build knows {sorted(DTYPE_SIZE)}"
                            ) from None


def digest(manifest: manifest_pb2.Manifest) -> bytes:
    """sha256 of the deterministic serialisation with the digest field empty."""
    bare = manifest_pb2.Manifest()
    bare.CopyFrom(manifest)
    bare.ClearField("digest")
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).digest()


def seal(manifest: manifest_pb2.Manifest) -> manifest_pb2.Manifest:
    """Set the digest field in place and return the manifest."""
    manifest.digest = digest(manifest)
    return manifest


def verify_digest(manifest: manifest_pb2.Manifest) -> None:
    """Raise ManifestError when the stored digest does not match the content."""
    if manifest.digest != digest(manifest):
        raise ManifestError(
            f"manifest of step {manifest.step} fails its sha256 digest: it was altered or "
            "torn after commit; restore an older step or re-fetch it from another tier")


def build_manifest(*, job_id: str, step: int, generation: int,
                   layout: common_pb2.ParallelLayout,
                   ranks: Iterable[manifest_pb2.RankState],
                   base_step: int | None = None,
                   created_unix_ms: int | None = None) -> manifest_pb2.Manifest:
    """A sealed manifest of `step` from every rank's prepared state.

    `base_step` is the full base the step's chain starts from; by default the
    oldest base_step named by any chunk (the step itself when all are bases).
    """
    ranks = sorted(ranks, key=lambda r: r.rank)
    if base_step is None:
        base_step = min((c.base_step for r in ranks for c in r.chunks), default=step)
    manifest = manifest_pb2.Manifest(
        format_version=FORMAT_VERSION, job_id=job_id, step=step, generation=generation,
        layout=layout, ranks=ranks, base_step=base_step,
        created_unix_ms=int(time.time() * 1000) if created_unix_ms is None else created_unix_ms)
    return seal(manifest)


def validate(manifest: manifest_pb2.Manifest) -> None:
    """Raise ManifestError naming the first structural problem found."""
    step = manifest.step
    if manifest.format_version != FORMAT_VERSION:
        raise ManifestError(f"step {step}: format_version {manifest.format_version}, "
                            f"this build reads {FORMAT_VERSION}; upgrade stalwart")
    layout = manifest.layout
    world = layout.dp * layout.pp * layout.tp
    if world == 0:
        raise ManifestError(f"step {step}: layout {layout.dp}x{layout.pp}x{layout.tp} is empty")
    ids = [r.rank for r in manifest.ranks]
    # Count first: a forged layout may claim billions of ranks (no huge range built).
    if len(ids) != world or sorted(ids) != list(range(world)):
        missing = sorted(set(range(min(world, len(ids) + 1))) - set(ids))
        raise ManifestError(f"step {step}: ranks {sorted(ids)} do not cover the layout "
                            f"dp={layout.dp} pp={layout.pp} tp={layout.tp} (missing {missing}, "
                            "duplicates possible); a step commits only with every rank")
    coords = set()
    for r in manifest.ranks:
        c = r.coord
        if c.dp >= layout.dp or c.pp >= layout.pp or c.tp >= layout.tp:
            raise ManifestError(f"step {step} rank {r.rank}: coord ({c.dp},{c.pp},{c.tp}) "
                                "lies outside the layout")
        coords.add((c.dp, c.pp, c.tp))
        validate_rank(step, r)
    if len(coords) != world:
        raise ManifestError(f"step {step}: two ranks share a (dp, pp, tp) coordinate")


def validate_rank(step: int, r: manifest_pb2.RankState) -> None:
    where = f"step {step} rank {r.rank}"
    spans = []
    for t in r.tensors:
        want = math.prod(t.shape) * element_size(t.dtype)
        if t.nbytes != want:
            raise ManifestError(f"{where} tensor {t.name!r}: nbytes {t.nbytes} but shape "
                                f"{list(t.shape)} needs {want}")
        spans.append((t.offset, t.offset + t.nbytes, t.name))
    spans.sort()
    for (_, end, name), (start, _, nxt) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ManifestError(f"{where}: tensors {name!r} and {nxt!r} overlap")
    if spans and spans[-1][1] > r.total_bytes:
        raise ManifestError(f"{where}: tensor {spans[-1][2]!r} ends past total_bytes "
                            f"{r.total_bytes}")
    cursor = 0
    for c in sorted(r.chunks, key=lambda c: c.offset):
        if c.offset != cursor:
            raise ManifestError(f"{where}: chunk {c.chunk_id} starts at {c.offset}, "
                                f"expected {cursor} (gap or overlap)")
        if c.codec == manifest_pb2.CODEC_UNSPECIFIED:
            raise ManifestError(f"{where}: chunk {c.chunk_id} has no codec")
        if c.codec in BASE_CODECS and c.base_step != step:
            raise ManifestError(f"{where}: base chunk {c.chunk_id} names base_step "
                                f"{c.base_step}")
        if c.codec not in BASE_CODECS and c.base_step >= step:
            raise ManifestError(f"{where}: delta chunk {c.chunk_id} applies to step "
                                f"{c.base_step}, not an earlier one")
        cursor += c.size
    if cursor != r.total_bytes:
        raise ManifestError(f"{where}: chunks cover {cursor} of {r.total_bytes} bytes")


def referenced_steps(manifest: manifest_pb2.Manifest) -> set[int]:
    """Earlier steps whose data this step's delta chunks apply to."""
    return {c.base_step for r in manifest.ranks for c in r.chunks
            if c.codec not in BASE_CODECS}


def plan_chain(manifests: Mapping[int, manifest_pb2.Manifest], step: int) -> list[int]:
    """Steps to decode, oldest base first, to restore `step`.

    Raises ManifestError naming the missing link when a step in the chain has
    no manifest (it was garbage-collected or never committed).
    """
    return walk_chain(step, manifests, lambda s: referenced_steps(manifests[s]))


def walk_chain(step: int, committed: Container[int],
               applies_to: Callable[[int], Iterable[int]]) -> list[int]:
    """`step` and every earlier step its deltas apply to, transitively, oldest first;
    ManifestError names the first one not `committed`."""
    needed: set[int] = set()
    frontier = [step]
    while frontier:
        s = frontier.pop()
        if s in needed:
            continue
        if s not in committed:
            raise ManifestError(f"step {step} needs step {s} to restore, but it is not "
                                "committed here (retired or never committed); restore an "
                                "older committed step")
        needed.add(s)
        frontier.extend(applies_to(s))
    return sorted(needed)


def retained_steps(manifests: Mapping[int, manifest_pb2.Manifest],
                   keep: int) -> set[int]:
    """The newest `keep` committed steps plus every step their chains need."""
    kept: set[int] = set()
    for s in sorted(manifests)[-keep:] if keep > 0 else []:
        kept.update(plan_chain(manifests, s))
    return kept
