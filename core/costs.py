"""Per-layer cost profiles: parameters, FLOPs, activation bytes and measured times.

A profile is what the partitioner and the advisor reason about. Analytic profiles
of a GPT shape come from closed-form counts; measured ones add forward/backward
seconds taken on the real device (see stalwart.client.layers.probe). Saved as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RECOMPUTE", "CostProfile", "GPTShape", "LayerCost", "gpt_profile", "shape_for_params"]

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation policies: keep everything, recompute the attention core
(softmax and its dropout), or keep only each layer's input and recompute the layer."""

# Mixed-precision Adam: 16-bit weights and gradients, fp32 master copy and two moments.
MIXED_ADAM_BYTES_PER_PARAM = 2 + 2 + 4 + 4 + 4


@dataclass
class LayerCost:
    """What one layer costs, per micro-batch."""

    name: str
    kind: str
    """"embedding", "block" or "head"."""
    params: int
    flops_fwd: float
    flops_bwd: float
    act_bytes: dict[str, float]
    """Activation bytes kept for the backward pass, by recomputation policy."""
    recompute_flops: dict[str, float] = field(default_factory=dict)
    """Extra forward FLOPs in the backward pass, by recomputation policy."""
    fwd_s: float | None = None
    bwd_s: float | None = None
    """Measured seconds on the profiling device (fastest of repeats), when profiled."""
    opt_s: float | None = None
    """Measured seconds of this layer's optimizer update (once per step, not per micro-batch)."""

    @property
    def measured(self) -> bool:
        return self.fwd_s is not None and self.bwd_s is not None

    def flops(self, recompute: str = "none") -> float:
        """Forward + backward FLOPs including recomputation."""
        return self.flops_fwd + self.flops_bwd + self.recompute_flops.get(recompute, 0.0)


