"""Where the frozen part of a whole-process concurrent checkpoint writes: a tmpfs on huge pages.

While the job is frozen CRIU writes its own memory (1.2-1.3 GB for a PyTorch job; its device
memory is not in it). On the H100 host CRIU wrote those pages into /dev/shm (4 KiB pages) in
0.41-0.58 s and into a tmpfs mounted with huge=always in 0.31 s, and the frozen part was
0.47 s instead of 0.55-0.75 s (bench/results/2026-11-25/hoist3). So the dump goes to
/run/pos/dump, and its files move into the image once the job runs again. The directory's name
ends in .partial, so that the undo (pos/operation/steps.py, watchdog.py) removes it like the
image's own partial directory; an empty tmpfs holds no memory.
"""

import os
import shutil
from pathlib import Path
from typing import Optional

from pos import host
from pos.image import names

ROOT = Path("/run/pos/dump")
OPTIONS = b"huge=always,mode=0700"


def directory(name: str, partial: Path, needed_bytes: int, enabled: bool = True
              ) -> Optional[Path]:
    """A new directory for CRIU's files on the huge-page tmpfs (mounted if need be); None when
    it cannot help: turned off (`enabled`: Settings.dump_staging), not mountable, the image is
    on it already, or the memory it would take is not free."""
    if not enabled or host.memory_available() < 2 * needed_bytes:
        return None
    try:
        host.mount_tmpfs(ROOT, OPTIONS)
        if os.stat(partial).st_dev == os.stat(ROOT).st_dev:
            return None
        d = names.partial(ROOT / f"{name}-{os.getpid()}")
        d.mkdir(mode=0o700)
    except OSError:
        return None
    return d


def move_into(stage: Path, partial: Path) -> None:
    """The dump's files into the image's partial directory (a copy across file systems)."""
    for f in sorted(stage.iterdir()):
        shutil.move(str(f), str(partial / f.name))
    stage.rmdir()
