"""Stalwart keeps large-model training alive through hardware failure.

The public API (docs/api.md) is the names in ``__all__``; everything else is internal.
Names are imported on first use, so ``import stalwart`` stays cheap and the daemon,
which shares this package, never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "run": "stalwart.client.user_loop",
    "Context": "stalwart.client.user_loop",
    "Result": "stalwart.client.user_loop",
    "Data": "stalwart.client.user_data",
    "Layers": "stalwart.client.layers",
    "run_layers": "stalwart.client.layers_run",
    "param_digest": "stalwart.client.digest",
    "StateError": "stalwart.client.user_state",
    "JobStopped": "stalwart.client.agent",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
