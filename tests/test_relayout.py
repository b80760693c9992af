"""A new role's state is assembled exactly from the old layout's rank states."""

from __future__ import annotations

import copy
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.client.layers import Stage
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.relayout import Role, fetch_and_assemble, needed_ranks, relayout
from stalwart.client.state_layout import StateTensor, describe, pack_into
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.client.trainer_state import load_state, state_tensors
from stalwart.core.layout import Layout
from stalwart.core.partition import uniform
from stalwart.daemon.snapshot.selection import Layers, packed, wanted
from stalwart.v1 import manifest_pb2
from stalwart_examples.gpt import job

JOB = job("tiny", d_model=32, n_layer=4, n_head=2, d_ff=64, seq_len=16, global_batch=4,
          corpus_bytes=1 << 16, seed=3)
CFG = TrainConfig(seed=3)
LAYERS = len(JOB[0])  # 6


def _trainer(generation: int) -> Trainer:
    dims = ParallelDims().build(dist.HashStore(), 0, generation)
    return Trainer(dims, *JOB, CFG)


@pytest.fixture(scope="module")
def trained() -> SimpleNamespace:
    """A (1,1,1) trainer after two steps: its full state and the loss of the next step."""
    t = _trainer(100)
    t.step()
    t.step()
    tensors, extra = state_tensors(t)
    full = [StateTensor(s.name, s.tensor.clone(), s.layer, s.global_shape, s.offsets)
            for s in tensors]
    params = {s.name[len("model/"):]: s.tensor for s in full if s.name.startswith("model/")}
    return SimpleNamespace(full=full, extra=extra, next_loss=t.step(), params=params)


def _rng(dp: int, base: torch.Tensor) -> torch.Tensor:
    """A distinct valid CPU RNG state per replica (replica 0 keeps the captured one)."""
    return base.clone() if dp == 0 else torch.Generator().manual_seed(dp).get_state()


def split(full: list[StateTensor], extra: dict, old: Layout) -> dict[int, tuple]:
    """Each old rank's (metas, tensors, extra), cut from a full state like a Trainer of
    that layout would capture it."""
    dims = extra["layout"]["shard_dims"]
    out = {}
    for d, p, t in itertools.product(range(old.dp), range(old.pp), range(old.tp)):
        a, b = old.stages[p]
        parts = []
        for s in full:
            if s.name.startswith("rng/"):
                parts.append(StateTensor(s.name, _rng(d, s.tensor)))
                continue
            if not a <= s.layer <= b:
                continue
            dim = dims.get(s.name.split("/")[1]) if s.tensor.dim() else None
            if dim is None or old.tp == 1:
                parts.append(StateTensor(s.name, s.tensor.clone(), s.layer,
                                         tuple(s.tensor.shape), (0,) * s.tensor.dim()))
                continue
            piece = s.tensor.chunk(old.tp, dim)[t].clone()
            offs = [0] * s.tensor.dim()
            offs[dim] = t * piece.shape[dim]
            parts.append(StateTensor(s.name, piece, s.layer, tuple(s.tensor.shape), tuple(offs)))
        metas, _ = describe(parts)
        rank_extra = copy.deepcopy(extra)
        rank_extra["layout"] = {
            "dp": old.dp, "pp": old.pp, "tp": old.tp, "coords": {"dp": d, "pp": p, "tp": t},
            "stage_bounds": [list(x) for x in old.stages],
            "shard_dims": {n: v for n, v in dims.items() if a <= int(n.split(".")[1]) <= b}}
        out[old.rank_of(d, p, t)] = (metas, {s.name: s.tensor for s in parts}, rank_extra)
    return out


def expected(full: list[StateTensor], extra: dict, role: Role) -> dict[str, torch.Tensor]:
    dims = extra["layout"]["shard_dims"]
    out = {}
    for s in full:
        if s.name.startswith("rng/") or not role.first <= s.layer <= role.last:
            continue
        dim = dims.get(s.name.split("/")[1]) if s.tensor.dim() else None
        t = s.tensor if dim is None or role.tp_size == 1 else \
            s.tensor.chunk(role.tp_size, dim)[role.tp]
        out[s.name] = t
    return out


def _old(dp: int, pp: int, tp: int) -> Layout:
    return Layout(dp, pp, tp, tuple(uniform(LAYERS, pp)))


def test_two_by_two_state_restores_into_a_single_rank_and_trains_on_identically(trained):
    old = _old(2, 2, 1)
    states = split(trained.full, trained.extra, old)
    role = Role(0, LAYERS - 1)
    fetch = needed_ranks(old, role)
    assert fetch == [0, 2]  # replica 0 of each stage: the fewest ranks
    tensors, extra = relayout(role, {r: states[r] for r in fetch}, old)
    b = _trainer(101)
    load_state(b, tensors, extra)
    for name, p in b.stage.named_parameters():
        assert torch.equal(p, trained.params[name]), name
    assert b.step() == trained.next_loss


@pytest.mark.parametrize("new_pp", [3, 2, 1])
def test_pipeline_shrink_reproduces_every_layer_exactly(trained, new_pp):
    old = _old(1, 4, 1)
    states = split(trained.full, trained.extra, old)
    for first, last in uniform(LAYERS, new_pp):
        role = Role(first, last)
        fetch = needed_ranks(old, role)
        got, _ = relayout(role, {r: states[r] for r in fetch}, old)
        want = expected(trained.full, trained.extra, role)
        assert {k for k in got if not k.startswith("rng/")} == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), name


