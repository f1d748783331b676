"""The 64-bit checksum of GPU chunks and of the validator's buffer snapshots: one word hash in
four lanes, in pos/image/chunks.c, called through ctypes without the GIL (19-20 GB/s a core on
the 2-core build VM, as fast as the numba loop it replaced; zlib's crc32 1.48 and sha256 0.98
on the H100 host). The hash is stated there, and in plain Python by
tests/image/test_checksum.py."""

import ctypes

import numpy as np

from pos import native

LIB = native.load(native.CHUNKS)     # pos/image/gpu.py declares the reader's functions
LIB.pos_fold.restype = ctypes.c_uint64
LIB.pos_fold.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]


def fold(buf: np.ndarray, h: int) -> int:
    """The hash of buf's bytes (contiguous uint8) continuing from h: its 8-byte words, then the
    tail zero-padded to a word."""
    return int(LIB.pos_fold(buf.ctypes.data, buf.shape[0], h))


def checksum(buf: np.ndarray) -> int:
    """A chunk's checksum: its bytes hashed from its length."""
    return fold(buf, buf.shape[0])
