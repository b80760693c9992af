"""Load-time resharding: build the tensors a rank needs in a new layout from the
TP shards and pipeline stages that an older layout captured.

Every captured tensor records its name, global shape and offsets, so a target
region is filled from whichever source shards overlap it, whatever the old
(dp, pp, tp) were. Data-parallel replicas hold identical copies; any one will do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """A captured tensor (or TP shard of one) at `offsets` inside `global_shape`."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Want:
    """The region of tensor `name` that a rank of the new layout holds."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def _overlap(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int],
             b_shape: Sequence[int]) -> list[tuple[int, int]] | None:
    """Per-dimension [start, end) of the intersection of two boxes, or None."""
    box = []
    for ao, al, bo, bl in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if lo >= hi:
            return None
        box.append((lo, hi))
    return box


def assemble(want: Want, pieces: Iterable[Piece]) -> torch.Tensor:
    """The wanted region, copied from overlapping pieces; every element must be covered."""
    out: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    for p in pieces:
        if p.name != want.name:
            continue
        if tuple(p.global_shape) != tuple(want.global_shape):
            raise ValueError(f"{want.name}: captured with global shape {p.global_shape}, "
                             f"the new layout expects {want.global_shape}; the model changed")
        box = _overlap(want.offsets, want.shape, p.offsets, p.tensor.shape)
        if box is None:
            continue
        if out is None:
            out = torch.empty(want.shape, dtype=p.tensor.dtype)
            covered = torch.zeros(want.shape, dtype=torch.bool)
        dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, want.offsets, strict=True))
        src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, p.offsets, strict=True))
        out[dst] = p.tensor[src]
        covered[dst] = True
    if out is None or covered is None or not bool(covered.all()):
        raise ValueError(f"{want.name}: the captured shards do not cover region "
                         f"offsets={want.offsets} shape={want.shape}; some ranks' state is "
                         "missing from this step")
    return out
