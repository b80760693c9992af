"""Tensor parallelism by plan: the nn.Linear modules a plan names are replaced by
column- or row-parallel versions holding this rank's slice of the full-size weight
(Megatron's split). A column-parallel linear splits its output features; the ops after
it run on the local slice (attention heads, MLP columns) until a row-parallel linear,
which splits its input features and sums the partial outputs over the TP group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "STYLES", "parallelize"]

STYLES = ("column", "row")


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


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's share of the output features."""

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.Linear, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach().chunk(group.size, 0)[group.index].clone())
        self.bias = None if full.bias is None else nn.Parameter(
            full.bias.detach().chunk(group.size, 0)[group.index].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over the TP group of x_local W_local^T, plus the (replicated) bias once."""

    shard_dims = {"weight": 1}

    def __init__(self, full: nn.Linear, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach().chunk(group.size, 1)[group.index].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTP.apply(nn.functional.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


def split_error(module: nn.Linear, style: str, size: int, where: str) -> str:
    """Why `module` cannot be split `style`-wise over `size` ranks, or ""."""
    features = module.out_features if style == "column" else module.in_features
    if features % size == 0:
        return ""
    side = "output" if style == "column" else "input"
    return (f"{where}.weight: {features} {side} features do not split over tp={size}; "
            f"choose a tensor-parallel degree that divides {features}")


def plan_errors(block: nn.Module, plan: Mapping[str, str], size: int,
                block_name: str = "") -> list[str]:
    """Every reason `block` (full size, any device) cannot take `plan` at tp=`size`;
    the launcher asks before any rank starts."""
    out = []
    for path, style in plan.items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, nn.Linear) and style in STYLES:
            why = split_error(module, style, size, f"{block_name}.{path}")
            if why:
                out.append(why)
    return out


def parallelize(block: nn.Module, plan: Mapping[str, str], group: Any,
                block_name: str = "") -> dict[str, int]:
    """Replace the planned linears of `block` in place (when the TP group has more than
    one rank); returns {parameter name in the block: split dimension} of every sharded
    parameter. A plan entry whose module the block lacks is skipped (embedding, head)."""
    size = group.size if group is not None else 1
    shard: dict[str, int] = {}
    for path, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor-parallel plan entry {path!r}: {style!r} is not one of "
                             f"{STYLES}")
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(module, nn.Linear):
            raise TypeError(f"tensor-parallel plan entry {path!r} of block {block_name!r} is a "
                            f"{type(module).__name__}; the plan splits nn.Linear modules only")
        why = split_error(module, style, size, f"{block_name}.{path}")
        if why:
            raise ValueError(why)
        cls = ColumnParallelLinear if style == "column" else RowParallelLinear
        for pname, dim in cls.shard_dims.items():
            if getattr(module, pname, None) is not None:
                shard[f"{path}.{pname}"] = dim
        if size > 1:
            parent, _, leaf = path.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, cls(module, group))
    return shard
