"""pos's C parts: the agent that `pos run` preloads into a job (agent/hook/poshook.c) and the
image's chunk reader and checksum (image/chunks.c). They are compiled from source with the
distribution's C compiler, by `scripts/setup.sh` (`python -m pos.native`) or on first use, next
to their source (or under POS_HOOK_DIR when the package folder is read-only)."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

from pos.errors import PosError

PACKAGE = Path(__file__).resolve().parent
HOOK, CHUNKS = "libposhook.so", "libposchunks.so"
# each library's source, and what it links
LIBRARIES: dict[str, tuple[Path, tuple[str, ...]]] = {
    HOOK: (PACKAGE / "agent" / "hook" / "poshook.c", ("-ldl", "-lpthread")),
    CHUNKS: (PACKAGE / "image" / "chunks.c", ()),
}
CFLAGS = ["-O3", "-g", "-Wall", "-Wextra", "-fPIC", "-shared", "-fvisibility=hidden"]


def library_path(name: str) -> Path:
    folder = os.environ.get("POS_HOOK_DIR")
    return (Path(folder) if folder else LIBRARIES[name][0].parent) / name


def build(name: str, force: bool = False) -> Path:
    """The library `name`, compiled if missing or older than its source."""
    source, libs = LIBRARIES[name]
    out = library_path(name)
    if not force and out.exists() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise PosError(f"no C compiler to build pos's {name}",
                       "install gcc (scripts/setup.sh does)")
    tmp = out.with_name(out.name + f".{os.getpid()}")
    r = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(source), *libs],
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
