"""A process tree that holds an io_uring is refused before it is touched (issue 27): CRIU 4.2
cannot dump one ("Unknown shit 600 (anon_inode:[io_uring])"), and a torchrun launcher holds one
(libuv's epoll batching ring, for PyTorch's TCPStore). Real processes that open a real ring
(io_uring_job.c, compiled here), real `pos checkpoint`: one sentence naming the process, the
ring and the fix, exit 2, every process still running and never stopped, no image left.

Under `pos run` (issue 42) the job's tree cannot open one: io_uring_setup fails with ENOSYS
(pos/agent/seccomp.py), a job that falls back as libuv does runs on epoll, and CRIU saves and
restores it, its filter included."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from pos.image import names
from tests.conftest import ROOT, need, reaped
from tests.engines.conftest import counts_on, lines, one_sentence, pos, wait_for

SOURCE = Path(__file__).with_name("io_uring_job.c")


@pytest.fixture(scope="module")
def job_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need(os.geteuid() == 0, "checkpointing needs root")
    need(shutil.which("gcc") is not None, "the io_uring job is compiled with gcc")
    out = tmp_path_factory.mktemp("io_uring") / "io_uring_job"
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-Wall", "-Werror", "-pthread", "-o", str(out),
                    str(SOURCE)], check=True, capture_output=True, timeout=120)
    return out


class Job:
    """io_uring_job in its own session (`run`: under `pos run` with these options, which execs
    it: the same PID); `files` are the counters of its processes."""

    def __init__(self, binary: Path, out: Path, *args: str,
                 run: "tuple[str, ...] | None" = None) -> None:
        head = [] if run is None else [sys.executable, "-m", "pos.cli", "run", *run, "--"]
        self.proc = subprocess.Popen([*head, str(binary), str(out), *args], cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.pid = self.proc.pid
        self.files = [out] + ([Path(f"{out}.1")] if "--child" in args else [])
        wait_for(self.counting, what="io_uring_job to start counting")
        from pos.process import procs

        self.tree = procs.tree(self.pid)

    def counting(self) -> bool:
        if all(len(lines(f)) >= 5 for f in self.files):
            return True
        if self.proc.poll() == 3:      # the kernel refuses io_uring here: nothing to refuse
            pytest.skip(f"no io_uring on this host: {self.proc.stderr.read().decode()}")
        assert self.proc.poll() is None, self.proc.stderr.read().decode()
        return False

    def untouched(self) -> None:
        """Every process alive, none stopped (pos never froze them), and still counting."""
        from pos.process import procs

        assert all(procs.state(p) in ("R", "S", "D") for p in self.tree), \
            [(p, procs.state(p)) for p in self.tree]
        counts_on(self.files, 3, "the job counting on")

    def end(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture
def start(job_binary: Path, tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def run(*args: str, run: "tuple[str, ...] | None" = None) -> Job:
        jobs.append(Job(job_binary, tmp_path / "count", *args, run=run))
        return jobs[-1]

    yield run
    for j in jobs:
        j.end()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}


def ring_fd(pid: int) -> str:
    """The descriptor number of `pid`'s io_uring."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[io_uring]":
            return fd
    raise AssertionError(f"PID {pid} has no io_uring descriptor")


def checkpoint(pid: int, img: Path, env: dict[str, str], *flags: str):
    r = pos("checkpoint", str(pid), "-D", str(img), *flags, env=env)
    assert not img.exists() and not names.partial(img).exists()
    return r


@pytest.mark.parametrize("flags", [("--leave-running", "--tcp-established"), ()],
                         ids=["leave-running", "dump-and-stop"])
def test_ring_of_the_root(start, tmp_path, env, flags) -> None:
    job = start()
    r = checkpoint(job.pid, tmp_path / "img", env, *flags)
    assert one_sentence(r, 2) == (
        f"Error: PID {job.pid} (io_uring_job) holds an io_uring (fd {ring_fd(job.pid)}), and "
        "CRIU cannot checkpoint an io_uring: start the job again with `pos run -- CMD`, which "
        "makes io_uring_setup fail for every process of the job (libuv then runs on epoll), or "
        "with io_uring_setup refused (a seccomp filter that fails it, as Docker's default "
        "profile does since Docker 25, or sysctl kernel.io_uring_disabled=2 while it starts), "
        "if it runs without one.")
    job.untouched()


