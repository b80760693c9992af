"""Activation recomputation: `none` keeps every activation, `selective` recomputes only
the parts a model names (Layers.selective_recompute, e.g. the attention core: cheap to
redo, large to keep), `full` keeps only each block's input and reruns it in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["POLICIES", "maybe_checkpoint"]

POLICIES = ("none", "selective", "full")


def maybe_checkpoint(enabled: bool, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """Run `fn(*args)`, saving only its inputs for backward when `enabled` and grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
