"""Processes as /proc shows them: trees, states, what they map. No signals sent here except by
`kill_tree`, which is the one place that ends a process tree that pos must not leave behind,
and SIGCONT by `thaw` and `resume`, which continue the trees CRIU left stopped."""

import os
import re
import signal
import stat
import struct
import time
from pathlib import Path
from typing import Optional

from pos import host
from pos.errors import BadInput, PosError


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    st = host.stat_fields(pid)
    return st is not None and st[0] not in ("Z", "X")


def state(pid: int) -> Optional[str]:
    """The one-letter state (R, S, T, Z, ...), None when gone."""
    st = host.stat_fields(pid)
    return st[0] if st else None


def parent(pid: int) -> Optional[int]:
    st = host.stat_fields(pid)
    return int(st[1]) if st else None


def is_kernel_thread(pid: int) -> bool:
    """Kernel threads have no memory map (flags PF_KTHREAD); their cmdline is empty too."""
    st = host.stat_fields(pid)
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


def _ns_inode(pid: str, kind: str) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def own_namespaces(pids: list[int]) -> list[int]:
    """The tree `pids` as it sees itself where its root is PID 1 of a PID namespace of its own
    (`pos run --clonable`): each one's PID in there, in the order of `pids`. Such a tree is
    restored into new namespaces, so that one image restores as often as wanted at once; []
    for a tree that shares this host's PIDs."""
    root = host.ns_pids(pids[0]) if pids else []
    if len(root) < 2 or root[-1] != 1:
        return []
    return [host.ns_pids(p)[-1] for p in pids]


def job_in_namespaces(pid: int) -> Optional[int]:
    """The job that `pid` runs in namespaces of its own (`pos run --clonable`'s parent, or
    unshare(1)'s): its only child, PID 1 of a PID namespace; None for any other process."""
    if own_namespaces([pid]):
        return None
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return None
    return kids[0] if len(kids) == 1 and own_namespaces(kids) else None


def own_netns(pid: int) -> bool:
    """`pid` has a network namespace other than pos's own."""
    theirs = _ns_inode(str(pid), "net")
    return theirs is not None and theirs != _ns_inode("self", "net")


def restored_pids(root: int, dumped: list[int], inner: list[int]) -> dict[int, int]:
    """Each dumped PID -> the PID its process has now, for a tree that CRIU restored at `root`:
    the same PIDs, or, for a tree of its own namespaces (`inner`: their PIDs in there, in the
    order of `dumped`), the host's PIDs of the new namespace's processes that have those PIDs
    there."""
    if not inner:
        return {p: p for p in dumped}
    now = {host.ns_pids(p)[-1]: p for p in tree(root)}
    missing = [i for i in inner if i not in now]
    if missing:
        raise PosError(f"the restored tree of PID {root} lacks the processes {missing} of its "
                       "namespace", "see CRIU's restore log")
    return {d: now[i] for d, i in zip(dumped, inner)}


def ancestors(pid: int) -> list[int]:
    out = []
    p = parent(pid)
    while p:
        out.append(p)
        p = parent(p)
    return out


def maps_library(pid: int, name: str) -> bool:
    """Whether the process maps a library whose file name starts with `name` (libnccl.so)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(f"/{name}" in line for line in f)
    except OSError:
        return False


def maps_libcuda(pid: int) -> bool:
    return maps_library(pid, "libcuda.so")


def environment(pid: int) -> dict[str, str]:
    """The process's environment as it is now: libc's `environ` read from its memory, so that a
    variable the program set after it started (`os.environ[...] = ...`, NCCL's own config
    file) is seen; /proc/PID/environ (what it started with) where that cannot be read (no
    glibc, no access)."""
    try:
        return _live_environment(pid)
    except (OSError, ValueError, LookupError, struct.error):
        pass
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return _pairs(raw.split(b"\0"))


def _pairs(entries: list[bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in entries:
        k, eq, v = e.decode(errors="replace").partition("=")
        if eq:
            out.setdefault(k, v)
    return out


def _live_environment(pid: int) -> dict[str, str]:
    """libc's `environ`, found as the dynamic linker finds it: a program that refers to it has
    it copied into its own data (a copy relocation, as python3 does), so the executable's
    definition comes before libc's."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    exe = os.readlink(f"/proc/{pid}/exe")
    first: dict[str, str] = {}           # file -> its mapping at offset 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and int(parts[2], 16) == 0:     # map_files/ names: unpadded hex
            first.setdefault(parts[5], "-".join(f"{int(x, 16):x}" for x in parts[0].split("-")))
    libc = next((f for f in first if re.search(r"/libc(\.so\.6|-[\d.]+\.so)$", f)), None)
    if libc is None:
        raise LookupError("no glibc mapped")
    where = None
    for path in (exe, libc):
        if path not in first:
            continue
        with open(f"/proc/{pid}/map_files/{first[path]}", "rb") as f:
            elf = ELFFile(f)
            dynsym = elf.get_section_by_name(".dynsym")
            found = isinstance(dynsym, SymbolTableSection) and (dynsym.get_symbol_by_name("environ")
                                or dynsym.get_symbol_by_name("__environ"))
            if found and found[0]["st_shndx"] != "SHN_UNDEF":
                pie = elf.header["e_type"] == "ET_DYN"
                base = int(first[path].split("-")[0], 16) if pie else 0
                where = base + found[0]["st_value"]
                break
    if where is None:
        raise LookupError("environ not found")
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        def read(addr: int, n: int) -> bytes:
            mem.seek(addr)
            return mem.read(n)

        def text(addr: int) -> bytes:      # up to its NUL, a page at a time
            out = b""
            while len(out) < ENVIRON_ENTRY_MAX:
                piece = read(addr + len(out), 4096 - (addr + len(out)) % 4096)
                out += piece.split(b"\0", 1)[0]
                if b"\0" in piece:
                    break
            return out

        array = struct.unpack("<Q", read(where, 8))[0]
        entries = []
        for i in range(ENVIRON_MAX):
            ptr = struct.unpack("<Q", read(array + 8 * i, 8))[0]
            if ptr == 0:
                break
            entries.append(text(ptr))
    return _pairs(entries)


