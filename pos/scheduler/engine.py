"""The full-process engine: CUDA driver checkpoint + CRIU, as ordered steps with their undo.

checkpoint: lock (with a timeout) -> driver checkpoint -> criu dump -> [--leave-running: driver
restore -> unlock] -> seal the image (checksums, manifest, DIR.partial -> DIR) -> [without
--leave-running: end the tree, which CRIU left stopped: until the seal it can run on].
restore: criu restore (the tree left stopped) beside the checksums' verify -> resume -> driver
restore (onto other GPUs if asked) -> unlock.

Every step runs inside a `Guard`: on any failure, Ctrl-C or SIGTERM it runs
`watchdog.recover` (the one undo), and a watchdog process runs the same undo if pos dies.
Processes without CUDA state skip the driver steps: CRIU alone.
"""

import os
import shutil
import signal
import socket
import platform
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from pos import host, nvml
from pos.errors import BadInput, PosError
from pos.progress import QUIET, Progress
from pos.scheduler import criu as criu_mod
from pos import image
from pos.scheduler import procs
from pos.scheduler.criu import Options, PageServer
from pos.image import Manifest
from pos.scheduler.watchdog import Plan, Watchdog, discard_leftovers, end_tree, recover

Echo = Callable[[str], None]
DEFAULT_LOCK_TIMEOUT_MS = 10_000
# Fault injection, as CRIU's CRIU_FAULT: "STEP=SIGNAL" (STEP:criu while CRIU runs) makes pos
# send itself SIGNAL when that step begins, so that tests can kill pos at every step.
FAULT_ENV = "POS_FAULT_AT"


def timed(timings: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    """fn(), its duration added to timings[name] (whether or not it raised)."""
    t = time.monotonic()
    try:
        return fn()
    finally:
        timings[name] = timings.get(name, 0.0) + time.monotonic() - t


UNITS = {"_mib": "{:.0f} MiB", "_bytes": "{:.0f} bytes", "_rc": "{:.0f}", "_n": "{:.0f}"}


def describe(timings: dict[str, float]) -> str:
    """Timings for a person: seconds, but for the keys that count memory (`*_mib`, `*_bytes`),
    the driver's answers (`*_rc`) and things (`*_n`)."""
    def one(k: str, v: float) -> str:
        unit = next((u for end, u in UNITS.items() if k.endswith(end)), "{:.3f} s")
        return f"{k} {unit.format(v)}"

    return ", ".join(one(k, v) for k, v in timings.items())


@contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGINT and SIGTERM ignored meanwhile: for an undo, or a last step, that must not be left
    half done."""
    held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in held.items():
            signal.signal(s, h)


class Guard:
    """Runs the steps of one operation with a watchdog behind them and the undo on failure."""

    def __init__(self, plan: Plan, echo: Echo, progress: Progress = QUIET) -> None:
        self.plan, self.echo, self.progress = plan, echo, progress
        self.timings: dict[str, float] = {}
        self.watchdog: Optional[Watchdog] = None
        self.memory: list[int] = []          # descriptors of a job's hoisted device memory

    def __enter__(self) -> "Guard":
        if self.plan.op == "checkpoint":    # a parent running now is continued with the tree
            parent = procs.parent(self.plan.pids[0]) or 0
            if procs.state(parent) not in ("T", "t"):
                self.plan.parent = parent
        self.watchdog = Watchdog(self.plan)
        return self

    def step(self, name: str, **changes: Any) -> None:
        """Tell the watchdog which step begins (and what changed in the plan)."""
        self.plan.step = name
        self.progress.phase(name)
        for k, v in changes.items():
            setattr(self.plan, k, v)
        assert self.watchdog is not None
        self.watchdog.send(self.plan)
        fault = os.environ.get(FAULT_ENV, "")
        point = name + (":criu" if self.plan.criu_pid else "")
        if fault.partition("=")[0] == point:
            os.kill(os.getpid(), signal.Signals["SIG" + fault.partition("=")[2]])

    def hold(self, fds: list[int]) -> None:
        """The job's device memory, as descriptors that the undo (here or in the watchdog)
        maps back into the job should this operation fail while the memory is pos's."""
        self.memory += fds
        assert self.watchdog is not None
        self.watchdog.hold(fds)

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one step and add its duration to timings[name]."""
        return timed(self.timings, name, fn)

    def dump(self, criu: criu_mod.Criu, argv: list[str], images: Path) -> None:
        """CRIU's dump into `images`, timed, and how its stats-dump splits the frozen time."""
        self.timed("dump", lambda: self.run_criu(criu, argv, "dump", images / criu_mod.DUMP_LOG))
        stats = criu_mod.dump_stats(images)
        if stats is not None:
            self.timings.update(stats.timings())

    def run_criu(self, criu: criu_mod.Criu, argv: list[str], what: str, log: Path,
                 pass_fds: tuple[int, ...] = (), terminal: bool = False,
                 stop: Callable[[], Optional[BaseException]] = lambda: None) -> None:
        """CRIU, with the watchdog told of it (`stop`: see Criu.finish)."""
        proc = criu.start(argv, pass_fds, terminal)
        self.step(self.plan.step, criu_pid=proc.pid, criu_log=str(log))
        criu.finish(proc, what, log, stop)
        self.step(self.plan.step, criu_pid=None)

    def end(self, **changes: Any) -> None:
        """The image is sealed: end the tree that CRIU left stopped, as the checkpoint was to.
        Not to be cut short by SIGINT/SIGTERM (the undo would find a tree half ended); a pos
        that dies here leaves the watchdog to finish it."""
        with uninterrupted():
            self.step("end", **changes)
            end_tree(self.plan)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], _tb: Any) -> bool:
        assert self.watchdog is not None
        if exc_type is None:
            self.watchdog.done()
            return False
        stopped = isinstance(exc, KeyboardInterrupt)
        with uninterrupted():
            self.echo(f"undoing {self.plan.op} of PID {self.plan.pids[0]} "
                      f"({'stopped' if stopped else 'failed'} at step {self.plan.step})")
            try:
                recover(self.plan, self.echo, self.memory, stopped)
            except PosError as undo:
                raise PosError(f"{_what(exc)}, and undoing it failed too ({undo.cause})",
                               undo.fix or "check the process by hand") from None
            finally:
                discard_leftovers(self.plan)
                self.watchdog.done()
        if stopped and self.plan.op == "restore":
            raise PosError(f"restore of PID {self.plan.pids[0]} from {self.plan.images} "
                           "stopped, nothing of it left running", "the image is untouched; "
                           "restore it again when you want") from None
        if stopped:
            raise PosError(f"{self.plan.op} of PID {self.plan.pids[0]} interrupted and undone",
                           "the processes run as before") from None
        return False


