"""Entry shape 2: a model given as ordered named blocks, a tensor-parallel plan and a
loss, which Stalwart profiles, partitions into pipeline stages, shards over TP and
re-partitions onto the survivors after a failure.

Every block is built at full size from its factory under the seed (job seed, block
index), then sliced for TP: every layout starts from the same weights. Inside a stage
the blocks are `layers.<index>`, so a parameter's name (`layers.3.attn.q.weight`)
says where it sits whatever the partition.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stalwart.client.recompute import POLICIES, maybe_checkpoint
from stalwart.client.tensor_parallel import parallelize

__all__ = ["BlockProbe", "Layers", "Stage", "probe"]


@dataclass(frozen=True, kw_only=True)
class Layers:
    """The model as Stalwart's 3D loop sees it."""

    blocks: Sequence[tuple[str, Callable[[], nn.Module]]]
    """(name, factory) per block in forward order; a factory builds the block at full
    size (Stalwart seeds torch's RNG before each call and slices it for TP afterwards).
    The first block takes the data set's inputs, the last one's output goes to `loss`,
    and every block before the last returns one floating-point tensor whose first
    dimension is the micro-batch (its other dimensions may differ from block to block)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """loss(last block's output, targets) -> the mean loss of a micro-batch."""
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    """Path of an nn.Linear inside a block -> "column" (split output features) or "row"
    (split input features, partial outputs summed); paths a block lacks are skipped.
    Code between a column and a row linear must work on the local slice (for example
    reshape heads with -1)."""
    selective_recompute: Sequence[str] = ()
    """Paths of submodules inside blocks whose forward is recomputed in backward under
    recompute="selective" (for example the attention core)."""
    costs: Sequence[float] | None = None
    """Relative cost of each block (e.g. its FLOPs) for the planner, instead of the
    forward and backward seconds measured at start-up: plans then do not vary with the
    machine's load."""

    def __post_init__(self) -> None:
        names = [name for name, _ in self.blocks]
        if not names:
            raise ValueError("Layers needs at least one block")
        if len(set(names)) != len(names):
            twice = sorted(n for n in set(names) if names.count(n) > 1)
            raise ValueError(f"block names must be unique; {twice} appear more than once")
        if self.costs is not None and (len(self.costs) != len(names)
                                       or any(not c >= 0 for c in self.costs)):
            raise ValueError(f"costs: give one non-negative number per block ({len(names)}), "
                             f"not {list(self.costs)}")
        for name, factory in self.blocks:
            if isinstance(factory, nn.Module) or not callable(factory):
                raise TypeError(f"block {name!r}: give a factory (a callable that builds the "
                                "block), not a built module, so every layout builds it fresh")

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.blocks]

    def build(self, index: int, seed: int) -> nn.Module:
        """Block `index` at full size, its weights drawn from (seed, index)."""
        name, factory = self.blocks[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + index)
            block = factory()
        if not isinstance(block, nn.Module):
            raise TypeError(f"block {name!r}: its factory returned a {type(block).__name__}, "
                            "not an nn.Module")
        return block


class Stage(nn.Module):
    """Blocks first..last (inclusive) of `layers`, sharded over the TP group `tp`."""

    def __init__(self, layers: Layers, first: int, last: int, *, seed: int = 0,
                 tp: Any = None, recompute: str = "none") -> None:
        super().__init__()
        if not 0 <= first <= last < len(layers):
            raise ValueError(f"stage bounds ({first}, {last}) are outside blocks "
                             f"0..{len(layers) - 1}")
        if recompute not in POLICIES:
            raise ValueError(f"recompute={recompute!r}; choose one of {POLICIES}")
        self.spec, self.first, self.last, self.tp = layers, first, last, tp
        self.recompute = recompute
        self.layers = nn.ModuleDict()
        self._shard: dict[str, int] = {}
        for i in range(first, last + 1):
            block = layers.build(i, seed)
            for local, dim in parallelize(block, layers.tp_plan, tp, layers.names[i]).items():
                self._shard[f"layers.{i}.{local}"] = dim
            if recompute == "selective":
                _recompute_parts(block, layers.selective_recompute)
            self.layers[str(i)] = block

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.last == len(self.spec) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = maybe_checkpoint(self.recompute == "full", block, x)
        return x

    def shard_dim(self, name: str) -> int | None:
        """TP split dimension of parameter `name` (None when replicated)."""
        return self._shard.get(name)


def _recompute_parts(block: nn.Module, paths: Sequence[str]) -> None:
    for path in paths:
        try:
            part = block.get_submodule(path)
        except AttributeError:
            continue
        forward = part.forward
        part.forward = lambda *args, _f=forward: maybe_checkpoint(True, _f, *args)


