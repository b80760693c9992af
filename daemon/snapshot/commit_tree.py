"""The commit tree: a step's prepares go up and its commit comes down a tree of the
job's daemons, so the coordinator exchanges a few messages per step with `fanout`
daemons instead of one each way with every daemon.

A tree is a sorted list of node names under the coordinator (its root): the root's
children are the first `fanout`, and the daemon at index i has those at fanout*(i+1)
... fanout*(i+1)+fanout-1. Every daemon derives the same tree from what it already
holds: the commit tree from the step's record (the daemons whose seals it holds), the
prepare tree from the plan (the daemons with ranks, less the coordinator). No
membership view has to agree.

Down: a daemon that cannot reach a child passes the commit on to that child's children
itself, so a lost daemon costs its subtree one hop, not the commit; daemons the record
does not name get it from the coordinator directly. A daemon accepts a commit from a
daemon other than the coordinator only with the coordinator's Ed25519 signature over
the step's identity and digest, checked against the key in the plan that coordinator
installed: a daemon on the way passes on bytes it cannot forge.

Up: a prepare travels as the seal of its daemon's ranks plus a 16-byte tag, in a column
of its step's seals (`SealColumn`) that the daemons on the way extend, so the
coordinator checks a step's prepares as one list of bytes per column rather than one
message per daemon. The tag is keyed BLAKE2b under a key only its daemon and the
coordinator know (`RelayKeys`; the coordinator hands a daemon its key in the reply to a
direct prepare), with the column's identity (job, step, generation, layout, final) in
its salt and personalisation. The coordinator checks every tag before it takes the seal
(daemon/security/prepare_rule.py), so a daemon on the way can drop a prepare but never
forge, alter or move one to another step, and a dropped one costs only that step (its
daemon sends it directly once it finds it uncommitted).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from stalwart.daemon.peers import PeerLost
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

log = logging.getLogger("stalwart.daemon.snapshot.commit_tree")

CONTEXT = b"stalwart step commit v1\0"


def nodes_of(record: manifest_pb2.StepRecord) -> list[str]:
    """The tree's daemons: those whose seals the record holds, by name."""
    return sorted({s.node for s in record.seals})


def children(nodes: list[str], node: str | None, fanout: int) -> list[str]:
    """Where `node` (None: the root) passes a commit on to in the tree over `nodes`
    (sorted); none for a node outside it or with fanout 0."""
    if fanout <= 0:
        return []
    if node is None:
        first = 0
    else:
        i = bisect.bisect_left(nodes, node)
        if i == len(nodes) or nodes[i] != node:
            return []
        first = fanout * (i + 1)
    return nodes[first:first + fanout]


