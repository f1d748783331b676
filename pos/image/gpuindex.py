"""The index of a GPU image (DIR/gpu-index.json: every buffer saved and its chunks; see
pos/image/gpu.py), apart from the chunk reader so that a restore reads it, and starts CRIU,
before numpy and the reader's library are loaded. A whole-process image of a job of several
CUDA processes (DDP's ranks) holds one index per process instead (pos/image/names.py).

The index is typed here (GpuIndex, BufferRecord, ChunkRecord); `to_json` writes the keys, and
their order, that pos has always written, so that images taken before and after read alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, TypeVar

from pos.errors import BadInput
from pos.image import names

FORMAT = 1
_T = TypeVar("_T")


# the kinds of a chunk's checksum (pos/image/hash.h): the words' four lanes over the whole
# chunk (made on the CPU), or 4 KiB blocks hashed so and folded (made on the GPU)
HASH_KINDS = ("words", "blocks")


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk of a buffer: `raw` bytes at `offset` in the buffer, stored as `stored` bytes at
    `at` in the data file `file` (zstd-compressed or not); `hash`: pos's 64-bit checksum of
    the raw bytes (pos/image/checksum.py), of kind `kind` (HASH_KINDS; images that name none
    have the first)."""

    offset: int
    file: str
    at: int
    stored: int
    raw: int
    hash: int
    zstd: bool
    kind: str = HASH_KINDS[0]

    def to_json(self) -> dict[str, Any]:
        d = {"offset": self.offset, "file": self.file, "at": self.at, "stored": self.stored,
             "raw": self.raw, "hash": f"{self.hash:016x}", "zstd": self.zstd}
        if self.kind != HASH_KINDS[0]:
            d["hash_kind"] = self.kind
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkRecord:
        kind = _is(str, d.get("hash_kind", HASH_KINDS[0]))
        if kind not in HASH_KINDS:
            raise BadInput(f"a chunk's checksum is of a kind this pos does not know ({kind!r})",
                           "restore the image with the pos that took it, or a newer one")
        return cls(_is(int, d["offset"]), _is(str, d["file"]), _is(int, d["at"]),
                   _is(int, d["stored"]), _is(int, d["raw"]), int(_is(str, d["hash"]), 16),
                   _is(bool, d["zstd"]), kind)


@dataclass(frozen=True)
class BufferRecord:
    """One device allocation of the job at the cut: `base` and `size` (what it asked for),
    `mapped` (rounded up to the allocation granularity: its addresses are [base, base+mapped)),
    the CUDA `device` it lived on; `hot`: the job used it right after its checkpoint released
    it (a restore fills it first); `in_parent`: its chunks are the parent image's (incremental
    images: none are written yet)."""

    base: int
    size: int
    mapped: int
    device: int
    hot: bool = False
    chunks: tuple[ChunkRecord, ...] = ()
    in_parent: bool = False

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base": f"0x{self.base:x}", "size": self.size, "mapped": self.mapped,
                             "device": self.device, "hot": self.hot}
        if self.in_parent:
            d["in_parent"] = True
        d["chunks"] = [c.to_json() for c in self.chunks]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BufferRecord:
        return cls(int(_is(str, d["base"]), 16), _is(int, d["size"]), _is(int, d["mapped"]),
                   _is(int, d["device"]), _is(bool, d.get("hot", False)),
                   tuple(ChunkRecord.from_json(c) for c in d.get("chunks", [])),
                   _is(bool, d.get("in_parent", False)))


@dataclass(frozen=True)
class GpuIndex:
    """The GPU index of one process: its PID (which CRIU restores it with), the UUID of the GPU
    it was taken on (None: NVML saw none), the parent image (incremental images) and every
    buffer, by address."""

    pid: int
    gpu: Optional[str]
    buffers: tuple[BufferRecord, ...]
    parent: Optional[str] = None
    format: int = FORMAT

    @property
    def hot(self) -> frozenset[int]:
        """The buffers (by base address) the job used right after its checkpoint released it:
        a restore fills them first. An image without the mark has none."""
        return frozenset(b.base for b in self.buffers if b.hot)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "pid": self.pid, "parent": self.parent, "gpu": self.gpu,
                "buffers": [b.to_json() for b in self.buffers]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuIndex:
        parent, gpu = d.get("parent"), d.get("gpu")
        return cls(_is(int, d["pid"]), None if gpu is None else _is(str, gpu),
                   tuple(BufferRecord.from_json(b) for b in d["buffers"]),
                   None if parent is None else _is(str, parent), _is(int, d["format"]))


class Saved(NamedTuple):
    """Where a buffer's bytes are: the image folder whose data files hold its chunks (its own,
    or a parent's), its size and its chunks."""

    folder: Path
    size: int
    chunks: tuple[ChunkRecord, ...]


def _is(kind: type[_T], v: Any) -> _T:
    """`v`, which JSON gave for a field of type `kind` (TypeError otherwise: a damaged index)."""
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise TypeError(f"{v!r} is not of type {kind.__name__}")
    return v


def jobs(folder: Path) -> list[Optional[int]]:
    """The jobs whose indexes `folder` holds: [None] for one job's (gpu-index.json), else each
    process's PID (gpu-index-PID.json), or none."""
    folder = Path(folder)
    if (folder / names.INDEX).is_file():
        return [None]
    if not folder.is_dir():
        return []
    ranks = sorted(r for r in (names.rank_of(p.name) for p in folder.iterdir()) if r is not None)
    return list[Optional[int]](ranks)


def write(folder: Path, index: GpuIndex, pid: Optional[int] = None) -> None:
    """Write the index of the job (`pid` None) or of the process `pid` of several; a file of
    that name already there is an error (an image is written once)."""
    fd = os.open(Path(folder) / names.index_name(pid), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(index.to_json(), f, indent=1)


def read(folder: Path, pid: Optional[int] = None) -> GpuIndex:
    """The index of the job (`pid` None) or of the process `pid` of an image of several;
    BadInput when there is none, or none this pos reads."""
    name = names.index_name(pid)
    path = Path(folder) / name
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{folder} is not a GPU image (no {name})",
                       "give the -D of a `pos checkpoint --concurrent`") from None
    except ValueError:
        raise BadInput(f"{path} is not valid JSON", "take a new checkpoint") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else None
        raise BadInput(f"{folder} is a GPU image of format {got}, this pos reads {FORMAT}",
                       "restore it with the pos version that wrote it")
    try:
        return GpuIndex.from_json(d)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise BadInput(f"{path} is not a valid GPU index", "the image is corrupt: take a new "
                       "checkpoint") from None


def saved(folder: Path, index: Optional[GpuIndex] = None) -> dict[int, Saved]:
    """base -> where that buffer's bytes are, following parents for `in_parent`; `index`:
    folder's, when the caller has read it already."""
    index = index if index is not None else read(folder)
    parent: Optional[dict[int, Saved]] = None
    out = {}
    for b in index.buffers:
        if b.in_parent:
            if parent is None:
                if index.parent is None:
                    raise BadInput(f"{folder}'s GPU index names no parent image for buffer "
                                   f"{b.base:#x}", "the image is corrupt: take a new checkpoint")
                parent = saved(Path(index.parent))
            if b.base not in parent or parent[b.base].size != b.size:
                raise BadInput(f"the parent image {index.parent} lacks buffer {b.base:#x}",
                               "restore from a full image")
            out[b.base] = parent[b.base]
        else:
            out[b.base] = Saved(Path(folder), b.size, b.chunks)
    return out
