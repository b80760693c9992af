"""Real text, offline: a byte-level corpus built from the Python standard library's own
sources, cut into fixed windows and served in a seeded order. The loader's position is
part of the training state, so a restored run sees exactly the samples it would have seen.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Any

import torch

__all__ = ["VOCAB_SIZE", "TextBatches", "load_corpus"]

VOCAB_SIZE = 256
"""Byte-level tokens: every byte value is a token."""


def load_corpus(max_bytes: int = 4 << 20, root: Path | None = None) -> bytes:
    """Concatenate the stdlib's top-level `.py` files in sorted order, up to `max_bytes`.

    Deterministic for one interpreter installation; files are joined with a blank line.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; pass root= pointing at text")
    parts: list[bytes] = []
    size = 0
    for path in files:
        data = path.read_bytes()
        parts.append(data + b"\n\n")
        size += len(data) + 2
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


class TextBatches:
    """Seeded, resumable stream of (input, target) windows of `seq_len` bytes.

    The corpus is cut into non-overlapping windows of seq_len+1 bytes; each epoch visits
    them in a permutation drawn from (seed, epoch). `position` counts samples served.
    """

    def __init__(self, corpus: bytes, seq_len: int, seed: int = 0) -> None:
        if len(corpus) < 2 * (seq_len + 1):
            raise ValueError(f"corpus of {len(corpus)} bytes is too short for seq_len={seq_len}")
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(corpus) - 1) // (seq_len + 1)
        self.position = 0
        self.corpus_sha256 = hashlib.sha256(corpus).hexdigest()
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `samples` windows as (inputs, targets), each [samples, seq_len] int64."""
        rows = []
        for _ in range(samples):
            epoch, index = divmod(self.position, self.windows)
            start = int(self._order(epoch)[index]) * (self.seq_len + 1)
            rows.append(self.tokens[start:start + self.seq_len + 1])
            self.position += 1
        batch = torch.stack(rows)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "corpus_sha256": self.corpus_sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; refuses a state made for a different corpus or cut."""
        for key in ("seq_len", "corpus_sha256"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={state[key]!r}, this loader "
                                 f"has {getattr(self, key)!r}; build the loader the same way")
        self.seed = int(state["seed"])
        self._perm_epoch = -1
        self.position = int(state["position"])
