"""A pos image: CRIU's files and/or the GPU buffers of a `pos run` job (pos/image/gpu.py)
plus its manifest, in one directory readable by root only (every file's name:
pos/image/names.py; what kind of image a directory holds: pos/image/kinds.py).

The image is written into DIR.partial and renamed to DIR only once the manifest (with the
checksums of every file) is on disk, so that a directory named DIR is always complete; anything
else is an interrupted checkpoint and says so in its name. `verify` is what restore trusts.
Every file's checksums, chunk by chunk on every core: pos/image/filehash.py.
"""

import json
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pos.errors import BadInput, PosError
from pos.image import filehash, names
from pos.image.filehash import Hashed

FORMAT = 3                     # files hashed by fold64 (filehash.py)
READS = (2, 3)                 # 2: by sha256, still read; 1: whole-file sha256, no longer
CHUNK_BYTES = 64 << 20         # hashed by one worker


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
    files: dict[str, dict[str, Any]] = field(default_factory=dict)   # filehash.record by name
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

    def hashes(self) -> list[str]:
        """The names of the hashes its files' checksums were made with."""
        return sorted({named[0].name for rec in self.files.values()
                       if (named := filehash.named(rec)) is not None})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def prepare(final: Path, needed_bytes: int) -> Path:
    """Create DIR.partial (0700) for a new image at `final`, after checking that the image can
    be written there (`check_new`); returns the partial directory."""
    partial = check_new(final, needed_bytes)
    try:
        partial.mkdir(mode=0o700)
    except OSError as e:
        raise BadInput(f"cannot create {partial} ({e.strerror})",
                       "give a writable directory with -D") from None
    return partial


def check_new(final: Path, needed_bytes: int = 0) -> Path:
    """Refuse, in one sentence, a place where a new image at `final` cannot be written (it or
    its DIR.partial exists, no writable folder, too little room); its DIR.partial, not made."""
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
        elif p.name not in (names.MANIFEST, names.MANIFEST_TMP):
            out.append(p.name)
    return sorted(out)


def seal(partial: Path, manifest: Manifest, hashed: Hashed = filehash.no_progress,
         written: Optional[dict[str, filehash.Written]] = None) -> Path:
    """Make every file root-only, checksum it, write the manifest, then rename DIR.partial to
    DIR: the image appears complete or not at all. `written`: files hashed as they were
    written, whose entries are taken as they are where their chunks are CHUNK_BYTES (the
    others are read)."""
    files = [n for n in listing(partial) if (partial / n).is_file()]
    for n in files:
        os.chmod(partial / n, 0o600)
    known = {n: w.record() for n, w in (written or {}).items() if w.chunk_bytes == CHUNK_BYTES}
    for n, rec in known.items():
        if n not in files or (partial / n).stat().st_size != rec["size"]:
            raise PosError(f"{partial / n} does not hold the {rec['size']} bytes written into it",
                           "check the image's file system (full, or written by another program)")
    manifest.chunk_bytes = CHUNK_BYTES
    read = filehash.checksums(partial, [n for n in files if n not in known],
                              manifest.chunk_bytes, hashed)
    manifest.files = {n: known[n] if n in known else read[n] for n in files}
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
    tmp = folder / names.MANIFEST_TMP
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
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{folder} is not a complete pos image (no {names.MANIFEST})",
                       "give the -D of a finished `pos checkpoint`") from None
    except PermissionError as e:
        raise BadInput(f"cannot read {e.filename} (images are readable by root only)",
                       "run pos with sudo") from None
    try:
        manifest = Manifest.from_json(raw.decode())
    except (ValueError, TypeError):       # UnicodeDecodeError is a ValueError
        raise BadInput(f"{path} is not a valid pos manifest",
                       "the image is corrupt: take a new checkpoint") from None
    if manifest.format not in READS:
        raise BadInput(f"{folder} is an image of format {manifest.format}, this pos reads "
                       f"{' and '.join(map(str, READS))}",
                       "restore it with the pos version that wrote it")
    if not _well_formed(manifest):
        raise BadInput(f"{path} is not a valid pos manifest (its file list is malformed)",
                       "the image is corrupt: take a new checkpoint")
    return manifest


