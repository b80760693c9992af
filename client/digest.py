"""Layout-independent digests of a job's full parameters."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

__all__ = ["param_digest", "tensor_sha256"]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (on the CPU, contiguous)."""
    t = t.detach().to("cpu").contiguous()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return hashlib.sha256(head + t.view(torch.uint8).numpy().tobytes()).hexdigest()


def param_digest(params: torch.nn.Module | Mapping[str, str]) -> str:
    """sha256 over 'name sha256' lines in name order, of a module's parameters or of
    {full parameter name: tensor_sha256} collected from every stage and TP shard: equal
    for equal parameters whatever layout trained them."""
    if isinstance(params, torch.nn.Module):
        hashes = {n: tensor_sha256(p) for n, p in params.named_parameters()}
    else:
        hashes = dict(params)
    lines = "".join(f"{n} {hashes[n]}\n" for n in sorted(hashes))
    return hashlib.sha256(lines.encode()).hexdigest()
