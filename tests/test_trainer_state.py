"""A captured Trainer state restores bitwise, and training continues exactly."""

import json

import pytest
import torch
import torch.distributed as dist
from programs.normed_layers import Normed, Points

from stalwart.client.layers import Activation
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.trainer import TrainConfig, Trainer
from stalwart.client.trainer_state import adamw_hints, load_state, state_tensors
from stalwart_examples.gpt import job

JOB = job("tiny", d_model=32, n_layer=2, n_head=2, d_ff=64, seq_len=16, global_batch=4,
          corpus_bytes=1 << 16, seed=3)
CFG = TrainConfig(seed=3)


def _trainer(generation: int) -> Trainer:
    dims = ParallelDims().build(dist.HashStore(), 0, generation)
    return Trainer(dims, *JOB, CFG)


def test_restored_trainer_continues_with_identical_losses_and_params():
    a = _trainer(0)
    for _ in range(3):
        a.step()
    tensors, extra = state_tensors(a)
    snapshot = {t.name: t.tensor.clone() for t in tensors}
    expected = [a.step() for _ in range(2)]

    b = _trainer(1)
    load_state(b, snapshot, extra)
    assert b.step_count == 3
    assert [b.step() for _ in range(2)] == expected
    for (name, pa), (_, pb) in zip(a.stage.named_parameters(), b.stage.named_parameters(),
                                   strict=True):
        assert torch.equal(pa, pb), name


def test_state_names_are_layout_independent_and_cover_optimizer_and_rng():
    t = _trainer(0)
    t.step()
    tensors, extra = state_tensors(t)
    names = {s.name for s in tensors}
    assert "rng/cpu" in names
    assert any(n.startswith("optim/") and n.endswith("/exp_avg_sq") for n in names)
    assert all(s.layer >= 0 for s in tensors if s.name.startswith("model/"))
    assert extra["step"] == 1 and extra["data"] == JOB[1].state_dict()


def test_extra_record_survives_a_json_round_trip():
    """`extra` travels as JSON in the capture; restoring from the decoded copy is exact."""
    a = _trainer(0)
    a.step()
    tensors, extra = state_tensors(a)
    snapshot = {t.name: t.tensor.clone() for t in tensors}
    expected = a.step()
    b = _trainer(1)
    load_state(b, snapshot, json.loads(json.dumps(extra)))
    assert b.step() == expected


def test_adamw_hints_name_captured_tensors_with_the_step_lr():
    t = _trainer(0)
    t.step()
    t.step()
    tensors, _ = state_tensors(t)
    names = {s.name for s in tensors}
    hints = adamw_hints(t)
    assert len(hints) == len(list(t.stage.parameters()))
    for h in hints:
        assert {h.param, h.exp_avg, h.exp_avg_sq} <= names
        assert h.step == 2 and h.lr == CFG.lr_at(1)


def _normed_trainer(generation: int) -> Trainer:
    import stalwart

    layers = stalwart.Layers(blocks=[("a", Normed), ("b", Normed),
                                     ("head", lambda: torch.nn.Linear(16, 2))],
                             loss=torch.nn.functional.cross_entropy)
    data = stalwart.Data(Points(), global_batch=8, seed=1)
    # A probe's micro-batch of 1 is too few for BatchNorm: the activations are given.
    return Trainer(ParallelDims().build(dist.HashStore(), 0, generation), layers, data, CFG,
                   activations=[Activation((16,), torch.float32)] * 2)


def test_block_buffers_are_captured_at_the_capture_and_restored_with_the_parameters():
    a = _normed_trainer(0)
    for _ in range(3):
        a.step()
    tensors, extra = state_tensors(a)
    staged = {t.name for t in tensors if t.staged}
    assert staged == {f"model/layers.{i}.norm.{b}" for i in (0, 1)
                      for b in ("running_mean", "running_var", "num_batches_tracked")}
    assert all(t.layer in (0, 1) for t in tensors if t.name in staged)
    snapshot = {t.name: t.tensor.clone() for t in tensors}
    expected = [a.step() for _ in range(2)]

    b = _normed_trainer(1)
    load_state(b, snapshot, extra)
    assert [b.step() for _ in range(2)] == expected
    for (name, ta), (_, tb) in zip(a.stage.state_dict().items(), b.stage.state_dict().items(),
                                   strict=True):
        assert torch.equal(ta, tb), name  # buffers included: 5 forwards each
    assert int(b.stage.get_buffer("layers.0.norm.num_batches_tracked")) == 5


def test_a_step_no_longer_wanted_stops_at_its_next_forward_or_backward_without_updating():
    # A newer plan abandons the step (its thread cannot be stopped from outside): the
    # step stops computing at its next action instead of running on beside the rebuild.
    from stalwart.client.pipeline import StepInterrupted

    t = _trainer(0)
    t.step()
    before = {n: p.detach().clone() for n, p in t.stage.named_parameters()}
    looks: list[bool] = []

    def interrupted() -> bool:
        looks.append(len(looks) >= 1)  # wanted for its first forward only
        return looks[-1]

    t.interrupted = interrupted
    with pytest.raises(StepInterrupted):
        t.step()
    assert looks == [False, True] and t.step_count == 1
    for name, p in t.stage.named_parameters():
        assert torch.equal(p, before[name]), name
