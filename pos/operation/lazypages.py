"""CRIU's lazy restore of a whole-process image (POS_LAZY_PAGES=1): the job runs before its
memory is all read. `criu lazy-pages`, the daemon, serves each page the job touches through
userfaultfd, pushes the others in the background once CRIU's restore is done, and exits by
itself once every page is in. Which memory is lazy is CRIU's choice: private anonymous mappings
but the stack, locked and huge-page ones (criu/include/vma.h); CRIU's restore reads the rest as
without it, and any image can be restored either way.

The daemon and `criu restore --lazy-pages` meet at lazy-pages.socket in CRIU's work folder (a
name CRIU fixes): both run in the restore's work folder (-W), where the daemon's log lies beside
the restore's and, like it, is kept in Settings.log_dir when it fails (POS_KEEP_RESTORE_LOG=1:
always).

`pos restore` waits for the daemon before it says the restore is done, the job running
meanwhile, because:
  - a daemon that ends with pages left (killed, or failing to read the image) takes its
    userfaultfd along: the kernel then gives the job a zero-filled page for every page not
    yet in, and the job crashes (a Python job whose daemon was killed at once: SIGSEGV) or,
    worse, runs on with part of its memory gone. Only pos, the daemon's parent, learns how it
    ended; a restore is done once every page is in, or else the job is killed;
  - the daemon reads the image until it ends: once `pos restore` returns, the image may be
    removed, moved or restored again;
  - the watchdog stays behind pos until then: a pos that dies meanwhile leaves it to wait for
    the daemon in its place (`settle`).
The wait is bounded (POS_CRIU_WAIT_S from the daemon's start; past it the job is killed, then
the daemon) and timed: `lazy_done_at`, seconds from the restore's start to the last page in.

Checksums: pos/restore/tree.py resumes the tree, which CRIU restored stopped, only once the
image's check passed. The daemon's background push may give the stopped tree pages of an image
that then fails its check; the tree is killed then, having never run, which is enough: no page
of a bad image is ever run. Whatever undoes a lazy restore (watchdog.recover) kills the tree first
and ends the daemon after it: a daemon ended first would hand the job zeros.
"""

import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from pos.errors import PosError
from pos.image import names
from pos.operation.plan import RestorePlan
from pos.process import criu as criu_mod
from pos.process import procs

READY_S = 60.0    # what the daemon may take to listen: CRIU's start and the image's tree read
FEATURE = "uffd-noncoop"   # CRIU's check of what the daemon needs of the kernel


class Daemon:
    """A running `criu lazy-pages`, pos's child in its own process group (Criu.start), and a
    thread that waits for its end: when the last page went in, whenever pos looks."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log
        self.ended_at: Optional[float] = None      # time.monotonic() of its end
        self._reaper = threading.Thread(target=self._reap, name="pos-lazy-pages", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        self.proc.communicate()
        self.ended_at = time.monotonic()

    def ended(self, timeout: Optional[float] = None) -> Optional[int]:
        """Its exit status once it has ended (waited for up to `timeout` s), None before."""
        self._reaper.join(timeout)
        return self.proc.returncode


def start(criu: criu_mod.Criu, images: Path, work: Path, named: Callable[[Daemon], None]
          ) -> Daemon:
    """The daemon for the image in `images`, in the restore's work folder `work`, listening
    when this returns; `named` is told the daemon the moment it exists (the restore's plan
    names it from then on). BadInput when the kernel refuses what it needs."""
    status, theirs = os.pipe()
    try:
        proc = criu.start(criu.lazy_pages_argv(images, work, theirs), pass_fds=(theirs,))
    finally:
        os.close(theirs)
    daemon = Daemon(proc, work / names.LAZY_PAGES_LOG)
    named(daemon)
    try:
        listening = select.select([status], [], [], READY_S)[0] and os.read(status, 1) == b"\0"
    finally:
        os.close(status)
    if not listening:
        raise _not_listening(criu, daemon)
    return daemon


def _not_listening(criu: criu_mod.Criu, daemon: Daemon) -> PosError:
    """Why the daemon did not come to listen: the kernel's refusal, which CRIU's check names
    (the daemon itself ends at once without a word in its log), or its log's error."""
    if daemon.ended(criu_mod.END_S) is None:
        return PosError(f"criu lazy-pages did not listen within {READY_S:.0f} s",
                        criu_mod.LAZY_OFF)
    lacks = criu.lacks(FEATURE)
    if not lacks:
        return criu_mod.failure("lazy-pages", daemon.log, criu.log_dir)
    kept = criu_mod.keep_log(daemon.log, criu.log_dir) or daemon.log
    return criu_mod.known("lazy-pages", lacks, kept) or PosError(
        f"criu lazy-pages failed: `criu check --feature {FEATURE}` says {lacks!r}",
        criu_mod.LAZY_OFF)


def settle(plan: RestorePlan, returncode: Callable[[], Optional[int]] = lambda: None
           ) -> Optional[PosError]:
    """Wait for the plan's daemon to end: None once it has served every page, else why it
    cannot have, the restored tree killed first and the daemon ended after. `returncode`: how
    the daemon ended, which its parent (pos) learns; the watchdog, which is not its parent,
    has its log alone, where a daemon killed from outside leaves no word."""
    assert plan.lazy_pid
    why = _unserved(plan.lazy_pid, plan, returncode)
    if why is not None:
        procs.kill_tree(procs.tree(plan.pids[0]))
        end(plan.lazy_pid)
    return why


def _unserved(pid: int, plan: RestorePlan, returncode: Callable[[], Optional[int]]
              ) -> Optional[PosError]:
    """The wait of `settle`, bounded by the plan's deadline and its bound on CRIU's logs."""
    log = Path(plan.lazy_log)
    while not procs.wait_gone(pid, criu_mod.POLL_S):
        if criu_mod.log_bytes(log) > plan.criu_log_max:
            return criu_mod.overflow("lazy-pages", log, plan.criu_log_max, Path(plan.log_dir))
        if time.monotonic() > plan.lazy_deadline:
            return PosError(f"criu lazy-pages had not served all of the restored memory "
                            f"{plan.criu_wait_s:.0f} s after it started", "the restored job "
                            f"was killed; raise POS_CRIU_WAIT_S, or {criu_mod.LAZY_OFF}")
    rc = returncode()
    if rc is not None and rc < 0:
        return PosError(f"criu lazy-pages was killed ({signal.Signals(-rc).name}) before it "
                        "had served all of the restored memory", "the restored job was killed; "
                        f"restore it again, or {criu_mod.LAZY_OFF}")
    if rc or criu_mod.logged_error(log):
        return criu_mod.failure("lazy-pages", log, Path(plan.log_dir))
    return None


def end(pid: int) -> None:
    """End the daemon `pid` (its process group), once its tree is gone or has every page."""
    if not procs.alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs.wait_gone(pid, criu_mod.END_S)
