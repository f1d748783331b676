"""libposhook.so, the agent that `pos run` preloads into a job (poshook.c beside this file).

It is built from source with the distribution's C compiler, by `scripts/setup.sh` or on first
use, next to its source (or under POS_HOOK_DIR when the package folder is read-only)."""

import os
import shutil
import subprocess
from pathlib import Path

from pos.errors import PosError

SOURCE = Path(__file__).resolve().parent / "poshook.c"
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-fPIC", "-shared", "-fvisibility=hidden"]


def library_path() -> Path:
    folder = os.environ.get("POS_HOOK_DIR")
    return (Path(folder) if folder else SOURCE.parent) / "libposhook.so"


def build(force: bool = False) -> Path:
    """The preload library, compiled if missing or older than its source."""
    out = library_path()
    if not force and out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise PosError("no C compiler to build pos's preload library",
                       "install gcc (scripts/setup.sh does)")
    tmp = out.with_name(out.name + f".{os.getpid()}")
    r = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE), "-ldl", "-lpthread"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise PosError(f"building {out.name} failed: {r.stderr.strip().splitlines()[-1:]}",
                       "check the compiler (gcc) and pos's source tree")
    os.replace(tmp, out)
    return out
