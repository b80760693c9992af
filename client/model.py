"""A small GPT decoder built as a flat list of layers (embedding, N blocks, norm + LM head),
so any contiguous range of layers can be a pipeline stage. Blocks split heads and FFN
columns across the tensor-parallel group (Megatron column/row parallel); weights are drawn
at full size from (seed, layer index) and then sliced, so every layout starts identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.client import recompute
from stalwart.client.data import VOCAB_SIZE

__all__ = ["PRESETS", "GPTConfig", "GPTStage", "full_params", "layer_costs", "uniform_bounds",
           "with_overrides"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the decoder."""

    d_model: int = 128
    """Width of the residual stream."""
    n_layer: int = 4
    """Transformer blocks; the model has n_layer + 2 layers (embedding and head)."""
    n_head: int = 4
    """Attention heads; must divide by the tensor-parallel degree."""
    d_ff: int = 512
    """Hidden width of the MLP; must divide by the tensor-parallel degree."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    vocab: int = VOCAB_SIZE
    """Vocabulary size (256 for byte-level text)."""

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, n_layer=4, n_head=4, d_ff=512, seq_len=128),
    "small": GPTConfig(d_model=256, n_layer=6, n_head=8, d_ff=1024, seq_len=256),
    "medium": GPTConfig(d_model=512, n_layer=8, n_head=8, d_ff=2048, seq_len=512),
}


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward sums partial outputs over the TP group; backward is identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        # Reduce in fp32: partial sums under bf16/fp16 autocast would lose precision.
        out = torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
        out.copy_(x)  # a fresh buffer: never reduce in place into an autograd input
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Embedding(nn.Module):
    """Token plus learned position embedding (replicated on every TP rank)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.empty(cfg.vocab, cfg.d_model))
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.d_model))

    shard_dims: dict[str, int] = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok[ids] + self.pos[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block; q/k/v and fc1 are column-parallel, out and fc2 row-parallel."""

    # parameter name -> dimension split across TP ranks (absent = replicated)
    shard_dims: dict[str, int] = {"q.weight": 0, "q.bias": 0, "k.weight": 0, "k.bias": 0,
                                  "v.weight": 0, "v.bias": 0, "out.weight": 1,
                                  "fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}

    def __init__(self, cfg: GPTConfig, tp: Any) -> None:
        super().__init__()
        tp_size = tp.size if tp is not None else 1
        if cfg.n_head % tp_size or cfg.d_ff % tp_size:
            raise ValueError(f"n_head={cfg.n_head} and d_ff={cfg.d_ff} must both divide by "
                             f"tp={tp_size}; pick a tensor-parallel degree that divides them")
        d, hd = cfg.d_model, cfg.d_model // cfg.n_head
        self.tp = tp
        self.heads = cfg.n_head // tp_size
        self.head_dim = hd
        self.recompute = "none"
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, self.heads * hd)
        self.k = nn.Linear(d, self.heads * hd)
        self.v = nn.Linear(d, self.heads * hd)
        self.out = nn.Linear(self.heads * hd, d, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(d))
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.d_ff // tp_size)
        self.fc2 = nn.Linear(cfg.d_ff // tp_size, d, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(d))

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None or self.tp.size == 1 else _CopyToTP.apply(x, self.tp)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None or self.tp.size == 1 else _ReduceFromTP.apply(x, self.tp)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self._copy(self.ln1(x))

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        core = recompute.maybe_checkpoint(self.recompute == "selective", _attention_core, q, k, v)
        core = core.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        # Bias after the reduction, so it is added once rather than once per TP rank.
        return self._reduce(self.out(core)) + self.out_bias

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self._copy(self.ln2(x))))
        return self._reduce(self.fc2(h)) + self.fc2_bias

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(x)
        return x + self._mlp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute.maybe_checkpoint(self.recompute == "full", self._forward, x)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v, written out: its seq x seq score and probability
    tensors are what selective recomputation avoids keeping for backward."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


class Head(nn.Module):
    """Final layer norm and LM head producing logits over the vocabulary."""

    shard_dims: dict[str, int] = {}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class GPTStage(nn.Module):
    """Layers first..last (inclusive) of the model; parameters are named `layers.{i}.*`."""

    def __init__(self, cfg: GPTConfig, first: int, last: int, *, seed: int = 0,
                 tp: Any = None) -> None:
        super().__init__()
        if not 0 <= first <= last < cfg.num_layers:
            raise ValueError(f"stage bounds ({first}, {last}) are outside layers "
                             f"0..{cfg.num_layers - 1}")
        self.cfg, self.first, self.last, self.tp = cfg, first, last, tp
        self.layers = nn.ModuleDict({str(i): _make_layer(cfg, i, tp)
                                     for i in range(first, last + 1)})
        for i, layer in self.layers.items():
            _init_layer(layer, cfg, seed, int(i), tp)

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.last == self.cfg.num_layers - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x

    def shard_dim(self, name: str) -> int | None:
        """TP split dimension of canonical parameter `name` (None when replicated)."""
        _, index, local = name.split(".", 2)
        return type(self.layers[index]).shard_dims.get(local)


def _make_layer(cfg: GPTConfig, index: int, tp: Any) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.num_layers - 1:
        return Head(cfg)
    return Block(cfg, tp)


@torch.no_grad()
def _init_layer(layer: nn.Module, cfg: GPTConfig, seed: int, index: int, tp: Any) -> None:
    """Draw every parameter at full size from (seed, index), then keep this TP rank's slice."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    tp_size, tp_rank = (tp.size, tp.index) if tp is not None else (1, 0)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in sorted(layer.named_parameters()):
        dim = type(layer).shard_dims.get(name)
        full_shape = list(p.shape)
        if dim is not None:
            full_shape[dim] *= tp_size
        if name.startswith("ln") and name.endswith("weight"):
            full = torch.ones(full_shape)
        elif name.endswith("bias"):
            full = torch.zeros(full_shape)
        else:
            std = residual_std if name.split(".")[0] in ("out", "fc2") else 0.02
            full = torch.empty(full_shape).normal_(0.0, std, generator=gen)
        p.copy_(full if dim is None else full.chunk(tp_size, dim)[tp_rank])


def full_params(stage: GPTStage) -> dict[str, torch.Tensor]:
    """This stage's parameters at full size by canonical name (TP shards gathered).

    Collective over the stage's TP group: every TP rank of the stage must call it.
    """
    out = {}
    for name, p in stage.named_parameters():
        dim = stage.shard_dim(name)
        t = p.detach()
        if dim is not None and stage.tp is not None and stage.tp.size > 1:
            t = torch.cat(stage.tp.all_gather(t), dim=dim)
        out[name] = t.clone()
    return out


def uniform_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous inclusive (first, last) layer ranges of near-equal length."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} non-empty stages")
    base, extra = divmod(num_layers, stages)
    bounds, first = [], 0
    for s in range(stages):
        last = first + base + (1 if s < extra else 0) - 1
        bounds.append((first, last))
        first = last + 1
    return bounds


def layer_costs(cfg: GPTConfig) -> list[float]:
    """Forward FLOPs per token of each layer (embedding counted as a lookup of d_model)."""
    d, s = cfg.d_model, cfg.seq_len
    block = 2 * (4 * d * d + 2 * d * cfg.d_ff) + 4 * s * d
    return [float(d)] + [float(block)] * cfg.n_layer + [float(2 * d * cfg.vocab)]


def with_overrides(cfg: GPTConfig, **kw: Any) -> GPTConfig:
    """A copy of `cfg` with some fields changed (e.g. a preset with fewer layers)."""
    return replace(cfg, **kw)
