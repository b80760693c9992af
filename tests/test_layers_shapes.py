"""Blocks of Stalwart's 3D loop may change the activation's shape (a convolutional
network's downsampling stages, a projection to another width) and dtype (a bf16 head):
each stage receives what its first block takes and sends what its last block gives,
under any stage bounds, and trains as one process does. The data's inputs and targets
may be structures of tensors (a dict of token ids and a mask; a tuple of two targets)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.client.layers import Activation, probe
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.client.trainer_state import load_state, state_tensors
from stalwart.core.layout import Layout

CFG = TrainConfig(seed=5, lr=3e-3, warmup_steps=1)
STEPS = 4


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(i))
        return x + (i % 4) / 4, i % 4


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


BLOCKS = [("stem", lambda: nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.ReLU())),
          ("down", lambda: nn.Sequential(nn.Conv2d(4, 8, 3, 2, 1), nn.ReLU())),
          ("pool", lambda: nn.Sequential(Pool(), nn.Linear(8, 12))),
          ("mlp", lambda: Mlp(12)),
          ("widen", lambda: nn.Sequential(nn.Linear(12, 16), nn.Tanh())),
          ("head", lambda: nn.Linear(16, 4))]


class ToBf16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).to(torch.bfloat16)


# A tail of bf16 parameters behind a block whose output is bf16.
BF16_TAIL = [("cast", ToBf16), ("bf16", lambda: Mlp(16).to(torch.bfloat16)),
             ("head", lambda: nn.Linear(16, 4).to(torch.bfloat16))]
# (pp, tp, stage bounds): bounds that cut at every change of shape
LAYOUTS = [(2, 1, [(0, 0), (1, 5)]), (3, 1, [(0, 1), (2, 3), (4, 5)]),
           (2, 2, [(0, 2), (3, 5)]), (3, 1, [(0, 3), (4, 4), (5, 5)])]


class Tokens(torch.utils.data.Dataset):
    """({"ids": 6 tokens, "mask": which count}, (class, value)) pairs."""

    def __len__(self) -> int:
        return 128

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], tuple[int, torch.Tensor]]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 20, (6,), generator=g)
        mask = torch.arange(6) < 2 + i % 5
        return {"ids": ids, "mask": mask}, (int(ids[0]) % 3, ids.float().mean().reshape(1))


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 12)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        m = x["mask"].unsqueeze(-1).float()
        return (self.embed(x["ids"]) * m).sum(1) / m.sum(1)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls, self.reg = nn.Linear(12, 3), nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cls(x), self.reg(x)


def _two_losses(out: tuple[torch.Tensor, torch.Tensor],
                targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out[0], targets[0]) + F.mse_loss(out[1], targets[1])


STRUCTURED = stalwart.Layers(blocks=[("embed", MaskedMean), ("mlp", lambda: Mlp(12)),
                                     ("heads", TwoHeads)], loss=_two_losses)


def _job(blocks=BLOCKS) -> tuple[stalwart.Layers, stalwart.Data]:
    layers = stalwart.Layers(blocks=blocks, loss=lambda y, t: F.cross_entropy(y.float(), t),
                             tp_plan={"fc1": "column", "fc2": "row"})
    return layers, stalwart.Data(Images(), global_batch=8, seed=2)


def _train(store, rank: int, generation: int, pp: int, tp: int, bounds,
           blocks=BLOCKS) -> list[float]:
    dims = ParallelDims(Layout(pp=pp, tp=tp)).build(store, rank, generation)
    job = (STRUCTURED, stalwart.Data(Tokens(), global_batch=8)) if blocks is None else \
        _job(blocks)
    trainer = Trainer(dims, *job, CFG, stage_bounds=bounds, microbatches=2)
    try:
        return [trainer.step() for _ in range(STEPS)]
    finally:
        trainer.close()
        dims.destroy()


def _every_layout(ctx) -> dict[str, list[float]]:
    out = {}
    for generation, (pp, tp, bounds) in enumerate(LAYOUTS):
        if ctx.rank < pp * tp:
            out[str(bounds)] = _train(ctx.store, ctx.rank, generation, pp, tp, bounds)
    if ctx.rank < 3:  # stage 1 receives fp32, stage 2 bf16 (each block of its own)
        out["bf16"] = _train(ctx.store, ctx.rank, len(LAYOUTS), 3, 1,
                             [(0, 4), (5, 6), (7, 7)], BLOCKS[:-1] + BF16_TAIL)
    if ctx.rank < 2:
        out["structured"] = _train(ctx.store, ctx.rank, len(LAYOUTS) + 1, 2, 1, [(0, 0), (1, 2)],
                                   None)
    return out


def test_the_probe_measures_each_blocks_output_shape_per_sample():
    layers, data = _job()
    inputs, targets = data.batch(data.indices(0)[:2])
    probes, activations = probe(layers, inputs, targets, repeats=1)
    assert [a.shape for a in activations] == [(4, 8, 8), (8, 4, 4), (12,), (12,), (16,)]
    layers, _ = _job(BLOCKS[:-1] + BF16_TAIL)
    activations = probe(layers, inputs, targets, repeats=1)[1]
    fp32, bf16 = Activation((16,), torch.float32), Activation((16,), torch.bfloat16)
    assert activations[-3:] == (fp32, bf16, bf16)
    assert [p.out_bytes for p in probes[:2]] == [2 * 4 * 8 * 8 * 4, 2 * 8 * 4 * 4 * 4]


def test_a_block_that_drops_the_micro_batch_dimension_is_named():
    layers = stalwart.Layers(blocks=[("flat", lambda: nn.Flatten(0)),
                                     ("head", lambda: nn.Linear(6, 1))],
                             loss=lambda y, t: y.mean())
    with pytest.raises(ValueError, match=r"block 'flat' returned shape \(6,\) for a micro-batch "
                                         r"of 2; a block's output must keep the micro-batch"):
        probe(layers, torch.randn(2, 3), torch.zeros(2), repeats=1)


@pytest.mark.multiprocess
def test_stages_cut_where_the_shape_changes_train_as_one_process(run_ranks):
    reference = _train(dist.HashStore(), 0, 0, 1, 1, None)
    results = run_ranks(_every_layout, 4, timeout=240)
    for pp, tp, bounds in LAYOUTS:
        for rank in range(pp * tp):
            assert results[rank][str(bounds)] == pytest.approx(reference, rel=1e-5), (
                f"pp={pp} tp={tp} stages {bounds}, rank {rank}")
    assert reference[-1] < reference[0]
    # bf16 parameters on a stage of their own: the same arithmetic as in one process.
    bf16 = _train(dist.HashStore(), 0, 0, 1, 1, None, BLOCKS[:-1] + BF16_TAIL)
    assert [results[rank]["bf16"] for rank in range(3)] == [bf16] * 3
    # A dict of inputs to the first stage, a tuple of outputs and targets at the last.
    structured = _train(dist.HashStore(), 0, 0, 1, 1, None, None)
    assert [results[rank]["structured"] for rank in range(2)] == [structured] * 2
    assert structured[-1] < structured[0]


def test_data_that_is_not_an_inputs_targets_pair_is_named():
    class Flat(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"ids": torch.zeros(3), "labels": torch.zeros(3), "mask": torch.ones(3)}

    layers = stalwart.Layers(blocks=[("head", lambda: nn.Linear(3, 1))], loss=F.mse_loss)
    dims = ParallelDims().build(dist.HashStore(), 0, 0)
    try:
        with pytest.raises(ValueError, match=r"reads each sample as an \(inputs, targets\) "
                                             r"pair.*gave a dict with keys \['ids', 'labels'"):
            Trainer(dims, layers, stalwart.Data(Flat(), global_batch=4), CFG)
    finally:
        dims.destroy()


def test_a_frozen_block_is_captured_and_restored_but_never_updated():
    # A pretrained first block frozen in its factory: no backward reaches it (the data
    # requires no grad), AdamW (with weight decay) leaves it as built, and the captured
    # state, which holds it, restores bitwise.
    def frozen() -> nn.Module:
        block = nn.Linear(12, 12)
        block.requires_grad_(False)
        return block

    blocks = [("frozen", frozen), ("mlp", lambda: Mlp(12)), ("head", lambda: nn.Linear(12, 4))]
    layers = stalwart.Layers(blocks=blocks, loss=F.cross_entropy)

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.randn(12, generator=torch.Generator().manual_seed(i)), i % 4

    dims = ParallelDims().build(dist.HashStore(), 0, 0)
    trainer = Trainer(dims, layers, stalwart.Data(Rows(), global_batch=8), CFG)
    try:
        built = {k: v.clone() for k, v in trainer.stage.state_dict().items()}
        losses = [trainer.step() for _ in range(2)]
        tensors, extra = state_tensors(trainer)
        saved = {t.name: t.tensor.clone() for t in tensors}
        assert "model/layers.0.weight" in saved
        assert not any(n.startswith("optim/layers.0.") for n in saved)
        later = [trainer.step() for _ in range(2)]
        now = trainer.stage.state_dict()
        assert torch.equal(now["layers.0.weight"], built["layers.0.weight"])
        assert not torch.equal(now["layers.2.weight"], built["layers.2.weight"])
        load_state(trainer, saved, extra)
        assert [trainer.step() for _ in range(2)] == later
        assert losses[-1] != later[-1]
    finally:
        trainer.close()
        dims.destroy()
