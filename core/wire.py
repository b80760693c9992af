"""Protobuf's wire format for the few messages built from parts without a copy into a
message object: many seals parsed in one call, shard pieces framed around the shard's
own bytes. Each helper takes the field from the generated descriptor, so a renumbered
field changes the bytes with it."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.descriptor import Descriptor

Buffer = bytes | bytearray | memoryview
_ONE_BYTE = [bytes([n]) for n in range(0x80)]  # each varint under 128


def varint(n: int) -> bytes:
    """An unsigned integer as protobuf writes it (7 bits a byte, low first)."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tag(message: Descriptor, field: str) -> bytes:
    """The key of a length-delimited `field` of `message` (wire type 2)."""
    return varint(message.fields_by_name[field].number << 3 | 2)


def delimited(key: bytes, parts: Iterable[Buffer]) -> list[Buffer]:
    """Each of `parts` as one length-delimited field under `key`, to be joined."""
    out: list[Buffer] = []
    one = _ONE_BYTE
    for part in parts:
        n = len(part) if type(part) is bytes else memoryview(part).nbytes
        out += (key, one[n] if n < 0x80 else varint(n), part)
    return out
