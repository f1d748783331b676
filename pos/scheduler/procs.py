"""Processes as /proc shows them: trees, states, what they map. No signals sent here except by
`kill_tree`, which is the one place that ends a process tree that pos must not leave behind,
and SIGCONT by `thaw` and `resume`, which continue the trees CRIU left stopped."""

import os
import signal
import stat
import time
from pathlib import Path
from typing import Optional

from pos import host
from pos.errors import BadInput


def _stat(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat fields after the command name (index 0 = state), None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def state(pid: int) -> Optional[str]:
    """The one-letter state (R, S, T, Z, ...), None when gone."""
    st = _stat(pid)
    return st[0] if st else None


def parent(pid: int) -> Optional[int]:
    st = _stat(pid)
    return int(st[1]) if st else None


def is_kernel_thread(pid: int) -> bool:
    """Kernel threads have no memory map (flags PF_KTHREAD); their cmdline is empty too."""
    st = _stat(pid)
    return st is not None and int(st[6]) & 0x00200000 != 0


def tree(root: int) -> list[int]:
    """`root` and all its descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            pid = int(entry.name)
            ppid = parent(pid)
            if ppid is not None and alive(pid):
                children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


def ancestors(pid: int) -> list[int]:
    out = []
    p = parent(pid)
    while p:
        out.append(p)
        p = parent(p)
    return out


def maps_libcuda(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("/libcuda.so" in line for line in f)
    except OSError:
        return False


def resident_bytes(pids: list[int]) -> int:
    """Sum of VmRSS: what CRIU's pages will take at least."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def logs(pids: list[int]) -> dict[str, int]:
    """The logs the processes write: regular files open write-only (not appending) whose offset
    is at their end, such as a stdout redirected with `>`, by path with their size. CRIU
    refuses to restore such a file once it has grown (someone else wrote to it, or the job
    after a --leave-running dump); the restore reopens these for appending instead. Files
    opened with O_APPEND need nothing: CRIU does not check their size."""
    found: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                here = os.stat(path)   # the same file in pos's view (not another namespace's)
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            flags, offset = int(fields["flags"], 8), int(fields["pos"])
            if (stat.S_ISREG(st.st_mode) and flags & os.O_ACCMODE == os.O_WRONLY
                    and not flags & os.O_APPEND and offset == st.st_size
                    and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)):
                found[path] = st.st_size
    return found


def require_checkpointable(pid: int) -> None:
    """Refuse, with one sentence, what pos must not or cannot checkpoint."""
    if not alive(pid):
        raise BadInput(f"no process has PID {pid}", "give the PID of a running process")
    if pid == 1 or is_kernel_thread(pid):
        raise BadInput(f"PID {pid} is {'init' if pid == 1 else 'a kernel thread'}, which "
                       "cannot be checkpointed", "give the PID of a user process")
    me = os.getpid()
    if pid == me or pid in ancestors(me):
        raise BadInput(f"PID {pid} is pos itself or one of its parents",
                       "run pos from outside the process tree to checkpoint")
    host.require_root(f"checkpointing PID {pid}")


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until `pid` is gone or a zombie (it need not be our child); False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return not alive(pid)


def kill_tree(pids: list[int]) -> None:
    """SIGKILL every listed process still alive (children first)."""
    for pid in reversed(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        wait_gone(pid, 5)


def resume(pids: list[int], settle_s: float = 5.0) -> None:
    """Continue a tree that CRIU restored stopped (--leave-stopped). CRIU's stop takes effect
    only once a task runs after CRIU let it go, so a task may still be running when CRIU has
    exited and stop a moment later, after a SIGCONT that found it running: wait (up to
    `settle_s`) until each task has stopped, continue them, and continue again any that a late
    stop caught."""
    deadline = time.monotonic() + settle_s
    for pid in pids:
        while state(pid) not in ("T", "t", "Z", "X", None) and time.monotonic() < deadline:
            time.sleep(0.0005)
    for _ in range(50):
        stopped = [p for p in pids if state(p) in ("T", "t")]
        if not stopped:
            return
        thaw(stopped)
        time.sleep(0.001)


def thaw(pids: list[int]) -> None:
    """SIGCONT the listed processes that are stopped (T): what a dead CRIU may leave behind."""
    for pid in pids:
        if state(pid) in ("T", "t"):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
