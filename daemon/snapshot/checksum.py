"""CRC32C (Castagnoli) of chunks and shards, over any buffer without copying it.

google-crc32c's Python entry points accept only `bytes`; for memoryviews, numpy
arrays and shared-memory slots we call the C library it ships (via ctypes, which
also releases the GIL during the call), so a 4 MiB chunk is never duplicated.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import google_crc32c
import numpy as np

# Anything exposing the buffer protocol (collections.abc.Buffer arrives in 3.12).
Buffer = bytes | bytearray | memoryview | np.ndarray


def _load_native() -> ctypes.CDLL | None:
    """The libcrc32c bundled in the google-crc32c wheel, or None when absent."""
    libs = Path(google_crc32c.__file__).parent.parent / "google_crc32c.libs"
    for candidate in sorted(libs.glob("libcrc32c*.so*")):
        lib = ctypes.CDLL(str(candidate))
        lib.crc32c_extend.restype = ctypes.c_uint32
        lib.crc32c_extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    return None


_NATIVE = _load_native()


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC32C of `data` (any contiguous buffer), continuing from `crc`."""
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    view = np.frombuffer(data, dtype=np.uint8)
    if _NATIVE is None:
        # Wheel without the shared library: correct, one copy per call.
        return google_crc32c.extend(crc, view.tobytes())
    return int(_NATIVE.crc32c_extend(crc, view.ctypes.data, view.nbytes))
