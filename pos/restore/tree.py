"""A process tree back from a whole-process image, opened once (pos/image/opened.py: every
file's presence and size checked there), by either engine: first what this host must hold
(pos/restore/preflight.py), CRIU's restore (the tree left stopped) beside the checksums'
check, the tree resumed once the image is known good, the driver's restore (onto other GPUs if
asked) and unlock; the concurrent engine, spliced in (`Splice`), puts the job's device memory
back at the end. All of it as steps with their undo (pos/operation/steps.py): a tree is never
left half restored.
"""

import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

from pos import image
from pos.errors import PosError
from pos.image import names
from pos.image.kinds import ImageKind
from pos.image.opened import Opened
from pos.operation import lazypages
from pos.operation.engine import Hold, Operation, Report
from pos.operation.plan import RestorePlan
from pos.operation.steps import Echo, Guard
from pos.process import criu as criu_mod
from pos.process import cudackpt, procs
from pos.process.criu import Options
from pos.progress import QUIET, Progress
from pos.restore import preflight
from pos.settings import Settings

PORTS_WAIT_S = 65.0     # TIME_WAIT lasts 60 s: the wait where the kernel won't end them


def _verify_timed(img: Opened, names: Optional[tuple[str, ...]], stop: threading.Event
                  ) -> float:
    """The checksums of `names`; the seconds it took (it runs beside CRIU's restore)."""
    t0 = time.monotonic()
    image.check_sums(img.path, img.manifest, names, stop=stop)
    return time.monotonic() - t0


def _failed(checking: Future[float]) -> Optional[BaseException]:
    """Why the image's check beside CRIU failed, None while it runs or when it passed."""
    return checking.exception() if checking.done() else None


def _lazy_start(g: Guard[RestorePlan], criu: criu_mod.Criu, images: Path, work: Path
                ) -> lazypages.Daemon:
    """CRIU's lazy-pages daemon for the image, listening (timed: lazy_start); the plan names it
    from the moment it exists, and gives it the plan's wait for a CRIU (POS_CRIU_WAIT_S) to
    serve every page."""
    def named(daemon: lazypages.Daemon) -> None:
        # CLOCK_MONOTONIC, which time.monotonic reads, is one clock for every process of a host
        g.step(g.plan.step, lazy_pid=daemon.proc.pid, lazy_log=str(daemon.log),
               lazy_deadline=time.monotonic() + g.plan.criu_wait_s)

    return g.timed("lazy_start", lambda: lazypages.start(criu, images, work, named))


def _lazy_wait(g: Guard[RestorePlan], daemon: lazypages.Daemon, since: float) -> None:
    """The step "lazy-pages", the tree running: until the daemon has served every page
    (`lazypages.settle`), timed (lazy_wait), and when it ended (lazy_done_at, seconds from
    `since`); PosError if it cannot have, the restored tree killed by then."""
    g.step("lazy-pages")
    why = g.timed("lazy_wait", lambda: lazypages.settle(g.plan, daemon.ended))
    if why is not None:
        raise why
    assert daemon.ended_at is not None
    g.timings["lazy_done_at"] = daemon.ended_at - since


@dataclass(frozen=True)
class TreeRequest:
    """What a tree's restore is asked: the image, opened; `check`: the files whose checksums
    are verified (all when None; the rest is checked by whoever reads it); `gpu_pairs`: the
    driver's restore's map of GPUs (old UUID -> new UUID); `inherit_fds`: CRIU's
    --inherit-fd; `hold`: see pos/operation/engine.py Hold."""

    image: Opened
    settings: Settings
    inherit_fds: tuple[str, ...] = ()
    gpu_pairs: tuple[tuple[str, str], ...] = ()
    check: Optional[tuple[str, ...]] = None
    hold: Optional[Hold] = None        # where the restored, checked tree waits before it runs


class Splice(Protocol):
    """Where another engine's part of a restore joins the tree's: the concurrent engine makes
    the job's device memory beside CRIU and puts it back at the end. A restore with a splice
    is hoisted: the job's device memory comes back only in `finish`, and until then the undo
    ends a restored job rather than run it."""

    def checked(self) -> None:
        """The image and this host passed every check (preflight.py); nothing else started."""

    def before_driver(self) -> None:
        """Just before the driver's restore (the tree resumed)."""

    def finish(self, g: Guard, live: dict[int, int]) -> None:
        """Last, under the tree's guard (a failure ends the restored tree, never leaves it
        half-restored); `live`: each PID of the image -> its process's PID now (the same, or
        new ones for a tree of its own namespaces, restored into new ones)."""


Tree = Callable[[TreeRequest, Optional[Splice], Echo], Report]
"""What brings a tree back: restore_tree, or a container's runtime (pos/container/)."""


def driver_back(g: Guard, cuda: list[int], gpu_pairs: Sequence[tuple[str, str]],
                splice: Optional[Splice], live: dict[int, int]) -> None:
    """The driver's restore and unlock of the restored tree's CUDA processes (`live`: old PID
    -> new), the splice's parts just before and after: as pos's CRIU restores a tree, and as a
    container's runtime does (pos/container/restore.py)."""
    if splice is not None:
        splice.before_driver()
    g.each("restore", cuda, lambda p: cudackpt.restore(p, gpu_pairs))
    g.each("unlock", cuda, cudackpt.unlock)
    if splice is not None:
        splice.finish(g, live)


