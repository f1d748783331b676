"""CRIU's kernel-feature cache, kept where CRIU reads it on a host whose /run is not a tmpfs.

Each CRIU run first learns what the kernel offers (criu/kerndat.c: some forty probes, one of them
a network namespace with a veth pair) unless it finds them in /run/criu.kdat. CRIU writes that
file only onto a tmpfs, so that a reboot drops it with the kernel it describes. Where /run is on
disk, as a container's /run usually is, every dump and every restore probes again: 32-72 ms
before CRIU starts on the job, while the job is held, against 0.7-0.9 ms with the cache (one
H200 host, bench/results/2026-11-29-criu).

So pos has CRIU write its cache onto a tmpfs of pos's, /run/pos/kdat: a `criu check` run in a
mount namespace of its own, where that tmpfs is /run. The file is then bind-mounted onto
/run/criu.kdat, where every CRIU of the host reads it (CRIU asks for a tmpfs only when it
writes). The mounts go at a reboot, as CRIU wants of its cache; the empty file left under them
is one CRIU takes for stale and probes past. A CRIU of another build finds the cache stale too
(CRIU stamps it with its build), so pos keeps beside it the stamp of the CRIU that made it, and
makes it anew when pos's CRIU changes. `umount /run/criu.kdat /run/pos/kdat` takes it away.
"""

import enum
import fcntl
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pos import host

RUN = Path("/run")
ROOT = Path("/run/pos/kdat")         # pos's tmpfs: the cache and its stamp
CACHE = RUN / "criu.kdat"            # where CRIU reads it (its KDAT_RUNDIR, built in)
OPTIONS = b"mode=0700,size=1m"
CHECK = ("check", "--feature", "mnt_id")   # any CRIU command probes first; this one is quick
CHECK_S = 60.0


class State(enum.Enum):
    """Where the cache stands for this CRIU."""

    CRIU_KEEPS = "criu-keeps"      # /run is a tmpfs: CRIU keeps its own cache there
    KEPT = "kept"                  # pos's cache is in place, made before
    MADE = "made"                  # pos made it just now
    UNPRIVILEGED = "unprivileged"  # not root: CRIU runs for root only here
    FAILED = "failed"              # not kept (`reason`): each CRIU run probes the kernel


@dataclass(frozen=True)
class Cache:
    state: State
    seconds: float
    reason: str = ""


def keep(criu: str, version: str) -> Cache:
    """The kernel-feature cache of the CRIU at `criu` (saying `version`) in place where CRIU
    reads it, made if need be; never raises: without it CRIU only starts slower. A cache that
    could not be made is not tried again for the same CRIU until a reboot."""
    t0 = time.monotonic()

    def cache(state: State, reason: str = "") -> Cache:
        return Cache(state, time.monotonic() - t0, reason)

    if os.geteuid() != 0:
        return cache(State.UNPRIVILEGED)
    try:
        if host.fs_magic(RUN) == host.TMPFS_MAGIC:
            return cache(State.CRIU_KEEPS)
        want = stamp(criu, version)
        done = _known(want)
        if done is not None:
            return cache(*done)
        ROOT.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(ROOT.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)     # another pos may be making it, tmpfs and all
            done = _known(want)
            if done is not None:
                return cache(*done)
            host.mount_tmpfs(ROOT, OPTIONS)
            try:
                why = _make(criu)
            except (OSError, subprocess.SubprocessError) as e:
                why = str(e) or type(e).__name__
            (ROOT / "stamp").write_text(f"{want}\n{why}")
        finally:
            os.close(lock)
    except (OSError, subprocess.SubprocessError) as e:
        return cache(State.FAILED, str(e))
    return cache(State.FAILED, why) if why else cache(State.MADE)


def stamp(criu: str, version: str) -> str:
    """What tells one CRIU from another: the file run, its size and time, its version."""
    st = os.stat(criu)
    return f"{os.path.realpath(criu)} {st.st_size} {st.st_mtime_ns} {version}"


def _known(want: str) -> "tuple[State, str] | None":
    """What came of making the cache for the CRIU stamped `want`, if it was tried: kept, or
    failed and why; None when not tried (or for another CRIU)."""
    try:
        said = (ROOT / "stamp").read_text().split("\n", 1)
    except OSError:
        return None
    if said[0] != want:
        return None
    why = said[1] if len(said) > 1 else ""
    if why:
        return State.FAILED, why
    return (State.KEPT, "") if os.path.ismount(CACHE) else None


def _make(criu: str) -> str:
    """CRIU's cache made on pos's tmpfs and bound onto CACHE: "" when done, else why not."""
    made = ROOT / "criu.kdat"
    made.unlink(missing_ok=True)
    p = subprocess.run([criu, *CHECK], preexec_fn=_run_on_root, capture_output=True,
                       text=True, timeout=CHECK_S)
    if not made.exists():
        said = (p.stdout + p.stderr).strip().splitlines()
        return f"`{criu} {' '.join(CHECK)}` kept no cache" + (f": {said[-1]}" if said else "")
    if os.path.ismount(CACHE):
        host.unmount(CACHE)                      # another CRIU's, before
    os.close(os.open(CACHE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    host.bind_mount(made, CACHE)
    return ""


def _run_on_root() -> None:
    """In the `criu check` child, before its exec: pos's tmpfs is its /run, which CRIU writes
    its cache into; no other process sees that."""
    host.own_mounts()
    host.bind_mount(ROOT, RUN)
