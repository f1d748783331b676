"""What this host offers pos: privileges, bcc, kernel headers, tracefs; what a process is.

Each check returns None when fine, or a PosError naming the cause and the fix; `pos doctor`
prints them all, the commands raise the first that stops them.
"""

import ctypes
import importlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from pos.errors import BadInput

# Capability numbers from linux/capability.h.
CAPABILITIES = {"CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38, "CAP_BPF": 39,
                "CAP_CHECKPOINT_RESTORE": 40}
SETUP_HINT = "run scripts/setup.sh from the pos checkout (it installs bcc and the headers)"


def pos_module(module: str, *argv: str, **popen: Any) -> "subprocess.Popen[Any]":
    """`python -m MODULE ARGV...` of this very pos (its folder first on the import path, where
    it was not installed): pos's helper processes. `popen`: subprocess.Popen's other keywords."""
    here = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH")
    return subprocess.Popen([sys.executable, "-m", module, *argv],
                            env={**os.environ, "PYTHONPATH": f"{here}:{rest}" if rest else here},
                            **popen)


def describe(pid: int) -> tuple[str, str]:
    """(comm, command line) of a process, empty strings when it is gone."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace").strip()
    except OSError:
        return "", ""
    return comm, cmdline


def stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat fields after the command name (index 0 = state), None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def age(pid: int) -> Optional[float]:
    """Seconds since the process started (10 ms steps), None when gone."""
    st = stat_fields(pid)
    if st is None:
        return None
    up = float(Path("/proc/uptime").read_text().split()[0])
    return max(0.0, up - int(st[19]) / os.sysconf("SC_CLK_TCK"))


def ns_pids(pid: int) -> list[int]:
    """PID as each PID namespace it is in sees it, outermost (this host's) first (NSpid)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("NSpid:"):
                return [int(v) for v in line.split()[1:]]
    except OSError:
        pass
    return [pid]


def memory_available() -> int:
    """MemAvailable in bytes: what the host can give without swapping or taking back memory in
    use (pos's page-locked arena and its staging tmpfs are sized from it)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


_LIBC = ctypes.CDLL(None, use_errno=True)   # mount, umount2, unshare, statfs
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
TMPFS_MAGIC = 0x01021994          # linux/magic.h
RAMFS_MAGIC = 0x858458F6


def _checked(ret: int, what: object) -> None:
    """OSError for a libc call that failed (its errno, and `what` it was about)."""
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(what))


def _mount(source: Optional[Path], target: Path, fstype: Optional[bytes], flags: int,
           data: Optional[bytes] = None) -> None:
    _checked(_LIBC.mount(str(source).encode() if source is not None else None,
                         str(target).encode(), fstype, ctypes.c_ulong(flags), data), target)


def mount_tmpfs(root: Path, options: bytes) -> None:
    """A tmpfs mounted at `root` (made, mode 0700, if need be) unless one is there: OSError
    when the kernel refuses (no CAP_SYS_ADMIN, a read-only /run)."""
    if os.path.ismount(root):
        return
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _mount(Path("tmpfs"), root, b"tmpfs", 0, options)


def bind_mount(source: Path, target: Path) -> None:
    """`source` (a file or a folder) seen at `target` too, which must exist and be of its kind."""
    _mount(source, target, None, MS_BIND)


def unmount(target: Path) -> None:
    """The mount at `target` taken away, at once for new lookups (lazily for those in use)."""
    _checked(_LIBC.umount2(str(target).encode(), MNT_DETACH), target)


def unshare(flags: int) -> None:
    """This process in new namespaces of the kinds `flags` names (CLONE_NEW*): OSError when the
    kernel refuses."""
    _checked(_LIBC.unshare(flags), "unshare")


def own_mounts() -> None:
    """This process in a mount namespace of its own, whose mounts reach no other namespace:
    what it mounts from then on only it and its children see."""
    unshare(CLONE_NEWNS)
    _mount(None, Path("/"), None, MS_REC | MS_PRIVATE)


def fs_magic(path: Path) -> int:
    """The kind of file system that holds `path` (statfs's f_type: TMPFS_MAGIC, ...)."""
    buf = ctypes.create_string_buffer(256)      # struct statfs: 120 bytes, f_type first
    _checked(_LIBC.statfs(str(path).encode(), buf), path)
    return ctypes.c_long.from_buffer(buf).value


def in_memory(path: Path) -> bool:
    """Whether the file system that holds `path` (or, where it does not exist yet, its nearest
    parent that does) keeps its files in host memory (tmpfs, ramfs: /dev/shm, /run)."""
    for p in (path, *path.absolute().parents):
        if p.exists():
            return fs_magic(p) in (TMPFS_MAGIC, RAMFS_MAGIC)
    return False


def effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges(needed: tuple[str, ...] = ("CAP_SYS_ADMIN", "CAP_BPF", "CAP_PERFMON")
                     ) -> Optional[BadInput]:
    if os.geteuid() == 0:
        return None
    caps = effective_capabilities()
    missing = [c for c in needed if not caps >> CAPABILITIES[c] & 1]
    if not missing:
        return None
    return BadInput(f"pos needs root or {', '.join(needed)} and this process lacks "
                    f"{', '.join(missing)}", "run it with sudo, or grant those capabilities")


def require_root(what: str) -> None:
    """Refuse `what` (a checkpoint, a restore) to a user other than root: CRIU and the driver's
    checkpoint API need CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE, and the images are root's."""
    if os.geteuid() != 0:
        raise BadInput(f"{what} needs root (CRIU and the driver's checkpoint API need "
                       "CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE)", "run pos with sudo")


def check_bcc() -> Optional[BadInput]:
    try:
        importlib.import_module("bcc")   # the import is the check
    except ImportError:
        return BadInput("bcc's Python package is not importable",
                        f"install python3-bpfcc (apt-get install python3-bpfcc) or {SETUP_HINT}")
    except OSError as e:  # libbcc.so missing behind the Python package
        return BadInput(f"bcc is installed but its library failed to load ({e})",
                        "install libbpfcc (apt-get install libbpfcc)")
    return None


def check_kernel_headers() -> Optional[BadInput]:
    release = platform.release()
    if Path(f"/lib/modules/{release}/build/include").is_dir():
        return None
    if Path("/sys/kernel/kheaders.tar.xz").exists():
        return None
    return BadInput(f"no kernel headers for kernel {release} (bcc compiles its probes with them)",
                    f"install linux-headers-{release} or {SETUP_HINT}")


def check_tracefs() -> Optional[BadInput]:
    if Path("/sys/kernel/tracing/uprobe_events").exists() or \
            Path("/sys/kernel/debug/tracing/uprobe_events").exists():
        return None
    return BadInput("tracefs is not mounted (uprobes are created through it)",
                    "mount -t tracefs nodev /sys/kernel/tracing")


TRACING_CHECKS: tuple[Callable[[], Optional[BadInput]], ...] = (
    check_privileges, check_bcc, check_kernel_headers, check_tracefs)


def require_tracing() -> None:
    """Raise the first missing prerequisite of eBPF tracing."""
    for check in TRACING_CHECKS:
        problem = check()
        if problem:
            raise problem
