"""The pieces of the training loop that can be checked in one process: corpus and loader,
layout-independent initialisation, recomputation, schedules, and exact resume."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stalwart.client import recompute
from stalwart.client.data import TextBatches, load_corpus
from stalwart.client.dp import GradReducer
from stalwart.client.model import GPTConfig, GPTStage, uniform_bounds
from stalwart.client.parallel_dims import ParallelDims
from stalwart.client.pipeline import schedule
from stalwart.client.trainer import TrainConfig, Trainer, param_digest

SMALL = GPTConfig(d_model=32, n_layer=2, n_head=4, d_ff=64, seq_len=32)


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus(1 << 18)


def test_corpus_is_deterministic_python_source(corpus):
    assert len(corpus) == 1 << 18
    assert load_corpus(1 << 18) == corpus
    assert b"def " in corpus and b"import " in corpus


def test_loader_resumes_exactly_from_its_state(corpus):
    a = TextBatches(corpus, 32, seed=1)
    a.next_batch(5)
    state = a.state_dict()
    expected = a.next_batch(7)
    b = TextBatches(corpus, 32, seed=1)
    b.load_state_dict(state)
    got = b.next_batch(7)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(got[0][:, 1:], got[1][:, :-1])  # targets are inputs shifted by one


def test_loader_refuses_a_state_from_another_cut(corpus):
    state = TextBatches(corpus, 32).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        TextBatches(corpus, 64).load_state_dict(state)


def test_loader_wraps_into_a_new_epoch_with_a_new_order(corpus):
    d = TextBatches(corpus[:33 * 10 + 1], 32, seed=0)
    first, _ = d.next_batch(10)
    second, _ = d.next_batch(10)
    assert sorted(map(bytes, first.byte().tolist())) == sorted(map(bytes, second.byte().tolist()))
    assert not torch.equal(first, second)


def test_stages_hold_the_same_weights_as_the_whole_model():
    whole = dict(GPTStage(SMALL, 0, 3, seed=5).named_parameters())
    for first, last in uniform_bounds(4, 3):
        for name, p in GPTStage(SMALL, first, last, seed=5).named_parameters():
            assert torch.equal(p, whole[name]), name


def test_tensor_parallel_shards_are_slices_of_the_full_weights():
    whole = GPTStage(SMALL, 1, 1, seed=5)
    shards = [GPTStage(SMALL, 1, 1, seed=5, tp=SimpleNamespace(size=2, index=r))
              for r in range(2)]
    for name, p in whole.named_parameters():
        dim = whole.shard_dim(name)
        parts = [dict(s.named_parameters())[name] for s in shards]
        joined = parts[0] if dim is None else torch.cat(parts, dim)
        assert torch.equal(joined, p), name


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(policy, corpus):
    x, y = TextBatches(corpus, 32).next_batch(4)

    def grads(p: str) -> list[torch.Tensor]:
        model = GPTStage(SMALL, 0, 3, seed=1)
        recompute.apply_policy(model.layers, p)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        return [q.grad for q in model.parameters()]

    for a, b in zip(grads("none"), grads(policy), strict=True):
        assert torch.equal(a, b)


def test_recompute_policy_names_are_checked():
    model = GPTStage(SMALL, 0, 3)
    with pytest.raises(ValueError, match="unknown"):
        recompute.apply_policy(model.layers, "sometimes")
    with pytest.raises(ValueError, match="one policy per layer"):
        recompute.apply_policy(model.layers, ["none"])


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


def _trainer(cfg: TrainConfig, corpus: bytes) -> tuple[ParallelDims, Trainer]:
    dims = ParallelDims(dp=1, pp=1, tp=1).build(dist.HashStore(), 0, 0)
    return dims, Trainer(dims, cfg, corpus=corpus)


def test_a_restored_trainer_continues_with_identical_losses_and_weights(corpus):
    cfg = TrainConfig(model=SMALL, global_batch=4, seed=2)
    dims, a = _trainer(cfg, corpus)
    for _ in range(3):
        a.step()
    state = copy.deepcopy(a.state_dict())
    expected = [a.step() for _ in range(2)]
    dims2, b = _trainer(cfg, corpus)
    b.load_state_dict(state)
    assert [b.step() for _ in range(2)] == expected
    assert param_digest(b.param_hashes()) == param_digest(a.param_hashes())
    assert b.state_dict()["data"] == a.state_dict()["data"]
    for t, d in ((a, dims), (b, dims2)):
        t.close()
        d.destroy()


def test_stage_bounds_must_cover_every_layer_once(corpus):
    dims = ParallelDims(dp=1, pp=1, tp=1).build(dist.HashStore(), 0, 0)
    for bad in ([(0, 2)], [(1, 3)], [(0, 4)], [(2, 3)]):
        with pytest.raises(ValueError, match="must cover layers 0..3"):
            Trainer(dims, TrainConfig(model=SMALL, global_batch=4), stage_bounds=bad,
                    corpus=corpus)
    dims.destroy()


def test_bf16_autocast_tracks_fp32_losses(corpus):
    losses = {}
    for precision in ("fp32", "bf16"):
        dims, t = _trainer(TrainConfig(model=SMALL, global_batch=4, precision=precision),
                           corpus)
        losses[precision] = [t.step() for _ in range(3)]
        t.close()
        dims.destroy()
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_fp16_loss_scaling_skips_an_overflowing_step_and_backs_off(corpus):
    dims, t = _trainer(TrainConfig(model=SMALL, global_batch=4, precision="fp16"), corpus)
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
    model = GPTStage(SMALL, 0, 3, seed=1)
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
    cfg = TrainConfig(model=SMALL, lr=1e-3, min_lr=1e-4, warmup_steps=4, decay_steps=20)
    lrs = [cfg.lr_at(s) for s in range(30)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4)


def test_param_digest_ignores_the_order_hashes_arrive_in():
    hashes = {"layers.10.w": "a", "layers.2.w": "b", "layers.2.b": "c"}
    assert param_digest(hashes) == param_digest(dict(reversed(list(hashes.items()))))
    assert param_digest(hashes) != param_digest({**hashes, "layers.2.b": "d"})
