"""A pos image: CRIU's files plus pos-manifest.json, in one directory readable by root only.

The image is written into DIR.partial and renamed to DIR only once the manifest (with the sha256
of every file) is on disk, so that a directory named DIR is always complete; anything else is an
interrupted checkpoint and says so in its name. `verify` is what restore trusts.
"""

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from pos.errors import BadInput

FORMAT = 1
MANIFEST = "pos-manifest.json"
PARTIAL_SUFFIX = ".partial"
CHUNK = 8 << 20


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
    driver_version: Optional[str] = None      # NVML's, e.g. 580.159.04
    cuda_version: Optional[int] = None        # cuDriverGetVersion, e.g. 13000
    gpus: list[dict[str, Any]] = field(default_factory=list)   # uuid, name, memory_used
    files: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> size, sha256
    size_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)    # seconds per step
    stall_s: Optional[float] = None           # how long the process could not run
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def partial_path(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL_SUFFIX)


def prepare(final: Path, needed_bytes: int) -> Path:
    """Create DIR.partial (0700) for a new image at `final`, after checking that the image can
    be written there; returns the partial directory."""
    final = final.absolute()
    partial = partial_path(final)
    if final.exists():
        raise BadInput(f"{final} already exists", "give a new directory with -D, or remove it")
    if partial.exists():
        raise BadInput(f"{partial} exists (left by an interrupted checkpoint)",
                       "remove it, or give another directory with -D")
    parent = final.parent
    if not parent.is_dir():
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def checksums(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> {size, sha256}; files hashed in parallel (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda n: _sha256(folder / n), names))
    return {n: {"size": (folder / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(partial: Path, manifest: Manifest) -> Path:
    """Make every file root-only, checksum it, write the manifest, then rename DIR.partial to
    DIR: the image appears complete or not at all."""
    names = sorted(p.name for p in partial.iterdir() if p.is_file() and p.name != MANIFEST)
    for n in names:
        os.chmod(partial / n, 0o600)
    manifest.files = checksums(partial, names)
    manifest.size_bytes = sum(f["size"] for f in manifest.files.values())
    write_manifest(partial, manifest)
    final = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))
    os.rename(partial, final)
    _fsync_dir(final.parent)
    return final


def write_manifest(folder: Path, manifest: Manifest) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, folder / MANIFEST)
    _fsync_dir(folder)


def discard(partial: Path) -> None:
    """Remove an unfinished image (its name ends in .partial: it never looked complete)."""
    if partial.name.endswith(PARTIAL_SUFFIX):
        shutil.rmtree(partial, ignore_errors=True)


def load(folder: Path) -> Manifest:
    """The manifest of the image in `folder`; BadInput when there is none to trust."""
    folder = Path(folder)
    if folder.name.endswith(PARTIAL_SUFFIX):
        raise BadInput(f"{folder} is an incomplete image (an interrupted checkpoint)",
                       "restore from a complete image, or take a new checkpoint")
    if not folder.is_dir():
        raise BadInput(f"{folder} is not a directory", "give the -D of a `pos checkpoint`")
    path = folder / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(f"{folder} is not a complete pos image (no {MANIFEST})",
                       "give the -D of a finished `pos checkpoint`") from None
    except PermissionError:
        raise BadInput(f"cannot read {path} (images are readable by root only)",
                       "run pos with sudo") from None
    try:
        manifest = Manifest.from_json(text)
    except (ValueError, TypeError):
        raise BadInput(f"{path} is not a valid pos manifest",
                       "the image is corrupt: take a new checkpoint") from None
    if manifest.format != FORMAT:
        raise BadInput(f"{folder} is an image of format {manifest.format}, this pos reads "
                       f"{FORMAT}", "restore it with the pos version that wrote it")
    return manifest


def verify(folder: Path) -> Manifest:
    """load + every file present with its recorded size and sha256."""
    manifest = load(folder)
    if not manifest.files:
        raise BadInput(f"{folder} lists no files in its manifest", "take a new checkpoint")
    for name, want in manifest.files.items():
        path = Path(folder) / name
        if not path.is_file():
            raise BadInput(f"image {folder} is incomplete: {name} is missing",
                           "take a new checkpoint")
        if path.stat().st_size != want["size"]:
            raise BadInput(f"image {folder} is corrupt: {name} has {path.stat().st_size} bytes, "
                           f"the manifest says {want['size']}", "take a new checkpoint")
    got = checksums(Path(folder), list(manifest.files))
    for name, want in manifest.files.items():
        if got[name]["sha256"] != want["sha256"]:
            raise BadInput(f"image {folder} is corrupt: the checksum of {name} does not match "
                           "its manifest", "take a new checkpoint")
    return manifest
