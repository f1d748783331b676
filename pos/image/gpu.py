"""The GPU image of a `pos run` process: its device buffers in chunks, inside a pos image.
Writing and reading the chunks (checksums and pointer scans in pos/image/chunks.c, without the
GIL); the index alone is pos/image/gpuindex.py, the files' names pos/image/names.py.

The GPU index lists every buffer saved at the cut (base, size) and its chunks (ChunkRecord:
data file, position, stored and raw length, 64-bit checksum of the raw bytes, whether
zstd-compressed); the chunks live in data files, one per writer thread. The directory is
written as DIR.partial and sealed by pos/image/__init__.py (chunked checksums of every file in
the manifest, root-only, renamed to DIR when complete): the same trust as a full image.
An incremental image names its parent; a buffer not written since the parent is listed with
`in_parent` and read from there (recursively).
"""

import ctypes
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pos.errors import BadInput
from pos.image import names
from pos.image.checksum import LIB as _lib
from pos.image.checksum import checksum
from pos.image.gpuindex import HASH_KINDS, ChunkRecord

# A reader hashes what it read in pieces this big (a multiple of the hash's 32-byte groups),
# while they are in the CPU's cache: hashing a whole 64 MiB chunk afterwards reads it from
# memory again.
PIECE = 1 << 20
# the bytes of a block of a checksum of kind `blocks` (pos/image/hash.h)
BLOCK = ctypes.c_size_t.in_dll(_lib, "pos_block").value

_P = ctypes.c_void_p
_lib.pos_point.restype = None
_lib.pos_point.argtypes = [_P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P]
_lib.pos_fold_point.restype = ctypes.c_uint64
_lib.pos_fold_point.argtypes = [_P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P]
_lib.pos_blocks_point.restype = ctypes.c_uint64
_lib.pos_blocks_point.argtypes = [_P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P]
_lib.pos_blocks_fold.restype = ctypes.c_uint64
_lib.pos_blocks_fold.argtypes = [_P, ctypes.c_size_t]
_lib.pos_write_chunk.restype = ctypes.c_int64
_lib.pos_write_chunk.argtypes = [ctypes.c_int, _P, ctypes.c_size_t, ctypes.c_size_t, _P, _P,
                                 ctypes.c_size_t, _P, ctypes.POINTER(ctypes.c_uint64)]
_lib.pos_read_chunk.restype = ctypes.c_int64
_lib.pos_read_chunk.argtypes = [ctypes.c_int, _P, ctypes.c_size_t, ctypes.c_int64,
                                ctypes.c_size_t, ctypes.c_int, _P, _P, ctypes.c_size_t, _P,
                                ctypes.POINTER(ctypes.c_uint64)]
_lib.pos_fill_chunk.restype = ctypes.c_int64
_lib.pos_fill_chunk.argtypes = [_P, ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_size_t,
                                ctypes.c_int64, ctypes.c_int, _P, _P, ctypes.c_size_t, _P,
                                ctypes.POINTER(ctypes.c_uint64)]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = _P
