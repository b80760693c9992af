"""Measure what each layer of a GPT costs on this device: forward and backward seconds per
micro-batch (fastest of repeats), added to the analytic profile of the same shape so the
partitioner can balance stages on real times.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stalwart.client import recompute
from stalwart.client.model import GPTConfig, GPTStage
from stalwart.core.costs import CostProfile, GPTShape, gpt_profile

__all__ = ["measure_layers", "shape_of"]


def shape_of(cfg: GPTConfig, micro_batch: int) -> GPTShape:
    return GPTShape(vocab=cfg.vocab, d_model=cfg.d_model, n_layers=cfg.n_layer,
                    n_heads=cfg.n_head, seq=cfg.seq_len, micro_batch=micro_batch, d_ff=cfg.d_ff)


def measure_layers(cfg: GPTConfig, *, micro_batch: int = 1, repeats: int = 7, warmup: int = 2,
                   device: str | torch.device = "cpu", policy: str = "none") -> CostProfile:
    """Profile every layer (embedding, blocks, head with its loss) of `cfg`.

    Each layer runs alone on a micro-batch of `micro_batch` sequences: forward, then
    backward with an all-ones upstream gradient (the head backpropagates its cross-entropy
    loss, as the last pipeline stage does), then one AdamW update of its parameters.
    Times are the fastest of `repeats` runs after `warmup` untimed ones, in seconds: on a
    shared machine the fastest run is the least disturbed one, and it varies far less
    between profiles than the median does.
    """
    device = torch.device(device)
    model = GPTStage(cfg, 0, cfg.num_layers - 1, seed=0).to(device)
    recompute.apply_policy(model.layers, policy)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(cfg.vocab, 256), (micro_batch, cfg.seq_len), generator=gen)
    ids, targets = ids.to(device), ids.roll(-1, dims=1).to(device)
    hidden = torch.randn(micro_batch, cfg.seq_len, cfg.d_model, generator=gen).to(device)
    profile = gpt_profile(shape_of(cfg, micro_batch), act_bytes_per_value=4)
    profile.device = _describe(device)
    for index, layer in enumerate(model.layers.values()):
        def forward(layer=layer, index=index) -> torch.Tensor:
            if index == 0:
                return layer(ids)
            out = layer(hidden.detach().requires_grad_())
            if index == cfg.num_layers - 1:
                return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())
            return out

        fwd, bwd = _time_layer(forward, device, repeats, warmup)
        entry = profile.layers[index]
        entry.fwd_s, entry.bwd_s = fwd, bwd
        entry.opt_s = _time_optimizer(layer, device, repeats, warmup)
        entry.params = sum(p.numel() for p in layer.parameters())
    return profile


def _time_layer(forward: Callable[[], torch.Tensor], device: torch.device, repeats: int,
                warmup: int) -> tuple[float, float]:
    fwd_times, bwd_times = [], []
    for r in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        grad = None if out.dim() == 0 else torch.ones_like(out)
        torch.autograd.backward(out, grad)
        _sync(device)
        t2 = time.perf_counter()
        if r >= warmup:
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
    return min(fwd_times), min(bwd_times)


def _time_optimizer(layer: torch.nn.Module, device: torch.device, repeats: int,
                    warmup: int) -> float:
    """Fastest seconds of one AdamW update of the layer's parameters (as the trainer runs)."""
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for r in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    for p in params:
        p.grad = None
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