def test_tp_shards_and_their_adam_moments_are_resliced_per_tp_index(trained):
    old = _old(2, 2, 2)
    states = split(trained.full, trained.extra, old)
    for (first, last), t in itertools.product(uniform(LAYERS, 3), range(2)):
        role = Role(first, last, tp=t, tp_size=2, dp=0)
        got, _ = relayout(role, {r: states[r] for r in needed_ranks(old, role)}, old)
        want = expected(trained.full, trained.extra, role)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        steps = [n for n in got if n.endswith("/step")]
        assert steps and all(got[n].dim() == 0 for n in steps)


def test_fresh_model_shards_match_the_model_built_for_the_new_bounds():
    """Initial weights relaid from (1,2,2) to (1,3,2) equal a Stage built for the new stage."""
    old = _old(1, 2, 2)
    states = {}
    for p, t in itertools.product(range(2), range(2)):
        a, b = old.stages[p]
        stage = Stage(JOB[0], a, b, seed=CFG.seed, tp=SimpleNamespace(size=2, index=t))
        parts = []
        for name, w in stage.named_parameters():
            dim = stage.shard_dim(name)
            g, offs = list(w.shape), [0] * w.dim()
            if dim is not None:
                offs[dim], g[dim] = t * w.shape[dim], w.shape[dim] * 2
            parts.append(StateTensor(f"model/{name}", w.detach(), int(name.split(".")[1]),
                                     tuple(g), tuple(offs)))
        parts.append(StateTensor("rng/cpu", torch.get_rng_state()))
        metas, _ = describe(parts)
        states[old.rank_of(0, p, t)] = (metas, {s.name: s.tensor for s in parts}, {"format": 1})
    for (a, b), t in itertools.product(uniform(LAYERS, 3), range(2)):
        role = Role(a, b, tp=t, tp_size=2)
        got, _ = relayout(role, {r: states[r] for r in needed_ranks(old, role)}, old)
        fresh = Stage(JOB[0], a, b, seed=CFG.seed, tp=SimpleNamespace(size=2, index=t))
        for name, w in fresh.named_parameters():
            assert torch.equal(got[f"model/{name}"], w.detach()), name


def test_rng_comes_from_the_old_replica_with_the_same_dp_index(trained):
    old = _old(2, 2, 1)
    states = split(trained.full, trained.extra, old)
    role = Role(0, 3, dp=1)
    fetch = needed_ranks(old, role)
    assert fetch == [1, 3]
    got, extra = relayout(role, {r: states[r] for r in fetch}, old)
    assert torch.equal(got["rng/cpu"], states[1][1]["rng/cpu"])
    assert extra["step"] == trained.extra["step"] and "layout" not in extra


def test_a_rank_already_holding_old_state_fetches_only_what_it_lacks():
    old = _old(2, 2, 1)
    assert needed_ranks(old, Role(0, LAYERS - 1, dp=0), local={1}) == [1, 2]


def test_missing_layers_are_named(trained):
    old = _old(1, 2, 1)
    states = split(trained.full, trained.extra, old)
    with pytest.raises(ValueError, match=r"layers \[3, 4, 5\]"):
        relayout(Role(0, LAYERS - 1), {0: states[0]}, old)


@settings(max_examples=25, deadline=None)
@given(dp=st.integers(1, 2), pp=st.integers(1, 3), tp=st.sampled_from([1, 2]),
       new_pp=st.integers(1, 4), new_tp=st.sampled_from([1, 2]), data=st.data())
def test_any_old_layout_relays_into_any_role_exactly(trained, dp, pp, tp, new_pp, new_tp, data):
    old = _old(dp, pp, tp)
    states = split(trained.full, trained.extra, old)
    first, last = data.draw(st.sampled_from(uniform(LAYERS, new_pp)))
    role = Role(first, last, tp=data.draw(st.integers(0, new_tp - 1)), tp_size=new_tp,
                dp=data.draw(st.integers(0, 2)))
    got, _ = relayout(role, {r: states[r] for r in needed_ranks(old, role)}, old)
    want = expected(trained.full, trained.extra, role)
    assert {k for k in got if not k.startswith("rng/")} == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


class FakeDaemon:
    """Serves old ranks' states as DaemonClient.restore does: (RankState, bytes)."""

    def __init__(self, states: dict[int, tuple]) -> None:
        self.states, self.calls, self.layers = states, [], []

    def restore(self, step: int, rank: int, layers: tuple[int, int] | None = None
                ) -> tuple[manifest_pb2.RankState, bytearray]:
        self.calls.append((step, rank))
        self.layers.append(layers)
        metas, tensors, extra = self.states[rank]
        if layers is not None:  # what the daemon's selection keeps (test_partial_restore)
            whole = manifest_pb2.RankState(tensors=metas)
            metas = list(packed(whole, wanted(whole, Layers(*layers))).tensors)
        parts = [StateTensor(m.name, tensors[m.name]) for m in metas]
        _, total = describe(parts)
        buf = torch.zeros(total, dtype=torch.uint8)
        pack_into(buf, parts, metas)
        record = manifest_pb2.RankState(rank=rank, tensors=metas, total_bytes=total,
                                        extra=json.dumps(extra).encode())
        return record, bytearray(buf.numpy())  # as DaemonClient.restore: the caller's own


def test_a_former_spare_learns_the_old_layout_from_rank_zero_and_fetches_the_rest(trained):
    old = _old(2, 2, 1)
    daemon = FakeDaemon(split(trained.full, trained.extra, old))
    role = Role(0, LAYERS - 1, dp=0)
    tensors, extra = fetch_and_assemble(daemon, 7, None, role)
    assert daemon.calls == [(7, 0), (7, 2)]
    assert daemon.layers == [(0, LAYERS - 1)] * 2  # only the role's layers are asked for
    b = _trainer(102)
    load_state(b, tensors, extra)
    assert b.step() == trained.next_loss
