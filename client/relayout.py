"""State for a rank's new role after a plan change: which old ranks' captured states hold
its layers, and the named tensors plus `extra` record that `load_state` accepts,
assembled from those states whatever the old (dp, pp, tp) and stage bounds were.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.client.reshard import Piece, Want, assemble
from stalwart.client.state_layout import unpack
from stalwart.core.layout import Layout
from stalwart.v1 import common_pb2

__all__ = ["Role", "captured_layout", "fetch_and_assemble", "needed_ranks", "relayout"]


def captured_layout(extra: Mapping[str, Any]) -> Layout:
    """The layout a captured rank recorded in its `extra` (Trainer.layout())."""
    lay = extra.get("layout")
    if not lay or "stage_bounds" not in lay:
        raise ValueError("the captured state does not record its layout; pass the "
                         "layout of the plan that committed the step")
    return Layout(int(lay["dp"]), int(lay["pp"]), int(lay["tp"]),
                  tuple((int(a), int(b)) for a, b in lay["stage_bounds"]))


@dataclass(frozen=True)
class Role:
    """A rank of the new layout: its stage's layers and its TP and DP position."""

    first: int
    last: int
    tp: int = 0
    tp_size: int = 1
    dp: int = 0


def _tp_overlaps(old_t: int, old_size: int, new_t: int, new_size: int) -> bool:
    """Whether TP shard old_t of old_size overlaps shard new_t of new_size (as fractions)."""
    return old_t * new_size < (new_t + 1) * old_size and new_t * old_size < (old_t + 1) * new_size


def needed_ranks(old: Layout, role: Role, *, local: Iterable[int] = ()) -> list[int]:
    """Old ranks whose states together hold every layer shard of `role`, one replica per
    (stage, tp shard): a `local` one (already in this process) first, then the replica
    with the role's DP index (its RNG stream), then DP replica 0."""
    local = set(local)
    out = []
    for s, (a, b) in enumerate(old.stages):
        if b < role.first or a > role.last:
            continue
        for t in range(old.tp):
            if not _tp_overlaps(t, old.tp, role.tp, role.tp_size):
                continue
            replicas = [old.rank_of(d, s, t) for d in range(old.dp)]
            mine = old.rank_of(role.dp, s, t) if role.dp < old.dp else None
            out.append(min(replicas, key=lambda r, mine=mine: (
                r not in local, r != mine, r != old.rank_of(0, s, t), r)))
    return sorted(out)


def _param_of(name: str) -> str:
    """`model/layers.3.q.weight` and `optim/layers.3.q.weight/exp_avg` -> the parameter."""
    return name.split("/")[1]


def _shard_dim(meta: common_pb2.TensorMeta, shard_dims: Mapping[str, int | None]) -> int | None:
    for d, (n, g) in enumerate(zip(meta.shape, meta.global_shape, strict=True)):
        if n != g:
            return d
    return shard_dims.get(_param_of(meta.name)) if meta.global_shape else None


def relayout(role: Role, states: Mapping[int, tuple[Sequence[common_pb2.TensorMeta],
                                                     Mapping[str, torch.Tensor], dict[str, Any]]],
             old: Layout) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and `extra` of `role` from old ranks' states (rank -> metas, tensors by
    name, extra), as `client.trainer_state.load_state` takes them for the new layout.

    Optimizer moments of TP-sharded parameters are sliced like the parameters; the
    per-parameter `step` scalars and replicated tensors are copied whole.
    """
    if not states:
        raise ValueError("no old rank states given; fetch needed_ranks(...) first")
    metas: dict[str, common_pb2.TensorMeta] = {}
    pieces: dict[str, list[Piece]] = {}
    shard_dims: dict[str, int | None] = {}
    for _, _, extra in states.values():
        shard_dims.update(extra.get("layout", {}).get("shard_dims", {}))
    for _, (rank_metas, tensors, _) in sorted(states.items()):
        for m in rank_metas:
            if not m.name.startswith(("model/", "optim/")):
                continue
            if not role.first <= m.layer <= role.last:
                continue
            metas.setdefault(m.name, m)
            pieces.setdefault(m.name, []).append(Piece(
                m.name, tensors[m.name], tuple(m.global_shape), tuple(m.offsets)))
    # What the given ranks' stages held (a block without parameters or buffers, an
    # activation, has no tensors to show it).
    held: set[int] = set()
    for r in states:
        first, last = old.stages[old.coords(r).pp]
        held.update(range(first, last + 1))
    missing = sorted(set(range(role.first, role.last + 1)) - held)
    if missing:
        raise ValueError(f"the given old ranks {sorted(states)} hold no state of layers "
                         f"{missing}; fetch needed_ranks(...) for the role")
    out: dict[str, torch.Tensor] = {}
    for name, m in metas.items():
        gshape = tuple(m.global_shape)
        offs, shape = [0] * len(gshape), list(gshape)
        dim = _shard_dim(m, shard_dims)
        if dim is not None and role.tp_size > 1:
            if gshape[dim] % role.tp_size:
                raise ValueError(f"{name}: dimension {dim} of {gshape} does not split into "
                                 f"tp={role.tp_size} shards")
            shape[dim] = gshape[dim] // role.tp_size
            offs[dim] = shape[dim] * role.tp
        out[name] = assemble(Want(name, gshape, tuple(offs), tuple(shape)), pieces[name])
    source = _rng_source(role, states, old)
    src_metas, src_tensors, src_extra = states[source]
    for m in src_metas:
        if m.name.startswith("rng/"):
            out[m.name] = src_tensors[m.name].clone()
    extra = copy.deepcopy(src_extra)
    extra.pop("layout", None)  # it described the old rank; the new Trainer reports its own
    return out, extra


def _rng_source(role: Role, states: Mapping[int, Any], old: Layout) -> int:
    """An old rank with the role's DP index (its RNG stream) when one was fetched."""
    same = [r for r in sorted(states) if old.coords(r).dp == role.dp]
    return same[0] if same else min(states)


def fetch_and_assemble(daemon: Any, step: int, old: Layout | None, role: Role, *,
                       local: Mapping[int, tuple[Sequence[common_pb2.TensorMeta],
                                                 Mapping[str, torch.Tensor], dict[str, Any]]]
                       | None = None, fetched: dict[int, int] | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Restore the old ranks `role` needs for committed `step` through `daemon`
    (a DaemonClient) unless held in `local`, then assemble the role's state.

    Only the role's layers of each old rank are fetched (and what belongs to no layer):
    the daemon reads only the chunks that hold them. Without `old` (a rank that was a
    spare does not know it), old rank 0 is fetched first and its recorded layout is used.
    `fetched`, when given, gets the bytes received per old rank fetched here.
    """
    states = dict(local or {})

    def fetch(rank: int) -> None:
        record, data = daemon.restore(step, rank, layers=(role.first, role.last))
        if fetched is not None:
            fetched[rank] = len(data)
        metas = list(record.tensors)
        states[rank] = (metas, unpack(data, metas), json.loads(record.extra.decode()))

    if old is None:
        if 0 not in states:
            fetch(0)
        old = captured_layout(states[0][2])
    need = needed_ranks(old, role, local=states)
    for rank in need:
        if rank not in states:
            fetch(rank)
    return relayout(role, {r: states[r] for r in need}, old)