ENVIRON_MAX = 8192             # variables read at most
ENVIRON_ENTRY_MAX = 4096       # bytes of one variable read at most


def resident_bytes(pids: list[int]) -> int:
    """Sum of VmRSS: what CRIU's pages will take at least."""
    return _status_bytes(pids, "VmRSS:")


def anonymous_bytes(pids: list[int]) -> int:
    """Sum of RssAnon: the private memory CRIU writes (the driver's checkpoint adds to it the
    device memory it moves into the process)."""
    return _status_bytes(pids, "RssAnon:")


def _status_bytes(pids: list[int], field: str) -> int:
    """Sum of one size (kB) of /proc/PID/status over `pids`; a process gone counts 0."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(field):
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


IO_URING = "anon_inode:[io_uring]"
# The thread that runs PyTorch's TCPStore server on libuv (torchrun's rendezvous store). libuv
# (>= 1.45) opens an io_uring in every event loop it starts, to batch epoll_ctl calls, whatever
# UV_USE_IO_URING says (that variable governs only its SQPOLL ring for file operations), and
# torchrun's launcher creates that store without reading USE_LIBUV (PyTorch 2.13, 2026-11-27).
TCPSTORE_UV_THREAD = "pt_tcpstore_uv"
# Either makes io_uring_setup fail, and libuv then runs on epoll alone (it ignores the failure).
# `pos run` does it for the whole tree it starts (pos/agent/seccomp.py), unless --allow-io-uring.
REFUSE_IO_URING = ("io_uring_setup refused (a seccomp filter that fails it, as Docker's default "
                   "profile does since Docker 25, or sysctl kernel.io_uring_disabled=2 while it "
                   "starts)")
UNDER_POS_RUN = ("`pos run -- CMD`, which makes io_uring_setup fail for every process of the "
                 "job (libuv then runs on epoll)")


def fix_io_uring(pid: int, torchrun: bool) -> str:
    """What to do about the io_uring of `pid`: start it under `pos run` (without
    --allow-io-uring, if that is how it was started)."""
    from pos.agent import IO_URING_ENV

    if environment(pid).get(IO_URING_ENV) == "allowed":
        return ("start the job again with `pos run` without --allow-io-uring (io_uring_setup "
                "then fails for every process of the job, and libuv runs on epoll)"
                + ("" if torchrun else ", if it runs without one"))
    if torchrun:
        return (f"start torchrun with {UNDER_POS_RUN}, or with {REFUSE_IO_URING}; "
                "UV_USE_IO_URING=0 and USE_LIBUV=0 do not reach torchrun's own store")
    return f"start the job again with {UNDER_POS_RUN}, or with {REFUSE_IO_URING}, if it runs " \
           "without one"


def program(pid: int) -> str:
    """What a person calls the process: its program's name from the command line, the script
    for an interpreter (`python3 /x/bin/torchrun` is torchrun, `python -m m` is m), since the
    kernel's name of a process is whatever its main thread named itself (torchrun's is
    pt_elastic)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in argv if a]
    if not args:
        return "?"
    name = os.path.basename(args[0])
    if name.startswith("python") and len(args) > 1:
        if args[1] == "-m" and len(args) > 2:
            return args[2]
        if not args[1].startswith("-"):
            return os.path.basename(args[1])
    return name