def folder_bytes(folder: Path) -> int:
    """What the files of `folder` hold now (an image being written)."""
    return sum(f.stat().st_size for f in folder.iterdir())


def _what(exc: Optional[BaseException]) -> str:
    if isinstance(exc, PosError):
        return exc.cause
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {exc}"


def gpu_pids(pids: list[int]) -> list[int]:
    """The processes of the tree that hold CUDA state (map libcuda and initialised CUDA)."""
    candidates = [p for p in pids if procs.maps_libcuda(p)]
    if not candidates:
        return []
    from pos.scheduler import cudackpt

    return [p for p in candidates if cudackpt.cuda_state(p) is not None]


def new_manifest(pid: int, pids: list[int], cuda: list[int], criu_version: str,
                 options: Options, leave_running: bool, gpu_use: dict[str, int]) -> Manifest:
    """The manifest of an image about to be taken, by either engine (timings and files come
    later; a GPU-only image has no CRIU version and no CRIU options)."""
    from pos.scheduler import cudackpt

    names = {g.uuid: g.name for g in nvml.gpus()} if gpu_use else {}
    comm, cmdline = host.describe(pid)
    return Manifest(
        pid=pid, pids=pids, gpu_pids=cuda, comm=comm, cmdline=cmdline,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(), kernel=platform.release(), criu_version=criu_version,
        criu_options=options.to_json(), leave_running=leave_running,
        driver_version=nvml.driver_version() if cuda else None,
        cuda_version=cudackpt.driver_version() if cuda else None,
        gpus=[{"uuid": u, "name": names.get(u, "n/a"), "memory_used": m}
              for u, m in gpu_use.items()])


@dataclass
class Result:
    path: Path
    manifest: Manifest
    restored_pid: Optional[int] = None
    timings: dict[str, float] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """The outcome for scripts (--json): one JSON object."""
        m = self.manifest
        return {"path": str(self.path), "pid": m.pid, "pids": m.pids, "gpu_pids": m.gpu_pids,
                "restored_pid": self.restored_pid, "size_bytes": m.size_bytes,
                "files": len(m.files), "timings": self.timings, "stall_s": m.stall_s,
                "logs": m.logs}


