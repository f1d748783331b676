"""The 64-bit checksum of GPU chunks, of an image's files (pos/image/filehash.py) and of the
validator's buffer snapshots: one word hash in four lanes, in pos/image/chunks.c, called
through ctypes without the GIL (19-20 GB/s a core on the 2-core build VM, as fast as the numba
loop it replaced; zlib's crc32 1.48 and sha256 0.98 on the H100 host). The hash is stated
there, and in plain Python by tests/image/test_checksum.py. Its buffers are numpy arrays, but it
needs none of numpy itself: every pos command imports the image's modules, and numpy's import
took 0.3 s of a command's start on the H200 host."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from pos import native

if TYPE_CHECKING:
    import numpy as np

LIB = native.load(native.CHUNKS)     # pos/image/gpu.py declares the reader's functions
LIB.pos_fold.restype = ctypes.c_uint64
LIB.pos_fold.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
LIB.pos_fold_start.restype = None
LIB.pos_fold_start.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
LIB.pos_fold_groups.restype = None
LIB.pos_fold_groups.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
LIB.pos_fold_close.restype = ctypes.c_uint64
LIB.pos_fold_close.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
GROUP = 32      # the bytes the hash's four lanes take at a time


def fold(buf: np.ndarray, h: int) -> int:
    """The hash of buf's bytes (contiguous uint8) continuing from h: its 8-byte words, then the
    tail zero-padded to a word."""
    return int(LIB.pos_fold(buf.ctypes.data, buf.shape[0], h))


def checksum(buf: np.ndarray) -> int:
    """A chunk's checksum: its bytes hashed from its length."""
    return fold(buf, buf.shape[0])


class Folding:
    """fold(whole, h) taken over the pieces of `whole` as they come, so that a chunk is hashed
    through a small buffer: every piece but the last a whole number of GROUP bytes."""

    def __init__(self, h: int) -> None:
        self.lanes = (ctypes.c_uint64 * 4)()
        self.n = 0
        LIB.pos_fold_start(h, ctypes.addressof(self.lanes))

    def add(self, piece: np.ndarray) -> None:
        """Fold in a piece (contiguous uint8) that is not the last."""
        if self.n % GROUP:
            raise ValueError("only the last piece may end inside a group")
        LIB.pos_fold_groups(piece.ctypes.data, piece.shape[0] // GROUP,
                            ctypes.addressof(self.lanes))
        self.n += piece.shape[0]

    def close(self, last: np.ndarray) -> int:
        """The hash, with the last piece (possibly empty) folded in."""
        self.add(last)
        whole = last.shape[0] // GROUP * GROUP
        return int(LIB.pos_fold_close(ctypes.addressof(self.lanes), last.ctypes.data + whole,
                                      self.n))
