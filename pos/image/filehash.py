"""The checksums of an image's files, as its manifest records them (pos/image/__init__.py).

Each file is cut into chunks of the manifest's `chunk_bytes`; every chunk gets a digest and the
file's digest is made of its chunk digests, in order. CRIU puts nearly all of an image in one
pages-*.img, so hashing whole files in parallel would leave one thread doing the work (0.85
GB/s on the H100 host: 21 s for 17 GiB); chunks spread one file over every core, each thread
reading through a reusable buffer (the hashes let go of the GIL). The manifest keeps the chunk
digests, so a mismatch names the bytes.

A file's record names the hash that made it, and one verify serves every hash:
- fold64 (format 3, written): pos's 64-bit word hash (pos/image/chunks.c, 19-20 GB/s a core),
  the one of GPU chunks; a restore waits for this check before the restored tree may run, and
  sha256 took 9.4 s for a 14 GB image on the H200 host. From the page cache of the 2-core VM:
  11.1 GB/s against sha256's 3.2, x3.5 (bench/results/2026-11-27/image-checksum-vm.json).
- sha256 (format 2, read): the record has no `hash`; its `sha256` is the file's digest.
"""

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from pos.image.checksum import Folding, fold

if TYPE_CHECKING:      # imported where used: every pos command imports this module
    import numpy as np

# One preadv into a worker's reusable buffer (a whole number of the fold's groups). 1 MiB stays in
# the core's cache between the copy and the hash: on the 2-core VM fold64 ran 4-5% faster than
# through 8 MiB, and 23% faster than straight from an mmap of a file written 4 KiB at a time (the
# mmap won by 10% for one written 16 MiB at a time; bench/results/2026-11-27/image-checksum-*);
# and a read, unlike a mapping, cannot SIGBUS when a file is cut short meanwhile.
READ_BYTES = 1 << 20

Hashed = Callable[[int], None]
Pieces = Iterator[tuple["np.ndarray", bool]]   # a chunk's bytes as read, and whether the last


def no_progress(_done: int) -> None:
    """The `hashed` of callers that show no progress."""


def workers() -> int:
    """Threads that hash: one per core (the work is hashing over the page cache or a disk)."""
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Hash:
    """One way to checksum a file: the name its records carry, a chunk's digest from its bytes
    (read piece by piece) and its place, and the file's digest (hex) from its chunk digests."""

    name: str
    chunk: Callable[[Pieces, int, int], bytes]           # pieces, length, index
    file: Callable[[list[bytes], int], str]              # chunk digests, the file's size


def _sha256_chunk(pieces: Pieces, _length: int, _index: int) -> bytes:
    h = hashlib.sha256()
    for piece, _last in pieces:
        h.update(piece.data)
    return h.digest()


def _sha256_file(chunks: list[bytes], _size: int) -> str:
    return hashlib.sha256(b"".join(chunks)).hexdigest()


def fold_seed(length: int, index: int) -> int:
    """What a chunk's fold starts from: its length and its index in the file, in one word
    (lengths below 1 TiB). The fold pads a short tail with zeros, so without the length "ab"
    and "ab\\0" would hash alike; with the index a digest holds only at its own place, so bytes
    moved to another chunk (a reordered or misassembled copy) fail even where the manifest's
    chunk list moved with them."""
    return index << 40 | length


def _fold_chunk(pieces: Pieces, length: int, index: int) -> bytes:
    f = Folding(fold_seed(length, index))
    for piece, last in pieces:
        if last:
            return f.close(piece).to_bytes(8, "big")
        f.add(piece)
    raise AssertionError("a chunk's pieces end with the last")


def _fold_file(chunks: list[bytes], size: int) -> str:
    import numpy as np

    return f"{fold(np.frombuffer(b''.join(chunks), np.uint8), size):016x}"


SHA256 = Hash("sha256", _sha256_chunk, _sha256_file)
FOLD64 = Hash("fold64", _fold_chunk, _fold_file)
HASHES = {h.name: h for h in (SHA256, FOLD64)}
WRITTEN = FOLD64


@dataclass(frozen=True)
class Sums:
    """One file's checksums as its manifest records them, for a reader that checks each chunk
    as it reads it rather than the whole file first."""

    size: int
    how: Hash
    chunks: tuple[str, ...]     # each chunk's digest, hex
    chunk_bytes: int

    def span(self, i: int) -> tuple[int, int]:
        """Where chunk `i` begins in the file, and its bytes."""
        at = i * self.chunk_bytes
        return at, min(self.chunk_bytes, self.size - at)

    def read(self, i: int, fd: int, into: "np.ndarray") -> bool:
        """Chunk `i` read from fd (the file) into the start of `into` (contiguous uint8), then
        hashed whole: whether all of it came and is as the manifest has it. (Hashed a MiB at a
        time as read, while the cache held it, 95.5 GB filled in 5.5 s against 4.1 s: the
        loop's Python, under the GIL, on 16 threads; bench/results/2026-12-01.md.)"""
        at, n = self.span(i)
        data = into[:n]
        return (read_at(fd, data, at) == n and
                self.how.chunk(iter([(data, True)]), n, i).hex() == self.chunks[i])


def record(size: int, how: Hash, chunks: list[bytes]) -> dict[str, Any]:
    """A file's entry in the manifest's `files`."""
    return {"size": size, "hash": how.name, "digest": how.file(chunks, size),
            "chunks": [d.hex() for d in chunks]}


