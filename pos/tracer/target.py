"""Find the GPU driver libraries a process maps, through /proc so that containers work."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pos.errors import BadInput
from pos.host import describe
from pos.tracer.probes import FAMILIES, Family


@dataclass(frozen=True)
class MappedLibrary:
    family: Family
    path: str       # as the process sees it (its mount namespace)
    host_path: str  # the same file reached from here: /proc/PID/root/<path>


def process_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").is_dir()


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def mapped_files(pid: int) -> list[str]:
    """Distinct file paths mapped by the process, in first-mapped order."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        raise BadInput(f"no process has PID {pid}", "give the PID of a running process") from None
    except PermissionError:
        if os.geteuid() == 0:   # root is refused too where the host protects a process
            raise BadInput(f"this host denies even root the memory map of PID {pid} "
                           f"(/proc/{pid}/maps), so its driver library cannot be found",
                           "trace another process (this one is protected here)") from None
        raise BadInput(f"cannot read the memory map of PID {pid} as this user",
                       "run pos as root (sudo)") from None
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            seen.setdefault(parts[5].removesuffix(" (deleted)"), None)
    return list(seen)


def find_libraries(pid: int, lib: Optional[str] = None) -> list[MappedLibrary]:
    """The driver libraries of PID that pos can probe; `lib` forces one file (CUDA family)."""
    if not process_exists(pid):
        raise BadInput(f"no process has PID {pid}", "give the PID of a running process")
    files = mapped_files(pid)
    root = f"/proc/{pid}/root"
    if lib:
        if lib not in files and not os.path.exists(lib):
            raise BadInput(f"{lib} does not exist", "give the path of the driver library to probe")
        host_path = root + lib if lib in files else lib
        if not is_elf(host_path):
            raise BadInput(f"{lib} is not an ELF file, so not a driver library",
                           "give --lib the GPU driver library (libcuda.so.1 or libamdhip64.so)")
        family = next((f for f in FAMILIES if any(Path(lib).name.startswith(p)
                                                   for p in f.library_prefixes)), FAMILIES[0])
        return [MappedLibrary(family, lib, host_path)]
    found = []
    for family in FAMILIES:
        for path in files:
            if any(Path(path).name.startswith(p) for p in family.library_prefixes):
                found.append(MappedLibrary(family, path, root + path))
                break
    if not found:
        comm, _ = describe(pid)
        raise BadInput(f"process {pid} ({comm}) maps no GPU driver library (libcuda.so or "
                       "libamdhip64.so)", "trace a process that has initialised CUDA or HIP, "
                       "or name the library with --lib")
    return found
