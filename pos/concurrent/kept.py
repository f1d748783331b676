"""A checkpoint's page-locked arena kept in memory for the next one (POS_PIN_KEEP=1).

Locking the arena is most of a large job's wait before the cut: the kernel zeroes every page
(and may first have to reclaim the page cache that the last image filled) and the driver
registers them. On the H200 host a 54.6 GB arena locked at 3.7-8.6 GB/s and 97-142 GB arenas
at 19-22 GB/s (the spread is not explained), while registering pages already there ran at
46 GB/s (bench/results/2026-11-28-perf). With
POS_PIN_KEEP=1 the arena's pages live in a file on a huge-page tmpfs (ROOT) that outlives the
checkpoint: the next one maps the file and registers what is there, faulting in only what it
needs beyond it.

- The memory stays taken between checkpoints (shared memory: `Shmem` in /proc/meminfo), as
  much as the largest arena each file served, until the files are removed:
  `rm /run/pos/arena/arena-*`.
- A file serves one arena at a time: an exclusive flock, which the kernel lets go when pos ends,
  however it ends. The ranks of one checkpoint, and two checkpoints at once, take different
  files; a file that cannot be had (no tmpfs mountable) leaves the arena anonymous memory, as
  without the setting.
- The files hold what the last checkpoint copied through them (the job's device memory): they
  are root's, mode 0600, in a directory of mode 0700, as images are.
"""

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pos import host

ROOT = Path("/run/pos/arena")
# as large as the host's memory (a tmpfs takes half of it by default): what an arena may take is
# bounded by the host's available memory (copier.HostRoom), and the tmpfs's own room checked
# before the file grows (`fits`), since a write past it would be SIGBUS
OPTIONS = b"huge=always,mode=0700,size=100%"


@dataclass
class Kept:
    """One kept file, locked for one arena: `present` bytes of it are in memory already."""

    fd: int
    path: Path
    present: int

    def fits(self, size: int) -> bool:
        """Whether the tmpfs has room for the file to hold `size` bytes in memory."""
        st = os.fstatvfs(self.fd)
        return size - self.present <= st.f_bavail * st.f_frsize

    def grow(self, size: int) -> None:
        """At least `size` bytes long (the new part is faulted in by the arena's lock)."""
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)

    def close(self) -> None:
        """Let the file go (its lock with it); the file and its memory stay."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def take(root: Path = ROOT) -> Optional[Kept]:
    """The first kept file under `root` that no other arena holds (made if none is free); None
    when the tmpfs cannot be mounted or the file made."""
    try:
        host.mount_tmpfs(root, OPTIONS)
    except OSError:
        return None
    k = 0
    while True:
        path = root / f"arena-{k}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            k += 1
            continue
        st = os.fstat(fd)
        return Kept(fd, path, min(st.st_size, st.st_blocks * 512))
