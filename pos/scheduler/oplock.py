"""One checkpoint of a process at a time: each pos that checkpoints (or moves) a process claims
it first, with an exclusive lock on a file named after the process and its start time, held
until that pos exits. A second pos is told who holds it, instead of failing half-way in CRIU or
the agent ("Unable to detach from N"). The kernel drops the lock of a pos that dies."""

import fcntl
import os
from pathlib import Path

from pos import host
from pos.errors import BadInput

LOCK_DIR = Path("/run/pos/checkpoints")
_held: dict[str, int] = {}       # lock file -> its descriptor, for the life of this pos


def _name(pid: int) -> str:
    """The process's lock: its PID and start time (a PID the kernel gives again is another)."""
    fields = host.stat_fields(pid)
    started = fields[19] if fields and len(fields) > 19 else "0"
    return f"{pid}-{started}.lock"


def claim(pid: int) -> None:
    """Claim process `pid` for this pos's checkpoint; BadInput when another pos holds it. A
    second claim by the same pos is a no-op (a move checkpoints, then restores)."""
    path = LOCK_DIR / _name(pid)
    if str(path) in _held:
        return
    LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise BadInput(f"PID {pid} is being checkpointed by another pos now (PID {holder})",
                       "wait for that checkpoint to end, then try again") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[str(path)] = fd
