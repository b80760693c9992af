"""A small GPT decoder trained by Stalwart's 3D loop (entry shape 2)."""

from __future__ import annotations

from typing import Any

import stalwart
from stalwart_examples.gpt.data import TextWindows, load_corpus
from stalwart_examples.gpt.model import GPTConfig, config, layers

__all__ = ["GPTConfig", "config", "job", "layers"]


def job(model: str | GPTConfig = "tiny", *, global_batch: int = 8, seed: int = 0,
        corpus_bytes: int = 4 << 20, flops_costs: bool = False,
        **overrides: Any) -> tuple[stalwart.Layers, stalwart.Data]:
    """The GPT's Layers and its text Data (a preset name or a config, with overrides)."""
    cfg = config(model, **overrides) if isinstance(model, str) else model
    data = stalwart.Data(TextWindows(load_corpus(corpus_bytes), cfg.seq_len),
                         global_batch=global_batch, seed=seed)
    return layers(cfg, flops_costs), data
