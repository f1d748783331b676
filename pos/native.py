"""pos's C parts: the agent that `pos run` preloads into a job (agent/hook/*.c, one file per
concern) and the image's chunk reader and checksum (image/chunks.c). They are compiled from
source with the distribution's C compiler, by `scripts/setup.sh` (`python -m pos.native`) or on
first use, next to their sources (or under POS_HOOK_DIR when the package folder is
read-only).

The GPU's checksum kernel (image/blocks.cu) ships as the PTX that nvcc made of it
(image/blocks.ptx: hosts that run pos seldom have nvcc; the driver compiles PTX for its GPU),
which names the digest of the sources it was made from; `python -m pos.native --ptx` makes it
again after they change."""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pos.errors import PosError

PACKAGE = Path(__file__).resolve().parent
HOOK, CHUNKS = "libposhook.so", "libposchunks.so"
# each library's folder, its sources there, and what it links
LIBRARIES: dict[str, tuple[Path, tuple[str, ...], tuple[str, ...]]] = {
    HOOK: (PACKAGE / "agent" / "hook", ("*.c",), ("-ldl", "-lpthread")),
    CHUNKS: (PACKAGE / "image", ("chunks.c",), ()),
}
CFLAGS = ["-O3", "-g", "-Wall", "-Wextra", "-fPIC", "-shared", "-fvisibility=hidden"]
PTX = PACKAGE / "image" / "blocks.ptx"
PTX_SOURCES = (PACKAGE / "image" / "blocks.cu", PACKAGE / "image" / "hash.h")
PTX_ARCH = "compute_75"       # the oldest nvcc 13 makes PTX for; any later GPU compiles it
PTX_MARK = "// pos: made from blocks.cu and hash.h, sha256 "


def library_path(name: str) -> Path:
    folder = os.environ.get("POS_HOOK_DIR")
    return (Path(folder) if folder else LIBRARIES[name][0]) / name


def sources(name: str) -> list[Path]:
    """The C files compiled into the library `name`."""
    folder, patterns, _libs = LIBRARIES[name]
    return sorted({p for pattern in patterns for p in folder.glob(pattern)})


def build(name: str, force: bool = False) -> Path:
    """The library `name`, compiled if missing or older than any of its sources or of the
    headers beside them."""
    folder, _patterns, libs = LIBRARIES[name]
    files = sources(name)
    out = library_path(name)
    newest = max(p.stat().st_mtime for p in [*files, *folder.glob("*.h")])
    if not force and out.exists() and out.stat().st_mtime >= newest:
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise PosError(f"no C compiler to build pos's {name}",
                       "install gcc (scripts/setup.sh does)")
    tmp = out.with_name(out.name + f".{os.getpid()}")
    r = subprocess.run([cc, *CFLAGS, "-o", str(tmp), *map(str, files), *libs],
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise PosError(f"building {out.name} failed: {last}",
                       "check the compiler (gcc) and pos's source tree")
    os.replace(tmp, out)
    return out


def load(name: str) -> ctypes.CDLL:
    """The library, built if need be; its functions let go of the GIL while they run."""
    return ctypes.CDLL(str(build(name)))


def ptx_digest() -> str:
    """The sha256 of the kernel's sources, as blocks.ptx names it."""
    h = hashlib.sha256()
    for path in PTX_SOURCES:
        h.update(path.read_bytes())
    return h.hexdigest()


def ptx() -> bytes:
    """The kernel's PTX, NUL-terminated as cuModuleLoadData takes it."""
    return PTX.read_bytes() + b"\0"


def build_ptx() -> Path:
    """blocks.ptx made again from its sources with nvcc, its first line their digest."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise PosError("no nvcc to make pos's GPU checksum kernel", "install the CUDA toolkit")
    tmp = PTX.with_name(PTX.name + f".{os.getpid()}")
    r = subprocess.run([nvcc, "-ptx", f"-arch={PTX_ARCH}", "-O3", "-o", str(tmp),
                        str(PTX_SOURCES[0])], capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise PosError(f"nvcc failed on {PTX_SOURCES[0].name}: {last}",
                       "check the kernel's source and the CUDA toolkit")
    tmp.write_text(PTX_MARK + ptx_digest() + "\n" + tmp.read_text())
    os.replace(tmp, PTX)
    return PTX


if __name__ == "__main__":
    if sys.argv[1:] == ["--ptx"]:
        print(build_ptx())
    else:
        for lib in LIBRARIES:
            print(build(lib, force=True))
