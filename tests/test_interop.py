"""`stalwart export` writes standard PyTorch checkpoints of committed steps; `stalwart
import` reads them back into a store; neither ever unpickles arbitrary objects."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.cli import main
from stalwart.client import interop
from stalwart.client.checkpoint_files import torch_native
from stalwart.client.digest import tensor_sha256
from stalwart.client.local_cluster import LocalCluster
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.state_layout import describe, pack_into, unpack
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.client.trainer_state import load_state, state_tensors
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.v1 import common_pb2, manifest_pb2
from stalwart_examples.gpt import job

STEPS = 3
# Other tests load the 2 cores: a late heartbeat here is not the failure under test.
PATIENT = {"heartbeat_timeout_s": 30.0}


class Payload:
    """An arbitrary Python object: unpickling it could run any code."""


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A (1,1,2) run of a few steps on a real daemon, still up for exports."""
    spec = {"model": "tiny",
            "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
                                "seq_len": 16},
            "train": {"global_batch": 8, "corpus_bytes": 65536, "seed": 0},
            "layout": {"dp": 1, "pp": 1, "tp": 2}, "steps": STEPS, "faults": [],
            "collective_timeout_s": 120.0}
    cluster = LocalCluster(nodes=1, workdir=tmp_path_factory.mktemp("interop"),
                           daemon_settings=PATIENT)
    try:
        cluster.start_daemons()
        cluster.launch(spec, world=2)
        for r in cluster.ranks:
            code = r.proc.wait(timeout=300)
            assert code == 0, f"rank {r.rank} exited {code}: {r.log_path.read_text()[-2000:]}"
        hashes = {k: v for r in cluster.ranks for k, v in r.result()["param_hashes"].items()}
        yield {"socket": cluster.daemons[0].socket, "hashes": hashes,
               "data_dir": cluster.daemons[0].data_dir}
    finally:
        cluster.close()


def export(trained: dict[str, Any], path: Path, fmt: str) -> None:
    assert main(["export", "--step", str(STEPS), "--format", fmt, str(path),
                 "--socket", str(trained["socket"])]) == 0


