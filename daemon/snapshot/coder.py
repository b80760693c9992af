"""Reed-Solomon coding of snapshot chunks into k data + m parity shards (zfec).

Data shards are slices of the chunk itself (only the last one is padded), so an
encode computes parity alone. zfec releases the GIL: the placer (place.py) encodes a
capture's chunks on several threads.
"""

from __future__ import annotations

from typing import Protocol

import zfec

Buffer = bytes | bytearray | memoryview


class Codec(Protocol):
    """What the daemon needs from an erasure code; another codec may slot in."""

    k: int
    m: int

    def shard_size(self, size: int) -> int: ...
    def encode(self, chunk: Buffer) -> list[Buffer]: ...
    def decode(self, shards: dict[int, Buffer], size: int) -> bytes: ...


def default_km(nodes: int) -> tuple[int, int]:
    """Default (k, m) for a cluster of `nodes` daemons.

    One node is always left free of a given chunk's shards (k + m <= nodes - 1
    from 4 nodes on) so that a repair after a loss can restore full tolerance
    without doubling up shards on one node. m grows with the cluster because
    simultaneous losses become likelier; k grows to keep the overhead down.
      2 nodes: (1, 1) mirror, overhead 2.0, survives 1 (nothing else fits)
      4 nodes: (2, 1) overhead 1.5, survives 1, one spare for repair
      8 nodes: (4, 2) overhead 1.5, survives 2, two spares
      16 nodes: (8, 3) overhead 1.375, survives 3, five spares
    """
    if nodes < 2:
        return (1, 0)
    if nodes < 4:
        return (1, 1) if nodes == 2 else (2, 1)
    if nodes < 8:
        return (2, 1)
    if nodes < 16:
        return (4, 2)
    return (8, 3)


class ZfecCodec:
    """Systematic Reed-Solomon over GF(2^8) from zfec; shard i < k is data, i >= k parity."""

    def __init__(self, k: int, m: int) -> None:
        if k < 1 or m < 0 or k + m > 256:
            raise ValueError(
                f"erasure code needs k >= 1, m >= 0 and k + m <= 256; got k={k}, m={m}")
        self.k = k
        self.m = m
        self._encoder = zfec.Encoder(k, k + m) if m else None
        self._parity_nums = tuple(range(k, k + m))

    def shard_size(self, size: int) -> int:
        """Bytes per shard for a chunk of `size` bytes (at least 1: zfec needs data)."""
        return max(1, -(-size // self.k))

    def padding(self, size: int) -> int:
        """Zero bytes appended to the last data shard of a `size`-byte chunk."""
        return self.shard_size(size) * self.k - size

    def encode(self, chunk: Buffer) -> list[Buffer]:
        """k data shards (views into `chunk`, last one padded) then m parity shards."""
        view = memoryview(chunk).cast("B")
        size = len(view)
        step = self.shard_size(size)
        data: list[Buffer] = []
        for i in range(self.k):
            piece = view[i * step:(i + 1) * step]
            if len(piece) < step:
                piece = bytes(piece) + bytes(step - len(piece))
            data.append(piece)
        if self._encoder is None:
            return data
        parity = self._encoder.encode(data, self._parity_nums)
        return [*data, *parity]

    def decode(self, shards: dict[int, Buffer], size: int) -> bytes:
        """The original `size` bytes from any k shards {index: bytes}."""
        step = self.shard_size(size)
        usable = {i: s for i, s in shards.items() if 0 <= i < self.k + self.m}
        if len(usable) < self.k:
            raise ValueError(
                f"need {self.k} of {self.k + self.m} shards to decode, got indices "
                f"{sorted(usable)}")
        for i, s in usable.items():
            if len(s) != step:
                raise ValueError(f"shard {i} has {len(s)} bytes, expected {step} for a "
                                 f"{size}-byte chunk with k={self.k}")
        if all(i in usable for i in range(self.k)):
            return b"".join(usable[i] for i in range(self.k))[:size]
        # Prefer data shards: fewer parity shards means less work for the decoder.
        nums = sorted(usable)[: self.k]
        # zfec reorders the sequences it is given in place: hand it fresh lists
        # (the buffers themselves are only read).
        blocks = [usable[i] for i in nums]
        out = zfec.Decoder(self.k, self.k + self.m).decode(blocks, list(nums))
        return b"".join(out)[:size]
