"""A pos image: CRIU's files and/or the GPU buffers of a `pos run` job (pos/image/gpu.py)
plus its manifest, in one directory readable by root only (every file's name:
pos/image/names.py; what kind of image a directory holds: pos/image/kinds.py).

The image is written into DIR.partial and renamed to DIR only once the manifest (with the
checksums of every file) is on disk, so that a directory named DIR is always complete; anything
else is an interrupted checkpoint and says so in its name. `verify` is what restore trusts.

Checksums: each file is cut into chunks of `CHUNK_BYTES`, every chunk gets its sha256, and the
file's digest is the sha256 of its chunk digests (in order). CRIU puts nearly all of an image in
one pages-*.img, so hashing whole files in parallel would leave one thread doing the work (0.85
GB/s on the H100 host: 21 s for 17 GiB); chunks spread one file over every core (hashlib drops
the GIL while it hashes). The manifest keeps the chunk digests, so a mismatch names the bytes.
"""

import hashlib
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from pos.errors import BadInput
from pos.image import names

FORMAT = 2                     # 1: whole-file sha256 (no longer written or read)
CHUNK_BYTES = 64 << 20         # hashed by one worker
READ_BYTES = 8 << 20           # one pread into a worker's reusable buffer


@dataclass
class Manifest:
    """What an image holds and how it was taken (also a row of the store's `images`)."""

    pid: int                                  # the root of the dumped tree
    pids: list[int]                           # every process of the tree
    gpu_pids: list[int]                       # those with CUDA state (driver checkpoint)
    comm: str
    cmdline: str
    created_at: str                           # ISO 8601, UTC
    host: str
    kernel: str
    criu_version: str
    criu_options: dict[str, Any]
    leave_running: bool
    driver_version: Optional[str] = None      # the kernel module's, e.g. 580.159.04
    cuda_version: Optional[int] = None        # cuDriverGetVersion, e.g. 13000
    gpus: list[dict[str, Any]] = field(default_factory=list)   # uuid, name, memory_used, index
    logs: dict[str, int] = field(default_factory=dict)   # path -> size at the dump (procs.logs)
    tcp_listen: list[int] = field(default_factory=list)  # the TCP ports the tree listened on
    files: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> size, sha256, chunks
    chunk_bytes: int = CHUNK_BYTES            # what files[*].chunks were computed over
    size_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)    # seconds per step
    stall_s: Optional[float] = None           # how long the process could not run
    predumped: Optional[bool] = None          # whole-process concurrent images: CRIU copied the
                                              # host memory before the freeze (names.PARENT);
                                              # None: another engine, which never pre-dumps
    predump_note: str = ""                    # why it did not, or how its pre-dump failed
    inner_pids: list[int] = field(default_factory=list)   # each of `pids` as the tree sees it,
                                              # where it has PID and network namespaces of its
                                              # own (pos run --clonable): each restore makes new
                                              # ones, so the image restores many times at once
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def prepare(final: Path, needed_bytes: int) -> Path:
    """Create DIR.partial (0700) for a new image at `final`, after checking that the image can
    be written there; returns the partial directory."""
    final = final.absolute()
    partial = names.partial(final)
    if final.exists():
        raise BadInput(f"{final} already exists", "give a new directory with -D, or remove it")
    if partial.exists():
        raise BadInput(f"{partial} exists (left by an interrupted checkpoint)",
                       "remove it, or give another directory with -D")
    parent = final.parent
    if not parent.is_dir():
        blocker = file_in_the_way(parent)
        if blocker is not None:
            raise BadInput(f"{blocker} is a file, not a folder", "give -D a path under a folder")
        raise BadInput(f"the folder {parent} does not exist", "create it, or give another -D")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"the folder {parent} is not writable", "give a writable directory with -D")
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if free < needed_bytes:
        raise BadInput(f"{parent} has {free / 2**20:.1f} MiB free and the image needs about "
                       f"{needed_bytes / 2**20:.1f} MiB", "free space there or give another -D")
    try:
        partial.mkdir(mode=0o700)
    except OSError as e:
        raise BadInput(f"cannot create {partial} ({e.strerror})",
                       "give a writable directory with -D") from None
    return partial


def file_in_the_way(path: Path) -> Optional[Path]:
    """The nearest of `path` and its parents that exists and is not a folder: why a folder at
    `path` cannot be made (None when the nearest that exists is a folder)."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return None if p.is_dir() else p
    return None


def writable_root(root: str) -> str:
    """ROOT as an absolute path, created (0700) if missing, after a real write into it (root
    ignores permission bits, not read-only mounts): where a schedule's images go."""
    path = Path(root).absolute()
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise BadInput(f"-D {root} cannot be a directory: {blocker} is a file",
                       "give a directory on a writable file system with free space")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(tempfile.mkstemp(dir=path, prefix=".pos-probe-")[0])
        for probe in path.glob(".pos-probe-*"):
            probe.unlink()
    except OSError as e:
        raise BadInput(f"-D {root} is not a writable directory ({e.strerror})",
                       "give a directory on a writable file system with free space") from None
    return str(path)