def io_urings(pid: int) -> list[str]:
    """Where `pid` holds an io_uring: "fd N" for each descriptor, "a mapping at ADDR" for each
    mapped ring whose descriptor is gone (one that is also open as a descriptor is said once).
    CRIU (4.2) cannot dump either: it stops at the mapping ("Unknown shit 600
    (anon_inode:[io_uring])") and has no dumper for the descriptor."""
    found: list[str] = []
    try:
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
    except OSError:
        fds = []
    inodes = set()
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == IO_URING:
                found.append(f"fd {fd}")
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            continue
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if line.rstrip().endswith(IO_URING):
                    fields = line.split()
                    if int(fields[4]) not in inodes:
                        inodes.add(int(fields[4]))
                        found.append(f"a mapping at 0x{fields[0].split('-')[0]}")
    except OSError:
        pass
    return found


def threads(pid: int) -> list[str]:
    """The names of `pid`'s threads (/proc/PID/task/*/comm)."""
    out: list[str] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out.append(Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip())
        except OSError:
            pass
    return out


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


DEV_ZERO = os.makedev(1, 5)


def device_mapping(pid: int) -> Optional[str]:
    """A file the process maps that is neither a regular file nor /dev/zero (/dev/nvidia0, say):
    CRIU tells mappings apart so (criu/proc_parse.c, handle_vma) and saves such a one only
    through a plugin for its device. None when there is none (or the mappings cannot be read)."""
    try:
        entries = list(os.scandir(f"/proc/{pid}/map_files"))
    except OSError:
        return None
    for e in entries:
        try:
            st = os.stat(e.path)
            if not stat.S_ISREG(st.st_mode) and not (stat.S_ISCHR(st.st_mode)
                                                     and st.st_rdev == DEV_ZERO):
                return os.readlink(e.path)
        except OSError:
            continue
    return None


def largest_deleted_file(pids: list[int]) -> int:
    """The size of the largest deleted file the tree holds open or mapped (NCCL's 34 MB
    /dev/shm/nccl-* segment, say): CRIU saves such a ghost file whole into the image, and
    refuses one over its --ghost-limit (1 MiB by default)."""
    biggest = 0
    for p in pids:
        for folder in (f"/proc/{p}/fd", f"/proc/{p}/map_files"):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                try:
                    target = os.readlink(e.path)
                    if not target.endswith(" (deleted)") or target.startswith("/dev/zero"):
                        continue
                    st = os.stat(e.path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    biggest = max(biggest, st.st_size)
    return biggest


ESTABLISHED, LISTEN = "01", "0A"      # /proc/net/tcp's states


def _tcp(pid: int) -> list[tuple[str, str, str, str]]:
    """(local, remote, state, inode) of every TCP socket of `pid`'s network namespace."""
    out = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        out += [(f[1], f[2], f[3], f[9]) for f in (ln.split() for ln in lines) if len(f) > 9]
    return out


def tcp_within(pids: list[int]) -> bool:
    """Whether the tree holds established TCP connections and every one of them has its other
    end in the tree too (DDP's ranks over loopback): frozen together, no packet can come from
    outside, so CRIU need not lock the network (which takes iptables or nftables)."""
    if not pids:
        return False
    mine = set().union(*(_socket_inodes(p) for p in pids))
    ends = [(a, b) for a, b, st, ino in _tcp(pids[0]) if st == ESTABLISHED and ino in mine]
    local = {a for a, _ in ends}
    return bool(ends) and all(b in local for _, b in ends)


def listening_ports(pids: list[int]) -> list[int]:
    """The TCP ports the tree listens on (a restore binds them again)."""
    if not pids:
        return []
    mine = set().union(*(_socket_inodes(p) for p in pids))
    return sorted({int(a.rsplit(":", 1)[1], 16) for a, _, st, ino in _tcp(pids[0])
                   if st == LISTEN and ino in mine})


def require_dumpable(pid: int) -> None:
    """Refuse, before any process of the tree of `pid` is touched, a tree that CRIU cannot dump
    because a process holds an io_uring: otherwise the driver would lock and checkpoint every
    GPU process and CRIU fail only then, every rank of a job held for nothing (issue 27: a
    torchrun launcher). The sentence names the process, what made the ring, and the fix."""
    for p in tree(pid):
        where = io_urings(p)
        if not where:
            continue
        who = f"PID {p} ({program(p)})" + ("" if p == pid else f", in the tree of PID {pid},")
        held = f"an io_uring ({', '.join(where)})"
        if TCPSTORE_UV_THREAD in threads(p):
            raise BadInput(f"{who} holds {held} that libuv opened for PyTorch's TCPStore "
                           "server (torchrun's rendezvous store), and CRIU cannot checkpoint an "
                           "io_uring", fix_io_uring(p, torchrun=True))
        raise BadInput(f"{who} holds {held}, and CRIU cannot checkpoint an io_uring",
                       fix_io_uring(p, torchrun=False))


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
