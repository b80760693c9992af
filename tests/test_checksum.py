"""CRC32C over any buffer: the standard check value, and no dependence on the buffer type."""

from __future__ import annotations

import mmap

import numpy as np

from stalwart.daemon.snapshot.checksum import crc32c


def test_standard_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283


def test_every_buffer_type_gives_the_same_crc() -> None:
    data = np.random.default_rng(0).bytes(1 << 16)
    expected = crc32c(data)
    with mmap.mmap(-1, len(data)) as shared:  # like a shared-memory capture slot
        shared[:] = data
        views = [bytearray(data), memoryview(data), np.frombuffer(data, np.uint8),
                 np.frombuffer(data, np.float32), memoryview(shared)]
        assert [crc32c(v) for v in views] == [expected] * len(views)
        del views


def test_crc_of_a_slice_and_continuation() -> None:
    data = bytes(range(256)) * 40
    view = memoryview(data)
    assert crc32c(view[100:5000]) == crc32c(data[100:5000])
    assert crc32c(view[2000:], crc32c(view[:2000])) == crc32c(data)