@dataclass(frozen=True)
class Activation:
    """What a block hands the next one, per sample: a stage ending at the block sends it
    (as fp32), the next stage receives it and casts it back to `dtype`."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class BlockProbe:
    """What one block measured on one micro-batch at full size."""

    name: str
    params: int
    mem_bytes: int  # what training it holds on a rank: see block_bytes
    state_bytes: int  # what a snapshot of it holds
    fwd_s: float
    bwd_s: float
    out_shape: tuple[int, ...]
    out_bytes: int
    out_dtype: torch.dtype
    sharded: bool


def block_bytes(block: torch.nn.Module) -> tuple[int, int]:
    """(memory, snapshot) bytes of a block trained with AdamW: a parameter it trains holds
    itself, its gradient and two moments in memory, itself and the moments in a snapshot;
    a frozen parameter holds itself in both, a buffer itself in memory and, if it is
    persistent, in a snapshot. A tensor held twice (a tied weight) counts once."""
    mem = state = 0
    for p in block.parameters():
        size = p.numel() * p.element_size()
        mem += 4 * size if p.requires_grad else size
        state += 3 * size if p.requires_grad else size
    persistent = {id(t) for t in block.state_dict(keep_vars=True).values() if torch.is_tensor(t)}
    for b in block.buffers():
        size = b.numel() * b.element_size()
        mem += size
        state += size if id(b) in persistent else 0
    return mem, state


def sample_pair(batch: Any) -> tuple[Any, Any]:
    """A collated batch as the 3D loop reads it: (inputs, targets), each a tensor or a
    tuple, list or dict of tensors with the batch as their first dimension."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        inputs, targets = batch
        if all(next(_tensors(part), None) is not None for part in (inputs, targets)):
            return inputs, targets
    raise ValueError(f"the 3D loop reads each sample as an (inputs, targets) pair, each a "
                     f"tensor or a tuple, list or dict of tensors; the data gave "
                     f"{_describe(batch)} for a batch: make the dataset's items such pairs")


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with `fn` applied to each of its tensors (in tuples, lists and dicts)."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def split_rows(value: Any, size: int) -> list[Any]:
    """`value` cut into pieces of `size` rows (the first dimension of each tensor)."""
    count = -(-batch_rows(value) // size)
    return [map_tensors(lambda t, i=i: t[i * size:(i + 1) * size], value) for i in range(count)]


def batch_rows(value: Any) -> int:
    """Rows (samples) of a batch: the first dimension of its first tensor."""
    return next(t.shape[0] for t in _tensors(value))


def _tensors(value: Any) -> Any:
    if torch.is_tensor(value):
        if value.dim() > 0:
            yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors(v)


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def probe(layers: Layers, inputs: Any, targets: Any, *, seed: int = 0,
          repeats: int = 2) -> tuple[list[BlockProbe], tuple[Activation, ...]]:
    """Run every block alone, at full size, on a micro-batch (one block in memory at a
    time): its forward and backward seconds (fastest of `repeats`), parameters and
    output; returns the probes and each block's output but the last's (what a stage
    ending at that block sends on)."""
    out: list[BlockProbe] = []
    x: Any = inputs
    for i in range(len(layers)):
        name = layers.names[i]
        block = layers.build(i, seed)
        sharded = bool(parallelize(block, layers.tp_plan, None, name))
        last = i == len(layers) - 1
        best_f = best_b = float("inf")
        for _ in range(repeats):
            # The first block takes the inputs as the data gave them; a later one the
            # activation, as a leaf its backward reaches.
            xin = x if i == 0 or not x.is_floating_point() else x.detach().requires_grad_()
            t0 = time.perf_counter()
            y = block(xin)
            t1 = time.perf_counter()
            if last:
                loss = layers.loss(y, targets)
                if loss.dim() != 0:
                    raise ValueError(f"loss returned shape {tuple(loss.shape)}; return the "
                                     "mean loss of the micro-batch (a scalar)")
                if loss.requires_grad:  # a model frozen whole has no backward
                    loss.backward()
            else:
                if not torch.is_tensor(y) or not y.is_floating_point():
                    raise TypeError(f"block {name!r} returned {type(y).__name__}"
                                    f"{'' if not torch.is_tensor(y) else ' ' + str(y.dtype)}; "
                                    "blocks before the last must return one floating-point "
                                    "tensor (the activation the pipeline sends on)")
                if y.dim() == 0 or y.shape[0] != batch_rows(inputs):
                    raise ValueError(f"block {name!r} returned shape {tuple(y.shape)} for a "
                                     f"micro-batch of {batch_rows(inputs)}; a block's output "
                                     "must keep the micro-batch as its first dimension")
                if y.requires_grad:  # frozen blocks on the data have none
                    y.backward(torch.ones_like(y))
            t2 = time.perf_counter()
            best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        # The last block may return a structure for the loss (its shape is not sent).
        one = torch.is_tensor(y)
        out.append(BlockProbe(name, sum(p.numel() for p in block.parameters()),
                              *block_bytes(block), best_f, best_b,
                              tuple(y.shape) if one else (),
                              sum(t.numel() * t.element_size() for t in _tensors(y)),
                              y.dtype if one else torch.float32, sharded))
        x = y.detach() if one else y
    return out, tuple(Activation(p.out_shape[1:], p.out_dtype) for p in out[:-1])
