"""Fixtures of the checkpoint/restore tests: real CRIU on real processes, as root.

pytest makes itself a child subreaper: processes that CRIU restores (criu restore -d) and
processes orphaned by a killed pos are re-parented to it instead of to PID 1, which on these
machines never reaps them (a zombie keeps its PID, and a restore needs that PID free).
"""

import ctypes
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Iterator, Optional

import pytest

from tests.conftest import ROOT, need, wait_for

PR_SET_CHILD_SUBREAPER = 36
COUNTER = Path(__file__).with_name("counter.py")


@pytest.fixture(scope="session")
def criu_ready() -> None:
    need(os.geteuid() == 0, "CRIU needs root")
    from pos.errors import PosError
    from pos.process import criu

    try:
        criu.find()
    except PosError as e:
        need(False, e.message)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kernel_keeps_soft_dirty() -> bool:
    """The kernel's own answer, read as CRIU reads it (criu/kerndat.c): a page written after
    its soft-dirty bits were cleared shows bit 55 in /proc/self/pagemap."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    page[0] = 1
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("4")
    except OSError:
        return False
    page[0] = 2
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // mmap.PAGESIZE * 8)
        return bool(struct.unpack("<Q", f.read(8))[0] >> 55 & 1)


def lines(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except FileNotFoundError:
        return []


def counts_on(files: list[Path], more: int = 1, what: str = "the count to go on",
              timeout: float = 10.0) -> None:
    """Until each counter file (counter.py's, io_uring_job's) holds `more` lines more than now:
    its process runs, not frozen."""
    before = [len(lines(f)) for f in files]
    wait_for(lambda: all(len(lines(f)) >= b + more for f, b in zip(files, before)), timeout,
             what)


def listening(port: int, prefix: tuple[str, ...] = ()) -> bool:
    """Whether a TCP socket listens on `port` (`prefix`: a command that enters the network
    namespace to look in, nsenter)."""
    return b"LISTEN" in subprocess.run([*prefix, "ss", "-ltn", f"sport = :{port}"],
                                       capture_output=True).stdout


def alive(pid: int) -> bool:
    from pos.process import procs

    return procs.alive(pid)


def reap(pid: int) -> None:
    """Kill and reap a process that is (now) our child."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class Counter:
    """A counter.py process (see there) in its own session, or in a shell's (`shell_job`)."""

    def __init__(self, path: Path, children: int = 0, cuda: Optional[Path] = None,
                 shell_job: bool = False, env: Optional[dict] = None,
                 ballast_mb: int = 0, extra: tuple[str, ...] = (),
                 prefix: tuple[str, ...] = (), pass_fds: tuple[int, ...] = (),
                 stdout: Optional[IO] = None) -> None:
        """`extra`: more counter.py flags; `prefix`: a command that execs the counter (nsenter),
        so that its PID stays the counter's; `pass_fds`: descriptors it inherits; `stdout`:
        where its stdout and stderr go (default /dev/null)."""
        self.path = path
        argv = [*prefix, sys.executable, str(COUNTER), str(path), "--children", str(children),
                "--ballast-mb", str(ballast_mb), *extra]
        if cuda:
            argv += ["--cuda", str(cuda)]
        if shell_job:
            # a shell job: its session and group leader is a shell outside the dump. The shell
            # starts its own session so that the leader is in this PID namespace, which
            # pytest's session need not be (CI may run it in a namespace entered mid-session).
            argv = ["sh", "-c", '"$@" >/dev/null & echo $!; wait', "sh", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                     stderr=stdout or subprocess.DEVNULL,
                                     stdout=subprocess.PIPE if shell_job else
                                     stdout or subprocess.DEVNULL,
                                     start_new_session=True, pass_fds=pass_fds,
                                     env={**os.environ, **(env or {})})
        self.pid = int(self.proc.stdout.readline()) if shell_job else self.proc.pid
        # the original is reaped as soon as it dies (a dump kills it): its PID is free then
        threading.Thread(target=self.proc.wait, daemon=True).start()
        self.files = [path] + [Path(f"{path}.{i}") for i in range(children)]
        wait_for(lambda: all(len(lines(f)) >= 5 for f in self.files), what="the counter")
        self.tree = self.pids()

    def pids(self) -> list[int]:
        from pos.process import procs

        return procs.tree(self.pid)

    def running(self) -> bool:
        """Alive and still counting (AssertionError if it counts no more)."""
        if not alive(self.pid):
            return False
        counts_on(self.files, what=f"counter {self.pid} to count on")
        return True

    def reap_original(self) -> None:
        """Wait for the original tree (killed by a dump) so that its PIDs are free: the root
        is our child, its children come to us (the subreaper) when it dies."""
        self.proc.wait(timeout=20)
        for pid in self.tree[1:]:
            wait_for(lambda: not alive(pid), what=f"PID {pid} to end")
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def stop(self) -> None:
        for pid in reversed(self.pids()):
            reap(pid)
        if self.proc.returncode is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(autouse=True)
def criu_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRIU logs that pos keeps of failed runs go to the test's folder, not /var/log/pos
    (a test's env may name another POS_LOG_DIR)."""
    monkeypatch.setenv("POS_LOG_DIR", str(tmp_path / "criu-logs"))


@pytest.fixture
def counters(criu_ready: None) -> Iterator[list[Counter]]:
    """Counters to stop after the test (whatever incarnation, original or restored, runs)."""
    made: list[Counter] = []
    yield made
    for c in made:
        c.stop()


def pos(*args: str, env: Optional[dict] = None, timeout: float = 120,
        prefix: tuple[str, ...] = (), pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    """pos as a user runs it, its stdin no terminal whatever pytest's is."""
    return subprocess.run([*prefix, sys.executable, "-m", "pos.cli", *args], cwd=ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env={**os.environ, **(env or {})},
                          timeout=timeout, pass_fds=pass_fds)


def one_sentence(r: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The run failed with `code` and said why in one line on stderr, without a traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    errs = r.stderr.strip().splitlines()
    assert len(errs) == 1 and errs[0].startswith("Error: "), r.stderr
    for f in fragments:
        assert f in errs[0], errs[0]
    return errs[0]


