"""Real text, offline: a byte-level corpus built from the Python standard library's own
sources, cut into fixed windows (a map-style data set for stalwart.Data)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def load_corpus(max_bytes: int = 4 << 20, root: Path | None = None) -> bytes:
    """The stdlib's top-level `.py` files in sorted order, joined by a blank line, up to
    `max_bytes` (deterministic for one interpreter installation)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; pass root= pointing at text")
    parts, size = [], 0
    for path in files:
        data = path.read_bytes()
        parts.append(data + b"\n\n")
        size += len(data) + 2
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


class TextWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len + 1 bytes as (input, target) token ids."""

    def __init__(self, corpus: bytes, seq_len: int) -> None:
        if len(corpus) < 2 * (seq_len + 1):
            raise ValueError(f"corpus of {len(corpus)} bytes is too short for seq_len={seq_len}")
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // (self.seq_len + 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * (self.seq_len + 1)
        window = self.tokens[start:start + self.seq_len + 1]
        return window[:-1], window[1:]
