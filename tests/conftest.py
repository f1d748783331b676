"""Shared fixtures: the fake GPU driver built once per session, and prerequisite gates.

Outside the suite's own script a missing prerequisite skips the tests that need it; under
scripts/test.sh (POS_REQUIRE_PREREQS=1, as in CI) it fails them instead, so that a machine that
cannot run real eBPF never reports green.
"""

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REQUIRED = os.environ.get("POS_REQUIRE_PREREQS") == "1"
# Tests interrupt pos with SIGINT as Ctrl-C would. A suite started in the background of a
# non-interactive shell inherits SIGINT ignored, and would pass that on to every pos it runs.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
KERNELS = 9   # kernels.cu: axpy, pair_copy, mixed, scalars, fill<float>, fill<int>, no_params,
              # tensor_list, many


def need(condition: bool, why: str) -> None:
    """Skip (or, under scripts/test.sh, fail) when a prerequisite is missing."""
    if condition:
        return
    if REQUIRED:
        pytest.fail(f"prerequisite missing: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session", autouse=True)
def fake_driver_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fake driver keeps its state in POS_FAKECUDA_STATE_DIR, by default /tmp/pos-fakecuda:
    for every process the suite starts, a folder of this run's instead, removed with the run's
    other folders (tests that look at the state set their own)."""
    previous = os.environ.get("POS_FAKECUDA_STATE_DIR")
    os.environ["POS_FAKECUDA_STATE_DIR"] = str(tmp_path_factory.mktemp("fakecuda"))
    yield
    if previous is None:
        os.environ.pop("POS_FAKECUDA_STATE_DIR", None)
    else:
        os.environ["POS_FAKECUDA_STATE_DIR"] = previous


@pytest.fixture(scope="session", autouse=True)
def no_restore_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`pos restore` restores in its own process, with the test's settings, even on a host where
    `pos restore-service` runs: POS_RESTORE_SOCKET names a socket that is not there (the tests
    of the service start their own)."""
    previous = os.environ.get("POS_RESTORE_SOCKET")
    os.environ["POS_RESTORE_SOCKET"] = str(tmp_path_factory.mktemp("no-service") / "none.sock")
    yield
    if previous is None:
        os.environ.pop("POS_RESTORE_SOCKET", None)
    else:
        os.environ["POS_RESTORE_SOCKET"] = previous


@pytest.fixture(scope="session")
def bpf_ready() -> None:
    from pos import host

    need(os.geteuid() == 0, "real eBPF needs root")
    for check in host.TRACING_CHECKS:
        problem = check()
        need(problem is None, problem.message if problem else "")


@pytest.fixture(scope="session")
def fakegpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fake libcuda/libamdhip64, their workloads and the kernels' cubin and fatbin."""
    need(shutil.which("nvcc") is not None, "nvcc is needed to compile the test kernels")
    need(shutil.which("gcc") is not None, "gcc is needed to build the fake driver")
    from tests.fakegpu.build import build

    return build(tmp_path_factory.mktemp("fakegpu"))


def kill(pids: list[int], proc: subprocess.Popen) -> None:
    """SIGKILL each of `pids` (in that order; one gone already is skipped), then reap `proc`,
    the command that started them."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait()


class ShellJobs:
    """Jobs a `pos run -- sh -c '... & ... & wait'` started (`proc`), each writing `outs[i]`:
    what they said, and whether all said READY (the shell's end before that is a failure)."""

    outs: list[Path]
    proc: subprocess.Popen

    def said(self) -> list[str]:
        return [o.read_text() for o in self.outs if o.exists()]

    def ready(self) -> bool:
        if all(o.exists() and "READY" in o.read_text() for o in self.outs):
            return True
        assert self.proc.poll() is None, f"the job ended: {self.said()}"
        return False


def reaped(pid: int) -> bool:
    """`pid` is gone: reaped here where it became this process's child (a job restored by pos
    in this process, or a subreaper's orphan), whose zombie would keep the PID taken."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return not Path(f"/proc/{pid}").exists()


def wait_for(cond: Callable[[], object], timeout: float = 20.0,
             what: Union[str, Callable[[], str]] = "condition", every: float = 0.05) -> None:
    """Until `cond()` is true, asked every `every` s: the one way the suite waits for something
    to happen, never for a time that should be long enough. After `timeout` s, AssertionError
    naming `what` (or what `what()` says then). `cond` may raise to give up early (the process
    that was to do it ended)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what() if callable(what) else what}")
        time.sleep(every)


# ---- tracing the fake driver's workload (tests/tracer, tests/analyzer) ----

def wait_for_rows(db: Path, sql: str, n: int, what: str, timeout: float = 20.0) -> None:
    """Until the count query `sql` on the store gives at least `n`."""
    def enough() -> bool:
        try:
            with sqlite3.connect(db) as c:
                return c.execute(sql).fetchone()[0] >= n
        except sqlite3.OperationalError:   # tables not there yet
            return False

    wait_for(enough, timeout, f"{n} {what} in the store")


def wait_for_layouts(db: Path, n: int) -> None:
    """Until the tracer has pushed `n` layouts (their function rows carry them)."""
    wait_for_rows(db, "select count(*) from functions where layout is not null", n, "layouts")


def trace_app(argv: list[str], db: Path, phases_before: tuple[str, ...] = (),
              layouts: int = KERNELS, layouts_before: str = "launch",
              ) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """Run the workload's phases under `pos trace`, the `layouts` known before the phase
    `layouts_before`; (truth by phase, exported events, log)."""
    from pos.store.db import open_db
    from pos.store.export import json_events
    from workloads.harness import Job, PosTrace

    job = Job(argv)
    truth = {p: job.run(p) for p in phases_before}
    tr = PosTrace(job.pid, str(db))
    try:
        for p in ("load", "lookup", "alloc", "launch", "free"):
            if p == layouts_before and layouts:
                wait_for_layouts(db, layouts)
            if p not in truth:
                truth[p] = job.run(p)
        job.close()
    finally:
        log = tr.stop()
    engine = open_db(str(db), create=False)
    return truth, list(json_events(engine, 1)), log


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A process to target that does nothing (its command line is unique: sleep 600.4242)."""
    p = subprocess.Popen(["sleep", "600.4242"])
    yield p.pid
    p.kill()
    p.wait()
