"""Room in this process's table of descriptors, made before a job is held. The kernel grows a
table that a new descriptor does not fit, and where threads share the table each growth waits
for an RCU grace period: on the 2-core VM, 1,000 descriptors made in a process of two threads
took 25-27 ms, and 0.5 ms once the table held them. A checkpoint of a 400-buffer job (fake
driver) spent 16 ms of its export growing pos's table as the job's descriptors came, and 15 ms
growing the job's (which the agent's `room` makes before the cut: hook/export.c, do_room)."""

import fcntl
import os
import resource


def make(n: int) -> None:
    """Room for `n` more descriptors above the highest open one (within RLIMIT_NOFILE, whose
    soft limit is raised toward the hard one for them: a job's own memory can come in
    thousands of pieces, PyTorch's expandable segments mapping 20 MiB at a time): one
    descriptor is made there and closed. F_DUPFD takes the lowest free number from there, so
    no open descriptor is touched; where the limit or the kernel refuses, the table grows as
    the descriptors come, as before."""
    top = max((int(f) for f in os.listdir("/proc/self/fd")), default=0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)   # never unlimited: fs.nr_open
    if top + n >= soft:
        up = top + n + 1 if hard == resource.RLIM_INFINITY else min(top + n + 1, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (up, hard))
            soft = up
        except (ValueError, OSError):
            pass
    want = min(top + n, soft - 1)
    if want <= top:
        return
    probe = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.close(fcntl.fcntl(probe, fcntl.F_DUPFD_CLOEXEC, want))
    except OSError:
        pass
    finally:
        os.close(probe)
