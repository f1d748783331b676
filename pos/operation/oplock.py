"""One checkpoint of a process at a time: each engine's checkpoint (or move) of a process holds
an exclusive lock on a file named after the process and its start time while it runs. A second
pos is told who holds it, instead of failing half-way in CRIU or the agent ("Unable to detach
from N"). And no image deleted while a restore reads it: a restore holds a shared lock on the
image's folder until it has read all it needs (the restore service's fill goes on after `pos
restore` returned), and retention deletes an image only under an exclusive one. The kernel
drops the locks of a pos that dies."""

import fcntl
import functools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from pos import host
from pos.errors import BadInput

LOCK_DIR = Path("/run/pos/checkpoints")
_held: dict[str, int] = {}       # lock file -> its descriptor, while this pos's operation runs
F = TypeVar("F", bound=Callable[..., Any])


def _name(pid: int) -> str:
    """The process's lock: its PID and start time (a PID the kernel gives again is another)."""
    fields = host.stat_fields(pid)
    started = fields[19] if fields and len(fields) > 19 else "0"
    return f"{pid}-{started}.lock"


@contextmanager
def held(pid: int) -> Iterator[None]:
    """Process `pid` claimed by this pos for the block; BadInput when another pos holds it. A
    claim inside a claim of the same process is the outer one's (a move checkpoints, then
    restores)."""
    path = str(LOCK_DIR / _name(pid))
    if path in _held:
        yield
        return
    host.require_root(f"checkpointing PID {pid}")
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
    _held[path] = fd
    try:
        yield
    finally:
        del _held[path]
        os.close(fd)


@contextmanager
def reading(folder: Path) -> Iterator[None]:
    """The image at `folder` kept for the block (a restore reads it): `deletable` says no."""
    fd = _opened(folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextmanager
def deletable(folder: Path) -> Iterator[bool]:
    """Whether the image at `folder` may be deleted now: no restore reads it (`reading`), and
    none begins to while the block runs."""
    try:
        fd = _opened(folder)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _opened(folder: Path) -> int:
    """The image's folder, opened for its lock (a flock on the folder itself)."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def reads_image(method: F) -> F:
    """An engine's restore of the image given as its first argument, under `reading`."""
    @functools.wraps(method)
    def run(self: Any, img: Any, *args: Any, **kwargs: Any) -> Any:
        with reading(img.path):
            return method(self, img, *args, **kwargs)
    return run  # type: ignore[return-value]


def one_at_a_time(method: F) -> F:
    """An engine's operation on the process given as its first argument, under `held`."""
    @functools.wraps(method)
    def run(self: Any, pid: int, *args: Any, **kwargs: Any) -> Any:
        with held(pid):
            return method(self, pid, *args, **kwargs)
    return run  # type: ignore[return-value]
