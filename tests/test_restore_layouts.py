"""Restore through real daemons is bitwise exact in every layout, and resharding the
restored state into other layouts keeps the full parameters.

Each layout trains a few steps in a LocalCluster (real daemons, real gloo ranks,
capture every step); the final step is then read back through the daemon's Restore.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.client.digest import tensor_sha256
from stalwart.client.interop import read_from_daemon
from stalwart.client.local_cluster import LocalCluster
from stalwart.client.reshard import Piece, Want, assemble
from stalwart.client.state_layout import unpack
from stalwart.client.trainer import uniform_bounds

STEPS = 3
# Other tests load the 2 cores: a late heartbeat here is not the failure under test.
PATIENT = {"heartbeat_timeout_s": 30.0}
LAYERS = 4  # n_layer 2 + embedding + head
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2)]


def spec(dp: int, pp: int, tp: int) -> dict[str, Any]:
    return {"model": "tiny",
            "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
                                "seq_len": 16},
            "train": {"global_batch": 8, "corpus_bytes": 65536, "seed": 0},
            "layout": {"dp": dp, "pp": pp, "tp": tp, "microbatches": pp},
            "steps": STEPS, "faults": [], "collective_timeout_s": 120.0}


class Run:
    """A finished training run: each rank's result and its restored state."""

    def __init__(self, results: list[dict[str, Any]], restored: list[tuple[Any, bytes]]):
        self.results = results  # by rank
        self.states = {s.rank: s for s, _ in restored}
        self.tensors = {s.rank: unpack(data, list(s.tensors)) for s, data in restored}

    def pieces(self, ranks: list[int] | None = None) -> list[Piece]:
        return [Piece(m.name, self.tensors[r][m.name], tuple(m.global_shape), tuple(m.offsets))
                for r, s in self.states.items() if ranks is None or r in ranks
                for m in s.tensors if m.name.startswith(("model/", "optim/"))]


def train_and_restore(layout: tuple[int, int, int], workdir: Path) -> Run:
    dp, pp, tp = layout
    world = dp * pp * tp
    cluster = LocalCluster(nodes=2 if world > 1 else 1, workdir=workdir,
                           daemon_settings=PATIENT)
    try:
        cluster.start_daemons()
        cluster.launch(spec(dp, pp, tp), world=world)
        for r in cluster.ranks:
            code = r.proc.wait(timeout=300)
            assert code == 0, f"rank {r.rank} exited {code}: {r.log_path.read_text()[-2000:]}"
        results = [r.result() for r in sorted(cluster.ranks, key=lambda r: r.rank)]
        # Through node-0's daemon: ranks of node-1 come back from erasure shards.
        restored = read_from_daemon(STEPS, f"unix:{cluster.daemons[0].socket}")
    finally:
        cluster.close()
    return Run(results, restored)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[int, int, int], Run]]:
    """One cluster per layout, started on first use and shared by the whole module."""

    class Lazy(dict):
        def __missing__(self, layout: tuple[int, int, int]) -> Run:
            self[layout] = train_and_restore(layout, tmp_path_factory.mktemp("layout"))
            return self[layout]

    yield Lazy()


def full(pieces: list[Piece], names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every named tensor at full size, assembled from the pieces."""
    shapes = {p.name: p.global_shape for p in pieces}
    return {n: assemble(Want(n, g, (0,) * len(g), g), pieces) for n, g in shapes.items()
            if names is None or n in names}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def param_name(state_name: str) -> str:
    return state_name.split("/")[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "x".join(map(str, lay)))
def test_restored_state_is_bitwise_what_each_rank_held(runs: dict, layout: tuple) -> None:
    run = runs[layout]
    dp, pp, tp = layout
    assert sorted(run.states) == list(range(dp * pp * tp))
    for rank, result in enumerate(run.results):
        coord = run.states[rank].coord
        assert (coord.dp, coord.pp, coord.tp) == (result["coord"]["dp"], result["coord"]["pp"],
                                                  result["coord"]["tp"])
        assert json.loads(run.states[rank].extra)["step"] == STEPS
        # This rank's stage at full size, from its own shard and its TP peers' shards.
        peers = [r for r, s in run.states.items()
                 if (s.coord.dp, s.coord.pp) == (coord.dp, coord.pp)]
        restored = {param_name(n): tensor_sha256(t)
                    for n, t in full(run.pieces(peers)).items() if n.startswith("model/")}
        assert restored == result["param_hashes"], f"rank {rank} differs after restore"


@pytest.mark.multiprocess
def test_data_parallel_replicas_restore_identical_tensors(runs: dict) -> None:
    run = runs[(2, 2, 1)]
    for rank, state in run.states.items():
        if state.coord.dp != 0:
            continue
        twin = next(r for r, s in run.states.items()
                    if (s.coord.dp, s.coord.pp, s.coord.tp) == (1, state.coord.pp, state.coord.tp))
        mine, theirs = run.tensors[rank], run.tensors[twin]
        names = [n for n in mine if n.startswith(("model/", "optim/"))]
        assert names and names == [n for n in theirs if n.startswith(("model/", "optim/"))]
        for n in names:
            assert torch.equal(bits(mine[n]), bits(theirs[n])), n


def reshard(pieces: list[Piece], shard_dims: dict[str, int | None], pp: int, tp: int
            ) -> dict[tuple[int, int], list[Piece]]:
    """The pieces each (stage, tp rank) of a (1, pp, tp) layout holds."""
    shapes = {p.name: p.global_shape for p in pieces}
    out: dict[tuple[int, int], list[Piece]] = {}
    for stage, (first, last) in enumerate(uniform_bounds(LAYERS, pp)):
        for t in range(tp):
            held = []
            for name, gshape in shapes.items():
                if not first <= int(param_name(name).split(".")[1]) <= last:
                    continue
                dim = shard_dims.get(param_name(name)) if len(gshape) else None
                shape, offsets = list(gshape), [0] * len(gshape)
                if dim is not None and tp > 1 and len(gshape) > dim:
                    shape[dim] //= tp
                    offsets[dim] = shape[dim] * t
                want = Want(name, gshape, tuple(offsets), tuple(shape))
                held.append(Piece(name, assemble(want, pieces), gshape, tuple(offsets)))
            out[(stage, t)] = held
    return out


@pytest.mark.multiprocess
def test_reshard_221_to_122_to_111_keeps_the_full_parameters(runs: dict) -> None:
    source = runs[(2, 2, 1)]
    shard_dims = json.loads(source.states[0].extra)["layout"]["shard_dims"]
    for s in source.states.values():
        shard_dims.update(json.loads(s.extra)["layout"]["shard_dims"])
    original = full(source.pieces())

    as_122 = reshard(source.pieces(), shard_dims, pp=2, tp=2)
    # Each resharded rank holds the names, shapes and offsets a real (1,2,2) rank captured.
    real_122 = runs[(1, 2, 2)]
    for rank, state in real_122.states.items():
        held = {p.name: (tuple(p.tensor.shape), p.offsets)
                for p in as_122[(state.coord.pp, state.coord.tp)]}
        captured = {m.name: (tuple(m.shape), tuple(m.offsets)) for m in state.tensors
                    if m.name.startswith(("model/", "optim/"))}
        assert held == captured, f"(1,2,2) rank {rank} layout differs"

    as_111 = full([p for group in as_122.values() for p in group])
    assert as_111.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(bits(as_111[name]), bits(t)), name
    hashes = {k: v for r in source.results for k, v in r["param_hashes"].items()}
    assert {param_name(n): tensor_sha256(t) for n, t in as_111.items()
            if n.startswith("model/")} == hashes
