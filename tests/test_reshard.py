"""Resharding assembles any new region from the old layout's TP shards."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.client.reshard import Piece, Want, assemble


def _shards(full: torch.Tensor, name: str, parts: int, dim: int) -> list[Piece]:
    out = []
    for i, chunk in enumerate(full.chunk(parts, dim)):
        offs = [0] * full.dim()
        offs[dim] = i * chunk.shape[dim]
        out.append(Piece(name, chunk.clone(), tuple(full.shape), tuple(offs)))
    return out


@settings(max_examples=200, deadline=None)
@given(old=st.sampled_from([1, 2, 4]), new=st.sampled_from([1, 2, 4]), dim=st.integers(0, 1),
       seed=st.integers(0, 10_000))
def test_any_tp_degree_reshards_into_any_other(old, new, dim, seed):
    full = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed))
    pieces = _shards(full, "w", old, dim)
    for i, expect in enumerate(full.chunk(new, dim)):
        offs = [0, 0]
        offs[dim] = i * expect.shape[dim]
        got = assemble(Want("w", (8, 12), tuple(offs), tuple(expect.shape)), pieces)
        assert torch.equal(got, expect)


def test_missing_shard_is_named():
    full = torch.randn(4, 4)
    pieces = _shards(full, "w", 2, 0)[:1]
    with pytest.raises(ValueError, match="do not cover"):
        assemble(Want("w", (4, 4), (0, 0), (4, 4)), pieces)


def test_changed_model_shape_is_refused():
    pieces = _shards(torch.randn(4, 4), "w", 1, 0)
    with pytest.raises(ValueError, match="model changed"):
        assemble(Want("w", (4, 8), (0, 0), (4, 8)), pieces)
