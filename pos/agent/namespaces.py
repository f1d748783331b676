"""`pos run --clonable`: the job started in PID and network namespaces of its own, as a
container's process is.

Why: CRIU restores a process with the PIDs it had, and the agent's control socket with the
name it had (`@pos-agent-<pid>`, in its network namespace). Two copies of one image in the
host's namespaces would claim the same PIDs and the same name, and so would a copy beside the
process it was taken of. A tree that is PID 1 of namespaces of its own is restored by CRIU into
new ones each time (its network namespace saved empty, `--empty-ns net`), so one image gives as
many instances as wanted, at once.

Not for CUDA jobs yet: on four H100s with driver 580.159.04, a job started so failed at
CUDA's start (cuInit: CUDA_ERROR_OPERATING_SYSTEM, 304; the agent says so on its standard
error). A container's process also has a mount namespace with a /proc of its own, which this
does not make (CRIU would then have to save and restore that namespace too).

The job is PID 1 of its PID namespace: as in a container without an init, a signal it has no
handler for is not delivered (SIGKILL aside), and it reaps orphans of its namespace if it
waits for them. `pos run` stays outside as its parent, passes the usual signals on and exits
with its status.
"""

import errno
import os
import signal
import sys

from pos import host
from pos.errors import BadInput, PosError

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def _unshare(flags: int) -> None:
    try:
        host.unshare(flags)
    except OSError as e:
        if e.errno == errno.EPERM:
            raise BadInput("a job in namespaces of its own needs root (CAP_SYS_ADMIN makes PID "
                           "and network namespaces)", "run pos with sudo, or leave out "
                           "--clonable") from None
        raise PosError(f"the job's namespaces could not be made: {e.strerror}",
                       "leave out --clonable") from None


def _loopback_up() -> None:
    """A new network namespace has its loopback down: up, so that the job's localhost works."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")


def enter() -> None:
    """Fork into new PID and network namespaces. Returns in the child, PID 1 there, leader of
    a session of its own (no terminal: the parent passes the signals on), its loopback up,
    which then execs the job; the parent never returns: it waits for the child,
    passing signals on, and exits with its status (a signal's death as 128 + the signal)."""
    _unshare(CLONE_NEWPID | CLONE_NEWNET)
    child = os.fork()
    if child == 0:
        os.setsid()      # its session's leader inside: CRIU recreates no session from outside
        _loopback_up()
        return
    for s in PASSED_ON:
        signal.signal(s, lambda n, _f: os.kill(child, n))
    print(f"pos: the job is PID {child} (PID 1 of its own PID and network namespaces)",
          file=sys.stderr, flush=True)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)
