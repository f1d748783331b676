"""Continuing a tree that CRIU restored stopped (procs.resume): CRIU's stop reaches a task only
once it runs after CRIU let it go, so it may land after pos has looked. A stop that comes late
must not leave the task stopped for good (the plain `thaw` would: it saw it running)."""

import os
import signal
import subprocess
import threading
import time

from pos.process import procs
from tests.engines.conftest import wait_for


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def continued(pid: int) -> bool:
    """Whether the child `pid` was continued after a stop (left for its reaper to see)."""
    seen = os.waitid(os.P_PID, pid, os.WCONTINUED | os.WNOHANG | os.WNOWAIT)
    return seen is not None and seen.si_code == os.CLD_CONTINUED


def test_a_stop_that_lands_after_the_look_is_continued_too() -> None:
    p = sleeper()
    try:
        late = threading.Timer(0.05, os.kill, (p.pid, signal.SIGSTOP))   # CRIU's, late
        late.start()
        procs.resume([p.pid])
        late.join()
        # the stop landed and was continued (the kernel tells the parent, this process), and
        # it sleeps on, not stopped
        wait_for(lambda: continued(p.pid) and procs.state(p.pid) == "S", 5,
                 lambda: f"the late stop to be continued (state {procs.state(p.pid)})")
    finally:
        p.kill()
        p.wait()


def test_a_stopped_tree_is_continued_at_once() -> None:
    ps = [sleeper(), sleeper()]
    try:
        for p in ps:
            os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: all(procs.state(p.pid) == "T" for p in ps), what="the stops")
        t = time.monotonic()
        procs.resume([p.pid for p in ps])
        assert time.monotonic() - t < 0.5
        wait_for(lambda: all(procs.state(p.pid) == "S" for p in ps), what="the tree running")
    finally:
        for p in ps:
            p.kill()
            p.wait()