@pytest.mark.multiprocess
def test_exported_state_dict_reloads_with_weights_only_as_the_trained_parameters(
        trained: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    export(trained, path, "state_dict")
    state = torch.load(path, weights_only=True)
    params = {k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")}
    assert {n: tensor_sha256(t) for n, t in params.items()} == trained["hashes"]
    for name, p in params.items():  # AdamW moments at full size beside every parameter
        assert state[f"optim/{name}/exp_avg"].shape == p.shape
        assert state[f"optim/{name}/exp_avg_sq"].shape == p.shape


@pytest.mark.multiprocess
def test_dcp_export_holds_the_same_tensors_as_the_state_dict(
        trained: dict[str, Any], tmp_path: Path) -> None:
    export(trained, tmp_path / "ckpt.pt", "state_dict")
    export(trained, tmp_path / "dcp", "dcp")
    assert (tmp_path / "dcp" / ".metadata").exists()
    assert_same(interop.load(tmp_path / "dcp"),
                torch.load(tmp_path / "ckpt.pt", weights_only=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt", ["state_dict", "dcp"])
def test_import_then_export_gives_the_same_tensors(trained: dict[str, Any], tmp_path: Path,
                                                   fmt: str) -> None:
    original = tmp_path / "original"
    export(trained, original, fmt)
    store = tmp_path / "store"
    assert main(["import", str(original), "--data-dir", str(store),
                 "--step", str(STEPS)]) == 0
    again = tmp_path / "again.pt"
    assert main(["export", "--step", str(STEPS), str(again), "--data-dir", str(store)]) == 0
    assert_same(torch.load(again, weights_only=True), interop.load(original))


def test_a_checkpoint_with_python_objects_is_refused(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model/layers.0.tok.weight": torch.zeros(2), "hook": Payload()}, path)
    assert main(["import", str(path), "--data-dir", str(tmp_path / "store"),
                 "--step", "1"]) == 1
    err = capsys.readouterr().err
    assert "weights_only" in err and str(path) in err
    assert not (tmp_path / "store" / "snapshots").exists()


def test_dcp_metadata_with_python_objects_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps({"x": Payload()}))
    with pytest.raises(interop.InteropError, match="not allowed in DCP metadata"):
        interop.load(tmp_path / "dcp")


@pytest.mark.parametrize("name", ["Enum", "Any"])
def test_dcp_metadata_naming_what_the_metadata_module_only_imports_is_refused(
        tmp_path: Path, name: str) -> None:
    """A pickle may name any attribute of an allowed module: only the classes that
    module defines are let through, not those it imports (Enum's call makes classes)."""
    (tmp_path / "dcp").mkdir()
    # GLOBAL opcode, then STOP: the unpickler resolves the name and returns it.
    (tmp_path / "dcp" / ".metadata").write_bytes(
        f"ctorch.distributed.checkpoint.metadata\n{name}\n.".encode())
    with pytest.raises(interop.InteropError, match="not allowed in DCP metadata"):
        interop.load(tmp_path / "dcp")


@pytest.mark.multiprocess
def test_export_refuses_to_read_the_store_of_a_running_daemon(
        trained: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(interop.InteropError, match="--socket"):
        interop.read_from_store([trained["data_dir"]], "default", STEPS)


def test_an_imported_export_resumes_training_with_identical_losses(tmp_path: Path) -> None:
    cfg = TrainConfig(seed=3)
    gpt = job("tiny", d_model=32, n_layer=2, n_head=2, d_ff=64, seq_len=16, global_batch=4,
              corpus_bytes=1 << 16, seed=3)

    def trainer(generation: int) -> Trainer:
        return Trainer(ParallelDims().build(dist.HashStore(), 0, generation),
                       *gpt, cfg)

    a = trainer(0)
    for _ in range(3):
        a.step()
    tensors, extra = state_tensors(a)
    metas, nbytes = describe(tensors)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    pack_into(buffer, tensors, metas)
    state = manifest_pb2.RankState(rank=0, coord=common_pb2.RankCoord(rank=0), tensors=metas,
                                   extra=json.dumps(extra).encode())
    interop.save(interop.assemble_full([(state, buffer.numpy().tobytes())]),
                 tmp_path / "ckpt.pt", "state_dict")
    expected = [a.step() for _ in range(2)]

    assert main(["import", str(tmp_path / "ckpt.pt"), "--data-dir", str(tmp_path / "store"),
                 "--step", "3"]) == 0
    store = LocalStore(tmp_path / "store")
    record = store.load_manifest(3).ranks[0]
    b = trainer(1)
    load_state(b, unpack(store.read_rank(3, 0), list(record.tensors)),
               json.loads(record.extra))
    assert [b.step() for _ in range(2)] == expected


def test_offline_export_names_the_rank_whose_chunks_are_not_on_this_disk(tmp_path: Path) -> None:
    interop.commit_checkpoint({"model/layers.0.tok.weight": torch.arange(6.0).view(2, 3)},
                              tmp_path, step=5)
    LocalStore(tmp_path).chunk_path(5, 0, 0).unlink()
    with pytest.raises(interop.InteropError, match="Rank 0 .* --socket"):
        interop.read_from_store([tmp_path], "default", 5)


@pytest.mark.multiprocess
def test_a_dcp_export_of_a_users_loop_loads_into_a_plain_model_and_optimizer(
        tmp_path: Path) -> None:
    """The classifier trains in its own loop; its DCP export loads with nothing but
    torch.distributed.checkpoint into a fresh ConvNet, SGD (momentum) and StepLR."""
    import sys

    import torch.distributed.checkpoint as dcp
    from example_runs import REPO, run_example
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from stalwart import param_digest

    run = run_example(tmp_path, "examples/classifier/train.py", "--steps", "4",
                      nodes=1, world=1, settings=PATIENT)
    [trained] = run.finished()
    path = tmp_path / "dcp"
    assert main(["export", "--format", "dcp", str(path), "--data-dir",
                 str(run.workdir / "node-0")]) == 0

    sys.path.insert(0, str(REPO / "examples" / "classifier"))
    from convnet import ConvNet

    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {**model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict={k: state[k] for k in model_sd},
                   optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])

    # The model's own keys, not Stalwart's: digest as stalwart.run computed it ("model/").
    assert param_digest({f"model/{n}": tensor_sha256(p) for n, p in model.named_parameters()}
                        ) == trained["param_digest"]
    snapshot = interop.load(path)  # the same step under the snapshot's names
    for name, p in model.named_parameters():
        moment = optimizer.state[p]["momentum_buffer"]
        assert torch.equal(moment, snapshot[f"optimizer/model/{name}/momentum_buffer"])
        assert moment.abs().sum() > 0
    assert scheduler.last_epoch == 4 and optimizer.param_groups[0]["lr"] == 0.05


@pytest.mark.multiprocess
def test_a_dcp_export_of_the_3d_loop_loads_into_a_plain_module_of_its_blocks(
        trained: dict[str, Any], tmp_path: Path) -> None:
    """A model of the 3D loop, as a plain module holding its blocks as `layers` (the
    canonical names), with AdamW: plain DCP fills both from a (1,1,2) run's export."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    export(trained, tmp_path / "dcp", "dcp")
    cfg = {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}
    from stalwart_examples.gpt.model import GPTConfig
    from stalwart_examples.gpt.model import layers as gpt_layers

    blocks = gpt_layers(GPTConfig(**{**vars(GPTConfig()), **cfg}))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(blocks.build(i, 1) for i in range(len(blocks)))
    optimizer = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {**model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict={k: state[k] for k in model_sd},
                   optim_state_dict=state["optimizer"])
    assert {n: tensor_sha256(p) for n, p in model.named_parameters()} == trained["hashes"]
    assert all(optimizer.state[p]["exp_avg"].abs().sum() > 0 for p in model.parameters())
    assert optimizer.param_groups[0]["lr"] > 0


def test_a_dcp_export_refuses_tensors_inside_a_tuple(tmp_path: Path) -> None:
    # DCP keeps a tuple whole, pickled: its tensors could not come back through import.
    w, a, b = torch.ones(2), torch.zeros(1), torch.full((1,), 2.0)
    extra = {"format": 2, "step": 1, "objects": {
        "model": {"w": {"__stalwart_tensor__": "model/w"}},
        "custom": {"pair": {"__stalwart_tuple__": [{"__stalwart_tensor__": "custom/pair/0"},
                                                   {"__stalwart_tensor__": "custom/pair/1"}]}}}}
    tensors = {"model/w": w, "custom/pair/0": a, "custom/pair/1": b,
               interop.EXTRA_KEY: interop.json_tensor(extra)}
    with pytest.raises(interop.InteropError, match="'custom.pair' holds tensors in a tuple"):
        interop.save(tensors, tmp_path / "dcp", "dcp")
    interop.save(tensors, tmp_path / "ckpt.pt", "state_dict")  # the flat format keeps them
    assert torch.equal(torch.load(tmp_path / "ckpt.pt", weights_only=True)["custom/pair/1"], b)


def test_the_3d_loops_exported_optimizer_lists_only_what_adamw_trained() -> None:
    # A block's buffer and a frozen block's weight are model state, not AdamW's.
    extra = {"format": 1, "step": 2, "param_groups": [{"lr": 0.1}],
             "layout": {"shard_dims": {"layers.0.weight": None, "layers.1.weight": 0}}}
    tensors = {"model/layers.0.weight": torch.ones(2), "model/layers.1.weight": torch.ones(2),
               "model/layers.1.running_mean": torch.zeros(2),
               "optim/layers.1.weight/exp_avg": torch.ones(2),
               interop.EXTRA_KEY: interop.json_tensor(extra)}
    native = torch_native(tensors)
    assert native["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["layers.1.weight"]}]
    assert set(native["optimizer"]["state"]) == {"layers.1.weight"}
    assert torch.equal(native["layers.1.running_mean"], torch.zeros(2))
