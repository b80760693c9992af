"""The pieces of the training loop that can be checked in one process: corpus and loader,
layout-independent initialisation, recomputation, schedules, and exact resume."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from stalwart.client.digest import param_digest
from stalwart.client.dp import GradReducer
from stalwart.client.layers import Stage
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.pipeline import schedule
from stalwart.client.trainer import TrainConfig, Trainer, uniform_bounds
from stalwart.client.user_data import Data
from stalwart.core.layout import Layout
from stalwart_examples.gpt import GPTConfig, job, layers
from stalwart_examples.gpt.data import TextWindows, load_corpus

SMALL = GPTConfig(d_model=32, n_layer=2, n_head=4, d_ff=64, seq_len=32)
LAYERS = layers(SMALL)


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus(1 << 18)


def test_corpus_is_deterministic_python_source(corpus):
    assert len(corpus) == 1 << 18
    assert load_corpus(1 << 18) == corpus
    assert b"def " in corpus and b"import " in corpus


def test_text_windows_are_inputs_and_targets_shifted_by_one(corpus):
    windows = TextWindows(corpus, 32)
    x, y = windows[3]
    assert len(windows) == (len(corpus) - 1) // 33
    assert torch.equal(x[1:], y[:-1]) and x.shape == (32,)


def test_each_epoch_visits_every_sample_once_in_a_new_order():
    data = Data(list(range(10)), global_batch=5, seed=0)
    epoch0 = data.indices(0) + data.indices(1)
    epoch1 = data.indices(2) + data.indices(3)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert Data(list(range(10)), global_batch=5, seed=0).indices(2) == data.indices(2)


@pytest.mark.parametrize("layout", [
    Layout(dp=1), Layout(dp=2), Layout(dp=1, grad_accum=4), Layout(dp=2, grad_accum=2),
    Layout(dp=4), Layout(dp=3, grad_accum=3, microbatch_total=8),
    Layout(dp=2, grad_accum=2, microbatch_total=3)], ids=str)
def test_any_layout_reads_exactly_the_steps_global_batch(layout):
    data = Data(list(range(37)), global_batch=24, seed=4)
    for step in range(6):
        shares = [data.shares(step, layout, r) for r in range(layout.dp)]
        assert [i for share in shares for mb in share for i in mb] == data.indices(step)
        # Every micro-batch is the same size; shares differ by at most one of them.
        assert len({len(mb) for share in shares for mb in share}) == 1
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert max(map(len, shares)) == layout.grad_accum * layout.microbatches


def test_a_global_batch_that_does_not_split_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="does not split into dp=3"):
        Data(list(range(10)), global_batch=8).shares(0, Layout(dp=3), 0)


def test_stages_hold_the_same_weights_as_the_whole_model():
    whole = dict(Stage(LAYERS, 0, 3, seed=5).named_parameters())
    for first, last in uniform_bounds(4, 3):
        for name, p in Stage(LAYERS, first, last, seed=5).named_parameters():
            assert torch.equal(p, whole[name]), name


def test_tensor_parallel_shards_are_slices_of_the_full_weights():
    whole = Stage(LAYERS, 1, 1, seed=5)
    shards = [Stage(LAYERS, 1, 1, seed=5, tp=SimpleNamespace(size=2, index=r))
              for r in range(2)]
    assert shards[0].shard_dim("layers.1.q.weight") == 0
    assert shards[0].shard_dim("layers.1.out.weight") == 1
    assert shards[0].shard_dim("layers.1.ln1.weight") is None
    for name, p in whole.named_parameters():
        dim = shards[0].shard_dim(name)
        parts = [dict(s.named_parameters())[name] for s in shards]
        joined = parts[0] if dim is None else torch.cat(parts, dim)
        assert torch.equal(joined, p), name


def test_a_tensor_parallel_degree_that_does_not_divide_is_named():
    with pytest.raises(ValueError, match=r"block0\.q\.weight: 32 output features .* tp=3"):
        Stage(LAYERS, 1, 1, tp=SimpleNamespace(size=3, index=0))


def _saved_bytes_and_grads(policy: str, x: torch.Tensor, y: torch.Tensor):
    model = Stage(LAYERS, 0, 3, seed=1, recompute=policy)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = LAYERS.loss(model(x), y)
    loss.backward()
    return sum(saved), [q.grad for q in model.parameters()]


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recomputation_keeps_less_and_gives_the_same_gradients(policy, corpus):
    x, y = (torch.stack(t) for t in zip(*(TextWindows(corpus, 32)[i] for i in range(4)),
                                         strict=True))
    kept, expected = _saved_bytes_and_grads("none", x, y)
    fewer, got = _saved_bytes_and_grads(policy, x, y)
    assert fewer < kept  # the recomputed activations were not kept for backward
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_recompute_policy_names_are_checked():
    with pytest.raises(ValueError, match="recompute='sometimes'"):
        Stage(LAYERS, 0, 3, recompute="sometimes")


def _in_flight(actions: list[tuple[str, int]]) -> int:
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages,m", [(2, 2), (4, 4), (4, 8), (3, 7), (4, 2)])
def test_schedules_run_each_microbatch_forward_before_backward(stages, m):
    for kind in ("gpipe", "1f1b"):
        for s in range(stages):
            actions = schedule(kind, stages, s, m)
            assert sorted(actions) == sorted([("F", i) for i in range(m)] +
                                             [("B", i) for i in range(m)])
            assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))
            limit = m if kind == "gpipe" else min(m, stages - s)
            assert _in_flight(actions) == limit


def _trainer(cfg: TrainConfig, corpus: bytes, seed: int = 0) -> tuple[ParallelDims, Trainer]:
    dims = ParallelDims().build(dist.HashStore(), 0, 0)
    data = Data(TextWindows(corpus, SMALL.seq_len), global_batch=4, seed=seed)
    return dims, Trainer(dims, LAYERS, data, cfg)


def test_a_restored_trainer_continues_with_identical_losses_and_weights(corpus):
    cfg = TrainConfig(seed=2)
    dims, a = _trainer(cfg, corpus, seed=2)
    for _ in range(3):
        a.step()
    state = copy.deepcopy(a.state_dict())
    expected = [a.step() for _ in range(2)]
    dims2, b = _trainer(cfg, corpus, seed=2)
    b.load_state_dict(state)
    assert [b.step() for _ in range(2)] == expected
    assert param_digest(b.param_hashes()) == param_digest(a.param_hashes())
    assert b.state_dict()["data"] == a.state_dict()["data"]
    for t, d in ((a, dims), (b, dims2)):
        t.close()
        d.destroy()


def test_stage_bounds_must_cover_every_layer_once(corpus):
    dims = ParallelDims().build(dist.HashStore(), 0, 0)
    for bad in ([(0, 2)], [(1, 3)], [(0, 4)], [(2, 3)]):
        with pytest.raises(ValueError, match="must cover blocks 0..3"):
            Trainer(dims, *job(SMALL, global_batch=4, corpus_bytes=1 << 16), TrainConfig(),
                    stage_bounds=bad)
    dims.destroy()


def test_bf16_autocast_tracks_fp32_losses(corpus):
    losses = {}
    for precision in ("fp32", "bf16"):
        dims, t = _trainer(TrainConfig(precision=precision), corpus)
        losses[precision] = [t.step() for _ in range(3)]
        t.close()
        dims.destroy()
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_fp16_loss_scaling_skips_an_overflowing_step_and_backs_off(corpus):
    dims, t = _trainer(TrainConfig(precision="fp16"), corpus)
    t.step()
    assert t.scaler.state_dict() == {"enabled": True, "scale": 2.0**16, "good_steps": 1}
    t.scaler.scale = 2.0**120  # fp16 activation gradients overflow at this scale
    before = [p.detach().clone() for p in t.params]
    t.step()
    assert all(torch.equal(a, p) for a, p in zip(before, t.params, strict=True))
    assert t.scaler.scale == 2.0**119 and t.scaler.good_steps == 0
    t.close()
    dims.destroy()


@pytest.mark.parametrize("compress", ["none", "fp16"])
def test_grad_reducer_sums_buckets_in_order_during_backward(compress):
    model = Stage(LAYERS, 0, 3, seed=1)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model(ids).square().mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    sizes = []

    def twice(tensor: torch.Tensor, group) -> None:  # two ranks with identical gradients
        sizes.append(tensor.numel())
        tensor.mul_(2)

    reducer = GradReducer(list(model.parameters()), SimpleNamespace(size=2, pg=None),
                          bucket_bytes=4096, compress=compress, reduce_fn=twice)
    reducer.arm()
    model(ids).square().mean().backward()
    reducer.finish()
    reducer.close()
    assert sizes == [sum(p.numel() for p in b.params) for b in reducer.buckets]
    assert reducer.overlapped == len(reducer.buckets) - 1
    tol = 0 if compress == "none" else 1e-3
    for g, p in zip(local, model.parameters(), strict=True):
        assert torch.allclose(p.grad, 2 * g, rtol=tol, atol=tol * 1e-3)


def test_learning_rate_warms_up_then_decays_to_its_floor():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, decay_steps=20)
    lrs = [cfg.lr_at(s) for s in range(30)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4)


def test_param_digest_ignores_the_order_hashes_arrive_in():
    hashes = {"layers.10.w": "a", "layers.2.w": "b", "layers.2.b": "c"}
    assert param_digest(hashes) == param_digest(dict(reversed(list(hashes.items()))))
    assert param_digest(hashes) != param_digest({**hashes, "layers.2.b": "d"})
