"""`pos doctor`: every prerequisite of pos on this host, and how to get what is missing."""

import ctypes.util
import platform
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


def _criu() -> Optional[PosError]:
    from pos.scheduler import criu

    try:
        criu.find()
    except PosError as e:
        return e
    return None


def _hook() -> Optional[PosError]:
    from pos.agent.hook import build

    try:
        build()
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
    ("CRIU >= 4.0 (checkpoint/restore)", _criu),
    ("pos run's preload library (libposhook.so, built with gcc)", _hook),
)


def run_checks(echo: Callable[[str], None]) -> bool:
    """Print one line per check; True when nothing that pos needs is missing, and every check
    could read what it needed (a user other than root is denied some of the host's files: those
    are listed, not raised)."""
    ok = True
    unread: list[str] = []
    for label, check in CHECKS:
        try:
            problem = check()
        except OSError as e:
            unread.append(e.filename or label)
            ok = False
            echo(f"{'unknown':8} {label}: could not read {e.filename or 'it'} ({e.strerror})")
            continue
        if problem is None:
            echo(f"ok       {label}")
        else:
            required = check is not _nvidia_driver
            ok = ok and not required
            echo(f"{'MISSING' if required else 'n/a':8} {label}: {problem.message}")
    if unread:
        echo(f"pos doctor could not read {', '.join(unread)} as this user: run it as root "
             "(sudo) to check them.")
    return ok
