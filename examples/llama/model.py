"""A Llama-style decoder as Stalwart Layers: RMSNorm, rotary position embeddings,
grouped-query attention and a SwiGLU MLP, without biases. Its tensor-parallel plan
splits q, k, v, gate and up by output features and o, down by input features, so each
TP rank holds whole query heads and the whole key/value heads they share."""

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
class LlamaConfig:
    """Shape of the decoder."""

    d_model: int = 128
    """Width of the residual stream; must divide by n_head."""
    n_layer: int = 4
    """Decoder blocks; the model has n_layer + 2 blocks (embedding and head)."""
    n_head: int = 4
    """Query heads; must divide by n_kv_head."""
    n_kv_head: int = 2
    """Key/value heads, each shared by n_head / n_kv_head query heads; must divide by the
    tensor-parallel degree (a TP rank holds whole key/value heads)."""
    d_ff: int = 384
    """Hidden width of the SwiGLU MLP; must divide by the tensor-parallel degree."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    vocab: int = VOCAB_SIZE
    rope_base: float = 10_000.0
    """Base of the rotary embedding's frequencies."""
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} does not split into n_head={self.n_head} "
                             "heads; choose d_model divisible by n_head")
        if self.head_dim % 2:
            raise ValueError(f"head size d_model / n_head = {self.head_dim} is odd; rotary "
                             "embeddings rotate pairs of features, choose an even head size")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} query heads cannot share "
                             f"n_kv_head={self.n_kv_head} key/value heads evenly; choose "
                             "n_kv_head dividing n_head")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless the decoder splits over `tp` tensor-parallel ranks."""
        if tp < 1 or self.n_kv_head % tp:
            raise ValueError(f"n_kv_head={self.n_kv_head} key/value heads do not split over "
                             f"tp={tp}: each tensor-parallel rank must hold whole key/value "
                             f"heads; choose a tp that divides {self.n_kv_head}, or "
                             f"n_kv_head divisible by {tp}")
        if self.d_ff % tp:
            raise ValueError(f"d_ff={self.d_ff} does not split over tp={tp}; choose d_ff "
                             f"divisible by {tp}")


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(d_model=128, n_layer=4, n_head=4, n_kv_head=2, d_ff=384, seq_len=128),
    "small": LlamaConfig(d_model=256, n_layer=6, n_head=8, n_kv_head=4, d_ff=768, seq_len=256),
    "medium": LlamaConfig(d_model=512, n_layer=8, n_head=8, n_kv_head=2, d_ff=1536,
                          seq_len=512),
}

TP_PLAN = {"attn.q": "column", "attn.k": "column", "attn.v": "column", "attn.o": "row",
           "mlp.gate": "column", "mlp.up": "column", "mlp.down": "row"}


def config(preset: str = "tiny", **overrides: Any) -> LlamaConfig:
    if preset not in PRESETS:
        raise ValueError(f"model preset {preset!r} is unknown; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[preset], **overrides)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, seq_len x head_dim, of the rotation applied at each position."""
    freqs = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2).double() / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len).double(), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) feature pair of x (..., seq, head_dim) by position."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class GroupedCausalAttention(nn.Module):
    """Causal attention where each key/value head serves a group of query heads; takes
    the local heads, so the group size is read from the shapes, not the config."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.q, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k, self.v = nn.Linear(d, kv, bias=False), nn.Linear(d, kv, bias=False)
        self.core = GroupedCausalAttention()
        cos, sin = rotary_tables(cfg)
        # Derived from the config, not trained: rebuilt by the factory, never checkpointed.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # -1: the heads this TP rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        cos, sin = self.cos[:s], self.sin[:s]
        q, k = rotate(heads(self.q(x)), cos, sin), rotate(heads(self.k(x)), cos, sin)
        out = self.core(q, k, heads(self.v(x)))
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        with torch.no_grad():
            for lin in (self.attn.q, self.attn.k, self.attn.v, self.mlp.gate, self.mlp.up):
                lin.weight.normal_(0.0, 0.02)
            for lin in (self.attn.o, self.mlp.down):  # outputs added to the residual stream
                lin.weight.normal_(0.0, residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token embedding only: positions enter through the rotary embedding."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.randn(cfg.vocab, cfg.d_model) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok[ids]


class Head(nn.Module):
    """Final RMSNorm and an (untied) LM head producing logits over the vocabulary."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        with torch.no_grad():
            self.lm.weight.normal_(0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def layers(cfg: LlamaConfig) -> stalwart.Layers:
    """The decoder as ordered named blocks with its tensor-parallel plan; check the TP
    degree first with `cfg.check_tp(tp)` (the plan alone cannot see head boundaries)."""
    blocks = [("embed", lambda: Embedding(cfg))]
    blocks += [(f"block{i}", lambda: DecoderBlock(cfg)) for i in range(cfg.n_layer)]
    blocks += [("head", lambda: Head(cfg))]
    return stalwart.Layers(blocks=blocks, loss=next_token_loss, tp_plan=TP_PLAN,
                           selective_recompute=("attn.core",))
