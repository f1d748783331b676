"""`pos doctor`: every prerequisite of pos on this host, and how to get what is missing."""

import ctypes.util
import errno
import platform
from dataclasses import dataclass
from typing import Callable, Optional

from pos import host
from pos.errors import PosError


def _kernel() -> Optional[PosError]:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (5, 8):
        return PosError(f"kernel {platform.release()} is older than 5.8 (BPF ring buffer)",
                        "run pos on Linux 5.8 or newer")
    return None


def _nvidia_driver() -> Optional[PosError]:
    if ctypes.util.find_library("cuda") is None:
        return PosError("no NVIDIA driver library (libcuda.so.1) on this host",
                        "install the NVIDIA driver (>= 570; >= 580 to restore onto another GPU) "
                        "if this host runs CUDA jobs")
    return None


def _persistence() -> Optional[PosError]:
    """Whether a restore may start CUDA on the GPUs it fills alone (devices.start_cuda)."""
    from pos import nvml

    if not nvml.available():
        return PosError("NVML cannot be asked (no NVIDIA driver, or no libnvidia-ml.so.1)",
                        "install the NVIDIA driver if this host runs CUDA jobs")
    if nvml.persistent():
        return None
    return PosError("a GPU of this host is not in persistence mode, so a restore starts CUDA "
                    "on every GPU of the host (0.91-1.04 s on four H200s, against 0.19-0.33 s "
                    "for one)", "enable it: run nvidia-persistenced, or `nvidia-smi -pm 1`")


def _criu() -> Optional[PosError]:
    from pos.process import criu

    try:
        criu.find()
    except PosError as e:
        return e
    return None


def _criu_cache() -> Optional[PosError]:
    """Whether CRIU finds its kernel-feature cache (pos/process/kdat.py): without it, each
    dump and restore probes the kernel first, while the job is held."""
    from pos.process import criu, kdat

    try:
        found = criu.find()
    except PosError:
        return PosError("no CRIU whose cache to keep", "install CRIU (the line above)")
    cache = kdat.keep(found.path, found.version_text)
    if cache.state is kdat.State.UNPRIVILEGED:
        raise PermissionError(errno.EPERM, "only root keeps it", str(kdat.CACHE))
    if cache.state is kdat.State.FAILED:
        return PosError(f"CRIU's kernel-feature cache cannot be kept ({cache.reason}), so each "
                        "dump and restore probes the kernel first (30-70 ms while the job is "
                        "held)", "give pos CAP_SYS_ADMIN (it mounts a tmpfs on /run/pos/kdat)"
                        ", or mount a tmpfs on /run as systemd does (a container: --tmpfs /run)")
    return None


def _soft_dirty() -> Optional[PosError]:
    """Whether CRIU can copy a job's host memory before the freeze (pos/concurrent/predump.py)."""
    from pos.concurrent import predump
    from pos.process import criu

    try:
        path = criu.find().path
    except PosError:
        return PosError("no CRIU to ask whether this kernel tracks dirty pages",
                        "install CRIU (the line above)")
    tracks = predump.tracks_dirty_pages(path)
    if tracks is None:           # CRIU checks as root only: `unknown`, as for a file
        raise PermissionError(errno.EPERM, "CRIU could not check", path)
    if tracks:
        return None
    return PosError(f"{predump.NO_SOFT_DIRTY}, and a whole-process concurrent checkpoint dumps "
                    "all of it while the job is frozen", predump.FIX_SOFT_DIRTY)


def _hook() -> Optional[PosError]:
    from pos.agent.hook import build

    try:
        build()
    except PosError as e:
        return e
    return None


def _seccomp() -> Optional[PosError]:
    """`pos run`'s filter that turns io_uring off for a job (pos/agent/seccomp.py)."""
    from pos.agent.seccomp import ALLOW_FLAG, library

    try:
        library()
    except PosError as e:
        return PosError(e.cause, f"{e.fix}; until then start jobs with `pos run {ALLOW_FLAG}`, "
                        "and `pos checkpoint` refuses one that opens an io_uring (torchrun)")
    return None


def _migrate_key() -> Optional[PosError]:
    """`pos migrate --to HOST` and `--listen` speak TLS, and hear only a host that holds the
    same key (pos/engines/migrate_key.py): without one, migration between hosts is off."""
    from pos.engines import migrate_key

    folder = migrate_key.default_dir()
    if not folder.exists():
        return PosError(f"no migration key in {folder}: `pos migrate --to` and `--listen` "
                        "refuse to run (each end must prove it holds the key, over TLS)",
                        "make one with `pos migrate --new-key` and copy it to the other host "
                        f"(scp -rp {folder} HOST:{folder}) if this host migrates jobs")
    try:
        migrate_key.load(folder)
    except PosError as e:
        return e
    return None


CHECKS: tuple[tuple[str, Callable[[], Optional[PosError]]], ...] = (
    ("privileges (root or CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON)", host.check_privileges),
    ("Linux >= 5.8", _kernel),
    ("bcc (python3-bpfcc)", host.check_bcc),
    ("kernel headers for bcc", host.check_kernel_headers),
    ("tracefs", host.check_tracefs),
    ("NVIDIA driver library", _nvidia_driver),
    ("GPUs in persistence mode (a restore starts CUDA on its own GPUs alone)", _persistence),
    ("CRIU >= 4.0 (checkpoint/restore)", _criu),
    ("CRIU's kernel-feature cache (/run/criu.kdat)", _criu_cache),
    ("soft-dirty tracking (CRIU's pre-dump, of jobs that map no device)", _soft_dirty),
    ("pos run's preload library (libposhook.so, built with gcc)", _hook),
    ("pos run's io_uring filter (pyseccomp over libseccomp2)", _seccomp),
    ("the migration key (hosts authenticate each other over TLS)", _migrate_key),
)

# what pos can do without: n/a when absent
OPTIONAL = (_nvidia_driver, _persistence, _criu_cache, _soft_dirty, _migrate_key)


@dataclass
class Result:
    """One check: `status` ok, missing (pos needs it), n/a (pos can do without) or unknown
    (this user could not read what the check needs: `unread`)."""

    check: str
    status: str
    problem: Optional[str] = None
    unread: Optional[str] = None


def results() -> list[Result]:
    """Every check's outcome (a user other than root is denied some of the host's files: those
    checks are `unknown`, not raised)."""
    out = []
    for label, check in CHECKS:
        try:
            problem = check()
        except OSError as e:
            out.append(Result(label, "unknown", f"could not read {e.filename or 'it'} "
                                                f"({e.strerror})", e.filename or label))
            continue
        if problem is None:
            out.append(Result(label, "ok"))
        else:
            out.append(Result(label, "n/a" if check in OPTIONAL else "missing",
                              problem.message))
    return out


def healthy(found: list[Result]) -> bool:
    """Nothing that pos needs is missing, and every check could read what it needed."""
    return all(r.status in ("ok", "n/a") for r in found)


def run_checks(echo: Callable[[str], None]) -> bool:
    """Print one line per check; `healthy`."""
    found = results()
    for r in found:
        status = "MISSING" if r.status == "missing" else r.status
        echo(f"{status:8} {r.check}" + (f": {r.problem}" if r.problem else ""))
    unread = [r.unread for r in found if r.unread]
    if unread:
        echo(f"pos doctor could not read {', '.join(unread)} as this user: run it as root "
             "(sudo) to check them.")
    return healthy(found)