class Written:
    """A file's manifest entry by fold64 made as the file is written, so that the seal need not
    read it again: each piece is folded in just before it is written. Sealing read the 95.5 GB
    of a 60% job's own memory back in 6.1-10.4 s (bench/results/2026-12-01.md)."""

    def __init__(self, size: int, chunk_bytes: int) -> None:
        """`size`: the bytes the file will hold (each chunk's digest starts from its length)."""
        self.size, self.chunk_bytes = size, chunk_bytes
        self.done = 0
        self.digests: list[bytes] = []
        self._fold: Optional[Folding] = None

    def add(self, data: "np.ndarray") -> None:
        """The file's next bytes (contiguous uint8; every call's a whole number of the fold's
        groups, but the file's last)."""
        at = 0
        while at < data.shape[0]:
            i, into = divmod(self.done, self.chunk_bytes)
            length = min(self.chunk_bytes, self.size - i * self.chunk_bytes)
            if length - into <= 0:
                raise ValueError(f"more than the {self.size} bytes announced")
            if self._fold is None:
                self._fold = Folding(fold_seed(length, i))
            take = min(data.shape[0] - at, length - into)
            if into + take == length:
                self.digests.append(self._fold.close(data[at:at + take]).to_bytes(8, "big"))
                self._fold = None
            else:
                self._fold.add(data[at:at + take])
            at += take
            self.done += take

    def record(self) -> dict[str, Any]:
        """The file's entry, once all of its bytes came."""
        if not self.size:       # an empty file: one empty chunk
            import numpy as np

            return record(0, FOLD64, [FOLD64.chunk(iter([(np.empty(0, np.uint8), True)]), 0, 0)])
        if self.done != self.size:
            raise ValueError(f"{self.done} of the {self.size} bytes announced came")
        return record(self.size, FOLD64, self.digests)


def named(rec: dict[str, Any]) -> Optional[tuple[Hash, str]]:
    """The hash a file's entry was made with and the file's digest it records; None when it
    names no hash this pos knows. Entries of format 2 name none: theirs is sha256."""
    if "hash" in rec:
        how, digest = HASHES.get(str(rec["hash"])), rec.get("digest")
    else:
        how, digest = SHA256, rec.get("sha256")
    return (how, digest) if how is not None and isinstance(digest, str) else None


_local = threading.local()


def read_at(fd: int, view: "np.ndarray", offset: int) -> int:
    """Fill `view` from `offset` of fd; fewer bytes only where the file ends."""
    got = 0
    while got < view.shape[0]:
        n = os.preadv(fd, [view[got:].data], offset + got)
        if n == 0:
            break
        got += n
    return got


def _pieces(fd: int, offset: int, length: int, hashed: Hashed) -> Pieces:
    """The `length` bytes at `offset` of fd, READ_BYTES at a time through this thread's
    reusable buffer, each with whether it is the last (an empty chunk: one empty piece);
    `hashed` is told each piece's bytes. A file that ends early (truncated meanwhile) ends
    with a short piece: the digest differs."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        import numpy as np

        buf = _local.buf = np.empty(READ_BYTES, np.uint8)
    done = 0
    while True:
        want = min(READ_BYTES, length - done)
        got = read_at(fd, buf[:want], offset + done)
        if got:
            hashed(got)
        done += got
        last = done == length or got < want
        yield buf[:got], last
        if last:
            return


class Stopped(Exception):
    """A check stopped before its end (its `stop` was set): it says nothing of the image."""


def chunk_digests(folder: Path, files: dict[str, tuple[int, Hash]], chunk_bytes: int,
                  hashed: Hashed = no_progress, stop: Optional[threading.Event] = None
                  ) -> dict[str, list[bytes]]:
    """name -> the digest of each `chunk_bytes` chunk of the file's first `size` bytes, by its
    Hash (files: name -> (size, Hash)), every chunk of every file hashed by a pool of
    `workers()` threads; `hashed` is told the bytes of each read done (progress on a terminal).
    Once `stop` is set no chunk is begun, and Stopped is raised (a restore that ends does not
    wait for gigabytes hashed)."""

    def one(task: tuple[str, int, int]) -> bytes:
        name, at, length = task
        if stop is not None and stop.is_set():
            raise Stopped()
        return files[name][1].chunk(_pieces(fds[name], at, length, hashed), length,
                                    at // chunk_bytes)

    fds: dict[str, int] = {}
    try:
        for n in files:
            fds[n] = os.open(folder / n, os.O_RDONLY)
        tasks = [(n, at, min(chunk_bytes, size - at))
                 for n, (size, _how) in files.items() for at in range(0, max(size, 1), chunk_bytes)]
        with ThreadPoolExecutor(max_workers=workers()) as pool:
            digests = list(pool.map(one, tasks))
    finally:
        for fd in fds.values():
            os.close(fd)
    out: dict[str, list[bytes]] = {n: [] for n in files}
    for (n, _at, _len), d in zip(tasks, digests):
        out[n].append(d)
    return out


def checksums(folder: Path, names: list[str], chunk_bytes: int,
              hashed: Hashed = no_progress) -> dict[str, dict[str, Any]]:
    """name -> its manifest entry, by the hash new images are written with."""
    files = {n: ((folder / n).stat().st_size, WRITTEN) for n in names}
    digests = chunk_digests(folder, files, chunk_bytes, hashed)
    return {n: record(files[n][0], WRITTEN, digests[n]) for n in names}