def _well_formed(m: Manifest) -> bool:
    """Every file has a size, a hash this pos knows, a digest and one chunk digest per chunk
    (an empty file: one)."""
    if not isinstance(m.chunk_bytes, int) or m.chunk_bytes <= 0 or not isinstance(m.files, dict):
        return False
    for rec in m.files.values():
        if not isinstance(rec, dict):
            return False
        size, chunks = rec.get("size"), rec.get("chunks")
        if not isinstance(size, int) or size < 0 or not isinstance(chunks, list) \
                or filehash.named(rec) is None \
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


def verify(folder: Path, digests: Optional[Sequence[str]] = None,
           hashed: Hashed = filehash.no_progress, stop: Optional[threading.Event] = None
           ) -> Manifest:
    """check_files + the chunk checksums of the listed files (only the files named in
    `digests`, when given: the rest is checked by whoever reads it), each by the hash its
    entry names; `hashed` is told the bytes of each read checked; `stop`: see
    filehash.chunk_digests."""
    folder = Path(folder)
    manifest = check_files(folder)
    check_sums(folder, manifest, digests, hashed, stop)
    return manifest


def check_sums(folder: Path, manifest: Manifest, digests: Optional[Sequence[str]] = None,
               hashed: Hashed = filehash.no_progress, stop: Optional[threading.Event] = None
               ) -> None:
    """The chunk checksums of verify, for an image whose files check_files has checked
    already (`manifest`: what it returned): a restore checks them once, beside CRIU."""
    checked = list(manifest.files) if digests is None else digests
    missing = [n for n in checked if n not in manifest.files]
    if missing:
        raise BadInput(f"image {folder} lacks {', '.join(missing)} in its manifest",
                       "take a new checkpoint")
    how: dict[str, tuple[filehash.Hash, str]] = {}
    for n in checked:
        named = filehash.named(manifest.files[n])
        assert named is not None                   # load refuses a hash this pos does not know
        how[n] = named
    got = filehash.chunk_digests(
        folder, {n: (manifest.files[n]["size"], how[n][0]) for n in checked},
        manifest.chunk_bytes, hashed, stop)
    for name in checked:
        want = manifest.files[name]
        algorithm, digest = how[name]
        for i, (have, rec) in enumerate(zip(got[name], want["chunks"])):
            if have.hex() != rec:
                first = i * manifest.chunk_bytes
                raise corrupt(folder, name, first,
                              min(first + manifest.chunk_bytes, want["size"]) - first)
        if algorithm.file(got[name], want["size"]) != digest:
            raise _unlike_manifest(folder, name)


def corrupt(folder: Path, name: str, at: int, length: int) -> BadInput:
    """What a reader says of `length` bytes at `at` of the image's file `name` that do not
    match their checksum."""
    return BadInput(f"image {folder} is corrupt: bytes {at}-{at + length - 1} of {name} do not "
                    "match their checksum in the manifest", "take a new checkpoint")


def sums(folder: Path, manifest: Manifest, name: str) -> filehash.Sums:
    """The checksums of the image's file `name`, for a reader that checks each chunk as it
    reads it (`manifest`: check_files's): BadInput where the manifest lists no such file, or
    its chunk digests do not make the file's."""
    rec = manifest.files.get(name)
    if rec is None:
        raise BadInput(f"image {folder} lacks {name} in its manifest", "take a new checkpoint")
    named = filehash.named(rec)
    assert named is not None                   # load refuses a hash this pos does not know
    how, digest = named
    chunks = tuple(str(c) for c in rec["chunks"])
    try:
        whole = how.file([bytes.fromhex(c) for c in chunks], rec["size"])
    except ValueError:        # a chunk digest that is no hex
        whole = None
    if whole != digest:
        raise _unlike_manifest(folder, name)
    return filehash.Sums(rec["size"], how, chunks, manifest.chunk_bytes)


def _unlike_manifest(folder: Path, name: str) -> BadInput:
    return BadInput(f"image {folder} is corrupt: the checksum of {name} does not match its "
                    "manifest", "take a new checkpoint")


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
