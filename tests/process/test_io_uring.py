"""A process tree that holds an io_uring is refused before it is touched (issue 27): CRIU 4.2
cannot dump one ("Unknown shit 600 (anon_inode:[io_uring])"), and a torchrun launcher holds one
(libuv's epoll batching ring, for PyTorch's TCPStore). Real processes that open a real ring
(io_uring_job.c, compiled here), real `pos checkpoint`: one sentence naming the process, the
ring and the fix, exit 2, every process still running and never stopped, no image left."""

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from pos.image import names
from tests.conftest import need
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
    """io_uring_job in its own session; `files` are the counters of its processes."""

    def __init__(self, binary: Path, out: Path, *args: str) -> None:
        self.proc = subprocess.Popen([str(binary), str(out), *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
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

    def run(*args: str) -> Job:
        jobs.append(Job(job_binary, tmp_path / "count", *args))
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
        "CRIU cannot checkpoint an io_uring: start the job again with io_uring_setup refused (a "
        "seccomp filter that fails it, as Docker's default profile does since Docker 25, or "
        "sysctl kernel.io_uring_disabled=2 while it starts), if it runs without one.")
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
                 "start torchrun with io_uring_setup refused", "without torchrun with USE_LIBUV=0",
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