def workers() -> int:
    """Threads that hash: one per core (the work is sha256 over the page cache or a disk)."""
    return os.cpu_count() or 1


_local = threading.local()
Hashed = Callable[[int], None]


def _nothing(_done: int) -> None:
    """The `hashed` of callers that show no progress."""


def _hash_range(fd: int, offset: int, length: int, hashed: Hashed = _nothing) -> bytes:
    """sha256 of `length` bytes at `offset` of `fd`, read into this thread's reusable buffer;
    `hashed` told each read's bytes. A file that ends early (truncated meanwhile) hashes what
    is there: the digest differs."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    h = hashlib.sha256()
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [view[:min(READ_BYTES, end - offset)]], offset)
        if n == 0:
            break
        h.update(view[:n])
        hashed(n)
        offset += n
    return h.digest()


class Stopped(Exception):
    """A check stopped before its end (its `stop` was set): it says nothing of the image."""


def chunk_digests(folder: Path, sizes: dict[str, int], chunk_bytes: int,
                  hashed: Hashed = _nothing, stop: Optional[threading.Event] = None
                  ) -> dict[str, list[bytes]]:
    """name -> the sha256 of each `chunk_bytes` chunk of the first `sizes[name]` bytes of the
    file, every chunk of every file hashed by a pool of `workers()` threads; `hashed` is told
    the bytes of each read done (progress on a terminal). Once `stop` is set no chunk is
    begun, and Stopped is raised (a restore that ends does not wait for gigabytes hashed)."""

    def one(task: tuple[str, int, int]) -> bytes:
        if stop is not None and stop.is_set():
            raise Stopped()
        return _hash_range(fds[task[0]], task[1], task[2], hashed)

    fds: dict[str, int] = {}
    try:
        for n in sizes:
            fds[n] = os.open(folder / n, os.O_RDONLY)
        tasks = [(n, at, min(chunk_bytes, size - at))
                 for n, size in sizes.items() for at in range(0, max(size, 1), chunk_bytes)]
        with ThreadPoolExecutor(max_workers=workers()) as pool:
            digests = list(pool.map(one, tasks))
    finally:
        for fd in fds.values():
            os.close(fd)
    out: dict[str, list[bytes]] = {n: [] for n in sizes}
    for (n, _at, _len), d in zip(tasks, digests):
        out[n].append(d)
    return out


def file_digest(chunks: list[bytes]) -> str:
    """A file's digest: the sha256 of its chunk digests, in order."""
    return hashlib.sha256(b"".join(chunks)).hexdigest()


def checksums(folder: Path, files: list[str], chunk_bytes: int,
              hashed: Hashed = _nothing) -> dict[str, dict[str, Any]]:
    """name -> {size, sha256 (of the chunk digests), chunks (hex digest of each chunk)}."""
    sizes = {n: (folder / n).stat().st_size for n in files}
    digests = chunk_digests(folder, sizes, chunk_bytes, hashed)
    return {n: {"size": sizes[n], "sha256": file_digest(digests[n]),
                "chunks": [d.hex() for d in digests[n]]} for n in files}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listing(folder: Path) -> list[str]:
    """What an image's folder holds but its manifest, by name: its files, and the files of a
    pre-dump's folder as PARENT/NAME (names.PARENT); anything else by its own name."""
    out = []
    for p in folder.iterdir():
        if p.name == names.PARENT and p.is_dir() and not p.is_symlink():
            out += [f"{names.PARENT}/{q.name}" for q in p.iterdir()]
        elif p.name != names.MANIFEST:
            out.append(p.name)
    return sorted(out)


def seal(partial: Path, manifest: Manifest, hashed: Hashed = _nothing) -> Path:
    """Make every file root-only, checksum it, write the manifest, then rename DIR.partial to
    DIR: the image appears complete or not at all."""
    files = [n for n in listing(partial) if (partial / n).is_file()]
    for n in files:
        os.chmod(partial / n, 0o600)
    manifest.chunk_bytes = CHUNK_BYTES
    manifest.files = checksums(partial, files, manifest.chunk_bytes, hashed)
    manifest.size_bytes = sum(f["size"] for f in manifest.files.values())
    write_manifest(partial, manifest)
    return _publish(partial)


def adopt(partial: Path, manifest: Manifest) -> Path:
    """Seal an image that came whole from another host with its manifest: the sender's manifest
    written as it is (hashing gigabytes again here would only delay the restore, which checks
    the checksums as a local restore does; `pos inspect --verify` checks them all), the files
    checked against it for names and sizes, made root-only, then DIR.partial renamed DIR."""
    _same_files(partial, manifest)
    write_manifest(partial, manifest)
    for n in manifest.files:
        os.chmod(partial / n, 0o600)
    return _publish(partial)


def _publish(partial: Path) -> Path:
    final = partial.with_name(partial.name.removesuffix(names.PARTIAL_SUFFIX))
    os.rename(partial, final)
    _fsync_dir(final.parent)
    return final


