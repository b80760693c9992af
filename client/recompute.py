"""Activation recomputation, chosen per layer: `none` keeps every activation, `selective`
recomputes only the attention core (cheap to redo, large to keep), `full` keeps only a
block's input and reruns the whole block in backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["POLICIES", "apply_policy", "maybe_checkpoint"]

POLICIES = ("none", "selective", "full")


def maybe_checkpoint(enabled: bool, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """Run `fn(*args)`, saving only its inputs for backward when `enabled` and grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def apply_policy(layers: dict[str, Any], policy: str | Sequence[str]) -> None:
    """Set the policy of each layer that supports it (blocks); `policy` is one name for all
    layers or a sequence with one name per layer in order."""
    names = [policy] * len(layers) if isinstance(policy, str) else list(policy)
    if len(names) != len(layers):
        raise ValueError(f"{len(names)} recompute policies for {len(layers)} layers; "
                         "give one policy per layer of the stage")
    for layer, name in zip(layers.values(), names, strict=True):
        if name not in POLICIES:
            raise ValueError(f"recompute policy {name!r} is unknown; choose one of {POLICIES}")
        if hasattr(layer, "recompute"):
            layer.recompute = name
