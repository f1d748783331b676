"""The GPU image of a `pos run` process: its device buffers in chunks, inside a pos image.
Writing and reading the chunks (compiled: checksums, pointer scans); the index alone is
pos/image/gpuindex.py, which a restore reads before these are imported.

DIR/gpu-index.json lists every buffer saved at the cut (base, size) and its chunks (data file,
position, stored and raw length, 64-bit checksum of the raw bytes, whether zstd-compressed);
the chunks live in DIR/gpu-data-NN.bin, one file per writer thread. The directory is written
as DIR.partial and sealed by pos/image/__init__.py (chunked sha256 of every file in
pos-manifest.json, root-only, renamed to DIR when complete): the same trust as a full image.
An incremental image names its parent; a buffer not written since the parent is listed with
`in_parent` and read from there (recursively).
"""

import os
import threading
from pathlib import Path
from typing import Any

import numba as nb
import numpy as np

from pos.errors import BadInput
from pos.image.checksum import GROUP, absorb, checksum, finish, start

# A reader hashes what it read in pieces this big (a multiple of checksum.GROUP), while they
# are in the CPU's cache: hashing a whole 64 MiB chunk afterwards reads it from memory again.
PIECE = 1 << 20


class Writer:
    """Appends chunks to one data file per writer thread and records them for the index."""

    def __init__(self, folder: Path, compress: bool, level: int = 1) -> None:
        self.folder = folder
        self.compress = compress
        self.level = level
        self.chunks: dict[int, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._files: list[Any] = []
        warm()

    def _file(self) -> tuple[Any, str]:
        f = getattr(self._local, "file", None)
        if f is None:
            with self._lock:
                name = f"gpu-data-{len(self._files):02d}.bin"
                fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                f = os.fdopen(fd, "wb", buffering=0)
                self._files.append(f)
            self._local.file, self._local.name = f, name
        return f, self._local.name

    def put(self, base: int, offset: int, data: np.ndarray) -> int:
        """Checksum, maybe compress, and append one chunk of buffer `base`; bytes stored."""
        h = checksum(data)
        payload: Any = data
        if self.compress:
            import zstandard

            payload = zstandard.ZstdCompressor(level=self.level).compress(data)
        f, name = self._file()
        at = f.tell()
        view = memoryview(payload).cast("B")
        done = 0
        while done < len(view):
            done += f.write(view[done:])
        rec = {"offset": offset, "file": name, "at": at, "stored": len(view),
               "raw": int(data.shape[0]), "hash": f"{h:016x}", "zstd": self.compress}
        with self._lock:
            self.chunks.setdefault(base, []).append(rec)
        return len(view)

    def close(self) -> None:
        for f in self._files:
            os.fsync(f.fileno())
            f.close()


# pread(2), called from compiled code: the whole read of a chunk runs without the GIL (16 reader
# threads taking the GIL for every piece filled at 6 GB/s on the H100 host)
_pread = nb.types.ExternalFunction(
    "pread", nb.types.int64(nb.types.int32, nb.types.uint64, nb.types.uint64, nb.types.int64))


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


@nb.njit(nogil=True, cache=True)
def _point(words: np.ndarray, starts: np.ndarray, ends: np.ndarray, hits: np.ndarray) -> None:
    """hits[j] = 1 for each range j that one of `words` falls into."""
    k = starts.shape[0]
    if k == 0:
        return
    lo, hi = starts[0], ends[k - 1]
    for w in words:
        if w >= lo and w < hi:
            j = np.searchsorted(starts, w, side="right") - 1
            if w < ends[j]:
                hits[j] = 1


@nb.njit(nogil=True, cache=True)
def _read_absorb(fd: int, out: np.ndarray, n: int, at: int, piece: int, lanes: np.ndarray,
                 starts: np.ndarray, ends: np.ndarray, hits: np.ndarray) -> int:
    """Read n bytes at file position `at` into out, piece by piece, running the checksum's lanes
    over each piece's whole groups, and marking the target ranges its words point into, while
    it is in the CPU's cache; the bytes read (fewer: the file ended or the read failed)."""
    whole = n // GROUP * GROUP
    words = n // 8 * 8
    base = out.ctypes.data
    done = 0
    while done < n:
        end = min(done + piece, n)
        got = done
        while got < end:
            r = _pread(fd, base + got, end - got, at + got)
            if r <= 0:
                return got
            got += r
        if min(end, whole) > done:
            absorb(out[done:min(end, whole)].view(np.uint64), lanes)
        if min(end, words) > done:
            _point(out[done:min(end, words)].view(np.uint64), starts, ends, hits)
        done = end
    return n


def warm() -> None:
    """Make the first calls of the compiled reader and checksum on this thread, before many
    threads make theirs: 8 to 16 threads loading them at once waited about 1 s for each other
    (numba's dispatcher) at the start of every fill, against 0.1 s for one thread."""
    buf = np.zeros(GROUP + 9, np.uint8)      # groups, words and a tail: every path
    checksum(buf)
    lanes = start(buf.shape[0])
    fd = os.open("/dev/zero", os.O_RDONLY)
    one = Targets([(0, 1)])
    try:
        _read_absorb(fd, buf, buf.shape[0], 0, PIECE, lanes, one.starts, one.ends, one.hits())
    finally:
        os.close(fd)
    finish(lanes, buf)


def read_chunk_into(folder: Path, chunk: dict[str, Any], out: np.ndarray,
                    fds: dict[str, int], targets: Targets = NO_TARGETS) -> np.ndarray:
    """Read one chunk into out[:raw] and check its checksum, with no intermediate copy for an
    uncompressed chunk (pread straight into `out`, e.g. pinned staging, in pieces of PIECE
    bytes, each hashed while still in the CPU's cache; without the GIL). `fds` caches the open
    data files of the calling thread. Returns the indices of the `targets` that the chunk's
    8-byte words point into."""
    hits = targets.hits()
    if chunk["zstd"]:
        read_chunk(folder, chunk, out)
        n = chunk["raw"] // 8 * 8
        _point(out[:n].view(np.uint64), targets.starts, targets.ends, hits)
        return np.flatnonzero(hits)
    path = str(Path(folder) / chunk["file"])
    fd = fds.get(path)
    if fd is None:
        fd = fds[path] = os.open(path, os.O_RDONLY)
    n = chunk["raw"]
    if chunk["stored"] != n or out.shape[0] < n:
        raise BadInput(f"a chunk of {folder}/{chunk['file']} has an impossible size",
                       "the image is corrupt: take a new checkpoint")
    lanes = start(n)
    if _read_absorb(fd, out, n, chunk["at"], PIECE, lanes, targets.starts, targets.ends,
                    hits) < n:
        raise BadInput(f"{folder}/{chunk['file']} is truncated", "take a new checkpoint")
    if f"{finish(lanes, out[:n]):016x}" != chunk["hash"]:
        raise BadInput(f"a chunk of {folder}/{chunk['file']} does not match its checksum",
                       "the image is corrupt: take a new checkpoint")
    return np.flatnonzero(hits)


def read_chunk(folder: Path, chunk: dict[str, Any], out: np.ndarray) -> None:
    """Read one chunk into out[:raw] (decompressing) and check its checksum."""
    with open(folder / chunk["file"], "rb", buffering=0) as f:
        f.seek(chunk["at"])
        data = f.read(chunk["stored"])
    if len(data) != chunk["stored"]:
        raise BadInput(f"{folder}/{chunk['file']} is truncated", "take a new checkpoint")
    if chunk["zstd"]:
        import zstandard

        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=chunk["raw"])
    raw = np.frombuffer(data, np.uint8)
    if raw.shape[0] != chunk["raw"] or f"{checksum(raw):016x}" != chunk["hash"]:
        raise BadInput(f"a chunk of {folder}/{chunk['file']} does not match its checksum",
                       "the image is corrupt: take a new checkpoint")
    out[: chunk["raw"]] = raw