@dataclass(frozen=True)
class GPTShape:
    """A decoder-only transformer: token embedding, n_layers blocks, LM head."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq: int
    micro_batch: int = 1
    d_ff: int = 0
    """MLP width; 0 means 4 * d_model."""

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    def block_params(self) -> int:
        h, f = self.d_model, self.ff
        return 4 * h * h + 2 * h * f + 9 * h + f

    def params(self) -> int:
        """All parameters, with an untied LM head (a pipeline's last stage owns its own)."""
        h = self.d_model
        embed = self.vocab * h + self.seq * h
        head = self.vocab * h + 2 * h
        return embed + self.n_layers * self.block_params() + head


@dataclass
class CostProfile:
    """Layer costs in pipeline order, with where they came from."""

    layers: list[LayerCost]
    shape: dict = field(default_factory=dict)
    device: str = "analytic"

    def costs(self, source: str = "auto", recompute: str = "none",
              micro_batches: int = 1) -> list[float]:
        """Per-layer cost per micro-batch: measured seconds ("measured"), FLOPs ("flops"), or
        measured when every layer was profiled ("auto"). Measured costs add the optimizer
        update shared out over the `micro_batches` of a step."""
        if source == "auto":
            source = "measured" if all(x.measured for x in self.layers) else "flops"
        if source == "measured":
            missing = [x.name for x in self.layers if not x.measured]
            if missing:
                raise ValueError(f"layers {missing[:3]} have no measured time: profile them "
                                 f"first or use source='flops'")
            return [float(x.fwd_s + x.bwd_s + (x.opt_s or 0.0) / micro_batches)
                    for x in self.layers]
        if source == "flops":
            return [x.flops(recompute) for x in self.layers]
        raise ValueError(f"unknown cost source {source!r}: use auto, measured or flops")

    def params(self) -> list[int]:
        return [x.params for x in self.layers]

    def static_bytes(self, bytes_per_param: float = MIXED_ADAM_BYTES_PER_PARAM) -> list[float]:
        """Per-layer bytes of parameters, gradients and optimizer state."""
        return [x.params * bytes_per_param for x in self.layers]

    def act_bytes(self, recompute: str = "none") -> list[float]:
        if recompute not in RECOMPUTE:
            raise ValueError(f"unknown recompute policy {recompute!r}: use one of {RECOMPUTE}")
        return [x.act_bytes[recompute] for x in self.layers]

    def to_json(self) -> dict:
        return {"device": self.device, "shape": self.shape,
                "layers": [asdict(x) for x in self.layers]}

    @classmethod
    def from_json(cls, data: dict) -> CostProfile:
        return cls([LayerCost(**x) for x in data["layers"]], data.get("shape", {}),
                   data.get("device", "analytic"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        return cls.from_json(json.loads(Path(path).read_text()))


def gpt_profile(shape: GPTShape, act_bytes_per_value: int = 2) -> CostProfile:
    """Closed-form profile of a GPT: embedding, blocks and LM head as separate layers.

    FLOPs count multiply-adds as 2; backward is twice forward. Activation bytes follow
    the usual accounting for 16-bit activations with 1-byte dropout masks (scaled by
    act_bytes_per_value / 2 for other widths).
    """
    b, s, h, a, v, f = (shape.micro_batch, shape.seq, shape.d_model, shape.n_heads,
                        shape.vocab, shape.ff)
    scale = act_bytes_per_value / 2
    tokens = b * s
    attn_core = 4 * tokens * s * h  # Q @ K^T and softmax @ V
    block_fwd = 8 * tokens * h * h + 4 * tokens * h * f + attn_core
    # Per token: QKV input 2h, Q and K 4h, V 2h, projection input 2h, mask h (11h);
    # MLP input 2h, hidden 2f, activation input 2f, mask h (3h + 4f with f = 4h: 19h);
    # two layer norms 4h. The softmax output, its mask and its dropped copy: 5*a*s.
    keep_linear = tokens * (11 * h + 3 * h + 4 * f + 4 * h)
    keep_softmax = 5 * a * s * tokens
    block = LayerCost(
        name="block", kind="block", params=shape.block_params(),
        flops_fwd=block_fwd, flops_bwd=2 * block_fwd,
        act_bytes={"none": scale * (keep_linear + keep_softmax),
                   "selective": scale * keep_linear,
                   "full": scale * 2 * tokens * h},
        recompute_flops={"none": 0.0, "selective": float(attn_core), "full": float(block_fwd)})
    embed = LayerCost(
        name="embedding", kind="embedding", params=v * h + s * h,
        flops_fwd=2 * tokens * h, flops_bwd=4 * tokens * h,
        act_bytes={"none": scale * 3 * tokens * h, "selective": scale * 3 * tokens * h,
                   "full": 8.0 * tokens},
        recompute_flops={"none": 0.0, "selective": 0.0, "full": 2.0 * tokens * h})
    head_fwd = 2 * tokens * h * v
    # Layer-norm and projection inputs, 16-bit logits and the fp32 softmax for the loss.
    head = LayerCost(
        name="head", kind="head", params=v * h + 2 * h,
        flops_fwd=head_fwd, flops_bwd=2 * head_fwd,
        act_bytes={"none": scale * 4 * tokens * h + 6.0 * tokens * v,
                   "selective": scale * 4 * tokens * h + 6.0 * tokens * v,
                   "full": scale * 2 * tokens * h},
        recompute_flops={"none": 0.0, "selective": 0.0, "full": float(head_fwd)})
    layers = [embed]
    for i in range(shape.n_layers):
        layers.append(LayerCost(**{**asdict(block), "name": f"block.{i}"}))
    layers.append(head)
    return CostProfile(layers, asdict(shape), "analytic")


def shape_for_params(params: float, seq: int = 4096, vocab: int = 128256,
                     micro_batch: int = 1) -> GPTShape:
    """A plausible GPT shape for a parameter count: width/depth ratio near 128, as in
    common 7B-400B models, a width in multiples of 1024 and 128-dim heads."""
    h = max(1024, round((params * 128 / 12) ** (1 / 3) / 1024) * 1024)
    layers = max(1, round((params - 2 * vocab * h) / (12 * h * h)))
    return GPTShape(vocab=vocab, d_model=h, n_layers=layers, n_heads=max(1, h // 128),
                    seq=seq, micro_batch=micro_batch)