def test_mapping_only_in_a_child(start, tmp_path, env) -> None:
    job = start("--child", "--close-fd")
    child = job.tree[1]
    r = checkpoint(job.pid, tmp_path / "img", env, "--leave-running")
    one_sentence(r, 2, f"PID {child} (io_uring_job), in the tree of PID {job.pid}, holds an "
                 "io_uring (a mapping at 0x", "io_uring_disabled=2")
    job.untouched()


def test_torchrun_store(start, tmp_path, env) -> None:
    """The ring made by a thread named like PyTorch's libuv store thread: the sentence says it is
    torchrun's store and which settings avoid it (measured with torch: bench/ddp.py)."""
    job = start("--thread", "pt_tcpstore_uv")
    r = checkpoint(job.pid, tmp_path / "img", env, "--leave-running", "--tcp-established")
    one_sentence(r, 2, f"PID {job.pid} (io_uring_job) holds an io_uring (fd {ring_fd(job.pid)}) "
                 "that libuv opened for PyTorch's TCPStore server (torchrun's rendezvous store)",
                 "start torchrun with `pos run -- CMD`", "or with io_uring_setup refused",
                 "UV_USE_IO_URING=0 and USE_LIBUV=0 do not reach torchrun's own store")
    job.untouched()


def test_concurrent_engine_refuses_too(start, tmp_path, env) -> None:
    job = start()
    r = checkpoint(job.pid, tmp_path / "img", env, "--concurrent")
    one_sentence(r, 2, f"PID {job.pid} (io_uring_job) holds an io_uring")
    job.untouched()


def test_tree_without_a_ring_passes() -> None:
    """No false alarm: a process without a ring passes the check (its dump is tested
    elsewhere)."""
    from pos.process import procs

    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert procs.io_urings(sleeper.pid) == []
        procs.require_dumpable(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_pos_run_fails_io_uring_setup_with_enosys(job_binary, tmp_path) -> None:
    """A job that needs its ring (no fallback) says the kernel has none: ENOSYS, not EPERM."""
    r = subprocess.run([sys.executable, "-m", "pos.cli", "run", "--", str(job_binary),
                        str(tmp_path / "count")], cwd=ROOT, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r
    assert "io_uring_setup: Function not implemented" in r.stderr


@pytest.mark.parametrize("args", [("--fallback",), ("--fallback", "--child")],
                         ids=["itself", "its-child"])
def test_under_pos_run_a_libuv_like_job_falls_back_and_is_saved_and_restored(
        start, tmp_path, env, criu_ready, args) -> None:
    """The filter reaches every process of the tree (a child too); the job runs on epoll; CRIU
    dumps it (nothing refused), restores it, and the restored job still has its filter."""
    job = start(*args, run=())
    assert "anon_inode:[eventpoll]" in fds_of(job.tree[-1])    # the one that wanted a ring
    for p in job.tree:
        assert procs_io_urings(p) == [] and seccomp_filters(p) == 1
    img = tmp_path / "img"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--json", env=env)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: job.proc.poll() is not None and all(map(reaped, job.tree)),
             what="the dumped job's end")
    saved = [len(lines(f)) for f in job.files]
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    try:
        counts_on(job.files, 5, "the restored job counting on")
        for p, f, n in zip(job.tree, job.files, saved):
            assert lines(f)[-1] > n >= 5          # it went on from where it was saved
            assert seccomp_filters(p) == 1 and procs_io_urings(p) == []
    finally:
        for p in reversed(job.tree):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_allowed_io_uring_is_refused_with_the_flag_named(start, tmp_path, env) -> None:
    job = start(run=("--allow-io-uring",))
    assert seccomp_filters(job.pid) == 0
    r = checkpoint(job.pid, tmp_path / "img", env, "--leave-running")
    one_sentence(r, 2, f"PID {job.pid} (io_uring_job) holds an io_uring",
                 "start the job again with `pos run` without --allow-io-uring")
    job.untouched()


def procs_io_urings(pid: int) -> list[str]:
    from pos.process import procs

    return procs.io_urings(pid)


def fds_of(pid: int) -> list[str]:
    return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]


def seccomp_filters(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Seccomp_filters:"):
            return int(line.split()[1])
    raise AssertionError("the kernel does not say how many seccomp filters a process has")