def parent(nodes: list[str], node: str, fanout: int) -> str | None:
    """The daemon above `node` in the tree over `nodes`; None: the root (the
    coordinator), also for a node outside the tree."""
    i = bisect.bisect_left(nodes, node)
    if fanout <= 0 or i == len(nodes) or nodes[i] != node or i < fanout:
        return None
    return nodes[i // fanout - 1]


def below(nodes: list[str], node: str, fanout: int) -> int:
    """How many daemons are under `node` in the tree over `nodes`: O(depth)."""
    i = bisect.bisect_left(nodes, node)
    if fanout <= 0 or i == len(nodes) or nodes[i] != node:
        return 0
    n, count = len(nodes), 0
    first, last = fanout * (i + 1), fanout * (i + 1) + fanout - 1  # indexes, one level
    while first < n:
        count += min(last, n - 1) - first + 1
        first, last = fanout * (first + 1), fanout * (last + 1) + fanout - 1
    return count


def prepare_nodes(plan: common_pb2.Plan) -> list[str]:
    """The prepare tree's daemons: the plan's nodes with ranks, less its coordinator."""
    return sorted({a.node for a in plan.assignments if not a.spare} - {plan.coordinator})


TAG_BYTES = 16  # a relayed seal's tag (128-bit keyed BLAKE2b)
UP_CONTEXT = b"stalwart seal column v1\0"


def column_identity(job_id: str, step: int, generation: int,
                    layout: common_pb2.ParallelLayout, final: bool) -> bytes:
    """What a column's tags bind each seal to (32 bytes): computed once per column."""
    return hashlib.blake2b(
        UP_CONTEXT + job_id.encode() + b"\0" + struct.pack(">QQ?", step, generation, final)
        + layout.SerializeToString(deterministic=True), digest_size=32).digest()


def tagger(identity: bytes) -> Callable[..., Any]:
    """The hash a seal's tag is, in the column of `identity`: call it with the seal's
    bytes and its daemon's key (`key=`), then take `.digest()`. Bound once per column,
    so the coordinator's check per seal is one call in C."""
    return partial(hashlib.blake2b, digest_size=TAG_BYTES, salt=identity[:16],
                   person=identity[16:])


def tag(key: bytes, identity: bytes, seal: bytes) -> bytes:
    """The tag of one seal's bytes in the column of `identity`, under its daemon's key."""
    return tagger(identity)(seal, key=key).digest()


def column(job_id: str, key: bytes, req: peer_pb2.PrepareStepRequest) -> peer_pb2.SealColumn:
    """A daemon's own prepare as a column of one, tagged with its relay key."""
    seal = req.seal.SerializeToString(deterministic=True)
    identity = column_identity(job_id, req.step, req.generation, req.layout, req.final)
    return peer_pb2.SealColumn(step=req.step, generation=req.generation, layout=req.layout,
                               final=req.final, seals=[seal], tags=tag(key, identity, seal))


def append(into: peer_pb2.SealColumn, column: peer_pb2.SealColumn) -> None:
    """`column`'s seals and their tags after those of `into` (a column of the same step,
    generation, layout and final flag), as a daemon on the way merges them."""
    into.seals.extend(column.seals)
    into.tags += column.tags


class RelayKeys:
    """The coordinator's side of the tags: every daemon's key, derived from one secret
    that never leaves this coordinator (a new coordinator hands out new keys)."""

    def __init__(self) -> None:
        self._secret = os.urandom(32)
        # Keys derived so far; only nodes of a plan get here (the prepare rule first).
        self._known: dict[str, bytes] = {}

    def key_for(self, node: str) -> bytes:
        key = self._known.get(node)
        if key is None:
            key = self._known[node] = hashlib.blake2b(
                node.encode(), key=self._secret, digest_size=32,
                person=b"stalwart key").digest()
        return key


def _signed(record: manifest_pb2.StepRecord) -> bytes:
    return (CONTEXT + record.job_id.encode() + b"\0"
            + struct.pack(">QQ", record.step, record.generation) + record.digest)


class CommitKey:
    """The coordinator's signing key; its public half goes out with every plan."""

    def __init__(self) -> None:
        self._private = Ed25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, record: manifest_pb2.StepRecord) -> bytes:
        return self._private.sign(_signed(record))


def signed_by(public: bytes, record: manifest_pb2.StepRecord, signature: bytes) -> bool:
    """Whether `signature` is the holder of `public`'s over `record` (its digest)."""
    if not public or not signature:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, _signed(record))
    except (InvalidSignature, ValueError):
        return False
    return True


Send = Callable[[str, bytes], Awaitable[object]]


async def pass_on(request: peer_pb2.CommitStepRequest, targets: list[str], send: Send,
                  nodes: list[str] | None = None) -> list[str]:
    """Send `request` to `targets`; for a target that fails, to its children in the
    tree instead (and so on down). Returns the daemons the commit did not reach."""
    nodes = nodes_of(request.record) if nodes is None else nodes
    data = request.SerializeToString()
    missed: list[str] = []

    async def one(node: str) -> None:
        try:
            await send(node, data)
            return
        except (grpc.aio.AioRpcError, LookupError, PeerLost) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("commit not delivered" + (
                "; its children in the commit tree get it from here" if request.fanout else ""),
                extra={"node": node, "step": request.record.step, "error": detail})
        missed.append(node)
        await asyncio.gather(*(one(c) for c in children(nodes, node, request.fanout)))

    await asyncio.gather(*(one(t) for t in targets))
    return missed
