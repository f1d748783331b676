"""`pos run`'s seccomp filter: io_uring_setup, io_uring_enter and io_uring_register fail with
ENOSYS in the job and every process it starts, as if the kernel had no io_uring.

Why: CRIU (4.2) cannot dump a process that holds an io_uring, and torchrun's launcher holds one
for its own TCPStore: libuv (>= 1.45) opens a ring in every event loop to batch epoll_ctl
calls, whatever UV_USE_IO_URING says, and torchrun creates its store without reading USE_LIBUV
(PyTorch 2.13, 2026-11-27). libuv takes ENOSYS from io_uring_setup as "no io_uring here" and
runs on epoll alone, exactly as under Docker's default seccomp profile (since Docker 25). So
`pos run -- torchrun ...` is checkpointable as users start it; `--allow-io-uring` leaves the
job's io_uring alone (such a job is then refused by `pos checkpoint`, pos/process/procs.py).

The filter goes on just before exec, in the thread that execs, and the kernel passes it to
every child and across every exec: the whole tree. It is built by libseccomp through
`pyseccomp` (ctypes over the system's libseccomp.so.2, any CPython), which names the system
calls for the machine's architecture (x86_64 and aarch64 alike). CRIU saves and restores a
process's seccomp filters with it, so a restored job keeps it.
"""

import errno
from types import ModuleType

from pos.errors import BadInput, PosError

IO_URING_CALLS = ("io_uring_setup", "io_uring_enter", "io_uring_register")
ALLOW_FLAG = "--allow-io-uring"


def library() -> ModuleType:
    """pyseccomp, loaded over the system's libseccomp; BadInput when either is missing."""
    try:
        import pyseccomp
    except ImportError:
        raise BadInput("the Python package pyseccomp is missing", "run scripts/setup.sh (it "
                       "installs pos's dependencies)") from None
    except RuntimeError:         # pyseccomp found no libseccomp.so.2
        raise BadInput("this host has no libseccomp (libseccomp.so.2)",
                       "install libseccomp2 (apt-get install libseccomp2)") from None
    return pyseccomp


def refuse_io_uring(root: bool) -> None:
    """Install the filter on the calling thread (the one about to exec the job). `root`: pos
    runs with CAP_SYS_ADMIN, so the filter needs no `no_new_privs`, and the job keeps its setuid
    programs (sudo, ping) working; otherwise the kernel requires `no_new_privs`, which libseccomp
    sets. Any other system call, of any architecture, is allowed."""
    try:
        pyseccomp = library()
    except BadInput as e:
        raise BadInput(f"pos run cannot turn io_uring off for the job: {e.cause}",
                       f"{e.fix}, or start the job with `pos run {ALLOW_FLAG}`") from None
    try:
        f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        f.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.ALLOW)
        if root:
            f.set_attr(pyseccomp.Attr.CTL_NNP, 0)
        if pyseccomp.system_arch() == pyseccomp.Arch.X86_64:
            f.add_arch(pyseccomp.Arch.X86)      # 32-bit programs of the job: the same rule
        for call in IO_URING_CALLS:
            f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), call)
        f.load()
    except (OSError, ValueError) as e:
        raise PosError(f"pos run could not install its seccomp filter that turns io_uring off "
                       f"for the job ({getattr(e, 'strerror', None) or e})", "start the job with "
                       f"`pos run {ALLOW_FLAG}` (then `pos checkpoint` refuses a job that "
                       "opened an io_uring)") from None
