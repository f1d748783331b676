"""The steps of one checkpoint, restore or move, as every engine runs them: a watchdog process
behind them (pos/operation/watchdog.py), told each step as it begins, and the one undo
(`watchdog.recover`) on any failure, Ctrl-C or SIGTERM, which the watchdog runs too if pos
dies. Also how long each step took (`timed`; what each timing is: pos/operation/timings.py)."""

import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Literal, Optional, Sequence, TypeVar

from pos.errors import PosError
from pos.image import criustats, names
from pos.operation.plan import CheckpointPlan, ImagePlan, Plan, RestorePlan
from pos.operation.watchdog import Memory, Watchdog, discard_leftovers, end_tree, recover
from pos.process import criu as criu_mod
from pos.process import cudackpt
from pos.progress import QUIET, Progress
from pos.settings import Settings

Echo = Callable[[str], None]
P = TypeVar("P", bound=Plan)


def timed(timings: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    """fn(), its duration added to timings[name] (whether or not it raised)."""
    t = time.monotonic()
    try:
        return fn()
    finally:
        timings[name] = timings.get(name, 0.0) + time.monotonic() - t


@contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGINT and SIGTERM ignored meanwhile: for an undo, or a last step, that must not be left
    half done. Python runs signal handlers on the main thread alone: an operation run on
    another thread (a long-lived service's worker) is not interrupted by them, and has nothing
    to hold back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in held.items():
            signal.signal(s, h)


class Guard(Generic[P]):
    """Runs the steps of one operation with a watchdog behind them and the undo on failure (the
    undo of its plan's type: watchdog.UNDO)."""

    def __init__(self, plan: P, echo: Echo, settings: Settings,
                 progress: Progress = QUIET) -> None:
        """`settings`: the operation's; its `fault_at` is fault injection, as CRIU's
        CRIU_FAULT: "STEP=SIGNAL" (STEP:criu while CRIU runs) makes pos send itself SIGNAL
        when that step begins, so that tests can kill pos at every step; what the undo needs
        of the settings goes into the plan (Plan.begin)."""
        self.plan, self.echo, self.progress = plan, echo, progress
        self.fault_at = settings.fault_at
        plan.begin(settings)
        self.timings: dict[str, float] = {}
        self.t0 = time.monotonic()
        self.watchdog: Optional[Watchdog] = None
        self.memory = Memory()     # descriptors of the device memory the jobs gave up

    def __enter__(self) -> "Guard[P]":
        self.watchdog = Watchdog(self.plan)
        return self

    def step(self, name: str, **changes: Any) -> None:
        """Tell the watchdog which step begins (and what changed in the plan). When each step
        first began is kept (`step_NAME_at`, seconds from the guard's start): the time between
        two steps that no step's own timing covers shows there."""
        self.mark(f"step_{name}")
        unknown = set(changes) - {f.name for f in fields(self.plan)}
        if unknown:         # pos's own mistake: the watchdog would never hear of these
            raise TypeError(f"{type(self.plan).__name__} has no {', '.join(sorted(unknown))}")
        self.plan.step = name
        self.progress.phase(name)
        for k, v in changes.items():
            setattr(self.plan, k, v)
        assert self.watchdog is not None
        self.watchdog.send(self.plan)
        criu_runs = isinstance(self.plan, ImagePlan) and self.plan.criu_pid
        point = name + (":criu" if criu_runs else "")
        if self.fault_at.partition("=")[0] == point:
            os.kill(os.getpid(), signal.Signals["SIG" + self.fault_at.partition("=")[2]])

    def mark(self, name: str) -> None:
        """When `name` was first reached (`NAME_at`, seconds from the guard's start), told to
        no one: a point inside a step, where its own timings leave time unexplained."""
        self.timings.setdefault(f"{name}_at", round(time.monotonic() - self.t0, 4))

    def hold(self, pid: int, fds: list[int], own: bool = False) -> None:
        """The device memory of the job `pid`, as descriptors that the undo (here or in the
        watchdog) maps back into it should this operation fail while the memory is pos's
        (`own`: the job's own cuMem memory that pos took, pos/concurrent/ownmem.py)."""
        (self.memory.own if own else self.memory.hoisted).setdefault(pid, []).extend(fds)
        assert self.watchdog is not None
        self.watchdog.hold(pid, fds, own)

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one step and add its duration to timings[name]."""
        return timed(self.timings, name, fn)

    def each(self, name: str, pids: Sequence[int], call: Callable[[int], None]) -> None:
        """The step `name`: `call` (a driver call) on every process of `pids` at once
        (cudackpt.each), timed."""
        self.step(name)
        self.timed(name, lambda: cudackpt.each(pids, call))

    def dump(self, criu: criu_mod.Criu, argv: list[str], images: Path) -> None:
        """CRIU's dump into `images`, timed, and how its stats-dump splits the frozen time."""
        self.timed("dump", lambda: self.run_criu(criu, argv, "dump", images / names.DUMP_LOG))
        stats = criustats.dump_stats(images)
        if stats is not None:
            self.timings.update(stats.timings())

    def run_criu(self, criu: criu_mod.Criu, argv: list[str], what: str, log: Path,
                 pass_fds: tuple[int, ...] = (), terminal: bool = False,
                 stop: Callable[[], Optional[BaseException]] = lambda: None) -> None:
        """CRIU, with the watchdog told of it, and told when it ended, failed or not (a
        failure the caller goes on from, a pre-dump's, leaves no CRIU to wait for; `stop`: see
        Criu.finish)."""
        proc = criu.start(argv, pass_fds, terminal)
        self.step(self.plan.step, criu_pid=proc.pid, criu_log=str(log))
        try:
            criu.finish(proc, what, log, stop)
        finally:
            self.step(self.plan.step, criu_pid=None)

    def end(self: "Guard[CheckpointPlan]", **changes: Any) -> None:
        """The image is sealed: end the tree that CRIU left stopped, as the checkpoint was to.
        Not to be cut short by SIGINT/SIGTERM (the undo would find a tree half ended); a pos
        that dies here leaves the watchdog to finish it."""
        with uninterrupted():
            self.step("end", **changes)
            end_tree(self.plan)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], _tb: Any) -> Literal[False]:
        assert self.watchdog is not None
        if exc_type is None:
            self.watchdog.done()
            return False
        stopped = isinstance(exc, KeyboardInterrupt)
        with uninterrupted():
            self.echo(f"undoing {self.plan.WHAT} of {self.plan.who()} "
                      f"({'stopped' if stopped else 'failed'} at step {self.plan.step})")
            try:
                recover(self.plan, self.echo, self.memory, stopped)
            except PosError as undo:
                raise PosError(f"{_what(exc)}, and undoing it failed too ({undo.cause})",
                               undo.fix or "check the process by hand") from None
            finally:
                discard_leftovers(self.plan)
                self.watchdog.done()
        if stopped and isinstance(self.plan, RestorePlan):
            what = f"of PID {self.plan.pids[0]} " if self.plan.pids else ""
            raise PosError(f"restore {what}from {self.plan.images} "
                           "stopped, nothing of it left running", "the image is untouched; "
                           "restore it again when you want") from None
        if stopped:
            raise PosError(f"{self.plan.WHAT} of {self.plan.who()} interrupted and undone",
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