_libc.mmap.argtypes = [_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [_P, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


class Writer:
    """Appends chunks to one data file per writer thread and records them for the index."""

    def __init__(self, folder: Path, compress: bool, level: int = 1,
                 prefix: str = names.data_prefix()) -> None:
        self.folder = folder
        self.prefix = prefix          # how the data files' names begin (names.data_name)
        self.compress = compress
        self.level = level
        self._chunks: dict[int, list[ChunkRecord]] = {}     # by buffer, in the order written
        self._lock = threading.Lock()
        self._local = threading.local()
        self._files: list[Any] = []

    def _file(self) -> tuple[Any, str]:
        f = getattr(self._local, "file", None)
        if f is None:
            with self._lock:
                name = names.data_name(self.prefix, len(self._files))
                fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                f = os.fdopen(fd, "wb", buffering=0)
                self._files.append(f)
            self._local.file, self._local.name = f, name
        return f, self._local.name

    def put(self, base: int, offset: int, data: np.ndarray, h: Optional[int] = None,
            kind: str = HASH_KINDS[0]) -> int:
        """Checksum (unless the caller has: `h`, of kind `kind`), maybe compress, and append
        one chunk of buffer `base`; bytes stored."""
        h = checksum(data) if h is None else h
        payload: Any = data
        if self.compress:
            import zstandard

            payload = zstandard.ZstdCompressor(level=self.level).compress(data.data)
        f, name = self._file()
        at = f.tell()
        view = memoryview(payload).cast("B")
        done = 0
        while done < len(view):
            done += f.write(view[done:])
        self._record(base, ChunkRecord(offset, name, at, len(view), int(data.shape[0]), h,
                                       self.compress, kind))
        return len(view)

    def put_scanned(self, base: int, offset: int, data: np.ndarray, targets: "Targets"
                    ) -> np.ndarray:
        """`put` of one chunk that also says which of the targets its words point into (a
        hits array, as checksum_points). Uncompressed, each piece is hashed and scanned just
        before its write, while it is in the CPU's cache (pos_write_chunk): on the H200 host
        16 threads doing both drained a ring into /dev/shm at 15-20 GB/s, where 16 hashing
        and 16 more writing had managed 14-19 (bench/results/2026-11-29-drain)."""
        if self.compress:
            h, hits = checksum_points(data, targets)
            self.put(base, offset, data, h)
            return hits
        hits, digest = targets.hits(), ctypes.c_uint64()
        f, name = self._file()
        at = f.tell()
        r = _lib.pos_write_chunk(f.fileno(), data.ctypes.data, data.shape[0], PIECE,
                                 targets.starts.ctypes.data, targets.ends.ctypes.data,
                                 targets.starts.shape[0], hits.ctypes.data, ctypes.byref(digest))
        if r != 0:
            raise OSError(-r, f"writing {self.folder / name}: {os.strerror(-r)}")
        n = int(data.shape[0])
        self._record(base, ChunkRecord(offset, name, at, n, n, int(digest.value), False))
        return hits

    def _record(self, base: int, rec: ChunkRecord) -> None:
        """A chunk of buffer `base` written: one more record for the index."""
        with self._lock:
            self._chunks.setdefault(base, []).append(rec)

    def chunks_of(self, base: int) -> tuple[ChunkRecord, ...]:
        """The chunks of buffer `base` written so far, by offset: its BufferRecord's."""
        with self._lock:
            return tuple(sorted(self._chunks.get(base, []), key=lambda c: c.offset))

    def close(self) -> None:
        """Every data file synced and closed (once: again, nothing)."""
        files, self._files = self._files, []
        for f in files:
            os.fsync(f.fileno())
            f.close()


class Targets:
    """The address ranges of an image's buffers (sorted, disjoint): a reader marks which of
    them the 8-byte words it reads point into. A buffer holding pointers to others (an array
    of tensor addresses, a kernel's argument block) is usable only once those are back too."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.starts = np.array([a for a, _ in ranges], np.uint64)
        self.ends = np.array([b for _, b in ranges], np.uint64)

    def hits(self) -> np.ndarray:
        return np.zeros(self.starts.shape[0], np.uint8)


NO_TARGETS = Targets([])


def checksum_points(data: np.ndarray, targets: Targets) -> tuple[int, np.ndarray]:
    """A chunk's checksum (as `checksum`), and which of the targets its words point into
    (a hits array), in one pass."""
    hits = targets.hits()
    h = _lib.pos_fold_point(data.ctypes.data, data.shape[0], targets.starts.ctypes.data,
                            targets.ends.ctypes.data, targets.starts.shape[0], hits.ctypes.data)
    return int(h), hits


def blocks_points(data: np.ndarray, targets: Targets) -> tuple[int, np.ndarray]:
    """checksum_points with a checksum of kind `blocks`, made on the CPU (pos/image/hash.h)."""
    hits = targets.hits()
    h = _lib.pos_blocks_point(data.ctypes.data, data.shape[0], targets.starts.ctypes.data,
                              targets.ends.ctypes.data, targets.starts.shape[0], hits.ctypes.data)
    return int(h), hits


def blocks_fold(hashes: np.ndarray, n: int) -> int:
    """The checksum of kind `blocks` of n bytes from its blocks' hashes (uint64, as the GPU
    made them: pos/image/blocks.cu)."""
    return int(_lib.pos_blocks_fold(hashes.ctypes.data, n))


def _sum(data: np.ndarray, kind: str) -> int:
    """A chunk's checksum of kind `kind`."""
    return checksum(data) if kind == HASH_KINDS[0] else blocks_points(data, NO_TARGETS)[0]


def _point(words: np.ndarray, targets: Targets, hits: np.ndarray) -> None:
    """hits[j] = 1 for each of the targets' ranges j that one of `words` (uint64) falls into."""
    _lib.pos_point(words.ctypes.data, words.shape[0], targets.starts.ctypes.data,
                   targets.ends.ctypes.data, targets.starts.shape[0], hits.ctypes.data)


def _open(folder: Path, chunk: ChunkRecord, fds: dict[str, int]) -> int:
    path = str(Path(folder) / chunk.file)
    fd = fds.get(path)
    if fd is None:
        fd = fds[path] = os.open(path, os.O_RDONLY)
    if chunk.stored != chunk.raw or chunk.raw < 0:
        raise BadInput(f"a chunk of {folder}/{chunk.file} has an impossible size",
                       "the image is corrupt: take a new checkpoint")
    return fd


def _checked(folder: Path, chunk: ChunkRecord, got: int, h: int) -> None:
    if got == -1:
        raise ValueError("a fill piece must be a whole number of the checksum's 32-byte groups "
                         "(4 KiB blocks for a checksum of kind `blocks`)")
    if got < chunk.raw:
        raise BadInput(f"{folder}/{chunk.file} is truncated", "take a new checkpoint")
    if h != chunk.hash:
        raise BadInput(f"a chunk of {folder}/{chunk.file} does not match its checksum",
                       "the image is corrupt: take a new checkpoint")


def read_chunk_into(folder: Path, chunk: ChunkRecord, out: np.ndarray,
                    fds: dict[str, int], targets: Targets = NO_TARGETS) -> np.ndarray:
    """Read one chunk into out[:raw] and check its checksum, with no intermediate copy for an
    uncompressed chunk (pread straight into `out` in pieces of PIECE bytes, each hashed while
    still in the CPU's cache; without the GIL). `fds` caches the open data files of the
    calling thread. Returns the indices of the `targets` that the chunk's 8-byte words point
    into."""
    hits = targets.hits()
    if chunk.zstd:
        read_chunk(folder, chunk, out)
        n = chunk.raw // 8 * 8
        _point(out[:n].view(np.uint64), targets, hits)
        return np.flatnonzero(hits)
    fd = _open(folder, chunk, fds)
    if out.shape[0] < chunk.raw:
        raise ValueError("the output is smaller than the chunk")
    h = ctypes.c_uint64()
    got = _lib.pos_read_chunk(fd, out.ctypes.data, chunk.raw, chunk.at, PIECE,
                              chunk.kind == "blocks", targets.starts.ctypes.data,
                              targets.ends.ctypes.data,
                              targets.starts.shape[0], hits.ctypes.data, ctypes.byref(h))
    _checked(folder, chunk, got, h.value)
    return np.flatnonzero(hits)


class Maps:
    """An image's data files, each mapped read-only once for all the fill's threads: a chunk
    is then copied out of the page cache by the CPU, without a read call per piece (the kernel
    copies 4 KiB pages one by one there). A chunk that reaches past its file's end is refused
    before it is touched, and one whose pages the kernel cannot map (an I/O error) is read
    with pread instead, so that a bad file is a clear error rather than a SIGBUS (short of a
    file that shrinks while it is being copied: images are sealed and root-only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[int, int]] = {}      # path -> (address, size)

    def address(self, folder: Path, chunk: ChunkRecord) -> int:
        """Where the chunk's data file is mapped (its byte 0)."""
        path = str(Path(folder) / chunk.file)
        with self._lock:
            if path not in self._maps:
                fd = os.open(path, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    at = _libc.mmap(None, max(size, 1), mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                finally:
                    os.close(fd)
                if at in (None, MAP_FAILED):
                    raise OSError(ctypes.get_errno(), f"mapping {path} failed")
                self._maps[path] = (at, size)
            at, size = self._maps[path]
        if chunk.at < 0 or chunk.at + chunk.raw > size:
            raise BadInput(f"{folder}/{chunk.file} is truncated", "take a new checkpoint")
        return at

    def close(self) -> None:
        with self._lock:
            for at, size in self._maps.values():
                _libc.munmap(at, max(size, 1))
            self._maps = {}


def fill_chunk(ring: Any, folder: Path, chunk: ChunkRecord, dst: int, fds: dict[str, int],
               targets: Targets = NO_TARGETS, maps: Optional[Maps] = None) -> np.ndarray:
    """Copy one uncompressed chunk to device memory at dst through a fill thread's ring
    (pos/concurrent/gpucopy.py Ring) and check its checksum; like read_chunk_into otherwise, but
    copied out of `maps` when given (read from `fds`' file where its pages cannot be mapped).
    The copies may still run when this returns, or raises: the caller waits for the ring's
    stream before it counts the memory back or frees anything."""
    from pos.driver import DriverError, driver

    hits = targets.hits()
    fd = _open(folder, chunk, fds)
    h = ctypes.c_uint64()
    src = maps.address(folder, chunk) if maps is not None else None
    got = _lib.pos_fill_chunk(ctypes.addressof(ring), fd, src, dst, chunk.raw, chunk.at,
                              chunk.kind == "blocks", targets.starts.ctypes.data,
                              targets.ends.ctypes.data,
                              targets.starts.shape[0], hits.ctypes.data, ctypes.byref(h))
    if got == -2:
        drv = driver()
        raise DriverError("the fill's copy to the device (cuMemcpyHtoDAsync_v2, cuEventRecord "
                          "or cuEventSynchronize)", ring.error, drv.error_name(ring.error))
    _checked(folder, chunk, got, h.value)
    return np.flatnonzero(hits)


def read_chunk(folder: Path, chunk: ChunkRecord, out: np.ndarray) -> None:
    """Read one chunk into out[:raw] (decompressing) and check its checksum."""
    with open(folder / chunk.file, "rb", buffering=0) as f:
        f.seek(chunk.at)
        data = f.read(chunk.stored)
    if len(data) != chunk.stored:
        raise BadInput(f"{folder}/{chunk.file} is truncated", "take a new checkpoint")
    if chunk.zstd:
        import zstandard

        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=chunk.raw)
    raw = np.frombuffer(data, np.uint8)
    if raw.shape[0] != chunk.raw or _sum(raw, chunk.kind) != chunk.hash:
        raise BadInput(f"a chunk of {folder}/{chunk.file} does not match its checksum",
                       "the image is corrupt: take a new checkpoint")
    out[: chunk.raw] = raw
