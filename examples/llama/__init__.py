"""A Llama-style decoder trained by Stalwart's 3D loop (entry shape 2)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import stalwart
from stalwart_examples.gpt.data import TextWindows, load_corpus
from stalwart_examples.llama.model import LlamaConfig, config, layers

__all__ = ["LlamaConfig", "config", "job", "layers"]


def job(model: str | LlamaConfig = "tiny", *, tp: int = 1, global_batch: int = 8,
        seed: int = 0, corpus_bytes: int = 4 << 20,
        **overrides: Any) -> tuple[stalwart.Layers, stalwart.Data]:
    """The decoder's Layers and its byte-level text Data (a preset name or a config, with
    overrides), after checking that it splits over `tp` tensor-parallel ranks."""
    cfg = config(model, **overrides) if isinstance(model, str) else replace(model, **overrides)
    cfg.check_tp(tp)
    data = stalwart.Data(TextWindows(load_corpus(corpus_bytes), cfg.seq_len),
                         global_batch=global_batch, seed=seed)
    return layers(cfg), data
