"""pos's C parts: the agent that `pos run` preloads into a job (agent/hook/*.c, one file per
concern) and the image's chunk reader and checksum (image/chunks.c). They are compiled from
source with the distribution's C compiler, by `scripts/setup.sh` (`python -m pos.native`) or on
first use, next to their sources (or under POS_HOOK_DIR when the package folder is
read-only)."""

import ctypes
import os
import shutil
import subprocess
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


if __name__ == "__main__":
    for lib in LIBRARIES:
        print(build(lib, force=True))