def restore_tree(request: TreeRequest, splice: Optional[Splice] = None,
                 echo: Echo = lambda _: None, progress: Progress = QUIET) -> Report:
    """Restore the image and resume its processes. Every file's presence and size were
    checked when it was opened; this host's fitness before anything starts (preflight.py);
    the checksums while CRIU restores, which leaves the tree stopped: it runs only once the
    image is known good, and a check that fails ends CRIU at once. The work folder goes
    whatever happens (CRIU's log of a failure is kept in Settings.log_dir, and the error names
    it). With Settings.lazy_pages, CRIU's lazy-pages daemon serves the memory CRIU leaves lazy,
    and the restore ends once it has served every page (pos/operation/lazypages.py)."""
    img, settings, inherit_fds = request.image, request.settings, request.inherit_fds
    gpu_pairs, check = request.gpu_pairs, request.check
    directory, manifest = img.path, img.manifest
    t = time.monotonic()
    fds = criu_mod.inherited_fds(inherit_fds)
    criu = criu_mod.find(settings)
    checks: dict[str, float] = {}
    checked = time.monotonic()
    preflight.check(img, gpu_pairs, inherit_fds, checks)
    checked = time.monotonic() - checked
    if splice is not None:
        splice.checked()
    options = Options.from_json(manifest.criu_options)
    for path, size in manifest.logs.items():
        now = os.stat(path).st_size if os.path.exists(path) else size
        if now != size:
            echo(f"{path} changed since the dump ({size} bytes then, {now} now): the restored "
                 "process appends to it")
    own = bool(manifest.inner_pids)     # its PIDs are known once CRIU has made them
    plan = RestorePlan([] if own else manifest.pids, [] if own else manifest.gpu_pids,
                       images=str(directory), gpu_pairs=[list(p) for p in gpu_pairs],
                       hoisted=splice is not None, verify=None if check is None else list(check),
                       criu_log_max=criu.log_max)
    echo(f"restoring PID {manifest.pid} ({manifest.comm}) from {directory}")
    if manifest.tcp_listen and not own:     # a new network namespace has no old connections
        from pos.restore import timewait     # pyroute2: imported only where needed

        timewait.free(manifest.tcp_listen, PORTS_WAIT_S, echo)
    logs = criu_mod.reopen_logs(manifest.logs)
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pos-verify")
    checking = pool.submit(_verify_timed, img, check, stop)
    work = Path(tempfile.mkdtemp(prefix="pos-restore-"))
    plan.work = str(work)
    lazy: Optional[lazypages.Daemon] = None
    try:
        with Guard(plan, echo, settings, progress) as g:
            g.timings["prepare"] = time.monotonic() - t        # to CRIU's start
            g.timings["prepare_check"] = checked               # of which the host's checks
            g.timings.update(checks)                           # and each of those
            g.step("criu-restore")
            if settings.lazy_pages:
                lazy = _lazy_start(g, criu, directory, work)
            argv = criu.restore_argv(directory, options, work, work / names.RESTORE_PIDFILE,
                                     inherit_fds + tuple(logs.values()), leave_stopped=True,
                                     lazy_pages=lazy is not None)
            terminal = options.shell_job and os.isatty(0)
            try:
                g.timed("criu_restore", lambda: g.run_criu(criu, argv, "restore",
                                                           work / names.RESTORE_LOG,
                                                           fds + tuple(logs), terminal,
                                                           lambda: _failed(checking)))
            except PosError:
                checking.result()       # a corrupt image explains CRIU's failure best
                raise
            root = int((work / names.RESTORE_PIDFILE).read_text())
            live = procs.restored_pids(root, manifest.pids, manifest.inner_pids)
            cuda = [live[p] for p in manifest.gpu_pids]
            # the tree is stopped until its image is known good
            g.step("verify", pids=[live[p] for p in manifest.pids], gpu_pids=cuda)
            g.timings["verify"] = g.timed("verify_wait", checking.result)
            if request.hold is not None:    # held ready (a standby), until asked for
                g.step("standby")
                g.timed("standby", request.hold)
            procs.resume(procs.tree(root))
            driver_back(g, cuda, gpu_pairs, splice, live)
            if lazy is not None:        # the job runs; the rest of its memory comes in
                _lazy_wait(g, lazy, t)
    finally:
        stop.set()
        pool.shutdown()
        for fd in logs:
            os.close(fd)
        if lazy is not None:        # ended by now, served or by the undo: its thread goes too
            lazy.ended(criu_mod.END_S)
        if settings.keep_restore_log:
            criu_mod.keep_log(work / names.RESTORE_LOG, criu.log_dir)
            if lazy is not None:
                criu_mod.keep_log(lazy.log, criu.log_dir)
        shutil.rmtree(work, ignore_errors=True)
    return Report(ImageKind.STOP_THE_WORLD.value, Operation.RESTORE, str(directory), manifest,
                  timings=g.timings, restored_pid=root)
