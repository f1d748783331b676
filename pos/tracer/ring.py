"""Draining the probes' BPF ring buffer in bulk, without a Python call per event.

bcc's `ring_buffer_consume` calls back into Python once per event (a ctypes trampoline plus a
copy: about 1.5 µs each); at 500k launches/s that alone takes most of a core and, sharing the GIL
with decoding, let the ring overflow (bench/results/README.md). Here the ring buffer map is
mmapped as libbpf does it (a writable consumer page at offset 0; the producer page and the data
area, mapped twice in a row, read-only at offset one page), a numba-compiled walk finds the
committed records between the consumer and producer positions, and everything it found leaves
as one `bytes` copy plus per-record arrays. Only then is the consumer position advanced, so the
kernel never overwrites a record before it has been copied.

Record format (kernel/bpf/ringbuf.c): an 8-byte header (u32 length with BUSY bit 31 and DISCARD
bit 30, u32 page offset) then the payload, each record padded to 8 bytes. A BUSY record is
still being written: the walk stops there and takes it next time. x86-64 orders loads with
loads and stores with stores, which is the ordering the protocol needs.
"""

import mmap
from dataclasses import dataclass

import numpy as np
from numba import njit

BUSY = 1 << 31
DISCARD = 1 << 30
HEADER = 8
MAX_RECORDS = 1 << 18            # records per walk; `read` is called again for the rest

# Offsets inside a payload (pos/bpf/events.h): what the parent needs without decoding.
KIND_AT = 16                     # pos_hdr.kind (u16)
WORD_AT = 24                     # first u64 after the header: launch function, small a[0]
LAUNCH_KNOWN_AT = 24 + 46        # pos_launch.layout_known (u8)


def _compiled(f):
    """numba's compilation of `f`, kept in __pycache__ (0.6 s at every start else); not kept
    where numba finds no writable place (a user without a home directory)."""
    try:
        return njit(nogil=True, cache=True)(f)
    except RuntimeError:
        return njit(nogil=True)(f)


@_compiled
def _walk(u8: np.ndarray, mask: int, cons: int, prod: int, offsets: np.ndarray,
          kinds: np.ndarray, words: np.ndarray) -> tuple[int, int]:
    """Committed records from `cons` up to the first busy one: (records, new consumer pos).
    `offsets` are payload offsets from the record at `cons`; `words` the three u64 after the
    payload's header (0 where the payload is shorter)."""
    n = 0
    pos = cons
    while pos < prod and n < offsets.shape[0]:
        i = pos & mask
        length = np.int64(u8[i]) | np.int64(u8[i + 1]) << 8 | np.int64(u8[i + 2]) << 16 | \
            np.int64(u8[i + 3]) << 24
        if length & BUSY:
            break
        size = length & ~(BUSY | DISCARD)
        if not length & DISCARD and size >= WORD_AT:
            p = i + HEADER
            offsets[n] = pos - cons + HEADER
            kinds[n] = np.int64(u8[p + KIND_AT]) | np.int64(u8[p + KIND_AT + 1]) << 8
            for w in range(3):
                v = np.uint64(0)
                at = p + WORD_AT + 8 * w
                if WORD_AT + 8 * w + 8 <= size:
                    for b in range(8):
                        v |= np.uint64(u8[at + b]) << np.uint64(8 * b)
                words[n, w] = v
            n += 1
        pos += (size + HEADER + 7) & ~7
    return n, pos


def warm_up() -> None:
    """Compile the walk (or load it from numba's cache) now, not in the first drain: meanwhile
    the probes would fill the ring and the kernels looked up first would wait for their
    layouts. The tracer runs this in a thread while the kernel loads the probes."""
    _walk(np.zeros(16, np.uint8), 15, 0, 0, np.empty(1, np.int64), np.empty(1, np.int64),
          np.empty((1, 3), np.uint64))


@dataclass
class Batch:
    """Records drained in one walk: `data` holds them back to back as they lay in the ring."""

    data: bytes
    offsets: np.ndarray   # int64, payload offset of each record in `data`
    kinds: np.ndarray     # int64, pos_hdr.kind
    words: np.ndarray     # uint64 (n, 3): the first three u64 after the header

    def __len__(self) -> int:
        return len(self.offsets)


class RingReader:
    """One BPF ring buffer map, read in bulk (see the module docstring)."""

    def __init__(self, map_fd: int, size: int) -> None:
        page = mmap.PAGESIZE
        self.size = size
        self._cons_map = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._prod_map = mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ,
                                   offset=page)
        self._cons = np.frombuffer(self._cons_map, dtype=np.uint64, count=1)
        self._prod = np.frombuffer(self._prod_map, dtype=np.uint64, count=1)
        self._data = np.frombuffer(self._prod_map, dtype=np.uint8, offset=page)
        self._offsets = np.empty(MAX_RECORDS, np.int64)
        self._kinds = np.empty(MAX_RECORDS, np.int64)
        self._words = np.empty((MAX_RECORDS, 3), np.uint64)
        warm_up()

    def read(self) -> Batch:
        """The records committed since the last read (up to MAX_RECORDS), consumed."""
        cons, prod = int(self._cons[0]), int(self._prod[0])
        n, end = _walk(self._data, self.size - 1, cons, prod, self._offsets, self._kinds,
                       self._words)
        start = cons & (self.size - 1)
        data = self._data[start:start + (end - cons)].tobytes()   # contiguous: mapped twice
        self._cons[0] = end                                        # only after the copy
        return Batch(data, self._offsets[:n].copy(), self._kinds[:n].copy(),
                     self._words[:n].copy())

    def close(self) -> None:
        del self._cons, self._prod, self._data
        self._cons_map.close()
        self._prod_map.close()