def write_manifest(folder: Path, manifest: Manifest) -> None:
    tmp = folder / (names.MANIFEST + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, folder / names.MANIFEST)
    _fsync_dir(folder)


def discard(partial: Path) -> None:
    """Remove an unfinished image (its name ends in .partial: it never looked complete)."""
    if names.is_partial(partial.name):
        shutil.rmtree(partial, ignore_errors=True)


def load(folder: Path) -> Manifest:
    """The manifest of the image in `folder`; BadInput when there is none to trust."""
    folder = Path(folder)
    if names.is_partial(folder.name):
        raise BadInput(f"{folder} is an incomplete image (an interrupted checkpoint)",
                       "restore from a complete image, or take a new checkpoint")
    path = folder / names.MANIFEST
    try:
        if not folder.is_dir():
            raise BadInput(f"{folder} is not a directory", "give the -D of a `pos checkpoint`")
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(f"{folder} is not a complete pos image (no {names.MANIFEST})",
                       "give the -D of a finished `pos checkpoint`") from None
    except PermissionError as e:
        raise BadInput(f"cannot read {e.filename} (images are readable by root only)",
                       "run pos with sudo") from None
    try:
        manifest = Manifest.from_json(text)
    except (ValueError, TypeError):
        raise BadInput(f"{path} is not a valid pos manifest",
                       "the image is corrupt: take a new checkpoint") from None
    if manifest.format != FORMAT:
        raise BadInput(f"{folder} is an image of format {manifest.format}, this pos reads "
                       f"{FORMAT}", "restore it with the pos version that wrote it")
    if not _well_formed(manifest):
        raise BadInput(f"{path} is not a valid pos manifest (its file list is malformed)",
                       "the image is corrupt: take a new checkpoint")
    return manifest


def _well_formed(m: Manifest) -> bool:
    """Every file has a size, a digest and one chunk digest per chunk (an empty file: one)."""
    if not isinstance(m.chunk_bytes, int) or m.chunk_bytes <= 0 or not isinstance(m.files, dict):
        return False
    for rec in m.files.values():
        if not isinstance(rec, dict):
            return False
        size, chunks = rec.get("size"), rec.get("chunks")
        if not isinstance(size, int) or size < 0 or not isinstance(chunks, list) \
                or not isinstance(rec.get("sha256"), str) \
                or len(chunks) != max(1, -(-size // m.chunk_bytes)):
            return False
    return True


def check_files(folder: Path) -> Manifest:
    """load + the folder holds exactly the manifest's files, each of its recorded size: what
    can be checked at once, before anything runs (a file cut short sent CRIU's restorer into
    an endless loop of short reads, issue 26)."""
    folder = Path(folder)
    manifest = load(folder)
    _same_files(folder, manifest)
    return manifest


def verify(folder: Path, digests: Optional[list[str]] = None,
           hashed: Hashed = _nothing, stop: Optional[threading.Event] = None) -> Manifest:
    """check_files + the chunk checksums of the listed files (only the files named in
    `digests`, when given: the rest is checked by whoever reads it); `hashed` is told the
    bytes of each chunk checked; `stop`: see chunk_digests."""
    folder = Path(folder)
    manifest = check_files(folder)
    checked = list(manifest.files) if digests is None else digests
    missing = [n for n in checked if n not in manifest.files]
    if missing:
        raise BadInput(f"image {folder} lacks {', '.join(missing)} in its manifest",
                       "take a new checkpoint")
    got = chunk_digests(folder, {n: manifest.files[n]["size"] for n in checked},
                        manifest.chunk_bytes, hashed, stop)
    for name in checked:
        want = manifest.files[name]
        for i, (have, rec) in enumerate(zip(got[name], want["chunks"])):
            if have.hex() != rec:
                first = i * manifest.chunk_bytes
                last = min(first + manifest.chunk_bytes, want["size"]) - 1
                raise BadInput(f"image {folder} is corrupt: bytes {first}-{last} of {name} do "
                               "not match their checksum in the manifest",
                               "take a new checkpoint")
        if file_digest(got[name]) != want["sha256"]:
            raise BadInput(f"image {folder} is corrupt: the checksum of {name} does not match "
                           "its manifest", "take a new checkpoint")
    return manifest


def _same_files(folder: Path, manifest: Manifest) -> None:
    """The folder holds exactly the manifest's files, each of its recorded size."""
    if not manifest.files:
        raise BadInput(f"{folder} lists no files in its manifest", "take a new checkpoint")
    for name, want in manifest.files.items():
        path = folder / name
        if not path.is_file():
            raise BadInput(f"image {folder} is incomplete: {name} is missing",
                           "take a new checkpoint")
        if path.stat().st_size != want["size"]:
            raise BadInput(f"image {folder} is corrupt: {name} has {path.stat().st_size} bytes, "
                           f"the manifest says {want['size']}", "take a new checkpoint")
    extra = [n for n in listing(folder) if n not in manifest.files]
    if extra:
        raise BadInput(f"image {folder} holds {', '.join(extra)}, which its manifest does not "
                       "list", "remove what was added, or take a new checkpoint")