def checkpoint(pid: int, directory: Path, options: Options, leave_running: bool = False,
               lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS, echo: Echo = lambda _: None,
               page_server: Optional[PageServer] = None, progress: Progress = QUIET) -> Result:
    """Checkpoint the tree rooted at `pid` into `directory` (see the module docstring)."""
    procs.require_checkpointable(pid)
    procs.require_dumpable(pid)
    criu = criu_mod.find()
    pids = procs.tree(pid)
    cuda = gpu_pids(pids)
    from pos.scheduler import cudackpt

    for p in cuda:
        refuse_imported(p)
    gpu_use = nvml.gpus_of(cuda) if cuda else {}
    # pages at least as large as what is resident, plus the device memory the dump will hold;
    # a page server takes the pages elsewhere
    needed = 0 if page_server else procs.resident_bytes(pids) + sum(gpu_use.values())
    manifest = new_manifest(pid, pids, cuda, criu.version_text, options, leave_running, gpu_use)
    comm = manifest.comm
    plan = Plan("checkpoint", pids, cuda, criu_path=criu.path,
                images=str(image.partial_path(Path(directory).absolute())),
                stopped=[p for p in pids if procs.state(p) in ("T", "t")],
                criu_options=options.to_json())
    partial = image.prepare(directory, needed)    # just before the watchdog, which knows it
    with Guard(plan, echo, progress) as g:
        echo(f"checkpointing PID {pid} ({comm}): {len(pids)} process(es), {len(cuda)} with "
             "CUDA state")
        start = time.monotonic()
        for p in cuda:
            g.step("lock")
            g.timed("lock", lambda p=p: cudackpt.lock(p, lock_timeout_ms))
        for p in cuda:
            g.step("checkpoint")
            g.timed("checkpoint", lambda p=p: cudackpt.checkpoint(p))
        progress.phase("dump", poll=lambda: folder_bytes(partial))
        g.step("dump")
        manifest.logs = procs.logs(pids)
        argv = criu.dump_argv(pid, partial, options, leave_running, page_server)
        g.dump(criu, argv, partial)     # without --leave-running: the tree stays, stopped
        if leave_running:
            for p in cuda:
                g.step("restore")
                g.timed("restore", lambda p=p: cudackpt.restore(p))
            for p in cuda:
                g.step("unlock")
                g.timed("unlock", lambda p=p: cudackpt.unlock(p))
            manifest.stall_s = time.monotonic() - start if cuda else g.timings.get("frozen")
        g.step("seal")
        manifest.timings = g.timings
        progress.phase("checksum", total=folder_bytes(partial))
        final = g.timed("checksum", lambda: image.seal(partial, manifest, progress.advance))
        if not leave_running:
            g.end()
    manifest.timings = g.timings
    image.write_manifest(final, manifest)     # with the checksum's own time
    return Result(final, manifest, timings=g.timings)


def refuse_imported(pid: int, fix: str = "checkpoint it with `pos checkpoint --concurrent` (to "
                    "move it: copy that image and `pos restore -D` it on the other host)") -> None:
    """Refuse a `pos run` job whose device memory was mapped back from pos's descriptors (after
    a whole-process concurrent checkpoint or restore): the driver checkpoints it, but its
    restore fails (cuCheckpointProcessRestore: CUDA_ERROR_NOT_SUPPORTED on the H100, driver
    580.159.04, 2026-11-25), so a stop-the-world image of it could never be restored, nor the
    driver move it to another GPU. `fix`: what to do instead."""
    from pos.agent.control import Agent

    try:
        agent = Agent(pid, timeout=10)
    except PosError:
        return                          # no agent: the job's memory is its own
    with agent:
        imported = agent.status().imported
    if imported:
        raise BadInput(f"{imported} of the device allocations of PID {pid} were mapped back "
                       "from a whole-process concurrent checkpoint or restore, and the driver "
                       "cannot restore such memory from a stop-the-world image", fix)


def check_restorable(directory: Path, manifest: Manifest) -> None:
    """Refuse an image whose PIDs are taken or whose driver differs from this host's."""
    for pid in manifest.pids:
        if Path(f"/proc/{pid}").exists():
            comm = host.describe(pid)[0] or "a process"
            if procs.state(pid) == "Z":
                comm += ", a zombie its parent has not reaped"
            raise BadInput(f"PID {pid} of the image is taken ({comm})",
                           "stop that process (after a --leave-running checkpoint: the "
                           "original), then restore again")
    if not manifest.gpu_pids:
        return
    from pos.scheduler import cudackpt

    here = nvml.driver_version()
    if manifest.driver_version and here and here != manifest.driver_version:
        raise BadInput(f"{directory} was taken with NVIDIA driver {manifest.driver_version} "
                       f"and this host runs {here}", "restore it on a host with driver "
                       f"{manifest.driver_version} (driver checkpoints are tied to the driver)")
    cuda_here = cudackpt.driver_version()
    if manifest.cuda_version and cuda_here and cuda_here != manifest.cuda_version:
        raise BadInput(f"{directory} was taken with a CUDA {manifest.cuda_version} driver and "
                       f"this host's driver is CUDA {cuda_here}", "restore it on a host with "
                       "the same driver (driver checkpoints are tied to the driver)")


