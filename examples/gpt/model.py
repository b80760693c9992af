"""A small GPT decoder as Stalwart Layers: an embedding block, N transformer blocks and
a norm + LM head block, with a Megatron tensor-parallel plan (q, k, v and fc1 split by
output features, out and fc2 by input features)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stalwart

VOCAB_SIZE = 256  # byte-level text


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the decoder."""

    d_model: int = 128
    """Width of the residual stream."""
    n_layer: int = 4
    """Transformer blocks; the model has n_layer + 2 blocks (embedding and head)."""
    n_head: int = 4
    """Attention heads; must divide by the tensor-parallel degree."""
    d_ff: int = 512
    """Hidden width of the MLP; must divide by the tensor-parallel degree."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    vocab: int = VOCAB_SIZE

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, n_layer=4, n_head=4, d_ff=512, seq_len=128),
    "small": GPTConfig(d_model=256, n_layer=6, n_head=8, d_ff=1024, seq_len=256),
    "medium": GPTConfig(d_model=512, n_layer=8, n_head=8, d_ff=2048, seq_len=512),
}

TP_PLAN = {"q": "column", "k": "column", "v": "column", "out": "row",
           "fc1": "column", "fc2": "row"}


def config(preset: str = "tiny", **overrides: Any) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"model preset {preset!r} is unknown; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[preset], **overrides)


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.randn(cfg.vocab, cfg.d_model) * 0.02)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok[ids] + self.pos[: ids.shape[1]]


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v under a causal mask, written out: its seq x seq score
    tensors are what selective recomputation avoids keeping for backward."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.core = CausalAttention()
        self.out = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.d_ff), nn.Linear(cfg.d_ff, d)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        with torch.no_grad():
            for lin in (self.q, self.k, self.v, self.out, self.fc1, self.fc2):
                lin.weight.normal_(0.0, residual_std if lin in (self.out, self.fc2) else 0.02)
                lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:  # -1: the heads this TP rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        att = self.core(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)))
        x = x + self.out(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final layer norm and LM head producing logits over the vocabulary."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        with torch.no_grad():
            self.lm.weight.normal_(0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def layers(cfg: GPTConfig, flops_costs: bool = False) -> stalwart.Layers:
    """The decoder as ordered named blocks with its tensor-parallel plan; with
    `flops_costs` the planner uses layer_costs() instead of measured times."""
    blocks = [("embed", lambda: Embedding(cfg))]
    blocks += [(f"block{i}", lambda: Block(cfg)) for i in range(cfg.n_layer)]
    blocks += [("head", lambda: Head(cfg))]
    return stalwart.Layers(blocks=blocks, loss=next_token_loss, tp_plan=TP_PLAN,
                           selective_recompute=("core",),
                           costs=layer_costs(cfg) if flops_costs else None)


def layer_costs(cfg: GPTConfig) -> list[float]:
    """Forward FLOPs per token of each block (the embedding counted as a lookup of
    d_model), for planning without measuring."""
    d, s = cfg.d_model, cfg.seq_len
    block = 2 * (4 * d * d + 2 * d * cfg.d_ff) + 4 * s * d
    return [float(d)] + [float(block)] * cfg.n_layer + [float(2 * d * cfg.vocab)]