def _verify_timed(directory: Path, names: Optional[list[str]], stop: threading.Event) -> float:
    """image.verify of `names`; the seconds it took (it runs beside CRIU's restore)."""
    t0 = time.monotonic()
    image.verify(directory, names, stop=stop)
    return time.monotonic() - t0


def _failed(checking: Future[float]) -> Optional[BaseException]:
    """Why the image's check beside CRIU failed, None while it runs or when it passed."""
    return checking.exception() if checking.done() else None


def restore(directory: Path, inherit_fds: tuple[str, ...] = (), echo: Echo = lambda _: None,
            gpu_pairs: list[tuple[str, str]] = (), check: Optional[list[str]] = None,
            progress: Progress = QUIET, hoisted: bool = False,
            finish: Optional[Callable[[Guard, int], None]] = None,
            before_driver: Callable[[], None] = lambda: None) -> Result:
    """Restore the image in `directory` and resume its processes; `check`: the files whose
    checksums are verified (all when None; the rest is checked by whoever reads it). Every
    file's presence and size are checked before CRIU starts; the checksums while CRIU
    restores, which leaves the tree stopped: it runs only once the image is known good, and a
    check that fails ends CRIU at once. `hoisted`: the job's device memory comes back only in
    `finish` (until then the undo ends a restored job rather than run it). `finish(g, root)`
    runs last under the same guard (the concurrent engine puts the job's device memory back
    there: a failure then ends the restored tree, never leaves it half-restored);
    `before_driver()` just before the driver's restore (the concurrent engine pauses its fill
    there). The work folder goes whatever happens (CRIU's log of a failure is kept in
    criu.LOG_DIR, and the error names it)."""
    directory = Path(directory).absolute()
    t = time.monotonic()
    manifest = image.check_files(directory)
    fds = criu_mod.inherited_fds(inherit_fds)
    criu = criu_mod.find()
    criu_mod.log_max_bytes()          # a bad bound is said before CRIU starts
    checked = time.monotonic()
    check_restorable(directory, manifest)
    checked = time.monotonic() - checked
    options = Options.from_json(manifest.criu_options)
    for path, size in manifest.logs.items():
        now = os.stat(path).st_size if os.path.exists(path) else size
        if now != size:
            echo(f"{path} changed since the dump ({size} bytes then, {now} now): the restored "
                 "process appends to it")
    plan = Plan("restore", manifest.pids, manifest.gpu_pids, criu_path=criu.path,
                images=str(directory), criu_options=manifest.criu_options,
                gpu_pairs=[list(p) for p in gpu_pairs], hoisted=hoisted, verify=check)
    echo(f"restoring PID {manifest.pid} ({manifest.comm}) from {directory}")
    from pos.scheduler import cudackpt

    logs = criu_mod.reopen_logs(manifest.logs)
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pos-verify")
    checking = pool.submit(_verify_timed, directory, check, stop)
    work = Path(tempfile.mkdtemp(prefix="pos-restore-"))
    plan.work = str(work)
    try:
        with Guard(plan, echo, progress=progress) as g:
            g.timings["prepare"] = time.monotonic() - t        # to CRIU's start
            g.timings["prepare_check"] = checked               # of which the driver's checks
            g.step("criu-restore")
            argv = criu.restore_argv(directory, options, work, work / "pidfile",
                                     inherit_fds + tuple(logs.values()), leave_stopped=True)
            terminal = options.shell_job and os.isatty(0)
            try:
                g.timed("criu_restore", lambda: g.run_criu(criu, argv, "restore",
                                                           work / criu_mod.RESTORE_LOG,
                                                           fds + tuple(logs), terminal,
                                                           lambda: _failed(checking)))
            except PosError:
                checking.result()       # a corrupt image explains CRIU's failure best
                raise
            root = int((work / "pidfile").read_text())
            g.step("verify")             # the tree is stopped until its image is known good
            g.timings["verify"] = g.timed("verify_wait", checking.result)
            procs.resume(procs.tree(root))
            before_driver()
            for p in manifest.gpu_pids:
                g.step("restore")
                g.timed("restore", lambda p=p: cudackpt.restore(p, gpu_pairs))
            for p in manifest.gpu_pids:
                g.step("unlock")
                g.timed("unlock", lambda p=p: cudackpt.unlock(p))
            if finish is not None:
                finish(g, root)
    finally:
        stop.set()
        pool.shutdown()
        for fd in logs:
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    return Result(directory, manifest, restored_pid=root, timings=g.timings)
